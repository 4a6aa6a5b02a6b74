"""`specdeploy convert` (stage `convert`): TensorRT-LLM checkpoints written by the project.

Output (build/<name>/trtllm_ckpt/):
    target/config.json + rank{N}.safetensors   engine flow (engine_checkpoint.py): the base model, or
                                               MedusaForCausalLM with the heads inside
    draft/...                                  engine flow, draft-target: the plain draft checkpoint
    */specdeploy.json                          what was converted from what (read back by reader.py)
    llmapi/                                    the LLM-API route (llmapi.py, draft_folders.py):
                                               speculative_config.yaml, eagle3_draft/, llmapi_summary.json,
                                               model_bf16/ + draft_model_bf16/ for a float32 target / draft
                                               (half_folder.py: the PyTorch backend lacks float32)
    draft_model/                               draft-target: the draft's HF folder, carried by the build
    convert_summary.json                       which routes this build has, and why not the others

Which routes: the engine flow (TRT-LLM 1.1 and 1.2: base, Medusa, draft-target) and the LLM-API
route (every line read, 1.1-1.4: EAGLE-3, DFlash from 1.3, draft-target, n-gram, base), each
where the spec kind, the quantization and the release named by --trtllm-version allow it. Engine-flow EAGLE-1/2 is not
converted: the spec stage trains EAGLE-3, which only the LLM API runs. This file is the stage: its
inputs, the routes it writes and its CLI; spec_input.py reads the spec stage's output.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, content_fingerprint, link_folder
from specdeploy.hfcompat import write_compatible
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.resolve.stage import KEEP_SUFFIXES
from specdeploy.trtllm import llmapi, specmodules
from specdeploy.trtllm.engine_checkpoint import convert_all, engine_refusal
from specdeploy.trtllm.half_folder import needs_half, write_half
from specdeploy.trtllm.hostpaths import build_path
from specdeploy.trtllm.llmapi import DraftStructure
from specdeploy.trtllm.releases import DEFAULT_TRTLLM_VERSION, Release, release_for
from specdeploy.trtllm.spec_input import (
    DEFAULT_DRAFT_LEN,
    SpecInput,
    external_draft_len,
    load_spec,
    refuse_quantized_spec,
)

STAGE, OUT = "convert", "trtllm_ckpt"
DRAFT_MODEL = "draft_model"  # draft-target: the draft's HF folder, carried inside the build
# What convert writes, versioned: a build converted by an older writer is converted again (2: the
# configs named per release, drafters in bf16 and readable by the release's transformers; 3: a
# float32 target or draft in bf16 on the LLM-API route)
WRITER = 3


def _inputs(build: BuildDir) -> tuple[Path, tuple[str, ...]]:
    consumes = tuple(s for s in ("resolve", "spec", "quantize") if build.record(s))
    model = build.path("quantized") if build.record("quantize") else build.path("base")
    if not (model / "config.json").exists():
        raise SpecDeployError(f"no model in {model}", hint="run `specdeploy resolve` (and `specdeploy quantize`) first")
    return model, consumes


def _quant_algos(model: Path) -> tuple[str | None, str | None]:
    """(quant_algo, kv_cache_quant_algo) of ModelOpt's export; (None, None) unquantized."""
    file = Path(model) / "hf_quant_config.json"
    quant = json.loads(file.read_text()).get("quantization", {}) if file.exists() else {}
    return quant.get("quant_algo"), quant.get("kv_cache_quant_algo")


def draft_structure(spec: SpecInput, mode: str = "chain", topk: int | None = None, total: int | None = None) -> DraftStructure | None:
    """How EAGLE-3 / draft-target / n-gram draft on both the GPU host and the CPU deployment
    (Medusa keeps its choices tree, on the engine flow)."""
    if spec.kind in ("none", "medusa"):
        return None
    return DraftStructure.make(mode, external_draft_len(spec), topk, total)


def convert_routes(model: Path, out: Path, spec: SpecInput, *, route: str = "auto", tp: int = 1, pp: int = 1,
                   spec_dir: Path | None = None, base_dir: Path | None = None,
                   trtllm_version: str = DEFAULT_TRTLLM_VERSION, structure: DraftStructure | None = None,
                   root: Path | None = None, published: Path | None = None) -> dict[str, Any]:
    """Every route the build has for the release named: engine-flow checkpoints and/or the LLM-API
    files; `route` engine/llmapi insists on one (an error says why not); auto takes what applies,
    possibly none (e.g. INT8 SQ + n-gram). convert_summary.json records the routes written and
    why the others were not."""
    release = release_for(trtllm_version)  # refuses a release line nobody checked
    structure = structure or draft_structure(spec)
    reasons = _refusals(model, spec, route, release, trtllm_version)
    published = published or out
    summary: dict[str, Any] = {"kind": spec.kind, "tp_size": tp, "pp_size": pp, "trtllm_version": trtllm_version,
                               "structure": structure.as_dict() if structure else None,
                               "engine_flow": False, "engine_reason": reasons["engine"],
                               "llmapi": None, "llmapi_reason": reasons["llmapi"]}
    if spec.kind == "draft":
        spec, summary["draft_model"] = _carry_draft(spec, out, published, root)
    if route != "llmapi" and not reasons["engine"]:
        summary.update(convert_all(model, out, tp=tp, pp=pp, spec=spec), engine_flow=True)
    if route != "engine" and not reasons["llmapi"]:
        if spec.kind == "draft":
            spec = replace(spec, draft_dir=_llmapi_draft(spec.draft_dir, out, published))
        summary["llmapi"] = llmapi.write_llmapi(model, out / "llmapi", spec=spec, structure=structure or DraftStructure(),
                                                release=release, spec_dir=spec_dir, base_dir=base_dir, root=root,
                                                published=published / "llmapi")
    for name, why in reasons.items():  # the CPU deployment is still packaged; the GPU host gets nothing to run
        if why and route == "auto":
            print(f"convert: no {name} route: {why}")
    atomic_write_json(out / "convert_summary.json", summary)
    return summary


def _refusals(model: Path, spec: SpecInput, route: str, release: Release, trtllm_version: str) -> dict[str, str | None]:
    """Why each route is absent from this build (None: it is written); an error when `route`
    insists on an absent one."""
    quant, kv = _quant_algos(model)
    reasons = {"engine": engine_refusal(spec.kind, trtllm_version), "llmapi": llmapi.refusal(spec.kind, quant, release, kv, spec.config)}
    if route == "engine" and reasons["engine"]:
        raise specmodules.EngineFlowUnsupported(reasons["engine"], hint=specmodules.LLMAPI_HINT)
    if route == "llmapi" and reasons["llmapi"]:
        raise SpecDeployError(reasons["llmapi"], hint="use --route auto, or --route engine where the engine flow applies")
    return reasons


def _carry_draft(spec: SpecInput, out: Path, published: Path, root: Path | None) -> tuple[SpecInput, str]:
    """Draft-target: the build carries its draft model, so both sides run it wherever the build moves.
    The spec converted from the copy in `out`, and the copy's path as `published`."""
    link_folder(spec.draft_dir, out / DRAFT_MODEL)
    write_compatible(out / DRAFT_MODEL)  # TensorRT-LLM loads it with its own, older transformers
    return replace(spec, draft_dir=out / DRAFT_MODEL), build_path(published / DRAFT_MODEL, root)


def _llmapi_draft(carried: Path, out: Path, published: Path) -> Path:
    """The draft the LLM-API route names, as it will be published: the carried one, or its bfloat16
    copy where it is float32 (the PyTorch backend's kernels lack float32: half_folder.py)."""
    if not needs_half(carried):
        return published / DRAFT_MODEL
    write_half(carried, out / "llmapi" / llmapi.HALF_DRAFT)
    return published / "llmapi" / llmapi.HALF_DRAFT


def run(build: BuildDir, *, tp: int = 1, pp: int = 1, route: str = "auto", kind: str | None = None,
        draft_model: str | None = None, max_draft_len: int | None = None,
        trtllm_version: str = DEFAULT_TRTLLM_VERSION, eagle_tree: str = "chain", tree_topk: int | None = None,
        tree_total: int | None = None) -> Path:
    """Stage `convert`: build/<name>/trtllm_ckpt/ from the quantized (or resolved) model + spec."""
    model, consumes = _inputs(build)
    refuse_quantized_spec(model)
    spec_dir = build.path("spec") if build.record("spec") else None
    settings = {"tp": tp, "pp": pp, "route": route, "kind": kind, "draft_model": draft_model, "max_draft_len": max_draft_len,
                # the draft's content, not only its path: a draft replaced in place is converted again
                "draft_files": content_fingerprint(draft_model, KEEP_SUFFIXES) if draft_model and Path(draft_model).is_dir() else None,
                "writer": WRITER, "trtllm_version": trtllm_version, "eagle_tree": eagle_tree, "tree_topk": tree_topk, "tree_total": tree_total}
    if build.completed(STAGE, settings, consumes=consumes):
        return build.path(OUT)
    spec = load_spec(spec_dir, kind=kind, draft_model=draft_model, max_draft_len=max_draft_len)
    structure = draft_structure(spec, eagle_tree, tree_topk, tree_total)
    with build.stage(STAGE, OUT, settings, consumes=consumes) as tmp:
        convert_routes(model, tmp, spec, route=route, tp=tp, pp=pp, spec_dir=spec_dir, base_dir=build.path("base"),
                       trtllm_version=trtllm_version, structure=structure, root=build.root, published=build.path(OUT))
    return build.path(OUT)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    llmapi.add_trtllm_version_arg(parser)
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument("--pp-size", type=int, default=1, help="pipeline-parallel stages (default 1)")
    parser.add_argument("--route", choices=["auto", "engine", "llmapi"], default="auto",
                        help="engine: checkpoints for trtllm-build (TRT-LLM 1.1 / 1.2) or an error; llmapi: the LLM-API "
                             "files or an error; auto (default): every route the build has")
    parser.add_argument("--draft-model", help="draft-target: the draft model's HF folder")
    parser.add_argument("--max-draft-len", type=int,
                        help=f"EAGLE-3 chain length / dynamic-tree depth, draft-target and n-gram draft tokens per step (default {DEFAULT_DRAFT_LEN})")
    parser.add_argument("--eagle-tree", choices=["chain", "dynamic"], default="chain",
                        help="EAGLE-3 drafting on the GPU host and the CPU deployment: a chain (default) or TensorRT-LLM's "
                             "dynamic tree (1.3+)")
    parser.add_argument("--tree-topk", type=int, help="dynamic tree: children per node / nodes expanded per depth (default 3)")
    parser.add_argument("--tree-total-tokens", type=int, help="dynamic tree: draft tokens kept per step (default min(10, topk x depth))")
    parser.add_argument("--hf-dir", help="convert this HF folder directly (no build directory); needs --out")
    parser.add_argument("--spec-dir", help="with --hf-dir: a spec/ folder (spec_config.json + module.safetensors)")
    parser.add_argument("--out", help="with --hf-dir: output folder")


def main(args: argparse.Namespace) -> int:
    # medusa/eagle come from the spec stage's spec_config.json; draft/ngram need no module
    kind = args.spec if args.spec in ("draft", "ngram") else None
    tree = {"trtllm_version": args.trtllm_version}
    if args.hf_dir:
        if not args.out:
            raise SpecDeployError("--hf-dir needs --out")
        spec = load_spec(args.spec_dir, kind=kind, draft_model=args.draft_model, max_draft_len=args.max_draft_len)
        summary = convert_routes(Path(args.hf_dir), Path(args.out), spec, route=args.route, tp=args.tp_size, pp=args.pp_size,
                                 spec_dir=Path(args.spec_dir) if args.spec_dir else None,
                                 structure=draft_structure(spec, args.eagle_tree, args.tree_topk, args.tree_total_tokens), **tree)
        print(f"TRT-LLM {args.route} output in {args.out}: {json.dumps(summary, default=str)}")
        return 0
    out = run(build_from_args(args), tp=args.tp_size, pp=args.pp_size, route=args.route, kind=kind,
              draft_model=args.draft_model, max_draft_len=args.max_draft_len, eagle_tree=args.eagle_tree,
              tree_topk=args.tree_topk, tree_total=args.tree_total_tokens, **tree)
    print(f"TRT-LLM {args.route} output in {out}")
    return 0
