"""Medusa heads (ModelOpt state-dict names) -> TensorRT-LLM engine-flow names.

Medusa (tensorrt_llm/models/medusa/model.py): ModelOpt's `medusa_heads.{h}.{l}.linear.*`
(ResBlock x + SiLU(linear(x))) -> `medusa_heads.{h}.medusa_layers.{l}.linear.*`; ModelOpt's
`medusa_heads.{h}.{L}.weight` (the head's own vocab projection) -> `medusa_heads.{h}.lm_head.weight`.
Both are ColumnLinear with gather_output: split along the output dim under TP.

No engine-flow EAGLE: TensorRT-LLM's engine EagleNet is EAGLE-1/2, the spec stage trains EAGLE-3
(ModelOpt), and no stage takes an existing EAGLE-1/2 module; EAGLE-3 goes the LLM-API way (llmapi.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from specdeploy.errors import SpecDeployError
from specdeploy.trtllm.weights import pad_rows, slice_role

LLMAPI_HINT = (
    "use the LLM-API route instead (`specdeploy convert --route llmapi`): EAGLE-3, "
    "draft-target and n-gram run there"
)


class EngineFlowUnsupported(SpecDeployError):
    """The spec is valid but TRT-LLM's engine flow cannot run it (the LLM-API route may)."""


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
