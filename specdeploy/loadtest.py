"""`make loadtest`: a serving benchmark, as `vllm bench serve` and GenAI-Perf run one, of the
speculative deployment against its autoregressive twin (the same repository, speculation off).

For each concurrency level (default 1, 2, 4, 8) both arms get the same greedy requests, streamed
through tritonclient (gRPC), in passes (default 2) whose arm order alternates, ABBA within a level,
so that machine noise and drift hit both arms alike; a level's figures pool its passes. At most
`concurrency` requests are in flight: all sent at once (closed loop), or at Poisson arrival times
with --request-rate (open loop; a request that arrives while every slot is busy waits for one, as
`vllm bench serve --max-concurrency` does). A pass sends at least 3 requests per client, and the
prompts ask for different lengths (--length-spread around --max-tokens), so that the closed loop
reaches a steady state past its cold start (each client's first request, all at once into an empty
server), which the steady TTFT leaves out. Per arm and level: output
tokens/s, requests/s, TTFT / TPOT / ITL percentiles (DEFINITIONS), acceptance length, errors; then
the speed-up curve (speculative tokens/s over autoregressive tokens/s) and the break-even
concurrency, the first level where speculation stops paying. Writes loadtest/loadtest.json and
loadtest.png in the build.

Correctness: every output is compared with the same prompt's solo output (concurrency 1) of the
autoregressive arm (of the only arm, with --url alone). Where the deployment's dtype makes greedy
parity exact (verify.parity_rule: float64, or float32 without quantized activations/KV) any
difference fails the run. Elsewhere a batch of another shape may round a near-tie the other way,
and only the reference's logit margins tell that from a bug: every output that differs from its
solo run, and that solo output, is checked against the Hugging Face reference on the served
weights (verify's near-tie rule, one forward per distinct output, after the servers stop), and
one that leaves the reference's greedy path where its top-2 margin exceeds the near-tie limit
(measured on the served model as verify measures it, or --near-tie) fails the run. Errors always fail.
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from rich.console import Console
from rich.table import Table

from specdeploy.client import Request, TritonLLMClient
from specdeploy.device import add_device_arg
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.runtime.planner import break_even, suggested_spec_off_above
from specdeploy.runtime.types import acceptance_length
from specdeploy.stats import percentiles
from specdeploy.verify import (DEPLOYMENT, Reference, autoregressive_twin, near_tie_limit, parity_rule, round_tokens,
                               served_counts)

STAGE, OUT = "loadtest", "loadtest"
MIN_REQUESTS, REQUESTS_PER_CLIENT = 8, 3  # the default requests per arm, level and pass (Sweep.requests_at)
SPEC, AR = "speculative", "autoregressive"
DEFINITIONS = {
    "tokens": "output tokens of a request: its served text re-tokenized (no special tokens), as verify counts them",
    "output_tokens_per_s": ("output tokens of the level's successful requests / the level's wall time (first send to last "
                            "answer, summed over the level's passes)"),
    "ttft_s": "time to first token: request sent -> first streamed chunk with text",
    "ttft_steady_s": ("the same over the requests after each pass's first `concurrency` (every client's first request, "
                      "all sent into an empty server at once in the closed loop: the cold start), as GenAI-Perf and "
                      "perf_analyzer leave warm-up requests out; null where a pass sent no more"),
    "tpot_s": "time per output token after the first: (latency - TTFT) / (tokens - 1), requests with > 1 token",
    "itl_s": ("inter-token latency, one sample per token after the first chunk: a chunk of k tokens arriving g s after "
              "the previous chunk counts as k gaps of g/k (vLLM instead counts one gap per chunk)"),
    "acceptance_length": ("TensorRT-LLM's: (accepted draft tokens + 1 per target forward) / target forwards, prefill not "
                          "counted, summed over the level's requests, from the server's total_accepted_draft_tokens"),
    "speedup": "speculative output tokens/s / autoregressive output tokens/s at the same concurrency",
    "pass_speedups": "the same ratio in each pass (the two arms ran back to back in every pass)",
    "break_even_concurrency": ("the first level where speculation lost in every pass: one pass's loss is within this "
                               "machine's noise (null: no such level in the sweep)"),
    "spec_off_above": ("the deployment setting the curve suggests: the last level before break-even (0 when speculation "
                       "does not pay at the first level; null when it pays at every level): larger in-flight batches "
                       "then decode plainly"),
}


# ---------------------------------------------------------------------------------------------
# figures


def parse_levels(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (sorted, distinct)."""
    try:
        levels = sorted({int(value) for value in text.split(",") if value.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        raise SpecDeployError(f"--concurrency {text!r} is not a list of positive integers", hint="e.g. --concurrency 1,2,4,8")
    return levels


def arrival_times(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """When each request may be sent (s after the level starts): all at once (rate None), or a
    Poisson process of `rate` requests/s. Seeded: both arms see the same arrivals."""
    if rate is None:
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def chunk_tokens(tokenizer: Any, chunks: list[str]) -> list[int]:
    """Tokens each streamed chunk adds: differences of the growing text's token counts (a chunk
    alone can tokenize differently from inside the answer), so they sum to the answer's count."""
    counts, text, before = [], "", 0
    for chunk in chunks:
        text += chunk
        now = count_tokens(tokenizer, text)
        counts.append(now - before)
        before = now
    return counts


def inter_token_gaps(chunk_s: list[float], counts: list[int]) -> list[float]:
    """ITL samples, one per token after the first chunk: a chunk of k tokens g s after the previous
    chunk gives k gaps of g/k; a chunk that adds no token passes its gap on to the next one."""
    gaps: list[float] = []
    waited, pending = 0.0, 0
    for before, at, tokens in zip(chunk_s, chunk_s[1:], counts[1:]):
        waited, pending = waited + at - before, pending + tokens
        if pending > 0:
            gaps += [waited / pending] * pending
            waited, pending = 0.0, 0
    return gaps


# ---------------------------------------------------------------------------------------------
# sending


@dataclass
class Timed:
    """One request as the client saw it; tokens are counted after the level, off the clock."""

    prompt: int
    start_s: float  # after its pass of the level started
    latency_s: float = 0.0
    # each streamed chunk's arrival after the send, as the client's on_text sees it (a busy client
    # thread can see a few chunks at once: at a few ms per token the gaps bunch up)
    chunk_s: list[float] = field(default_factory=list)
    chunks: list[str] = field(default_factory=list)
    perf: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    cold: bool = False  # one of the pass's first `concurrency` requests (DEFINITIONS["ttft_steady_s"])


def send(client: TritonLLMClient, prompt: int, text: str, max_tokens: int, level_start: float) -> Timed:
    timed = Timed(prompt, time.perf_counter() - level_start)
    sent = time.perf_counter()
    stamp = lambda _: timed.chunk_s.append(time.perf_counter() - sent)  # noqa: E731
    try:
        done = client.generate(Request(text, max_tokens=max_tokens), stream=True, on_text=stamp)
    except Exception as err:  # any failure is this request's counted error; the level goes on
        timed.error = f"{type(err).__name__}: {err}"
        return timed
    timed.latency_s, timed.chunks, timed.perf = time.perf_counter() - sent, done.chunks, done.perf
    return timed


def run_level(clients: list[TritonLLMClient], prompts: list[str], order: list[int], lengths: list[int],
              arrivals: list[float]) -> tuple[list[Timed], float]:
    """One worker per client (the concurrency) takes the requests in order, each no earlier than
    its arrival time. Returns the requests and the level's wall time."""
    jobs: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(order)):
        jobs.put(i)
    done: list[Timed] = [Timed(order[i], 0.0, error="not sent") for i in range(len(order))]
    started = time.perf_counter()

    def worker(client: TritonLLMClient) -> None:
        while True:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            time.sleep(max(started + arrivals[i] - time.perf_counter(), 0.0))
            done[i] = send(client, order[i], prompts[order[i]], lengths[order[i]], started)

    threads = [threading.Thread(target=worker, args=(client,), daemon=True) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for timed in done[: len(clients)]:
        timed.cold = True
    return done, time.perf_counter() - started


Results = dict[str, dict[int, tuple[list[Timed], list[float]]]]  # arm -> concurrency -> (requests, wall s per pass)


@dataclass
class Sweep:
    """What the sweep sends: prompts, how many requests per level, their arrivals."""

    prompts: list[str]
    levels: list[int]
    requests: int | None  # per arm, level and pass; None: requests_at's default
    max_tokens: int  # the mean of the prompts' lengths
    rate: float | None = None
    seed: int = 0
    passes: int = 1
    spread: float = 0.0

    @property
    def lengths(self) -> list[int]:
        """Each prompt's max tokens: max_tokens x factors evenly spread over [1 - spread, 1 + spread],
        dealt to the prompts in a seeded order. Answers of one length keep a closed loop's clients
        in lockstep: they finish in the same round and come back as one burst."""
        factors = np.linspace(1 - self.spread, 1 + self.spread, len(self.prompts)) if len(self.prompts) > 1 else [1.0]
        dealt = np.random.default_rng(self.seed).permutation(len(self.prompts))
        return [max(1, round(self.max_tokens * float(factors[i]))) for i in dealt]

    def requests_at(self, level: int) -> int:
        """The asked number, or MIN_REQUESTS and at least REQUESTS_PER_CLIENT per client: a pass
        then measures beyond its cold start (each client's first request)."""
        return self.requests or max(MIN_REQUESTS, REQUESTS_PER_CLIENT * level)

    def order(self, level: int) -> list[int]:
        return [i % len(self.prompts) for i in range(self.requests_at(level))]


def sweep(urls: dict[str, str], plan: Sweep, say: Callable[[str], None] = print) -> Results:
    """Every level for every arm in `plan.passes` passes, the arms' order alternating from pass to
    pass and level to level; a level's passes pool (requests joined in pass order, a wall time per
    pass). The first reference-arm level is preceded by a solo pass when the sweep has no
    concurrency 1 (key 0)."""
    clients = {arm: [TritonLLMClient(url) for _ in range(plan.levels[-1])] for arm, url in urls.items()}
    results: Results = {arm: {} for arm in urls}
    try:
        for pool in clients.values():  # warm-up: first requests pay one-off costs
            pool[0].wait_ready()
            pool[0].generate(Request(plan.prompts[0], max_tokens=4), stream=True)
        reference = list(urls)[-1]
        if plan.levels[0] != 1:
            solo = list(range(len(plan.prompts)))
            timed, wall = run_level(clients[reference][:1], plan.prompts, solo, plan.lengths, [0.0] * len(solo))
            results[reference][0] = (timed, [wall])
        for n, level in enumerate(plan.levels):
            for p in range(plan.passes):
                for arm in list(urls)[:: 1 if (n + p) % 2 == 0 else -1]:
                    order = plan.order(level)
                    timed, wall = run_level(clients[arm][:level], plan.prompts, order, plan.lengths,
                                            arrival_times(len(order), plan.rate, plan.seed))
                    before, walls = results[arm].get(level, ([], []))
                    results[arm][level] = (before + timed, walls + [wall])
                    say(f"concurrency {level}, pass {p + 1}/{plan.passes}: {arm} done in {wall:.1f} s")
    finally:
        for pool in clients.values():
            for client in pool:
                client.close()
    return results


# ---------------------------------------------------------------------------------------------
# the report


def measure(timed: Timed, tokenizer: Any) -> dict[str, Any]:
    """A request's row: its timings and token counts."""
    row: dict[str, Any] = {"prompt": timed.prompt, "start_s": timed.start_s, "cold": timed.cold, "error": timed.error}
    if timed.error:
        return row
    counts = chunk_tokens(tokenizer, timed.chunks)
    tokens, accepted, forwards = served_counts(timed.perf, sum(counts))  # the server's own counters where it has them
    ttft = timed.chunk_s[0] if timed.chunk_s else timed.latency_s
    return {
        **row, "latency_s": timed.latency_s, "ttft_s": ttft, "tokens": tokens,
        "tpot_s": (timed.latency_s - ttft) / (tokens - 1) if tokens > 1 else None,
        "itl_s": inter_token_gaps(timed.chunk_s, counts), "chunk_s": timed.chunk_s, "chunk_tokens": counts,
        "accepted_draft_tokens": accepted, "target_forwards": forwards,
        "text": "".join(timed.chunks),
    }


def summarize_level(rows: list[dict[str, Any]], walls: list[float], expected: dict[int, str]) -> dict[str, Any]:
    """One arm at one level (`rows` pass after pass, a wall time per pass). `identical`: outputs
    equal to their prompt's solo output."""
    ok = [r for r in rows if r["error"] is None]
    tokens, wall_s = sum(r["tokens"] for r in ok), sum(walls)
    per_pass = len(rows) // len(walls)
    return {
        "requests": len(rows), "errors": len(rows) - len(ok), "error_messages": [r["error"] for r in rows if r["error"]][:10],
        "wall_s": wall_s, "output_tokens": tokens, "output_tokens_per_s": tokens / wall_s, "requests_per_s": len(ok) / wall_s,
        "pass_tokens_per_s": [sum(r["tokens"] for r in rows[i * per_pass:(i + 1) * per_pass] if r["error"] is None) / wall
                              for i, wall in enumerate(walls)],
        "ttft_s": percentiles([r["ttft_s"] for r in ok]),
        "ttft_steady_s": percentiles([r["ttft_s"] for r in ok if not r["cold"]]),
        "tpot_s": percentiles([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
        "itl_s": percentiles([gap for r in ok for gap in r["itl_s"]]),
        "latency_s": percentiles([r["latency_s"] for r in ok]),
        "acceptance_length": acceptance_length(sum(r["accepted_draft_tokens"] for r in ok), sum(r["target_forwards"] for r in ok)),
        "identical": sum(r["text"] == expected.get(r["prompt"]) for r in ok), "compared": len(ok),
        "per_request": rows,
    }


Judge = Callable[[list[tuple[int, str]]], dict[str, Any]]


def build_report(results: Results, tokenizer: Any, levels: list[int], rule: str, judge: Judge | None = None) -> dict[str, Any]:
    """Rows, per-level figures, the speed-up curve, break-even, pass/fail. Outside the exact rule,
    `judge` rules on the outputs that differ from their solo run (judge_near_ties)."""
    rows = {arm: {level: [measure(t, tokenizer) for t in timed] for level, (timed, _) in by_level.items()}
            for arm, by_level in results.items()}
    reference = list(results)[-1]  # the autoregressive arm, when there is one
    solo = rows[reference][min(rows[reference])]  # concurrency 1, or the solo pass (key 0)
    expected = {r["prompt"]: r["text"] for r in solo if r["error"] is None}
    report_levels = []
    for level in levels:
        entry: dict[str, Any] = {"concurrency": level}
        for arm in results:
            entry[arm] = summarize_level(rows[arm][level], results[arm][level][1], expected)
        both = SPEC in entry and AR in entry and min(entry[AR]["pass_tokens_per_s"]) > 0
        entry["speedup"] = entry[SPEC]["output_tokens_per_s"] / entry[AR]["output_tokens_per_s"] if both else None
        entry["pass_speedups"] = ([spec / ar for spec, ar in zip(entry[SPEC]["pass_tokens_per_s"], entry[AR]["pass_tokens_per_s"])]
                                  if both else None)
        report_levels.append(entry)
    best_pass = [None if e["pass_speedups"] is None else max(e["pass_speedups"]) for e in report_levels]
    figures = [entry[arm] for entry in report_levels for arm in results]
    solo_errors = sum(r["error"] is not None for r in rows[reference].get(0, []))  # the solo pass, when there was one
    errors = sum(f["errors"] for f in figures) + solo_errors
    mismatches = sum(f["compared"] - f["identical"] for f in figures)
    near_tie = judge(disputed_outputs(figures, expected)) if mismatches and rule != "exact" and judge else None
    return {
        "arms": list(results), "parity_rule": rule, "definitions": DEFINITIONS, "levels": report_levels,
        "solo_reference": rows[reference].get(0),
        # a level stops paying only where speculation lost in every pass
        "break_even_concurrency": break_even(levels, best_pass),
        "spec_off_above": suggested_spec_off_above(levels, best_pass),
        "errors": errors, "mismatches": mismatches, "near_tie": near_tie,
        "ok": errors == 0 and (mismatches == 0 or rule != "exact") and (near_tie is None or near_tie["ok"]),
    }


def disputed_outputs(figures: list[dict[str, Any]], expected: dict[int, str]) -> list[tuple[int, str]]:
    """(prompt, text) of every distinct output that differs from its prompt's solo output, and of
    those solo outputs."""
    disputed = set()
    for figure in figures:
        for row in figure["per_request"]:
            solo = expected.get(row["prompt"])
            if row["error"] is None and row["text"] != solo:
                disputed |= {(row["prompt"], text) for text in (row["text"], solo) if text is not None}
    return sorted(disputed)


def judge_near_ties(disputed: list[tuple[int, str]], prompts: list[str], reference: Reference, lengths: list[int],
                    near_tie: float | None, chunk: int = 1) -> dict[str, Any]:
    """verify's near-tie rule for each disputed output: the reference's greedy answer, or parting
    from it where the reference's top-2 logit margin is <= near_tie (None: measured as verify
    measures it, over the disputed outputs with verify rounds of `chunk` tokens)."""
    from tqdm import tqdm

    from specdeploy.parity import parity_holds

    answers = [(prompts[i], text) for i, text in disputed]
    near_tie, measured = near_tie_limit(reference, answers, max(lengths), chunk, near_tie)
    rows = []
    for index, text in tqdm(disputed, desc="near-tie check", unit="output"):
        _, result = reference.check(prompts[index], text, lengths[index], complete=False)
        rows.append({"prompt": index, "match": result.match, "first_divergence_token": result.first_divergence_token,
                     "margin_at_divergence": result.margin_at_divergence, "ok": parity_holds(result, False, near_tie)})
    margins = [r["margin_at_divergence"] for r in rows if r["margin_at_divergence"] is not None]
    return {"rule": f"each output the reference's greedy answer, or parting from it at a top-2 logit margin <= {near_tie:.3g}",
            "near_tie": near_tie, "measured": measured, "outputs": len(rows), "passed": sum(r["ok"] for r in rows),
            "largest_margin": max(margins, default=None), "ok": all(r["ok"] for r in rows), "rows": rows}


def plot(report: dict[str, Any], path: Path) -> None:
    """Tokens/s of both arms and the speed-up (second axis) vs concurrency; TTFT p99 (all requests, and
    past the cold start) vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [e["concurrency"] for e in report["levels"]]
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in report["arms"]:
        tput.plot(levels, [e[arm]["output_tokens_per_s"] for e in report["levels"]], "o-", label=arm)
        line, = ttft.plot(levels, [(e[arm]["ttft_s"]["p99"] or 0) * 1000 for e in report["levels"]], "o-", label=arm)
        ttft.plot(levels, [(e[arm]["ttft_steady_s"]["p99"] or 0) * 1000 for e in report["levels"]], "o--",
                  color=line.get_color(), label=f"{arm}, steady")
    tput.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="Throughput")
    ttft.set(xscale="log", xlabel="concurrency", ylabel="TTFT p99 (ms)", title="Time to first token")
    if all(e["speedup"] is not None for e in report["levels"]):
        speed = tput.twinx()
        speed.plot(levels, [e["speedup"] for e in report["levels"]], "s--", color="k", label="speed-up")
        speed.axhline(1.0, color="gray", lw=0.8)
        speed.set(ylabel="speed-up (speculative / autoregressive)", ylim=(0, None))
        speed.legend(loc="upper right")
    for ax in (tput, ttft):
        ax.minorticks_off()
        ax.set_xticks(levels, [str(level) for level in levels])
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(report: dict[str, Any], title: str) -> Table:
    out = Table(title=title)
    for column in ("conc", "arm", "tok/s", "req/s", "TTFT p50/p99 ms", "steady TTFT", "TPOT p50/p99 ms",
                   "ITL p50/p99 ms", "accept len", "identical", "errors", "speed-up"):
        out.add_column(column, justify="left" if column == "arm" else "right")
    ms = lambda p: "/".join("-" if p[k] is None else f"{p[k] * 1000:.0f}" for k in ("p50", "p99"))  # noqa: E731
    for entry in report["levels"]:
        for arm in report["arms"]:
            f = entry[arm]
            speedup = speedup_cell(entry) if arm == SPEC else ""
            out.add_row(str(entry["concurrency"]), arm, f"{f['output_tokens_per_s']:.1f}", f"{f['requests_per_s']:.2f}",
                        ms(f["ttft_s"]), ms(f["ttft_steady_s"]), ms(f["tpot_s"]), ms(f["itl_s"]),
                        f"{f['acceptance_length']:.2f}",
                        f"{f['identical']}/{f['compared']}", str(f["errors"]), speedup)
    return out


def speedup_cell(entry: dict[str, Any]) -> str:
    """'1.08x', and the passes' range where there were several: '1.08x (0.97-1.19)'."""
    if entry["speedup"] is None:
        return ""
    passes = entry["pass_speedups"]
    return f"{entry['speedup']:.2f}x" + (f" ({min(passes):.2f}-{max(passes):.2f})" if len(passes) > 1 else "")


# ---------------------------------------------------------------------------------------------
# command


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
                        help="passes per level, the arms' order alternating (ABBA); default 2: the default sweep took "
                             "~4.5 min on 2 CPU cores (one pass of 8 requests could not tell 10%% apart)")
    parser.add_argument("--max-tokens", type=int, default=32, help="the mean of the prompts' max tokens (default 32)")
    parser.add_argument("--length-spread", type=float, default=0.5,
                        help="each prompt asks for --max-tokens x a factor in [1 - spread, 1 + spread], spread evenly over "
                             "the prompts (default 0.5: 16-48 tokens), as a dataset's answers vary; 0: all alike, and the "
                             "closed loop's clients then finish together and return as one burst")
    parser.add_argument("--request-rate", type=float,
                        help="Poisson arrivals at this many requests/s (open loop); default: all at once (closed loop)")
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts per category (ShareGPT chat, HumanEval code)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    parser.add_argument("--near-tie", type=float,
                        help="outside exact dtypes: an output that differs from its solo run passes when it leaves the "
                             "reference's greedy path where the top-2 logit margin is <= this (as `verify --near-tie`; "
                             "default: measured on the served model, as verify does)")
    add_device_arg(parser)  # where the reference of the near-tie check computes


def _check_args(args: argparse.Namespace) -> None:
    if args.url_ar and not args.url:
        raise SpecDeployError("--url-ar needs --url (the speculative server)", hint="pass both, or neither to start the build's")
    if min(args.requests_per_level or 1, args.passes, args.max_tokens, args.prompts) < 1:
        raise SpecDeployError("--requests-per-level, --passes, --max-tokens and --prompts must be >= 1",
                              hint="e.g. --requests-per-level 8 --passes 2")
    if not 0 <= args.length_spread < 1:
        raise SpecDeployError(f"--length-spread {args.length_spread} is not in [0, 1)", hint="e.g. 0.5: 0.5x to 1.5x --max-tokens")
    if args.request_rate is not None and not args.request_rate > 0:
        raise SpecDeployError(f"--request-rate {args.request_rate} is not a positive rate", hint="requests per second, e.g. 2")


def loadtest(build: BuildDir, args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    """Start the servers (unless --url), sweep, write loadtest/; return the report."""
    from specdeploy.models import load_tokenizer
    from specdeploy.quantize.loader import read_quant_config
    from specdeploy.verify import load_prompts, load_reference

    cpu_repo = build.path("triton_repo") / "cpu"
    if build.record("package") is None or not (cpu_repo / DEPLOYMENT).exists():
        raise SpecDeployError(f"no packaged repository in {build.root}", hint="run `make engine` (or `specdeploy package`) first")
    deployment = json.loads((cpu_repo / DEPLOYMENT).read_text())
    model_dir = (cpu_repo / DEPLOYMENT).parent / deployment["model_dir"]
    tokenizer = load_tokenizer(model_dir)
    prompts = [p.text_input for p in load_prompts(args.prompts, tokenizer)][: args.requests_per_level]
    plan = Sweep(prompts, levels, args.requests_per_level, args.max_tokens, args.request_rate, args.seed, args.passes,
                 args.length_spread)
    settings = {"concurrency": levels, "requests_per_level": [plan.requests_at(level) for level in levels],
                "passes": plan.passes, "max_tokens": plan.max_tokens, "length_spread": plan.spread,
                "max_tokens_per_prompt": plan.lengths, "request_rate": plan.rate, "prompts": len(prompts),
                "seed": plan.seed, "url": args.url, "url_ar": args.url_ar, "near_tie": args.near_tie}
    rule = parity_rule(deployment["dtype"], read_quant_config(model_dir))

    def judge(disputed: list[tuple[int, str]]) -> dict[str, Any]:
        reference = load_reference(model_dir, deployment["dtype"], args.device)
        return judge_near_ties(disputed, prompts, reference, plan.lengths, args.near_tie, round_tokens(deployment))

    twin_dir = build.root / ".loadtest_ar_repo" / "cpu"  # as deep as triton_repo/cpu: relative paths hold
    with build.stage(STAGE, OUT, settings, consumes=("package",)) as tmp, ExitStack() as stack:
        stack.callback(shutil.rmtree, twin_dir.parent, ignore_errors=True)  # runs last: after the servers stop
        if args.url:
            urls = {SPEC: args.url, **({AR: args.url_ar} if args.url_ar else {})}
        else:
            urls = _start_servers(stack, {SPEC: cpu_repo, AR: autoregressive_twin(cpu_repo, twin_dir)}, tmp)
        results = sweep(urls, plan)
        stack.close()  # the servers stop before the judge loads the reference
        report = {"settings": settings, "dtype": deployment["dtype"], **build_report(results, tokenizer, levels, rule, judge)}
        atomic_write_json(tmp / "loadtest.json", report)
        plot(report, tmp / "loadtest.png")
    return report


def _start_servers(stack: ExitStack, repos: dict[str, Path], logs: Path) -> dict[str, str]:
    """One tritonserver per arm, loading side by side; they stop when the stack closes."""
    from specdeploy.triton.serve import TritonServer, start_together

    servers = {arm: TritonServer(repo, log_path=logs / f"tritonserver_{arm}.log") for arm, repo in repos.items()}
    return {arm: server.grpc_url for arm, server in start_together(stack, servers).items()}


def suggestion(off_above: int | None) -> str:
    if off_above is None:
        return "speculation paid at every level swept: keep the deployment as it is (no spec_off_above)"
    why = ("speculation did not pay even alone: spec_off_above 0 serves plainly until the module accepts more"
           if off_above == 0 else f"batches of more than {off_above} sequences then decode plainly")
    return (f"suggested: spec_off_above {off_above} ({why}); package with --spec-off-above {off_above}, "
            f'or make engine ENGINE_ARGS="--spec-off-above {off_above}"')


def verdict(report: dict[str, Any]) -> str:
    """What the outputs that differ from their solo run mean, by the deployment's parity rule."""
    if report["parity_rule"] == "exact":
        return "FAIL: greedy output changed under concurrency (exact parity rule)"
    judged = report["near_tie"]
    largest = "-" if judged["largest_margin"] is None else f"{judged['largest_margin']:.3f}"
    return (f"{'' if judged['ok'] else 'FAIL: '}{report['mismatches']} outputs differ from their solo run ({report['dtype']}: "
            f"a batch of another shape rounds apart); near-tie rule against the reference on the served weights: "
            f"{judged['passed']}/{judged['outputs']} distinct outputs pass (largest margin where one parts {largest}, "
            f"allowed <= {judged['near_tie']:g})")


def main(args: argparse.Namespace) -> int:
    _check_args(args)
    levels = parse_levels(args.concurrency)
    build = build_from_args(args)
    report = loadtest(build, args, levels)
    rate = f"Poisson {args.request_rate:g} req/s" if args.request_rate else "closed loop"
    requests = "/".join(map(str, report["settings"]["requests_per_level"]))
    lengths = report["settings"]["max_tokens_per_prompt"]
    title = (f"load test: {args.passes} x {requests} requests x {min(lengths)}-{max(lengths)} tokens per arm at concurrency "
             f"{'/'.join(map(str, levels))} (arms alternating), {rate}")
    # piped (a log, a test): wide enough for every column, where rich would assume 80
    Console(width=None if sys.stdout.isatty() else 160).print(table(report, title))
    curve = [e["speedup"] for e in report["levels"]]
    if all(s is not None for s in curve):
        point = report["break_even_concurrency"]
        print(f"break-even concurrency: {point if point is not None else 'none in the sweep'} "
              f"(speed-up {' '.join(f'{s:.2f}' for s in curve)} at concurrency {' '.join(map(str, levels))}; "
              "a level stops paying where speculation lost in every pass)")
        print(suggestion(report["spec_off_above"]))
    print(f"ITL: {DEFINITIONS['itl_s']}")
    print(f"report: {build.path(OUT)}/loadtest.json, loadtest.png")
    if report["mismatches"]:
        print(verdict(report))
    if report["errors"]:
        print(f"FAIL: {report['errors']} requests failed (see error_messages in the report)")
    return 0 if report["ok"] else 1
