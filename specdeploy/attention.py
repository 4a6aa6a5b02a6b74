"""transformers' "sdpa" attention, without two CPU costs that do not change its accuracy.

1. With an explicit mask (every batched or tree-verification step) transformers copies K and V
   once per query head before calling torch's sdpa, because on CUDA torch's grouped-query path
   falls back to the math kernel when a mask is given. On the CPU torch's flash kernel reads the
   grouped K/V in place (enable_gqa) with the same bits (tests), and the copy of the whole cache
   was a large part of a batched decode step here.
2. For a single query in bfloat16/float16 (every plain decode step) torch 2.13's CPU kernel
   takes a path 1.5-2x slower per call than two queries do on an AMD EPYC with AVX512-BF16 (444 vs
   248 us at batch 8 x 100 columns); on an Intel Xeon with AMX the same one-row path is the fast
   one (63 vs 262 us there; 1.2 vs 6.1 ms at batch 64 x 300 columns). Where the CPU has no AMX, the
   query runs as two identical rows and one is kept: as accurate against float64 (over a served
   generation, about as many calls closer as farther, the mean error equal to 1e-8), but not always
   the same bits: the two paths round a few elements apart.
Selected per attention module, like the K/V quantizing variant in checkpoints.quantized, so the model's
own config (masks, callers) stays "sdpa".
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import nn

CPU_SDPA = "specdeploy_sdpa"


def sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An attention function with transformers' signature: a single reduced-precision query on
    the CPU as two rows; else transformers' own "sdpa" wherever it does not copy K/V (no mask, no
    grouping) or where its copy is the faster path (CUDA)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cpu = query.device.type == "cpu" and "position_bias" not in kwargs
    if cpu and query.shape[-2] == 1 and query.dtype in (torch.bfloat16, torch.float16) and single_query_as_two_rows():
        return _single_query(query, key, value, attention_mask, dropout, scaling), None
    if not cpu or attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, **kwargs)
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                     scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def single_query_as_two_rows() -> bool:
    """Whether this CPU runs a single bf16/fp16 query faster as two rows (see the module docstring):
    measured slower one-row calls on an EPYC without AMX, faster ones on a Xeon with it."""
    from specdeploy.device import cpu_amx

    return not cpu_amx()


def _single_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  dropout: float, scaling: float | None) -> torch.Tensor:
    """One query row through the kernel's two-row path (see the module docstring)."""
    if mask is not None:  # (batch, 1 | heads, 1, columns), as transformers slices it to the keys
        mask = mask[..., : key.shape[-2]].expand(-1, -1, 2, -1)
    out = nn.functional.scaled_dot_product_attention(query.expand(-1, -1, 2, -1), key, value, attn_mask=mask,
                                                     dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out[:, :, :1].transpose(1, 2).contiguous()


def use_attention(attention: nn.Module, name: str) -> None:
    """Run this attention module with the registered function `name` (its own config copy)."""
    attention.config = copy.copy(attention.config)
    attention.config._attn_implementation = name


def use_cpu_sdpa(model: nn.Module) -> nn.Module:
    """Every attention module of `model` that runs "sdpa" runs `sdpa` above."""
    from transformers.modeling_utils import AttentionInterface

    if CPU_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(CPU_SDPA, sdpa)
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(module, "num_key_value_groups") and getattr(config, "_attn_implementation", None) == "sdpa":
            use_attention(module, CPU_SDPA)
    return model
