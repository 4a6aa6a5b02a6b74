"""The engine flow's checkpoints (TensorRT-LLM 1.1 and 1.2, for trtllm-build): config.json +
rank{N}.safetensors + specdeploy.json for the base model, MedusaForCausalLM with the heads
inside, or the plain draft of draft-target; and why the engine flow cannot serve a spec kind.

Config fields and tensor names follow TensorRT-LLM's own sources, cited field by field in
specdeploy/trtllm/formats.py (LLaMAConfig/QWenConfig/MedusaConfig/QuantConfig/Mapping,
llama/convert.py naming and TP split rules). Ranks are
rank = pp_rank * tp_size + tp_rank (tensorrt_llm/mapping.py); each rank file holds only what
that rank's model declares: vocab_embedding on the first PP rank, ln_f / lm_head / Medusa
heads on the last one (PretrainedModel.load fails on a missing tensor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from specdeploy.choices import validate_choices
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_bytes, atomic_write_json
from specdeploy.trtllm import specmodules
from specdeploy.trtllm.releases import release_for
from specdeploy.trtllm.source import HFSource, load_hf_source
from specdeploy.trtllm.spec_input import SpecInput, external_draft_len
from specdeploy.trtllm.weights import kv_rep, layer_rank, pad_rows, slice_role, unquantized_linears

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
                hint="use --pp-size 1 (or --tp-size) for a mixed-precision checkpoint, or quantize without --exclude "
                     "(specdeploy engine: --quant-exclude)",
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
        # the biases the HF config declares (Qwen2's attention always has them): TensorRT-LLM would
        # ignore bias tensors its config does not ask for
        "mlp_bias": bool(src.config.get("mlp_bias", False)),
        "attn_bias": src.family == "qwen2" or bool(src.config.get("attention_bias", False)),
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


def _spec_extras(src: HFSource, spec: SpecInput, kind: str, config: dict, sidecar: dict,
                 tp: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """Fill the spec part of config/sidecar; return rank -> extra tensors (last PP stage)."""
    dtype = TORCH_DTYPES[src.dtype]
    if kind == "medusa":
        shape = specmodules.medusa_shape(spec.module)
        config.update(medusa_config(src, spec, shape))
        sidecar["spec"].update(heads=shape.heads, layers=shape.layers)
        return lambda tp_rank: specmodules.medusa_rank(spec.module, shape, tp, tp_rank, dtype)
    return lambda tp_rank: {}


# ------------------------------------------------------------------------- the engine flow

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
