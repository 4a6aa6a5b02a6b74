"""`specdeploy loadtest`: its options and their checks, and main(), which runs the load test,
prints the table, the break-even concurrency and the suggestion, and exits 1 on errors or outputs
that fail the parity rule."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from specdeploy.device import add_device_arg
from specdeploy.errors import SpecDeployError
from specdeploy.loadtest.display import noise_summary, suggestion, table
from specdeploy.loadtest.figures import DEFINITIONS
from specdeploy.loadtest.near_ties import verdict
from specdeploy.loadtest.orchestration import OUT, loadtest
from specdeploy.loadtest.sending import MIN_REQUESTS, REQUESTS_PER_CLIENT
from specdeploy.manifest import add_build_args, build_from_args
from specdeploy.runtime.load_plan import LOAD_ANSWER_SPREAD, LOAD_ANSWER_TOKENS


def parse_levels(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (sorted, distinct)."""
    try:
        levels = sorted({int(value) for value in text.split(",") if value.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        raise SpecDeployError(f"--concurrency {text!r} is not a list of positive integers", hint="e.g. --concurrency 1,2,4,8")
    return levels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    parser.add_argument("--url", help="benchmark a running server (gRPC host:port) instead of starting the build's "
                        "two; one arm unless --url-ar names the autoregressive one")
    parser.add_argument("--url-ar", help="with --url: a running autoregressive server to compare against")
    parser.add_argument("--concurrency", default="1,2,4,8", help="levels swept, comma-separated (default 1,2,4,8)")
    parser.add_argument("--requests-per-level", type=int,
                        help=f"requests per arm, level and pass (default: {MIN_REQUESTS}, and {REQUESTS_PER_CLIENT} per client "
                             f"where that is more, so that a pass goes on past its cold start: "
                             f"{REQUESTS_PER_CLIENT * 8} at concurrency 8)")
    parser.add_argument("--passes", type=int, default=2,
                        help="passes per level, the arms' order alternating (ABBA); default 2: the default load test took "
                             "~4 min on 2 CPU cores (one pass of 8 requests could not tell 10%% apart)")
    parser.add_argument("--max-tokens", type=int, default=LOAD_ANSWER_TOKENS,
                        help=f"the mean of the prompts' max tokens (default {LOAD_ANSWER_TOKENS}; the build's load plan "
                             "asks for the default lengths)")
    parser.add_argument("--length-spread", type=float, default=LOAD_ANSWER_SPREAD,
                        help="each prompt asks for --max-tokens x a factor in [1 - spread, 1 + spread], spread evenly over "
                             f"the prompts (default {LOAD_ANSWER_SPREAD}: 16-48 tokens), as a dataset's answers vary; 0: all "
                             "alike, and the closed loop's clients then finish together and return as one burst")
    parser.add_argument("--fixed-lengths", action=argparse.BooleanOptionalAction, default=True,
                        help="each request sends min_tokens = its max tokens, so every answer has exactly its length in "
                             "every pass and arm, as trtllm-bench and GenAI-Perf's TensorRT-LLM runs do (default); "
                             "--no-fixed-lengths lets answers end at EOS, where a near-tie decided by the batch's shape "
                             "(bf16) ends one early in one pass and not in the next: unequal work for the two arms")
    parser.add_argument("--request-rate", type=float,
                        help="Poisson arrivals at this many requests/s (open loop); default: all at once (closed loop)")
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts per category (ShareGPT chat, HumanEval code)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    parser.add_argument("--control", action="store_true",
                        help="a second copy of the autoregressive twin as a third arm of the same passes (A/A; the twin "
                             "runs between the other two, so each ratio pairs runs one run apart; half the time again): "
                             "each level's pass ratios of two identical deployments, the host's noise floor in the same "
                             "minutes, against which a speculative pass below 1 is read")
    parser.add_argument("--near-tie", type=float,
                        help="outside exact dtypes: an output that differs from its solo run passes when it leaves the "
                             "reference's greedy path where the top-2 logit margin is <= this (as `verify --near-tie`; "
                             "default: measured on the served model, as verify does)")
    add_device_arg(parser)  # where the reference of the near-tie check computes


def _check_args(args: argparse.Namespace) -> None:
    if args.control and args.url:
        raise SpecDeployError("--control starts the build's servers (the twin twice); it cannot measure a server at --url",
                              hint="drop --url, or drop --control")
    if args.url_ar and not args.url:
        raise SpecDeployError("--url-ar needs --url (the speculative server)", hint="pass both, or neither to start the build's")
    given = [value for value in (args.requests_per_level, args.passes, args.max_tokens, args.prompts) if value is not None]
    if min(given) < 1:
        raise SpecDeployError("--requests-per-level, --passes, --max-tokens and --prompts must be >= 1",
                              hint="e.g. --requests-per-level 8 --passes 2")
    if not 0 <= args.length_spread < 1:
        raise SpecDeployError(f"--length-spread {args.length_spread} is not in [0, 1)", hint="e.g. 0.5: 0.5x to 1.5x --max-tokens")
    if args.request_rate is not None and not args.request_rate > 0:
        raise SpecDeployError(f"--request-rate {args.request_rate} is not a positive rate", hint="requests per second, e.g. 2")


def main(args: argparse.Namespace) -> int:
    _check_args(args)
    levels = parse_levels(args.concurrency)
    build = build_from_args(args)
    report = loadtest(build, args, levels)
    rate = f"Poisson {args.request_rate:g} req/s" if args.request_rate else "closed loop"
    requests = "/".join(map(str, report["settings"]["requests_per_level"]))
    lengths = report["settings"]["max_tokens_per_prompt"]
    exactly = "exactly " if args.fixed_lengths else "up to "
    title = (f"load test: {args.passes} x {requests} requests x {exactly}{min(lengths)}-{max(lengths)} tokens per arm at concurrency "
             f"{'/'.join(map(str, levels))} (arms alternating), {rate}")
    # piped (a log, a test): wide enough for every column, where rich would assume 80
    Console(width=None if sys.stdout.isatty() else 160).print(table(report, title))
    curve = [e["speedup"] for e in report["levels"]]
    if all(s is not None for s in curve):
        point, current = report["break_even_concurrency"], report["deployment_spec_off_above"]
        plain = "" if current is None or levels[-1] <= current else (
            f"; above {current}, the deployment's spec_off_above, batches decode plainly and do not count")
        print(f"break-even concurrency: {point if point is not None else 'none in the sweep'} "
              f"(speed-up {' '.join(f'{s:.2f}' for s in curve)} at concurrency {' '.join(map(str, levels))}; "
              f"speculation stops paying where it lost in every pass at that level and every level above{plain})")
        print(suggestion(report))
    if report["control"]:
        print(noise_summary(report))
    print(f"ITL: {DEFINITIONS['itl_s']}")
    print(f"report: {build.path(OUT)}/loadtest.json, loadtest.png")
    if report["short_answers"]:
        print(f"warning: {report['short_answers']} answers ended before their length although min_tokens asked for "
              "all of it (a server that does not read min_tokens, a stop word, or a count re-tokenized from text where "
              "the server sends none): the arms' passes may have done unequal work")
    if report["mismatches"]:
        print(verdict(report))
    if report["errors"]:
        print(f"FAIL: {report['errors']} requests failed (see error_messages in the report)")
    return 0 if report["ok"] else 1
