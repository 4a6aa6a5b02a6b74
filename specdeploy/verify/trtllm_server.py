"""verify against a TensorRT-LLM server (`--server trtllm`), in two phases: the served phase asks
the server through the route's entry model (triton_repo/gpu_routes.json) and writes the answers
and perf counters to a file, loading no model; the reference phase reads that file and judges each
answer against the float32 reference by the near-tie rule, without a server, into reports_gpu/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdeploy.client import TritonLLMClient
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json
from specdeploy.manifest import BuildDir
from specdeploy.parity import NEAR_TIE
from specdeploy.runtime.types import acceptance_length
from specdeploy.verify.reference import Reference, load_prompts, load_reference
from specdeploy.verify.reports import write_reports
from specdeploy.verify.served import Target, answer_tokens, served_counts
from specdeploy.verify.summary import summarize

GPU_STAGE, GPU_OUT = "verify_gpu", "reports_gpu"
GPU_SERVED = "reports_gpu_served.json"  # `verify --server trtllm --phase served` writes it, --phase reference reads it
TRTLLM_PHASES = ("all", "served", "reference")
# the Triton llmapi model's names for the ensemble's inputs (triton_backend/all_models/llmapi)
LLMAPI_INPUTS = {"max_tokens": "sampling_param_max_tokens", "stream": "streaming",
                 "return_perf_metrics": "sampling_param_return_perf_metrics", "temperature": "sampling_param_temperature",
                 "top_k": "sampling_param_top_k", "top_p": "sampling_param_top_p", "seed": "sampling_param_seed"}


def trtllm_target(routes: dict[str, Any], route: str | None) -> Target:
    """The entry model of a packaged GPU route (triton_repo/gpu_routes.json)."""
    route = route or routes.get("recommended")
    if route not in routes.get("routes", {}):
        raise SpecDeployError(f"this build has no GPU route {route!r} (it has: {', '.join(routes.get('routes', {})) or 'none'})",
                              hint="pass --route with one the build has; `specdeploy package` says which")
    entry = routes["routes"][route]
    names = LLMAPI_INPUTS if entry["inputs"] == "llmapi" else {}
    extra = {**entry.get("request", {}), **({"sampling_param_exclude_input_from_output": True} if names else {})}
    # NVIDIA's llmapi model streams the whole text so far in every response (model.py _create_response
    # sends CompletionOutput.text, not text_diff): asked not to stream, it sends the answer once
    return Target(entry["model"], names, extra, bool(entry["stream"]) and not names)


def _model_dir(build: BuildDir) -> Path:
    """The checkpoint a TensorRT-LLM server loads: the quantized one, else the resolved base."""
    return build.path("quantized") if build.record("quantize") else build.path("base")


def _verify_trtllm(build: BuildDir, *, per_category: int, max_new_tokens: int, url: str | None, near_tie: float | None,
                   device: str, route: str | None, phase: str = "all", served_file: str | Path | None = None) -> dict[str, Any]:
    """Against a TensorRT-LLM server: float32 reference on `device`, the near-tie rule (NEAR_TIE
    unless given: the server's own rounding cannot be measured from here).

    `phase` "served" asks the server and writes its answers to `served_file` (default
    <build>/reports_gpu_served.json) without loading a model; "reference" reads that file and
    computes the reference without a server, so the caller can stop the server in between;
    "all" does both in one go, the server still up. Returns the summary (phase "served": what it wrote)."""
    if phase not in TRTLLM_PHASES:
        raise SpecDeployError(f"unknown verify phase {phase!r}", hint=f"use {', '.join(TRTLLM_PHASES)}")
    path = Path(served_file) if served_file else build.root / GPU_SERVED
    if phase == "reference":
        served = _read_served(path)
    else:
        served = _ask_trtllm(build, per_category=per_category, max_new_tokens=max_new_tokens, url=url, route=route)
        atomic_write_json(path, served)
        if phase == "served":
            return served
    return _trtllm_reference(build, served, NEAR_TIE if near_tie is None else near_tie, device)


def _ask_trtllm(build: BuildDir, *, per_category: int, max_new_tokens: int, url: str | None,
                route: str | None) -> dict[str, Any]:
    """The served phase: the prompts, the server's answers and perf counters (the tokenizer only:
    no model competes with the server for the GPU)."""
    from specdeploy.checkpoints import load_tokenizer
    from specdeploy.triton.routes import gpu_routes

    if url is None:
        raise SpecDeployError("--server trtllm needs --url (the gRPC address of the TensorRT-LLM Triton server)",
                              hint="build_scripts/gpu_host.sh build/<name> starts one and passes it")
    routes = gpu_routes(build)
    target = trtllm_target(routes, route)
    route = route or routes["recommended"]
    prompts = load_prompts(per_category, load_tokenizer(_model_dir(build)))
    client = TritonLLMClient(url, model=target.model)
    client.wait_ready(timeout_s=600)
    client.generate(target.request(prompts[0].text_input, 4), stream=target.stream)  # warm-up: one-off costs
    answers = []
    for category, shown, text_input in tqdm(prompts, desc="served", unit="prompt"):
        done = client.generate(target.request(text_input, max_new_tokens), stream=target.stream)
        answers.append({"category": category, "shown": shown, "text_input": text_input, "served": done.text,
                        "perf": done.perf, "latency_s": done.latency_s, "ttft_s": done.time_to_first_chunk_s})
    return {"server": f"TensorRT-LLM {routes['trtllm_version']} ({route} route, {target.model})", "url": url,
            "route": route, "model": target.model, "per_category": per_category, "max_new_tokens": max_new_tokens,
            "prompts": answers}


def _read_served(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise SpecDeployError(f"{path} not found: the reference phase reads the served phase's answers",
                              hint="run `specdeploy verify --server trtllm --phase served --url HOST:PORT` first "
                                   "(or pass --served-file)")
    return json.loads(path.read_text())


def _trtllm_reference(build: BuildDir, served: dict[str, Any], near_tie: float, device: str) -> dict[str, Any]:
    """The reference phase: each served answer against the float32 reference, reports_gpu/."""
    max_new_tokens = served["max_new_tokens"]
    settings = {key: served[key] for key in ("per_category", "max_new_tokens", "url", "route", "model")}
    settings["near_tie"] = near_tie
    reference = load_reference(_model_dir(build), "float32", device)
    with build.stage(GPU_STAGE, GPU_OUT, settings, consumes=("package",)) as tmp:
        rows = [_trtllm_row(reference, answer, max_new_tokens)
                for answer in tqdm(served["prompts"], desc="reference", unit="prompt")]
        summary = {"server": served["server"],
                   **summarize(rows, "float32 reference; TensorRT-LLM serves bf16/fp16 or FP8", "near-tie", near_tie)}
        atomic_write_json(tmp / "served.json", served)  # what the server answered, beside what it was judged by
        write_reports(tmp, summary, rows)
    return summary


def _trtllm_row(reference: Reference, answer: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """One served answer judged: run_prompts' row, without an AR twin."""
    ref, parity = reference.check(answer["text_input"], answer["served"], max_new_tokens)
    text_tokens = answer_tokens(ref.token_ids if parity.match else None, reference.tokenizer, answer["served"], max_new_tokens)
    tokens, accepted, forwards = served_counts(answer["perf"], text_tokens)
    if "total_accepted_draft_tokens" not in answer["perf"]:  # a release whose llmapi model returns no draft counts
        accepted = forwards = None
    return {"category": answer["category"], "shown": answer["shown"], **parity.as_dict(), "tokens": tokens,
            "perf": answer["perf"], "accepted_draft_tokens": accepted, "target_forwards": forwards,
            "acceptance_length": None if accepted is None else acceptance_length(accepted, forwards),
            "latency_s": answer["latency_s"],
            "ttft_s": answer["ttft_s"], "ar_latency_s": None, "ar_tokens": None, "ar_matches": None, "speedup": None}
