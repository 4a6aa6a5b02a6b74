"""loadtest(): the benchmark on a build. It loads the prompts, starts the speculative server and
its autoregressive twin (unless --url; with --control a second copy of the twin too, a third arm of
the same passes), sweeps, stops the servers before the near-tie judge loads the reference, and
writes loadtest/loadtest.json and loadtest.png."""

from __future__ import annotations

import argparse
import json
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json
from specdeploy.loadtest.display import plot
from specdeploy.loadtest.near_ties import judge_near_ties
from specdeploy.loadtest.report import AR, CONTROL, SPEC, build_report
from specdeploy.loadtest.sending import Sweep, sweep
from specdeploy.manifest import BuildDir
from specdeploy.verify.cpu_repository import DEPLOYMENT, autoregressive_twin, round_tokens
from specdeploy.verify.summary import parity_rule

STAGE, OUT = "loadtest", "loadtest"


def loadtest(build: BuildDir, args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    """Start the servers (unless --url), sweep, write loadtest/; return the report."""
    from specdeploy.checkpoints import load_tokenizer
    from specdeploy.checkpoints.quantized import read_quant_config
    from specdeploy.exactness import speculative_exactness
    from specdeploy.verify.reference import load_prompts, load_reference

    cpu_repo = build.path("triton_repo") / "cpu"
    if build.record("package") is None or not (cpu_repo / DEPLOYMENT).exists():
        raise SpecDeployError(f"no packaged repository in {build.root}", hint="run `make engine` (or `specdeploy package`) first")
    deployment = json.loads((cpu_repo / DEPLOYMENT).read_text())
    model_dir = (cpu_repo / DEPLOYMENT).parent / deployment["model_dir"]
    tokenizer = load_tokenizer(model_dir)
    prompts = [p.text_input for p in load_prompts(args.prompts, tokenizer)][: args.requests_per_level]
    plan = Sweep(prompts, levels, args.requests_per_level, args.max_tokens, args.request_rate, args.seed, args.passes,
                 args.length_spread, args.fixed_lengths)
    settings = {"concurrency": levels, "requests_per_level": [plan.requests_at(level) for level in levels],
                "passes": plan.passes, "max_tokens": plan.max_tokens, "length_spread": plan.spread,
                "max_tokens_per_prompt": plan.lengths, "fixed_lengths": plan.fixed, "request_rate": plan.rate, "prompts": len(prompts),
                "seed": plan.seed, "url": args.url, "url_ar": args.url_ar, "near_tie": args.near_tie, "control": args.control}
    rule = parity_rule(deployment["dtype"], read_quant_config(model_dir))

    def judge(disputed: list[tuple[int, str]]) -> dict[str, Any]:
        reference = load_reference(model_dir, deployment["dtype"], args.device)

        def exact_in_batch() -> list[bool]:  # every prompt in one in-flight batch, float64
            ids = [reference.ids(text)[0].tolist() for text in prompts]
            rows = speculative_exactness(cpu_repo / DEPLOYMENT, ids, max(plan.lengths), args.device)["rows"]
            return [row["identical"] for row in rows]

        # a server at --url is not this CPU deployment: its float64 exactness would say nothing of that server
        return judge_near_ties(disputed, prompts, reference, plan.lengths, args.near_tie, round_tokens(deployment), plan.fixed,
                               None if args.url else exact_in_batch)

    twin_dir = build.root / ".loadtest_ar_repo" / "cpu"  # as deep as triton_repo/cpu: relative paths hold
    with build.stage(STAGE, OUT, settings, consumes=("package",)) as tmp, ExitStack() as stack:
        stack.callback(shutil.rmtree, twin_dir.parent, ignore_errors=True)  # runs last: after the servers stop
        if args.url:
            urls = {SPEC: args.url, **({AR: args.url_ar} if args.url_ar else {})}
        else:
            twin = autoregressive_twin(cpu_repo, twin_dir)
            urls = _start_servers(stack, {SPEC: cpu_repo, AR: twin, **({CONTROL: twin} if args.control else {})}, tmp)
        # with the control, the twin runs between the others in every pass (speculative, twin, copy, then
        # back): the speculative and the A/A ratio each pair runs one run apart, in the same minutes, as
        # the host's speed drifts (two sweeps one after the other measured the noise of another hour)
        swept = sweep(urls, plan, reference=AR if AR in urls else None)
        results = {arm: swept[arm] for arm in (SPEC, AR) if arm in swept}
        control = {CONTROL: swept[CONTROL], AR: swept[AR]} if CONTROL in swept else None
        stack.close()  # the servers stop before the judge loads the reference
        report = {"settings": settings, "dtype": deployment["dtype"],
                  **build_report(results, tokenizer, levels, rule, judge, control, deployment.get("spec_off_above"),
                                 plan.lengths if plan.fixed else None)}
        atomic_write_json(tmp / "loadtest.json", report)
        plot(report, tmp / "loadtest.png")
    return report


def _start_servers(stack: ExitStack, repos: dict[str, Path], logs: Path) -> dict[str, str]:
    """One tritonserver per arm, loading side by side; they stop when the stack closes."""
    from specdeploy.triton.serve import TritonServer, start_together

    servers = {arm: TritonServer(repo, log_path=logs / f"tritonserver_{arm}.log") for arm, repo in repos.items()}
    return {arm: server.grpc_url for arm, server in start_together(stack, servers).items()}
