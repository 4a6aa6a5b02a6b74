"""HF decoder-layer tensors -> TRT-LLM rank tensors (and back), with TP sharding and the
quantization scales under TRT-LLM's names.

Names and split rules: tensorrt_llm/models/llama/convert.py (see formats.py for commits): q/k/v are split per projection along the output dim and concatenated
per rank as [q_r; k_r; v_r] into attention.qkv; o_proj and down_proj split along the input dim;
gate_proj -> mlp.fc, up_proj -> mlp.gate (GatedMLP activates fc); KV heads fewer than TP ranks
are duplicated (dup_kv_weight). Scale names follow ModelOpt's TRT-LLM export
(weights_scaling_factor, activation_scaling_factor, prequant_scaling_factor,
kv_cache_scaling_factor), which is what TRT-LLM's quantized layers declare.
"""

from __future__ import annotations

import torch

from specdeploy.errors import SpecDeployError
from specdeploy.quantize.formats import FUSED_GROUPS
from specdeploy.trtllm.source import Dims, Quant

# HF unified-checkpoint suffix -> TRT-LLM parameter suffix.
ROLE_TO_TRT = {
    "weight": "weight",
    "bias": "bias",
    "weight_scale": "weights_scaling_factor",
    "input_scale": "activation_scaling_factor",
    "pre_quant_scale": "prequant_scaling_factor",
}
TRT_TO_ROLE = {v: k for k, v in ROLE_TO_TRT.items()}
# A decoder layer's HF Linears -> (TRT-LLM module, tensor-parallel split); q/k/v fuse into one
# attention.qkv.
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
LAYER_LINEARS = {"self_attn.o_proj": ("attention.dense", "row"), "mlp.gate_proj": ("mlp.fc", "col"),
                 "mlp.up_proj": ("mlp.gate", "col"), "mlp.down_proj": ("mlp.proj", "row")}


def _split(t: torch.Tensor, dim: int, parts: int, index: int, what: str) -> torch.Tensor:
    if t.shape[dim] % parts:
        raise SpecDeployError(
            f"{what}: dimension {dim} of size {t.shape[dim]} does not split into {parts} tensor-parallel ranks",
            hint="choose a --tp-size that divides the heads, the intermediate size and (for INT4 AWQ) the groups",
        )
    return t.chunk(parts, dim=dim)[index].contiguous()


def slice_role(role: str, t: torch.Tensor, kind: str, tp: int, rank: int, what: str) -> torch.Tensor:
    """One tensor of a linear layer, as rank `rank` of `tp` holds it."""
    if tp == 1:
        return t
    if kind == "col":
        if role in ("weight", "bias") or (role == "weight_scale" and t.numel() > 1):  # per-channel / per-group
            return _split(t, 0, tp, rank, what)
        return t
    if role == "weight" or (role == "weight_scale" and t.dim() == 2):
        return _split(t, 1, tp, rank, what)
    if role == "pre_quant_scale":
        return _split(t, 0, tp, rank, what)
    return t  # row-parallel bias and per-tensor / per-output-channel scales are replicated


def linear_roles(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    found = {role: tensors[f"{prefix}.{role}"] for role in ROLE_TO_TRT if f"{prefix}.{role}" in tensors}
    if "weight" not in found:
        raise SpecDeployError(f"tensor {prefix}.weight missing from the checkpoint", hint="is this a complete HF checkpoint?")
    if found["weight"].dtype == torch.uint8:  # packed INT4: ModelOpt's HF export says uint8, TRT-LLM declares int8
        found["weight"] = found["weight"].view(torch.int8)
    return found


def dup_heads(t: torch.Tensor, heads: int, rep: int) -> torch.Tensor:
    """Repeat each of `heads` row-blocks `rep` times (KV heads < TP ranks, dup_kv_weight)."""
    if rep == 1 or t.dim() == 0 or t.shape[0] % heads:
        return t
    blocks = t.reshape(heads, t.shape[0] // heads, *t.shape[1:])
    return blocks.repeat_interleave(rep, dim=0).reshape(-1, *t.shape[1:])


def kv_rep(dims: Dims, tp: int) -> int:
    """How many times each KV head is stored so every TP rank owns one (1 = no duplication)."""
    if dims.heads % tp:
        raise SpecDeployError(
            f"{dims.heads} attention heads are not divisible by --tp-size {tp}",
            hint="TensorRT-LLM splits whole attention heads across tensor-parallel ranks",
        )
    if dims.kv_heads >= tp:
        if dims.kv_heads % tp:
            raise SpecDeployError(f"{dims.kv_heads} KV heads are not divisible by --tp-size {tp}", hint="use a --tp-size that divides the KV heads")
        return 1
    if tp % dims.kv_heads:
        raise SpecDeployError(f"--tp-size {tp} is not a multiple of the {dims.kv_heads} KV heads", hint="TRT-LLM duplicates KV heads only by an integer factor")
    return tp // dims.kv_heads


def _fp8_requant(parts: list[dict[str, torch.Tensor]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One per-tensor scale for a fused GEMM: the max, with the FP8 weights requantized to it
    (what ModelOpt's TRT-LLM export and TRT-LLM's fuse_gate_mlp do)."""
    scales = [p["weight_scale"].float().reshape(()) for p in parts]
    top = torch.stack(scales).max()
    weights = [
        p["weight"] if torch.equal(s, top) else (p["weight"].float() * (s / top)).to(torch.float8_e4m3fn)
        for p, s in zip(parts, scales)
    ]
    return weights, top.reshape(1)


def fuse_columns(parts: list[dict[str, torch.Tensor]], quant: Quant, dtype: torch.dtype, in_features: int) -> dict[str, torch.Tensor]:
    """q/k/v slices of one rank -> attention.qkv tensors (unquantized when --exclude kept them)."""
    out: dict[str, torch.Tensor] = {}
    quantized = "weight_scale" in parts[0]
    if quantized and quant.algo == "FP8":
        weights, scale = _fp8_requant(parts)
        out["weight"], out["weights_scaling_factor"] = torch.cat(weights), scale
    else:
        out["weight"] = torch.cat([p["weight"] for p in parts])
        if quantized:
            out["weights_scaling_factor"] = torch.cat([p["weight_scale"].float() for p in parts])
    if "bias" in parts[0]:
        out["bias"] = torch.cat([p["bias"] for p in parts])
    if quantized:
        out.update(_input_scales(parts[0], quant, dtype, in_features, [p.get("input_scale") for p in parts]))
    return out


def _input_scales(part: dict, quant: Quant, dtype: torch.dtype, in_features: int, inputs: list | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    inputs = [s for s in (inputs or [part.get("input_scale")]) if s is not None]
    if inputs:
        out["activation_scaling_factor"] = torch.stack([s.float().reshape(()) for s in inputs]).max().reshape(1)
    if quant.algo in ("W4A16_AWQ", "W8A8_SQ_PER_CHANNEL"):
        # ModelOpt's HF export folds AWQ's pre-quant scale into the preceding RMSNorm when it
        # can; the folded layer then needs an all-ones prequant_scaling_factor in TRT-LLM.
        pre = part.get("pre_quant_scale")
        out["prequant_scaling_factor"] = pre if pre is not None else torch.ones(in_features, dtype=dtype)
    return out


def single_linear(roles: dict[str, torch.Tensor], quant: Quant, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A linear kept on its own (dense, fc, gate, proj, medusa, fc_after_embed, lm_head)."""
    out = {"weight": roles["weight"]}
    if "bias" in roles:
        out["bias"] = roles["bias"]
    if "weight_scale" in roles:
        scale = roles["weight_scale"].float()
        out["weights_scaling_factor"] = scale.reshape(1) if scale.dim() == 0 else scale
    if quant.algo and "weight_scale" in roles:
        in_features = roles["weight"].shape[1]
        out.update(_input_scales(roles, quant, dtype, in_features))
    return out


def kv_cache_scales(tensors: dict[str, torch.Tensor], attn: str) -> dict[str, torch.Tensor]:
    """FP8 KV cache: ModelOpt's TRT-LLM export clamps k/v scales to >= 1.0 and stores the max
    as kv_cache_scaling_factor (quant_utils.get_kv_cache_scaling_factor)."""
    k, v = tensors.get(f"{attn}.k_proj.k_scale"), tensors.get(f"{attn}.v_proj.v_scale")
    if k is None or v is None:
        raise SpecDeployError(f"FP8 KV cache announced but {attn}.k_proj.k_scale / v_proj.v_scale missing", hint="re-export the quantized checkpoint with ModelOpt")
    one = torch.ones(1)
    k, v = torch.maximum(k.float().reshape(1), one), torch.maximum(v.float().reshape(1), one)
    return {"kv_cache_scaling_factor": torch.maximum(k, v), "k_cache_scaling_factor": k, "v_cache_scaling_factor": v}


def _prefixed(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v for k, v in tensors.items()}


def _qkv_rank(tensors: dict, attn: str, dims: Dims, quant: Quant, tp: int, rank: int, dtype: torch.dtype) -> dict:
    rep = kv_rep(dims, tp)
    parts = []
    for name in (hf.removeprefix("self_attn.") for hf in QKV):
        roles = linear_roles(tensors, f"{attn}.{name}")
        if name != "q_proj":
            roles = {r: dup_heads(t, dims.kv_heads, rep) if r in ("weight", "bias") or (r == "weight_scale" and t.dim() >= 1) else t for r, t in roles.items()}
        parts.append({r: slice_role(r, t, "col", tp, rank, f"{attn}.{name}.{r}") for r, t in roles.items()})
    return fuse_columns(parts, quant, dtype, dims.hidden)


def layer_rank(tensors: dict, hf_prefix: str, dims: Dims, quant: Quant, tp: int, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All TRT-LLM tensors of one decoder layer on one TP rank (names relative to the layer)."""
    out = _prefixed("attention.qkv", _qkv_rank(tensors, f"{hf_prefix}.self_attn", dims, quant, tp, rank, dtype))
    for hf, (trt, kind) in LAYER_LINEARS.items():
        roles = linear_roles(tensors, f"{hf_prefix}.{hf}")
        roles = {r: slice_role(r, t, kind, tp, rank, f"{hf_prefix}.{hf}.{r}") for r, t in roles.items()}
        out.update(_prefixed(trt, single_linear(roles, quant, dtype)))
    if f"{hf_prefix}.input_layernorm.weight" in tensors:
        out["input_layernorm.weight"] = tensors[f"{hf_prefix}.input_layernorm.weight"]
    out["post_layernorm.weight"] = tensors[f"{hf_prefix}.post_attention_layernorm.weight"]
    if quant.kv_algo == "FP8":
        out.update(_prefixed("attention", kv_cache_scales(tensors, f"{hf_prefix}.self_attn")))
    return out


def unquantized_linears(tensors: dict[str, torch.Tensor], layers: int) -> list[str]:
    """TRT-LLM names of the decoder Linears a quantized checkpoint keeps in the model dtype
    (stored without weight_scale: `quantize --exclude`), as ModelOpt's TRT-LLM export lists
    them in exclude_modules. TRT-LLM runs each of FUSED_GROUPS as one GEMM: all or none."""
    names = []
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        kept = {hf for hf in (*QKV, *LAYER_LINEARS) if f"{prefix}.{hf}.weight_scale" not in tensors}
        for leaves in FUSED_GROUPS:
            group = {hf for hf in (*QKV, *LAYER_LINEARS) if hf.rpartition(".")[2] in leaves}
            if kept & group and not group <= kept:
                raise SpecDeployError(
                    f"{prefix}: {', '.join(sorted(kept & group))} unquantized but {', '.join(sorted(group - kept))} quantized",
                    hint="TensorRT-LLM runs these as one GEMM: quantize (or --exclude) them together")
        if kept & set(QKV):
            names.append(f"transformer.layers.{layer}.attention.qkv")
        names += [f"transformer.layers.{layer}.{LAYER_LINEARS[hf][0]}" for hf in LAYER_LINEARS if hf in kept]
    return names


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """lm_head rows padded to a multiple of TP (pad_vocab_size), zeros in the padding."""
    extra = -t.shape[0] % multiple
    if not extra:
        return t
    return torch.cat([t, torch.zeros(extra, *t.shape[1:], dtype=t.dtype)])


# ---------------------------------------------------------------- back: TRT-LLM -> HF layout

def _cat(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def merge_role(role: str, pieces: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Inverse of slice_role over all TP ranks of one linear."""
    first = pieces[0]
    if len(pieces) == 1:
        return first
    if kind == "col":
        split = role in ("weight", "bias") or (role == "weight_scale" and first.numel() > 1)  # per-channel / per-group
        return _cat(pieces, 0) if split else first
    if role == "weight" or (role == "weight_scale" and first.dim() == 2):
        return _cat(pieces, 1)
    return _cat(pieces, 0) if role == "pre_quant_scale" else first


def split_qkv(rank_tensors: dict[str, torch.Tensor], dims: Dims, tp: int, packed: bool) -> list[dict[str, torch.Tensor]]:
    """One rank's attention.qkv.* -> [q, k, v] role dicts (HF suffixes)."""
    rep = kv_rep(dims, tp)
    q, kv = dims.q_size // tp, dims.kv_size * rep // tp
    parts: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    for suffix, t in rank_tensors.items():
        role = TRT_TO_ROLE.get(suffix)
        if role is None:
            continue
        if role == "weight":
            div = 2 if packed and t.dtype == torch.int8 else 1  # an --exclude'd qkv is not packed
            chunks = t.split([q // div, kv // div, kv // div])
        elif role == "bias" or (role == "weight_scale" and t.numel() > 1):
            chunks = t.split([q, kv, kv])
        else:
            chunks = [t, t, t]
        for part, chunk in zip(parts, chunks):
            part[role] = chunk
    return parts


def undup_heads(t: torch.Tensor, heads: int, rep: int) -> torch.Tensor:
    if rep == 1 or t.dim() == 0:
        return t
    blocks = t.reshape(heads * rep, t.shape[0] // (heads * rep), *t.shape[1:])
    return blocks[::rep].reshape(-1, *t.shape[1:])
