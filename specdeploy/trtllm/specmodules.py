"""Medusa heads and EAGLE modules (ModelOpt state-dict names) -> TensorRT-LLM engine-flow names.

Medusa (tensorrt_llm/models/medusa/model.py): ModelOpt's `medusa_heads.{h}.{l}.linear.*`
(ResBlock x + SiLU(linear(x))) -> `medusa_heads.{h}.medusa_layers.{l}.linear.*`; ModelOpt's
`medusa_heads.{h}.{L}.weight` (the head's own vocab projection) -> `medusa_heads.{h}.lm_head.weight`.
Both are ColumnLinear with gather_output: split along the output dim under TP.

EAGLE (tensorrt_llm/models/eagle/model.py, EagleNet): the engine runs the EAGLE-1/2 draft
network, num_eagle_layers copies of
    x = fc(concat([embedding(token), hidden]))  (bias)  -> decoder layers (layer 0 has NO
    input_layernorm) -> no final norm -> lm_head
fed with the base model's post-final-norm hidden states. What maps from a ModelOpt module:
  - decoder layers (q/k/v/o, gate/up/down, post_attention_layernorm, input_layernorm of layers > 0)
  - `eagle_module.fc` (2*hidden -> hidden) when present; when absent (ModelOpt 0.47 without
    aux hidden states feeds the base hidden straight into layer 0) an exact identity
    fc = [0 | I], bias 0, is written
  - lm_head: the module's own if it has a full-vocabulary one, else a copy of the base lm_head
What cannot map (refused, with the LLM-API route as the way out):
  - EAGLE-3 (use_aux_hidden_state): fc over 3 base layers, first-layer attention over
    concat(embeds, hidden) (2*hidden inputs), hidden_norm; TRT-LLM's engine EagleNet has none
  - a final norm (use_last_layernorm): EagleForCausalLM hard-codes use_last_layernorm=False
  - a reduced draft vocabulary (d2t): the engine drafts over the full vocabulary
  - an input_layernorm in the first layer: EagleForCausalLM hard-codes
    use_input_layernorm_in_first_layer=False, and a norm cannot be folded into a linear
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from specdeploy.errors import SpecDeployError
from specdeploy.trtllm.source import Dims, Quant
from specdeploy.trtllm.weights import layer_rank, pad_rows, slice_role

LLMAPI_HINT = (
    "TensorRT-LLM's engine flow cannot run this module; use the LLM-API route instead "
    "(TRT-LLM >= 1.2, `specdeploy convert --route llmapi`: an EAGLE-3 draft folder + speculative_config "
    "with decoding_type Eagle3)"
)


class EngineFlowUnsupported(SpecDeployError):
    """The module is valid but TRT-LLM's engine flow cannot run it (the LLM-API route may)."""


@dataclass(frozen=True)
class MedusaShape:
    heads: int
    layers: int


def medusa_shape(module: dict[str, torch.Tensor]) -> MedusaShape:
    idx = [tuple(map(int, m.groups())) for k in module if (m := re.match(r"medusa_heads\.(\d+)\.(\d+)\.", k))]
    if not idx:
        raise SpecDeployError("no medusa_heads.* tensors in the Medusa module", hint="the spec stage writes module.safetensors with ModelOpt's names")
    heads = 1 + max(h for h, _ in idx)
    layers = max(l for _, l in idx)  # the highest index is the head's vocab projection
    return MedusaShape(heads, layers)


def medusa_rank(module: dict[str, torch.Tensor], shape: MedusaShape, tp: int, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for h in range(shape.heads):
        for l in range(shape.layers):
            for role in ("weight", "bias"):
                t = module[f"medusa_heads.{h}.{l}.linear.{role}"].to(dtype)
                out[f"medusa_heads.{h}.medusa_layers.{l}.linear.{role}"] = slice_role(role, t, "col", tp, rank, f"medusa head {h}")
        head = pad_rows(module[f"medusa_heads.{h}.{shape.layers}.weight"].to(dtype), tp)
        out[f"medusa_heads.{h}.lm_head.weight"] = slice_role("weight", head, "col", tp, rank, f"medusa head {h} lm_head")
    return out


def medusa_from_trt(tensors: dict[str, torch.Tensor], shape: MedusaShape, vocab: int) -> dict[str, torch.Tensor]:
    """Merged (unsharded) TRT-LLM Medusa tensors -> ModelOpt names."""
    out = {}
    for h in range(shape.heads):
        for l in range(shape.layers):
            for role in ("weight", "bias"):
                out[f"medusa_heads.{h}.{l}.linear.{role}"] = tensors[f"medusa_heads.{h}.medusa_layers.{l}.linear.{role}"]
        out[f"medusa_heads.{h}.{shape.layers}.weight"] = tensors[f"medusa_heads.{h}.lm_head.weight"][:vocab]
    return out


# ------------------------------------------------------------------------------------ EAGLE

def _arch(spec_config: dict[str, Any]) -> dict[str, Any]:
    cfg = spec_config.get("modelopt_config") or {}
    return dict(cfg.get("eagle_architecture_config") or cfg.get("config", {}).get("eagle_architecture_config") or {})


def check_eagle_engine(module: dict[str, torch.Tensor], spec_config: dict[str, Any], base: Dims) -> None:
    """Refuse, naming the reason, any module TRT-LLM's engine EagleNet would compute differently."""
    arch = _arch(spec_config)
    fc = module.get("eagle_module.fc.weight")
    reasons = []
    if arch.get("use_aux_hidden_state") or any(".hidden_norm." in k for k in module) or (fc is not None and fc.shape[1] != 2 * base.hidden):
        reasons.append("it is an EAGLE-3 module (fc over auxiliary hidden states of several base layers, first-layer "
                       "attention over concat(embeddings, hidden)); the engine EagleNet is EAGLE-1/2: fc(concat(embedding, hidden))")
    if "eagle_module.norm.weight" in module:
        reasons.append("it has a final norm (use_last_layernorm); EagleForCausalLM hard-codes use_last_layernorm=False")
    lm = module.get("eagle_module.lm_head.weight")
    if "eagle_module.d2t" in module or (lm is not None and lm.shape[0] != base.vocab):
        reasons.append("it drafts over a reduced vocabulary (d2t); the engine drafts over the full vocabulary")
    if "eagle_module.layers.0.input_layernorm.weight" in module:
        reasons.append("its first decoder layer normalises its input (input_layernorm); EagleForCausalLM hard-codes "
                       "use_input_layernorm_in_first_layer=False and a norm cannot be folded into a linear layer")
    if reasons:
        raise EngineFlowUnsupported("EAGLE module cannot be converted for the TRT-LLM engine flow: " + "; ".join(reasons), hint=LLMAPI_HINT)


def eagle_dims(module: dict[str, torch.Tensor], spec_config: dict[str, Any], base: Dims) -> Dims:
    arch = _arch(spec_config)
    layers = 1 + max(int(m.group(1)) for k in module if (m := re.match(r"eagle_module\.layers\.(\d+)\.", k)))
    heads = arch.get("num_attention_heads", base.heads)
    head_dim = arch.get("head_dim") or module["eagle_module.layers.0.self_attn.q_proj.weight"].shape[0] // heads
    kv_rows = module["eagle_module.layers.0.self_attn.k_proj.weight"].shape[0]
    theta = float(arch.get("rope_theta") or (arch.get("rope_scaling") or {}).get("rope_theta") or base.rope_theta)
    return Dims(
        hidden=base.hidden, heads=heads, kv_heads=kv_rows // head_dim, head_dim=head_dim,
        intermediate=module["eagle_module.layers.0.mlp.gate_proj.weight"].shape[0], layers=layers,
        vocab=base.vocab, norm_eps=float(arch.get("rms_norm_eps", 1e-5)),
        max_positions=base.max_positions, hidden_act=arch.get("hidden_act", "silu"),
        rope_theta=theta, rope_scaling=None,
    )


def _identity_fc(hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fc(concat(e, h)) = h exactly: ModelOpt 0.47 (no aux states) feeds h into layer 0 as is."""
    weight = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1).to(dtype)
    return weight, torch.zeros(hidden, dtype=dtype)


def eagle_net_rank(module: dict, base_tensors: dict, dims: Dims, tp: int, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One EagleNet's tensors on one rank (names relative to eagle_nets.{i})."""
    module = {k: v.to(dtype) if v.is_floating_point() else v for k, v in module.items()}
    out = {"drafter.vocab_embedding.weight": base_tensors["model.embed_tokens.weight"]}
    if "eagle_module.fc.weight" in module:
        w = module["eagle_module.fc.weight"]
        b = module.get("eagle_module.fc.bias", torch.zeros(w.shape[0], dtype=dtype))
    else:
        w, b = _identity_fc(dims.hidden, dtype)
    out["drafter.fc.weight"] = slice_role("weight", w, "col", tp, rank, "eagle fc")
    out["drafter.fc.bias"] = slice_role("bias", b, "col", tp, rank, "eagle fc")
    for l in range(dims.layers):
        layer = layer_rank(module, f"eagle_module.layers.{l}", dims, Quant(), tp, rank, dtype)
        out.update({f"drafter.layers.{l}.{k}": v for k, v in layer.items()})
    lm = module.get("eagle_module.lm_head.weight", base_tensors.get("lm_head.weight", base_tensors["model.embed_tokens.weight"]))
    out["lm_head.weight"] = slice_role("weight", pad_rows(lm, tp), "col", tp, rank, "eagle lm_head")
    return out


def eagle_choices_shape(paths: tuple[tuple[int, ...], ...]) -> dict[str, int]:
    """num_eagle_layers = tree depth; max_non_leaves_per_layer = most non-leaf nodes at one depth."""
    nodes = set(paths)
    non_leaves: dict[int, int] = {}
    for p in nodes:
        if any(q[:-1] == p for q in nodes if len(q) == len(p) + 1):
            non_leaves[len(p)] = non_leaves.get(len(p), 0) + 1
    # the root (the token the base model just produced) is the one non-leaf at depth 0
    return {
        "num_eagle_layers": max(len(p) for p in nodes),
        "max_non_leaves_per_layer": max([1, *non_leaves.values()]),
        "max_draft_len": len(nodes),
    }
