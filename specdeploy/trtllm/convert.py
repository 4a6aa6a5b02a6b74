"""`specdeploy convert` (stage `convert`): TensorRT-LLM checkpoints written by the project.

Output (build/<name>/trtllm_ckpt/):
    target/config.json + rank{N}.safetensors   engine flow: the base model, or MedusaForCausalLM
                                               with the heads inside
    draft/...                                  engine flow, draft-target: the plain draft checkpoint
    */specdeploy.json                          what was converted from what (read back by reader.py)
    llmapi/                                    the LLM-API route (llmapi.py): speculative_config.yaml,
                                               eagle3_draft/, llmapi_summary.json
    convert_summary.json                       which routes this build has, and why not the others

Which routes: the engine flow (TRT-LLM 1.1 and 1.2: base, Medusa, draft-target) and the LLM-API
route (every line read, 1.1-1.4: EAGLE-3, DFlash from 1.3, draft-target, n-gram, base), each
where the spec kind, the quantization and the release named by --trtllm-version allow it. Engine-flow EAGLE-1/2 is not
converted: the spec stage trains EAGLE-3, which only the LLM API runs.

Config fields and tensor names follow TensorRT-LLM's own sources, cited field by field in
specdeploy/trtllm/formats.py (LLaMAConfig/QWenConfig/MedusaConfig/QuantConfig/Mapping,
llama/convert.py naming and TP split rules). Ranks are
rank = pp_rank * tp_size + tp_rank (tensorrt_llm/mapping.py); each rank file holds only what
that rank's model declares: vocab_embedding on the first PP rank, ln_f / lm_head / Medusa
heads on the last one (PretrainedModel.load fails on a missing tensor).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdeploy.choices import ChoicesTree, validate_choices
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_bytes, atomic_write_json
from specdeploy.hfcompat import write_compatible
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.trtllm import llmapi, specmodules
from specdeploy.trtllm.hostpaths import build_path
from specdeploy.trtllm.llmapi import DraftStructure
from specdeploy.trtllm.releases import DEFAULT_TRTLLM_VERSION, release_for
from specdeploy.trtllm.source import HFSource, load_hf_source
from specdeploy.trtllm.weights import kv_rep, layer_rank, pad_rows, slice_role, unquantized_linears

STAGE, OUT = "convert", "trtllm_ckpt"
KINDS = ("none", "medusa", "eagle", "dflash", "draft", "ngram")
DEFAULT_DRAFT_LEN = 4  # EAGLE-3 chain / draft-target / n-gram drafts per step when nothing says otherwise
DRAFT_MODEL = "draft_model"  # draft-target: the draft's HF folder, carried inside the build
# What convert writes, versioned: a build converted by an older writer is converted again (2: the
# configs named per release, drafters in bf16 and readable by the release's transformers)
WRITER = 2
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class SpecInput:
    """What the spec stage produced (spec/spec_config.json + module.safetensors), or a plain run."""

    kind: str = "none"
    config: dict[str, Any] | None = None
    module: dict[str, torch.Tensor] | None = None
    tree: ChoicesTree | None = None
    draft_dir: Path | None = None
    max_draft_len: int | None = None


def load_spec(spec_dir: str | Path | None, *, kind: str | None = None, draft_model: str | Path | None = None,
              max_draft_len: int | None = None) -> SpecInput:
    """Read build/<name>/spec/; `kind`/`draft_model` override or stand in for it."""
    config: dict[str, Any] = {}
    if spec_dir is not None and (Path(spec_dir) / "spec_config.json").exists():
        config = json.loads((Path(spec_dir) / "spec_config.json").read_text())
    kind = kind or config.get("kind") or ("draft" if draft_model else "none")
    if kind not in KINDS:
        raise SpecDeployError(f"unknown spec kind {kind!r}", hint=f"one of {', '.join(KINDS)}")
    spec = SpecInput(kind=kind, config=config, max_draft_len=max_draft_len or config.get("max_draft_len"))
    if kind in ("medusa", "eagle", "dflash"):
        module_file = Path(spec_dir or ".") / "module.safetensors"
        if not module_file.exists():
            raise SpecDeployError(f"{module_file} not found", hint="run `specdeploy spec` first: it writes the trained module there")
        from safetensors.torch import load_file

        spec.module = load_file(str(module_file))
        _refuse_quantized_module(spec.module)
        if kind == "medusa" and config.get("choices"):
            spec.tree = validate_choices(config["choices"], name="medusa_choices")
    if kind == "draft":
        found = draft_model or config.get("draft_model") or config.get("draft_model_dir")
        if not found:
            raise SpecDeployError("draft-target needs a draft model", hint="pass --draft-model or record draft_model in spec_config.json")
        spec.draft_dir = Path(found)
    return spec


def _refuse_quantized_module(module: dict[str, torch.Tensor]) -> None:
    scaled = [k for k in module if k.endswith(("weight_scale", "input_scale", "pre_quant_scale"))]
    if scaled:
        raise SpecDeployError(
            f"the spec module holds quantized tensors ({scaled[0]}, ...): quantized Medusa/EAGLE modules are not converted",
            hint="keep the module unquantized: the converter excludes medusa_heads* from quantization",
        )


QUANTIZED_SPEC_REASON = (
    "--quantize-spec wrote an FP8 module (quantized/spec/) that no TensorRT-LLM route here can deploy: the engine "
    "flow's Medusa converter writes unquantized heads, and that the LLM API loads ModelOpt's FP8 EAGLE-3 drafter "
    "export could not be confirmed in the llm_args/loader sources read for 1.2, 1.3 or main (formats.py)"
)


def refuse_quantized_spec(model_dir: Path) -> None:
    """Refuse to deploy an unquantized module beside a quality report measured with an FP8 one."""
    config = Path(model_dir) / "spec" / "spec_config.json"
    if config.exists() and json.loads(config.read_text()).get("quantization"):
        raise SpecDeployError(QUANTIZED_SPEC_REASON,
                              hint="rebuild without --quantize-spec (the module deploys unquantized; the quality report "
                                   "then measures what is deployed)")


# ------------------------------------------------------------------------------- config.json

def quant_config(src: HFSource, kind: str, pp: int = 1) -> dict[str, Any]:
    """QuantConfig dict (modeling_utils.QuantConfig). exclude_modules lists what stays in the
    model dtype: lm_head, the spec module, and the decoder Linears `quantize --exclude` kept,
    by name as ModelOpt's TRT-LLM export does (TRT-LLM's quantize_layers fnmatches them)."""
    quant = src.quant
    out: dict[str, Any] = {"quant_algo": quant.algo, "kv_cache_quant_algo": quant.kv_algo}
    if quant.algo:
        kept = unquantized_linears(src.tensors, src.dims.layers)
        if kept and pp > 1:
            raise SpecDeployError(
                f"{len(kept)} decoder Linears are unquantized (quantize --exclude) and --pp-size is {pp}: TRT-LLM matches "
                "exclude_modules against each pipeline stage's local layer names, so they would land on the wrong layers",
                hint="use --pp-size 1 (or --tp-size) for a mixed-precision checkpoint, or quantize without --exclude",
            )
        # The embedding is not a quantized GEMM in TRT-LLM; lm_head stays in the model dtype.
        spec_module = ["medusa_heads*"] if kind == "medusa" else []
        out["exclude_modules"] = ["lm_head", *spec_module, *kept]
    if quant.algo == "W4A16_AWQ":
        out.update(group_size=quant.group_size, has_zero_point=False, pre_quant_scale=True)
    return out


def mapping_dict(tp: int, pp: int) -> dict[str, int]:
    return {"world_size": tp * pp, "tp_size": tp, "pp_size": pp}


def base_config(src: HFSource, tp: int, pp: int, kind: str = "none") -> dict[str, Any]:
    d = src.dims
    config: dict[str, Any] = {
        "architecture": src.config["architectures"][0],
        "dtype": src.dtype,
        "logits_dtype": "float32",
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_size": d.head_dim,
        "intermediate_size": d.intermediate,
        "hidden_act": d.hidden_act,
        "norm_epsilon": d.norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": d.max_positions,
        "rotary_base": d.rope_theta,
        "rotary_scaling": d.rope_scaling,
        "mapping": mapping_dict(tp, pp),
        "quantization": quant_config(src, kind, pp),
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mlp_bias": False,
        "attn_bias": src.family == "qwen2",
        # lm_head is always written (a copy of the embedding when the HF model ties them)
        "tie_word_embeddings": False,
    }
    if src.family == "qwen2":
        config.update(qwen_type="qwen2", use_logn_attn=False, seq_length=src.config.get("seq_length", 8192))
    return config


def medusa_config(src: HFSource, spec: SpecInput, shape: specmodules.MedusaShape) -> dict[str, Any]:
    tree = spec.tree or validate_choices([[0] * (i + 1) for i in range(shape.heads)])
    validate_choices(tree.to_list(), max_depth=shape.heads, name="medusa_choices")
    extra = {"architecture": "MedusaForCausalLM", "num_medusa_heads": shape.heads,
             "num_medusa_layers": shape.layers, "max_draft_len": tree.num_nodes}
    if src.family == "qwen2":
        extra["model_type"] = "qwen2"  # MedusaConfig wraps QWenConfig only when model_type says qwen
    return extra


# ---------------------------------------------------------------------------- validation

def check_mapping(src: HFSource, tp: int, pp: int, kind: str) -> None:
    """The combinations TRT-LLM cannot build, refused before anything is written."""
    d = src.dims
    if tp < 1 or pp < 1:
        raise SpecDeployError(f"--tp-size {tp} / --pp-size {pp} must be >= 1")
    if d.layers % pp:
        raise SpecDeployError(f"{d.layers} layers do not split evenly into --pp-size {pp} stages", hint="TRT-LLM 1.x gives each stage num_layers // pp_size layers")
    kv_rep(d, tp)
    if d.intermediate % tp:
        raise SpecDeployError(f"intermediate size {d.intermediate} is not divisible by --tp-size {tp}")
    if src.quant.algo == "W4A16_AWQ":
        for name, width in (("o_proj", d.q_size), ("down_proj", d.intermediate)):
            if (width // tp) % src.quant.group_size:
                raise SpecDeployError(
                    f"INT4 AWQ: {name} input width {width} / tp {tp} is not a multiple of the group size {src.quant.group_size}",
                    hint="row-parallel layers split whole quantization groups; use a smaller --tp-size",
                )


# ---------------------------------------------------------------------------- rank tensors

def _lm_head(src: HFSource) -> torch.Tensor:
    return src.tensors.get("lm_head.weight", src.tensors["model.embed_tokens.weight"])


def base_rank(src: HFSource, tp: int, pp: int, rank: int, progress: tqdm | None = None) -> dict[str, torch.Tensor]:
    tp_rank, pp_rank = rank % tp, rank // tp
    per_stage = src.dims.layers // pp
    dtype = TORCH_DTYPES[src.dtype]
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["transformer.vocab_embedding.weight"] = src.tensors["model.embed_tokens.weight"]
    for local in range(per_stage):
        layer = layer_rank(src.tensors, f"model.layers.{pp_rank * per_stage + local}", src.dims, src.quant, tp, tp_rank, dtype)
        out.update({f"transformer.layers.{local}.{k}": v for k, v in layer.items()})
        if progress:
            progress.update(1)
    if pp_rank == pp - 1:
        out["transformer.ln_f.weight"] = src.tensors["model.norm.weight"]
        out["lm_head.weight"] = slice_role("weight", pad_rows(_lm_head(src), tp), "col", tp, tp_rank, "lm_head")
    return out


def _save_rank(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save

    seen: set[int] = set()
    fixed = {}
    for name, t in tensors.items():
        t = t.contiguous()
        storage = t.untyped_storage().data_ptr()
        if storage in seen:  # safetensors refuses tensors sharing storage (slices/copies of one tensor)
            t = t.clone()
            storage = t.untyped_storage().data_ptr()
        seen.add(storage)
        fixed[name] = t
    atomic_write_bytes(path, save(fixed, metadata=metadata))


def write_checkpoint(src: HFSource, out: Path, *, tp: int = 1, pp: int = 1, spec: SpecInput | None = None,
                     role: str = "target") -> dict[str, Any]:
    """One TRT-LLM checkpoint (config.json + rank files) for `src` with an optional spec module."""
    spec = spec or SpecInput()
    kind = spec.kind if spec.kind == "medusa" else "none"
    check_mapping(src, tp, pp, kind)
    config = base_config(src, tp, pp, kind)
    sidecar: dict[str, Any] = {"producer": "specdeploy", "role": role, "source": str(src.path), "family": src.family,
                               "hf_config": src.config, "kv_rep": kv_rep(src.dims, tp), "spec": {"kind": kind}}
    extra_rank = _spec_extras(src, spec, kind, config, sidecar, tp)
    out.mkdir(parents=True, exist_ok=True)
    with tqdm(total=src.dims.layers * tp, desc=f"convert {role} tp={tp} pp={pp}", unit="layer") as progress:
        for rank in range(tp * pp):
            tensors = base_rank(src, tp, pp, rank, progress)
            if rank // tp == pp - 1:
                tensors.update(extra_rank(rank % tp))
            _save_rank(out / f"rank{rank}.safetensors", tensors, {"format": "pt"})
    atomic_write_json(out / "config.json", config)
    atomic_write_json(out / "specdeploy.json", sidecar)
    return config


def _spec_extras(src: HFSource, spec: SpecInput, kind: str, config: dict, sidecar: dict, tp: int):
    """Fill the spec part of config/sidecar; return rank -> extra tensors (last PP stage)."""
    dtype = TORCH_DTYPES[src.dtype]
    if kind == "medusa":
        shape = specmodules.medusa_shape(spec.module)
        config.update(medusa_config(src, spec, shape))
        sidecar["spec"].update(heads=shape.heads, layers=shape.layers)
        return lambda tp_rank: specmodules.medusa_rank(spec.module, shape, tp, tp_rank, dtype)
    return lambda tp_rank: {}


def engine_refusal(kind: str, version: str | None = None) -> str | None:
    """Why the engine flow cannot serve this spec kind (on this release), or None; the kind's own
    reason first, as it holds on every release."""
    if kind == "eagle":
        return ("the engine flow runs EAGLE-1/2 (EagleForCausalLM) only, and the spec stage trains EAGLE-3, which only "
                "the LLM API runs")
    if kind == "dflash":
        return "DFlash runs on the LLM API only (DFlashDecodingConfig supports the pytorch backend alone, 1.3+)"
    if kind == "ngram":
        return ("an engine-flow n-gram target expects external draft tokens and nothing in the Triton engine repository "
                "supplies them: it would serve plain decoding (the LLM API's NGram drafts inside TensorRT-LLM)")
    if version is not None and release_for(version).engine_flow == "removed":
        return (f"TensorRT-LLM {version} has no engine flow: trtllm-build and the C++ Triton backend were removed in the "
                "1.3 line (no tensorrt requirement from 1.3.0rc22 on, PR #15918); the engine flow runs on 1.1 and 1.2")
    return None


def external_draft_len(spec: SpecInput) -> int:
    """--max-draft-len, else DFlash's whole block (block_size - 1 drafts), else the default chain."""
    block = (spec.config or {}).get("block_size") if spec.kind == "dflash" else None
    return int(spec.max_draft_len or (block - 1 if block else DEFAULT_DRAFT_LEN))


def convert_all(model_dir: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, spec: SpecInput | None = None) -> dict[str, Any]:
    """Every engine-flow checkpoint a spec kind needs, under out/target (and out/draft)."""
    spec = spec or SpecInput()
    why = engine_refusal(spec.kind)
    if why:
        raise specmodules.EngineFlowUnsupported(why, hint=specmodules.LLMAPI_HINT)
    out = Path(out)
    summary: dict[str, Any] = {"kind": spec.kind, "tp_size": tp, "pp_size": pp}
    config = write_checkpoint(load_hf_source(model_dir), out / "target", tp=tp, pp=pp, spec=spec)
    summary["max_draft_len"] = config.get("max_draft_len", 0)
    if spec.kind == "draft":
        summary["max_draft_len"] = external_draft_len(spec)
        write_checkpoint(load_hf_source(spec.draft_dir), out / "draft", tp=tp, pp=pp, role="draft")
    if spec.tree is not None:
        summary["choices"] = spec.tree.to_list()
    atomic_write_json(out / "convert_summary.json", summary)
    return summary


# --------------------------------------------------------------------------------- the stage

def _inputs(build: BuildDir) -> tuple[Path, tuple[str, ...]]:
    consumes = tuple(s for s in ("resolve", "spec", "quantize") if build.record(s))
    model = build.path("quantized") if build.record("quantize") else build.path("base")
    if not (model / "config.json").exists():
        raise SpecDeployError(f"no model in {model}", hint="run `specdeploy resolve` (and `specdeploy quantize`) first")
    return model, consumes


def link_folder(src: Path, dst: Path) -> None:
    """A copy of an HF folder's files (hard links where the filesystem allows: no extra space)."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in Path(src).iterdir():
        if item.is_file():
            try:
                os.link(item, dst / item.name)
            except OSError:
                shutil.copy2(item, dst / item.name)


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
    quant, kv = _quant_algos(model)
    reasons = {"engine": engine_refusal(spec.kind, trtllm_version), "llmapi": llmapi.refusal(spec.kind, quant, release, kv, spec.config)}
    if route == "engine" and reasons["engine"]:
        raise specmodules.EngineFlowUnsupported(reasons["engine"], hint=specmodules.LLMAPI_HINT)
    if route == "llmapi" and reasons["llmapi"]:
        raise SpecDeployError(reasons["llmapi"], hint="use --route auto, or --route engine where the engine flow applies")
    published = published or out
    summary: dict[str, Any] = {"kind": spec.kind, "tp_size": tp, "pp_size": pp, "trtllm_version": trtllm_version,
                               "structure": structure.as_dict() if structure else None,
                               "engine_flow": False, "engine_reason": reasons["engine"],
                               "llmapi": None, "llmapi_reason": reasons["llmapi"]}
    if spec.kind == "draft":  # the build carries its draft model: both sides run it wherever the build moves
        link_folder(spec.draft_dir, out / DRAFT_MODEL)
        write_compatible(out / DRAFT_MODEL)  # TensorRT-LLM loads it with its own, older transformers
        summary["draft_model"] = build_path(published / DRAFT_MODEL, root)
        spec = replace(spec, draft_dir=out / DRAFT_MODEL)  # converted from here; named as published
    if route != "llmapi" and not reasons["engine"]:
        summary.update(convert_all(model, out, tp=tp, pp=pp, spec=spec), engine_flow=True)
    if route != "engine" and not reasons["llmapi"]:
        if spec.kind == "draft":
            spec = replace(spec, draft_dir=published / DRAFT_MODEL)
        summary["llmapi"] = llmapi.write_llmapi(model, out / "llmapi", spec=spec, structure=structure or DraftStructure(),
                                                release=release, spec_dir=spec_dir, base_dir=base_dir, root=root,
                                                published=published / "llmapi")
    for name, why in reasons.items():  # the CPU deployment is still packaged; the GPU host gets nothing to run
        if why and route == "auto":
            print(f"convert: no {name} route: {why}")
    atomic_write_json(out / "convert_summary.json", summary)
    return summary


def run(build: BuildDir, *, tp: int = 1, pp: int = 1, route: str = "auto", kind: str | None = None,
        draft_model: str | None = None, max_draft_len: int | None = None,
        trtllm_version: str = DEFAULT_TRTLLM_VERSION, eagle_tree: str = "chain", tree_topk: int | None = None,
        tree_total: int | None = None) -> Path:
    """Stage `convert`: build/<name>/trtllm_ckpt/ from the quantized (or resolved) model + spec."""
    model, consumes = _inputs(build)
    refuse_quantized_spec(model)
    spec_dir = build.path("spec") if build.record("spec") else None
    settings = {"tp": tp, "pp": pp, "route": route, "kind": kind, "draft_model": draft_model, "max_draft_len": max_draft_len,
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
