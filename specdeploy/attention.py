"""transformers' "sdpa" attention, without its grouped-query copy of the KV cache on the CPU.

With an explicit mask (every batched or tree-verification step) transformers copies K and V
once per query head before calling torch's sdpa, because on CUDA torch's grouped-query path
falls back to the math kernel when a mask is given. On the CPU torch's flash kernel reads the
grouped K/V in place (enable_gqa) with the same bits (tests), and the copy of the whole cache
was a large part of a batched decode step here. Selected per attention module, like the K/V
quantizing variant in quantize.loader, so the model's own config (masks, callers) stays "sdpa".
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

GQA_SDPA = "specdeploy_sdpa"


def sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An attention function with transformers' signature; transformers' own "sdpa" wherever it
    does not copy K/V (no mask, no grouping) or where its copy is the faster path (CUDA)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if (attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1 or query.device.type != "cpu"
            or "position_bias" in kwargs):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, **kwargs)
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                     scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_attention(attention: nn.Module, name: str) -> None:
    """Run this attention module with the registered function `name` (its own config copy)."""
    attention.config = copy.copy(attention.config)
    attention.config._attn_implementation = name


def use_gqa_sdpa(model: nn.Module) -> nn.Module:
    """Every grouped-query attention module of `model` that runs "sdpa" runs `sdpa` above."""
    from transformers.modeling_utils import AttentionInterface

    if GQA_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(GQA_SDPA, sdpa)
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(module, "num_key_value_groups", 1) > 1 and getattr(config, "_attn_implementation", None) == "sdpa":
            use_attention(module, GQA_SDPA)
    return model
