"""`specdeploy convert` (stage `convert`): TensorRT-LLM checkpoints written by the project.

Output (build/<name>/trtllm_ckpt/):
    target/config.json + rank{N}.safetensors   the base model, or MedusaForCausalLM /
                                               EagleForCausalLM with the spec module inside
    draft/...                                  draft-target only: the plain draft checkpoint
    */specdeploy.json                          what was converted from what (read back by reader.py)
    llmapi/                                    --route llmapi: the TRT-LLM >= 1.2 route (llmapi.py)

Config fields and tensor names follow TensorRT-LLM's own sources, cited field by field in
specdeploy/trtllm/formats.py (LLaMAConfig/QWenConfig/MedusaConfig/EagleConfig/QuantConfig/
Mapping, llama/convert.py + eagle/weight.py naming and TP split rules). Ranks are
rank = pp_rank * tp_size + tp_rank (tensorrt_llm/mapping.py); each rank file holds only what
that rank's model declares: vocab_embedding on the first PP rank, ln_f / lm_head / Medusa
heads on the last one (PretrainedModel.load fails on a missing tensor).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdeploy.choices import ChoicesTree, validate_choices
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_bytes, atomic_write_json
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.trtllm import specmodules
from specdeploy.trtllm.formats import MAX_EAGLE_DRAFT_LEN
from specdeploy.trtllm.source import HFSource, load_hf_source
from specdeploy.trtllm.weights import kv_rep, layer_rank, pad_rows, slice_role, unquantized_linears

STAGE, OUT = "convert", "trtllm_ckpt"
KINDS = ("none", "medusa", "eagle", "draft", "ngram")
DEFAULT_EXTERNAL_DRAFT_LEN = 4  # draft-target / n-gram drafts per step when nothing says otherwise
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
    if kind in ("medusa", "eagle"):
        module_file = Path(spec_dir or ".") / "module.safetensors"
        if not module_file.exists():
            raise SpecDeployError(f"{module_file} not found", hint="run `specdeploy spec` first: it writes the trained module there")
        from safetensors.torch import load_file

        spec.module = load_file(str(module_file))
        _refuse_quantized_module(spec.module)
        if config.get("choices"):
            spec.tree = validate_choices(config["choices"], name=f"{kind}_choices")
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
            hint="keep the module unquantized: the converter excludes medusa_heads*/eagle_nets* from quantization",
        )


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
        spec_module = {"medusa": ["medusa_heads*"], "eagle": ["eagle_nets*"]}.get(kind, [])
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


def eagle_config(src: HFSource, spec: SpecInput, dims, tp: int) -> dict[str, Any]:
    tree = spec.tree or validate_choices([[0] * (i + 1) for i in range(4)])
    shape = specmodules.eagle_choices_shape(tree.paths)
    if shape["max_draft_len"] > MAX_EAGLE_DRAFT_LEN:
        raise SpecDeployError(f"EAGLE choices tree has {shape['max_draft_len']} nodes", hint=f"TRT-LLM supports max_draft_len <= {MAX_EAGLE_DRAFT_LEN}")
    net = {
        "architecture": "LlamaForCausalLM", "dtype": src.dtype, "logits_dtype": "float32",
        "num_hidden_layers": dims.layers, "num_attention_heads": dims.heads, "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate, "num_key_value_heads": dims.kv_heads, "vocab_size": dims.vocab,
        "position_embedding_type": "rope_gpt_neox", "max_position_embeddings": dims.max_positions,
        "hidden_act": dims.hidden_act, "rotary_base": dims.rope_theta, "rotary_scaling": dims.rope_scaling,
        "norm_epsilon": dims.norm_eps, "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "mapping": mapping_dict(tp, 1), "use_parallel_embedding": False, "embedding_sharding_dim": 0,
        "head_dim": dims.head_dim, "head_size": dims.head_dim,
    }
    return {"architecture": "EagleForCausalLM", **shape, "eagle_net_config": net}


# ---------------------------------------------------------------------------- validation

def check_mapping(src: HFSource, tp: int, pp: int, kind: str) -> None:
    """The combinations TRT-LLM cannot build, refused before anything is written."""
    d = src.dims
    if tp < 1 or pp < 1:
        raise SpecDeployError(f"--tp-size {tp} / --pp-size {pp} must be >= 1")
    if kind == "eagle" and pp > 1:
        raise SpecDeployError(
            "EAGLE does not support pipeline parallelism in TensorRT-LLM (its EagleNets run on a pp_size=1 mapping)",
            hint="use --tp-size for EAGLE and keep --pp-size 1",
        )
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
    kind = spec.kind if spec.kind in ("medusa", "eagle") else "none"
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
    if kind == "eagle":
        if src.family != "llama":
            raise specmodules.EngineFlowUnsupported("TRT-LLM's engine EAGLE (EagleForCausalLM) takes Llama-family bases only", hint=specmodules.LLMAPI_HINT)
        specmodules.check_eagle_engine(spec.module, spec.config or {}, src.dims)
        dims = specmodules.eagle_dims(spec.module, spec.config or {}, src.dims)
        kv_rep(dims, tp)
        config.update(eagle_config(src, spec, dims, tp))
        sidecar["spec"].update(
            eagle_layers=dims.layers, heads=dims.heads,
            synthesized_fc="eagle_module.fc.weight" not in spec.module,
            lm_head_from_base="eagle_module.lm_head.weight" not in spec.module,
        )
        n = config["num_eagle_layers"]

        def eagle_rank(tp_rank: int) -> dict[str, torch.Tensor]:
            net = specmodules.eagle_net_rank(spec.module, src.tensors, dims, tp, tp_rank, dtype)
            return {f"eagle_nets.{i}.{k}": v for i in range(n) for k, v in net.items()}

        return eagle_rank
    return lambda tp_rank: {}


def external_draft_len(spec: SpecInput) -> int:
    if spec.max_draft_len is not None:
        return int(spec.max_draft_len)
    return spec.tree.num_nodes if spec.tree else DEFAULT_EXTERNAL_DRAFT_LEN


def convert_all(model_dir: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, spec: SpecInput | None = None) -> dict[str, Any]:
    """Every engine-flow checkpoint a spec kind needs, under out/target (and out/draft)."""
    spec = spec or SpecInput()
    out = Path(out)
    summary: dict[str, Any] = {"kind": spec.kind, "tp_size": tp, "pp_size": pp}
    config = write_checkpoint(load_hf_source(model_dir), out / "target", tp=tp, pp=pp, spec=spec)
    summary["max_draft_len"] = config.get("max_draft_len", 0)
    if spec.kind in ("draft", "ngram"):
        summary["max_draft_len"] = external_draft_len(spec)
    if spec.kind == "draft":
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


def convert_routes(model: Path, out: Path, spec: SpecInput, *, route: str = "auto", tp: int = 1, pp: int = 1,
                   spec_dir: Path | None = None, base_dir: Path | None = None) -> dict[str, Any]:
    """engine: checkpoints or a clear error; llmapi: the >= 1.2 files; auto: the engine flow when
    the spec maps onto it (else a summary saying why not), plus the LLM-API files when TRT-LLM's
    LLM API supports the spec kind."""
    summary: dict[str, Any] = {"kind": spec.kind, "tp_size": tp, "pp_size": pp}
    if route in ("engine", "auto"):
        try:
            summary = convert_all(model, out, tp=tp, pp=pp, spec=spec)
            summary["engine_flow"] = True
        except specmodules.EngineFlowUnsupported as err:
            if route == "engine":
                raise
            summary.update(engine_flow=False, reason=str(err))
            atomic_write_json(out / "convert_summary.json", summary)
            print(f"convert: no TRT-LLM engine flow for this spec: {err}")
    from specdeploy.trtllm import llmapi

    llmapi_ok = spec.kind in ("draft", "ngram", "none") or (spec.kind == "eagle" and llmapi.is_eagle3(spec))
    if route == "llmapi" or (route == "auto" and llmapi_ok):
        summary["llmapi"] = llmapi.write_llmapi(model, out / "llmapi", spec=spec, spec_dir=spec_dir, base_dir=base_dir, tp=tp, pp=pp)
    return summary


def run(build: BuildDir, *, tp: int = 1, pp: int = 1, route: str = "auto", kind: str | None = None,
        draft_model: str | None = None, max_draft_len: int | None = None) -> Path:
    """Stage `convert`: build/<name>/trtllm_ckpt/ from the quantized (or resolved) model + spec."""
    model, consumes = _inputs(build)
    spec_dir = build.path("spec") if build.record("spec") else None
    settings = {"tp": tp, "pp": pp, "route": route, "kind": kind, "draft_model": draft_model, "max_draft_len": max_draft_len}
    if build.completed(STAGE, settings, consumes=consumes):
        return build.path(OUT)
    spec = load_spec(spec_dir, kind=kind, draft_model=draft_model, max_draft_len=max_draft_len)
    with build.stage(STAGE, OUT, settings, consumes=consumes) as tmp:
        convert_routes(model, tmp, spec, route=route, tp=tp, pp=pp, spec_dir=spec_dir, base_dir=build.path("base"))
    return build.path(OUT)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument("--pp-size", type=int, default=1, help="pipeline-parallel stages (default 1; not with EAGLE)")
    parser.add_argument("--route", choices=["auto", "engine", "llmapi"], default="auto",
                        help="engine: checkpoints for trtllm-build (TRT-LLM <= 1.1.x) or an error; llmapi: speculative_config for "
                             "TRT-LLM >= 1.2; auto (default): both where the spec allows")
    parser.add_argument("--draft-model", help="draft-target: the draft model's HF folder")
    parser.add_argument("--max-draft-len", type=int, help="draft-target / n-gram: draft tokens per step (default: the choices tree, else 4)")
    parser.add_argument("--hf-dir", help="convert this HF folder directly (no build directory); needs --out")
    parser.add_argument("--spec-dir", help="with --hf-dir: a spec/ folder (spec_config.json + module.safetensors)")
    parser.add_argument("--out", help="with --hf-dir: output folder")


def main(args: argparse.Namespace) -> int:
    # medusa/eagle come from the spec stage's spec_config.json; draft/ngram need no module
    kind = args.spec if args.spec in ("draft", "ngram") else None
    if args.hf_dir:
        if not args.out:
            raise SpecDeployError("--hf-dir needs --out")
        spec = load_spec(args.spec_dir, kind=kind, draft_model=args.draft_model, max_draft_len=args.max_draft_len)
        summary = convert_routes(Path(args.hf_dir), Path(args.out), spec, route=args.route, tp=args.tp_size, pp=args.pp_size,
                                 spec_dir=Path(args.spec_dir) if args.spec_dir else None)
        print(f"TRT-LLM {args.route} output in {args.out}: {json.dumps(summary, default=str)}")
        return 0
    out = run(build_from_args(args), tp=args.tp_size, pp=args.pp_size, route=args.route, kind=kind,
              draft_model=args.draft_model, max_draft_len=args.max_draft_len)
    print(f"TRT-LLM {args.route} output in {out}")
    return 0
