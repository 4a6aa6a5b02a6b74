"""Stage `package`: fill the project's Triton templates into build/<name>/triton_repo/.

Model repositories, side by side, all generated from the templates in specdeploy/triton/templates/
(package data: an installed wheel carries them); the GPU ones only for the routes the build really
has (convert_summary.json says which):

    triton_repo/cpu/      ensemble + preprocessing + postprocessing + tensorrt_llm (Python backend
                          running specdeploy's runtime: what `specdeploy serve` serves here),
                          + tensorrt_llm_bls (the ensemble's steps as BLS: cancellable)   cpu_repo.py
                          (draft shape and load planned on this machine: cpu_plan.py)
    triton_repo/engine/   the engine flow (TensorRT-LLM 1.1 / 1.2, C++ tensorrtllm backend):
                          base, Medusa, draft-target (tensorrt_llm_bls + tensorrt_llm_draft)   engine_repo.py
    triton_repo/llmapi/   the LLM API (PyTorch backend): the llmapi model and its model.yaml
                          (+ trtllm_serve.yaml for `trtllm-serve --config`)   llmapi_repo.py
    triton_repo/gpu_routes.json   which GPU routes exist, which to run, and what a GPU host needs   routes.py

Paths: the CPU repository names files relative to each model's folder (served here, wherever the
build sits); the GPU ones as `$BUILD_DIR/...` (trtllm/hostpaths.py), resolved by
build_scripts/gpu_host.sh where the build is mounted. Templates are copied and filled by
templating.py; what the stage reads from the build, build_inputs.py. This module: the stage
(settings, skip when complete, the order of the writers) and its CLI.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any, Callable

from specdeploy.choices import ChoicesTree
from specdeploy.engines import sglang, vllm
from specdeploy.device import check_device_spec
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.trtllm.build import GPU_MAX_BATCH_SIZE
from specdeploy.trtllm.hostpaths import build_path
from specdeploy.trtllm.llmapi import DraftStructure
from specdeploy.triton import build_inputs
from specdeploy.triton.cpu_plan import CPU_DRAFT_SHAPES, CPU_PLAN, PLAN_FILE, plan_cpu_repo
from specdeploy.triton.cpu_repo import (CPU_MAX_BATCH_SIZE, SERVE_DTYPES, cpu_options, deployment_json, serve_dtype,
                                        write_cpu_repo)
from specdeploy.triton.engine_repo import write_engine_repo
from specdeploy.triton.llmapi_repo import gpu_knobs, write_llmapi_repo
from specdeploy.triton.routes import OUT, gpu_summary, write_gpu_routes
from specdeploy.triton.templating import templates_digest

STAGE = "package"
SERVE_DTYPE_HELP = ("compute dtype of the CPU runtime served by Triton: native (default): bfloat16 where the device "
                    "computes it natively (a GPU deployment's dtype; CUDA, CPUs with AVX512-BF16/AMX), float32 where bf16 "
                    "would be emulated (several times slower there); served parity by the near-tie rule in bf16, "
                    "exactness proven by `verify` in float64. auto: the dtype in which served greedy parity is itself "
                    "exact (float64 when activations or K/V are quantized, else float32)")
ADAPTIVE_HELP = ("CPU deployment: fall back to plain decoding while speculation does not pay (faster on a CPU "
                 "with a weak module); default off: speculate every step, as TensorRT-LLM does")
_UPSTREAM = ("resolve", "spec", "quantize", "convert", "build")


def run(
    build: BuildDir,
    *,
    spec: str = "none",
    choices: list[list[int]] | str | None = None,
    max_draft_len: int | None = None,
    draft_model_dir: str | Path | None = None,
    dtype: str = "native",
    adaptive: bool = False,
    device: str = "auto",
    max_batch_size: int = GPU_MAX_BATCH_SIZE,
    cpu_max_batch_size: int = CPU_MAX_BATCH_SIZE,
    spec_off_above: int | None = None,
    cpu_draft_shape: str = "fixed",
    kv_cache_free_gpu_mem_fraction: float = 0.9,
    decoupled: bool = True,
) -> Path:
    """Write build/<name>/triton_repo/{cpu,engine,llmapi}; skipped when already complete.

    The GPU routes and the draft structure come from the convert stage (convert_summary.json);
    `choices` is a Medusa tree (default: the one the spec stage recorded); EAGLE drafts the chain
    or dynamic tree convert named, never a static tree. `dtype` is the CPU runtime's compute dtype (SERVE_DTYPES):
    "native" bf16 where the device computes it natively, else float32; "auto" the one in which
    served greedy parity is exact (checkpoints.quantized.parity_dtype). `device` is where the CPU deployment
    computes (auto|cpu|cuda|cuda:N, stored as given). `adaptive`: the CPU runtime falls back to
    plain decoding while speculation does not pay; off by default, as TensorRT-LLM speculates.
    `cpu_max_batch_size`: sequences in the CPU deployment's in-flight batch; `spec_off_above`:
    larger batches decode plainly (None: always speculate, or with "auto" below what the planner
    measures; `make loadtest` measures it through the server);
    `cpu_draft_shape` "auto": the CPU deployment drafts the shape the planner measures fastest on
    this machine and stops speculating above the batch size where that stops paying
    (runtime.planner; the GPU routes keep convert's shape), "fixed": convert's."""
    if cpu_draft_shape not in CPU_DRAFT_SHAPES:
        raise SpecDeployError(f"unknown draft shape choice '{cpu_draft_shape}'", hint=f"use {' or '.join(CPU_DRAFT_SHAPES)}")
    if spec == "eagle" and choices is not None:
        raise SpecDeployError("EAGLE deploys as a chain or TensorRT-LLM's dynamic tree, not a static eagle_choices tree "
                              "(discouraged in TensorRT-LLM 1.2, deprecated in 1.3, removed in 1.4)",
                              hint="drop --choices; pick the structure with `specdeploy convert --eagle-tree chain|dynamic`")
    tree = build_inputs.tree(choices)  # a bad tree fails before anything else
    device = check_device_spec(device)
    model_dir = build_inputs.model_dir(build)
    dtype = serve_dtype(dtype, model_dir, device)
    spec_dir = build.path("spec").resolve()
    if spec == "medusa":
        tree = tree or build_inputs.medusa_tree(spec_dir, None)
    converted = build_inputs.convert_summary(build)
    structure = build_inputs.structure(spec, converted, max_draft_len,
                                       build_inputs.dflash_block(spec_dir) if spec == "dflash" else None)
    draft = build_inputs.draft_dir(spec, converted, draft_model_dir, spec_dir, build.root)
    settings = {
        "spec": spec, "choices": tree.to_list() if tree else None, "structure": structure.as_dict() if structure else None,
        # $BUILD_DIR/... for the draft the build carries: a moved build stays complete
        "draft_model_dir": build_path(draft, build.root) if draft else None,
        "dtype": dtype, "device": device, "adaptive": adaptive,
        "max_batch_size": max_batch_size, "cpu_max_batch_size": cpu_max_batch_size, "spec_off_above": spec_off_above,
        "cpu_draft_shape": cpu_draft_shape, "cpu_plan": CPU_PLAN if cpu_draft_shape == "auto" else None, "decoupled": decoupled,
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction, "templates": templates_digest(),
        "engines": {"vllm": vllm.RELEASE.version, "sglang": sglang.RELEASE.version},  # the releases their routes are for
    }
    consumes = tuple(s for s in _UPSTREAM if build.record(s) is not None)
    if build.completed(STAGE, settings, consumes=consumes):
        return build.path(OUT)
    with build.stage(STAGE, OUT, settings, consumes=consumes) as tmp:
        _write_repos(tmp, build, model_dir, spec_dir, tree, structure, converted, draft, settings)
    return build.path(OUT)


def _write_repos(tmp: Path, build: BuildDir, model_dir: Path, spec_dir: Path, tree: ChoicesTree | None,
                 structure: DraftStructure | None, converted: dict[str, Any] | None, draft: Path | None,
                 settings: dict[str, Any]) -> None:
    kind, root = settings["spec"], build.root.resolve()
    tokenizer = build_inputs.tokenizer_dir(build, model_dir)
    limits = build_inputs.serving_limits(build, model_dir)
    final = root / OUT  # where tmp lands: relative paths are computed against it
    deployment = deployment_json(final / "cpu" / "tensorrt_llm" / "1", root, model_dir, settings["dtype"], settings["device"],
                                 kind, spec_dir, choices=tree.to_list() if tree else None,
                                 options=cpu_options(kind, structure, tree, converted,
                                                     build_inputs.dflash_block(spec_dir) if kind == "dflash" else None),
                                 draft_model_dir=draft,
                                 adaptive=settings["adaptive"], spec_off_above=settings["spec_off_above"])
    write_cpu_repo(tmp / "cpu", deployment, os.path.relpath(tokenizer, final / "cpu" / "preprocessing"), limits,
                   max_batch_size=settings["cpu_max_batch_size"], tree=tree, decoupled=settings["decoupled"])
    if settings["cpu_draft_shape"] == "auto" and kind != "none":
        # tmp is final's sibling (BuildDir.stage): the file's relative paths resolve alike from it
        plan_cpu_repo(tmp / "cpu", deployment, structure, max_batch_size=settings["cpu_max_batch_size"],
                      spec_off_above=settings["spec_off_above"])
    gpu = {"max_batch_size": settings["max_batch_size"], "decoupled": settings["decoupled"],
           "kv_cache_free_gpu_mem_fraction": settings["kv_cache_free_gpu_mem_fraction"]}
    if converted and converted.get("engine_flow"):
        write_engine_repo(tmp / "engine", kind, tree, build_path(build.path("engines"), root), build_path(tokenizer, root),
                          limits, **gpu)
    knobs = None
    if converted and converted.get("llmapi"):
        knobs = gpu_knobs(converted, structure, tmp / "cpu" / PLAN_FILE)
        write_llmapi_repo(tmp / "llmapi", converted["llmapi"]["model"], converted["llmapi"], limits,
                          tp=converted["tp_size"], pp=converted["pp_size"], knobs=knobs, **gpu)
    write_gpu_routes(tmp, build, kind, converted, structure, settings, knobs, model_dir)


# ---------------------------------------------------------------------------------------------
# CLI


def _at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= `minimum`."""
    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*-?\d+\s*", text) or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return int(text)
    return parse


def add_cpu_deployment_args(parser: argparse.ArgumentParser, draft_shape: str) -> None:
    """The CPU deployment's in-flight batching and draft shape (package and engine)."""
    parser.add_argument("--cpu-draft-shape", choices=CPU_DRAFT_SHAPES, default=draft_shape,
                        help="CPU deployment: auto drafts the chain or tree the planner measures fastest on this machine "
                             f"(calibrated on held-out prompts; ~1 min), fixed the convert stage's (default {draft_shape})")
    parser.add_argument("--cpu-max-batch-size", type=_at_least(1), default=CPU_MAX_BATCH_SIZE,
                        help=f"CPU deployment: sequences decoded together in one in-flight batch (default {CPU_MAX_BATCH_SIZE})")
    parser.add_argument("--spec-off-above", type=_at_least(0),
                        help="CPU deployment: batches of more active sequences than this decode plainly (default: with "
                             "--cpu-draft-shape auto, the largest batch up to which speculating measured faster here; "
                             "else always speculate); `make loadtest` measures the curve through the server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdeploy.device import add_device_arg

    add_build_args(parser)
    add_device_arg(parser)
    parser.add_argument("--choices", help="Medusa choices tree, JSON ('[[0], [0, 0]]') or '{0}, {0, 0}'")
    parser.add_argument("--max-draft-len", type=int, help="draft tokens per step (default: what convert wrote, else 4)")
    parser.add_argument("--draft", help="draft model folder (spec=draft); default: the copy convert made, else spec/")
    parser.add_argument("--dtype", choices=SERVE_DTYPES, default="native", help=SERVE_DTYPE_HELP)
    parser.add_argument("--adaptive", action="store_true", help=ADAPTIVE_HELP)
    parser.add_argument("--max-batch-size", type=int, default=GPU_MAX_BATCH_SIZE,
                        help=f"engine/llmapi max batch size (default {GPU_MAX_BATCH_SIZE}, as `specdeploy build` builds the engines)")
    add_cpu_deployment_args(parser, draft_shape="fixed")
    parser.add_argument("--kv-cache-free-gpu-mem-fraction", type=float, default=0.9)
    parser.add_argument("--no-stream", action="store_true",
                        help="non-decoupled repositories, CPU and GPU (TensorRT-LLM's decoupled_mode false): plain "
                             "infer requests are answered, streaming ones refused")


def main(args: argparse.Namespace) -> int:
    build = build_from_args(args)
    out = run(
        build, spec=args.spec, choices=args.choices, max_draft_len=args.max_draft_len,
        draft_model_dir=args.draft, dtype=args.dtype, adaptive=args.adaptive, device=args.device,
        max_batch_size=args.max_batch_size, kv_cache_free_gpu_mem_fraction=args.kv_cache_free_gpu_mem_fraction,
        decoupled=not args.no_stream, cpu_max_batch_size=args.cpu_max_batch_size, spec_off_above=args.spec_off_above,
        cpu_draft_shape=args.cpu_draft_shape,
    )
    print(out)
    for line in gpu_summary(build):
        print(line)
    return 0
