"""The in-flight batch's KV cache: one transformers DynamicCache for every row, plus a boolean
"valid column" mask (rows, columns) saying which columns hold each row's tokens.

A DynamicCache appends the same number of columns to every row. Instead of trimming rows to
different lengths, each row keeps its valid-column mask: a round's columns that the row did not
accept (rejected drafts, padding) stay in the cache but are masked out forever. Keys carry their
rotary position, so a row's columns need be neither contiguous nor in order; only the mask and the
explicit position ids (each row's true positions) matter. When at least half of the columns would
go, every row's valid columns are gathered to the front (`compact`). A leaving row is dropped from
the batch dimension at once (`keep_rows`), so its memory goes with it. A row's valid columns are in
its positions' order all the same (its i-th valid column, counting from 0, holds position i): that
is how the columns before a position are found (`seen_before`).

Every tensor made here is made on the mask's device, the target's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specdeploy.runtime.kv_cache import cache_layers


def join(cache: DynamicCache | None, valid: torch.Tensor | None, new: DynamicCache,
         device: torch.device) -> tuple[DynamicCache, torch.Tensor]:
    """The batch cache and mask with a prefilled request's cache `new` appended as a row; the
    shorter side is padded with masked columns. `cache` None: `new` starts the batch."""
    length = new.get_seq_length()
    mine = torch.ones(1, length, dtype=torch.bool, device=device)
    if cache is None:
        return new, mine
    width = max(valid.shape[1], length)
    for batch_layer, new_layer in zip(cache_layers(cache), cache_layers(new)):
        batch_layer.keys = _stack_padded(batch_layer.keys, new_layer.keys, width)
        batch_layer.values = _stack_padded(batch_layer.values, new_layer.values, width)
    return cache, torch.cat([F.pad(valid, (0, width - valid.shape[1])), F.pad(mine, (0, width - length))])


def keep_rows(cache: DynamicCache, valid: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """Drop every row not in `keep` from the cache (in place: their KV memory goes at once);
    the mask of the rows kept."""
    index = torch.tensor(keep, dtype=torch.long, device=valid.device)
    for layer in cache_layers(cache):
        layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
        layer.values = layer.values.index_select(0, index.to(layer.values.device))
    return valid.index_select(0, index)


def compact(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
    """Gather each row's valid columns to the front (in place) when that frees at least half the
    cache; the mask after (`valid` itself when nothing moved)."""
    counts = valid.sum(dim=1)
    width = int(counts.max())
    if 2 * width > valid.shape[1]:
        return valid
    # a stable sort of "invalid" puts each row's valid columns first, in their order
    order = torch.sort(~valid, dim=1, stable=True).indices[:, :width]
    for layer in cache_layers(cache):
        index = order.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
    return torch.arange(width, device=valid.device)[None] < counts[:, None]


def seen_before(valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(rows, queries, columns) bool: the cached columns a query at `positions` (rows, queries)
    attends to, those of its row holding an earlier position."""
    # a row's valid column of rank k (its k-th, counting from 1) holds position k - 1: position p sees ranks <= p
    rank = valid.cumsum(dim=1)
    return valid[:, None, :] & (rank[:, None, :] <= positions[:, :, None])


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask (rows, 1, queries, columns) in the target's `dtype` from a
    boolean one (rows, queries, columns)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def _stack_padded(batch: torch.Tensor, new: torch.Tensor, width: int) -> torch.Tensor:
    """Batch KV (rows, heads, cols, dim) and one new row, both padded to `width` columns."""
    return torch.cat([F.pad(batch, (0, 0, 0, width - batch.shape[-2])), F.pad(new, (0, 0, 0, width - new.shape[-2]))])
