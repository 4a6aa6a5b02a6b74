"""Keep only the accepted path in a transformers DynamicCache after a tree verification.

After verifying [pending] + n tree nodes the cache holds prefix + n + 1 positions. The next round
must see exactly the prefix, the pending token and the accepted nodes, in path order. A chain
whose accepted nodes are a prefix of it only needs a crop; a tree path needs a gather.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from specdeploy.errors import SpecDeployError


def check_full_attention(config: Any, what: str, hint: str) -> None:
    """Refuse a model with sliding-window attention shorter than its context: speculative rounds
    and in-flight batching trim, extend and regroup the KV cache position by position, which a
    sliding-window cache cannot do. One request decoded plainly (`specdeploy generate`) needs none
    of that. Checked at load, so it fails there and not at the first round."""
    window = getattr(config, "sliding_window", None)
    context = getattr(config, "max_position_embeddings", None) or 0
    if window and getattr(config, "use_sliding_window", True) and (not context or window < context):
        raise SpecDeployError(
            f"{config.name_or_path or 'the model'} uses sliding-window attention (sliding_window={window}, "
            f"context {context}), which specdeploy's runtime does not support for {what}",
            hint=hint,
        )


def cache_layers(cache: DynamicCache) -> list:
    """The cache's filled layers (keys/values of shape (batch, kv_heads, seq, head_dim)); refuses
    sliding-window layers, which cannot be trimmed or extended position by position."""
    layers = cache.layers
    if any(layer.is_sliding for layer in layers):
        raise NotImplementedError("sliding-window KV caches cannot be trimmed position by position")
    return [layer for layer in layers if layer.is_initialized]


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions."""
    for layer in cache_layers(cache):
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def keep_path(cache: DynamicCache, prefix_len: int, path: list[int]) -> None:
    """Keep prefix, root (the pending token) and the accepted tree nodes `path`, in that order."""
    rows = [0] + [node + 1 for node in path]
    if rows == list(range(len(rows))):
        crop(cache, prefix_len + len(rows))
        return
    index = None
    for layer in cache_layers(cache):
        # on the layer's own device (layers may sit on several GPUs under device_map)
        if index is None or index.device != layer.keys.device:
            index = torch.tensor(rows, dtype=torch.long, device=layer.keys.device) + prefix_len
        layer.keys = torch.cat([layer.keys[..., :prefix_len, :], layer.keys.index_select(-2, index)], dim=-2)
        layer.values = torch.cat([layer.values[..., :prefix_len, :], layer.values.index_select(-2, index)], dim=-2)
