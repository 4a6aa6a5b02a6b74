"""verify(): the checks against the CPU deployment. It starts tritonserver on the packaged CPU
repository (or uses --url) and its autoregressive twin, asks both, then with the servers stopped
measures the near-tie limit, the fidelity to the original model and the float64 exactness, and
writes reports/. `--server trtllm` is handed to trtllm_server."""

from __future__ import annotations

import json
import shutil
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from specdeploy.client import TritonLLMClient
from specdeploy.errors import SpecDeployError
from specdeploy.exactness import speculative_exactness
from specdeploy.manifest import BuildDir
from specdeploy.verify.cpu_repository import DEPLOYMENT, autoregressive_twin, round_tokens
from specdeploy.verify.reference import fidelity, load_prompts, load_reference, near_tie_limit
from specdeploy.verify.reports import write_reports
from specdeploy.verify.served import run_prompts
from specdeploy.verify.replay import reproduces
from specdeploy.verify.summary import beyond_limit, may_be_rounding, parity_rule, summarize
from specdeploy.verify.trtllm_server import _verify_trtllm

STAGE, OUT = "verify", "reports"


def verify(build: BuildDir, *, per_category: int = 4, max_new_tokens: int = 64, url: str | None = None,
           near_tie: float | None = None, baseline: bool = True, device: str = "auto", server: str = "cpu",
           route: str | None = None, phase: str = "all", served_file: str | Path | None = None) -> dict[str, Any]:
    """Run the checks; return the summary (also written to reports/, or reports_gpu/ for a
    TensorRT-LLM server). `near_tie` None: measured on the served model (CPU), NEAR_TIE (TensorRT-LLM).
    `phase`, `served_file`: TensorRT-LLM only (see _verify_trtllm)."""
    _check_sizes(per_category, max_new_tokens)
    if server == "trtllm":
        return _verify_trtllm(build, per_category=per_category, max_new_tokens=max_new_tokens, url=url,
                              near_tie=near_tie, device=device, route=route, phase=phase, served_file=served_file)
    if phase != "all":
        raise SpecDeployError(f"--phase {phase} is for --server trtllm", hint="the CPU server's checks run in one go")
    from specdeploy.triton.serve import TritonServer, start_together

    cpu_repo = build.path("triton_repo") / "cpu"
    if build.record("package") is None or not (cpu_repo / DEPLOYMENT).exists():
        raise SpecDeployError(f"no packaged repository in {build.root}", hint="run `make engine` (or `specdeploy package`) first")
    settings = {"per_category": per_category, "max_new_tokens": max_new_tokens, "url": url,
                "near_tie": "measured" if near_tie is None else near_tie}
    deployment = json.loads((cpu_repo / DEPLOYMENT).read_text())
    dtype = deployment["dtype"]
    reference = load_reference((cpu_repo / DEPLOYMENT).parent / deployment["model_dir"], dtype, device)
    quant = getattr(reference.model, "specdeploy_quant", {})
    prompts = load_prompts(per_category, reference.tokenizer)
    twin_dir = build.root / ".ar_repo" / "cpu"  # as deep as triton_repo/cpu: relative paths hold
    seconds: dict[str, float] = {}  # per report: what a verify run's time goes to
    with build.stage(STAGE, OUT, settings, consumes=("package",)) as tmp:
        start = time.perf_counter()
        with ExitStack() as stack:  # the servers stop before the in-process checks load their models
            servers = {}
            if url is None:
                servers["spec"] = TritonServer(cpu_repo, log_path=tmp / "tritonserver.log")
            if baseline:
                servers["ar"] = TritonServer(autoregressive_twin(cpu_repo, twin_dir), log_path=tmp / "tritonserver_ar.log")
            start_together(stack, servers)
            url = servers["spec"].grpc_url if url is None else url
            ar = None
            if baseline:
                ar = TritonLLMClient(servers["ar"].grpc_url)
                ar.wait_ready()
            spec = TritonLLMClient(url)
            spec.wait_ready()
            seconds["servers_start"] = time.perf_counter() - start
            rows = run_prompts(spec, ar, reference, prompts, max_new_tokens)
            seconds["served_and_reference"] = time.perf_counter() - start - seconds["servers_start"]
        shutil.rmtree(twin_dir.parent, ignore_errors=True)
        rule, limit, tie = parity_rule(dtype, quant), near_tie, None
        if rule != "exact":
            start = time.perf_counter()
            answers = [(prompt.text_input, row["served"]) for prompt, row in zip(prompts, rows)]
            limit, tie = near_tie_limit(reference, answers, max_new_tokens, round_tokens(deployment), near_tie)
            if tie:
                seconds["near_tie"] = time.perf_counter() - start
        ids = [reference.ids(p.text_input)[0].tolist() for p in prompts]
        del reference  # one model in memory at a time
        from specdeploy.checkpoints import checkpoint_dtype

        start = time.perf_counter()

        base = build.path("base")
        original = load_reference(base, checkpoint_dtype(base), device, role="original model")
        served = f"{dtype} CPU runtime on {quant.get('quant_algo') or 'unquantized'} weights"
        fidelity_report = fidelity(original, prompts, rows, max_new_tokens, served, checkpoint_dtype(base))
        del original
        seconds["fidelity"], start = time.perf_counter() - start, time.perf_counter()
        exactness = speculative_exactness(cpu_repo / DEPLOYMENT, ids, max_new_tokens, device)
        seconds["exactness"], start = time.perf_counter() - start, time.perf_counter()
        candidates = [] if rule == "exact" else [i for i in beyond_limit(rows, rule, limit)
                                                 if may_be_rounding(rows[i], exactness["rows"][i])]
        reproduced = []
        if candidates:
            found = reproduces(cpu_repo / DEPLOYMENT, [ids[i] for i in candidates], [rows[i]["served"] for i in candidates],
                               max_new_tokens, device)
            reproduced = [i for i, ok in zip(candidates, found) if ok]
            seconds["replay"] = time.perf_counter() - start
        summary = summarize(rows, dtype, rule, limit, measured=tie, reproduced=reproduced)
        summary["fidelity"], summary["exactness"] = fidelity_report, exactness
        summary["seconds"] = {name: round(value, 3) for name, value in seconds.items()}
        write_reports(tmp, summary, rows)
    return summary


def _check_sizes(per_category: int, max_new_tokens: int) -> None:
    """Refuse a run with nothing to judge: its reports would divide by no prompts or tokens."""
    for option, value, what in (("--prompts", per_category, "prompts per category (chat, code)"),
                                ("--max-new-tokens", max_new_tokens, "tokens an answer may have")):
        if value < 1:
            raise SpecDeployError(f"{option} must be at least 1, got {value}", hint=f"it is the number of {what}")
