"""specdeploy.attention: grouped-query sdpa without the per-head KV copy, the same bits as
transformers' own "sdpa" on the steps that take it (explicit masks: batches, trees)."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from specdeploy.attention import GQA_SDPA, use_gqa_sdpa
from specdeploy.models import load_causal_lm


def _masked_steps(model, dtype: torch.dtype) -> list[torch.Tensor]:
    """A padded two-row prefill, then a 3-node tree step, each with an explicit 4D mask."""
    valid = torch.tensor([[True] * 6, [False, False] + [True] * 4])  # row 1 is left-padded
    prefill = (valid[:, None, None, :] & torch.ones(6, 6, dtype=torch.bool).tril()) | torch.eye(6, dtype=torch.bool)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 2 does not see node 1
    step = torch.cat([valid[:, None, None, :].expand(-1, 1, 3, -1), tree.expand(2, 1, 3, 3)], dim=-1)
    cache, logits = DynamicCache(config=model.config), []
    with torch.no_grad():
        for ids, allowed in [([[5, 9, 30, 44, 2, 7], [0, 0, 11, 12, 13, 14]], prefill), ([[3, 4, 8], [6, 4, 9]], step)]:
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
            logits.append(model(input_ids=torch.tensor(ids), attention_mask=mask, past_key_values=cache,
                                use_cache=True).logits)
    return logits


def test_gqa_sdpa_equals_transformers_sdpa_bit_for_bit(tiny_llama_dir, monkeypatch):
    for dtype in ("float32", "float64", "bfloat16"):
        reference = load_causal_lm(tiny_llama_dir, dtype=dtype)
        fast = use_gqa_sdpa(copy.deepcopy(reference))
        attention = fast.model.layers[0].self_attn
        assert attention.num_key_value_groups > 1 and attention.config._attn_implementation == GQA_SDPA
        assert reference.model.layers[0].self_attn.config._attn_implementation == "sdpa"
        assert fast.config._attn_implementation == "sdpa"  # masks are still built for sdpa

        grouped = []
        sdpa = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda q, k, *a, **kw: grouped.append(k.shape[1] < q.shape[1]) or sdpa(q, k, *a, **kw))
        torch_dtype = getattr(torch, dtype)
        for a, b in zip(_masked_steps(reference, torch_dtype), _masked_steps(fast, torch_dtype)):
            assert torch.equal(a, b), dtype
        monkeypatch.undo()
        # transformers copied K/V per head (never grouped); the fast path read them grouped
        assert grouped.count(True) == 2 * fast.config.num_hidden_layers and grouped.count(False) == grouped.count(True)
