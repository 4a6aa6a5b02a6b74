"""specdeploy.attention: grouped-query sdpa without the per-head KV copy, the same bits as
transformers' own "sdpa" on the steps that take it (explicit masks: batches, trees)."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from specdeploy.attention import CPU_SDPA, use_cpu_sdpa
from specdeploy.attention import sdpa as attention_sdpa
from specdeploy.checkpoints import load_causal_lm


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
        fast = use_cpu_sdpa(copy.deepcopy(reference))
        attention = fast.model.layers[0].self_attn
        assert attention.num_key_value_groups > 1 and attention.config._attn_implementation == CPU_SDPA
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


def _attention(dtype: torch.dtype, masked_value: float = 0.0):
    """One query per row over grouped K/V whose masked columns hold `masked_value`: a mask that
    is not applied shows in the output."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 6, 1, 16, generator=generator)
    key, value = torch.randn(2, 3, 2, 40, 16, generator=generator)
    allowed = torch.rand(3, 1, 1, 40, generator=generator) > 0.3
    allowed[..., -1] = True
    value = value.masked_fill(~allowed[:, :, 0, :, None], masked_value)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return [t.to(dtype) for t in (query, key, value, mask)]


def test_a_single_reduced_precision_query_runs_as_two_rows_where_chosen_as_accurately(monkeypatch):
    import specdeploy.attention as attention

    queries = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **kw: queries.append(q.shape[-2]) or sdpa(q, *a, **kw))
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    reference = _attention(torch.float64, masked_value=1e4)
    expected = sdpa(*reference[:3], attn_mask=reference[3], enable_gqa=True).transpose(1, 2)
    for two_rows in (True, False):
        monkeypatch.setattr(attention, "single_query_as_two_rows", lambda: two_rows)
        for dtype, rows in ((torch.bfloat16, 2 if two_rows else 1), (torch.float32, 1)):
            queries.clear()
            query, key, value, mask = _attention(dtype, masked_value=1e4)
            out, _ = attention_sdpa(module, query, key, value, mask)
            assert queries == [rows], (dtype, two_rows)
            assert out.shape == (3, 1, 6, 16) and out.dtype == dtype
            # masked columns hold 1e4: any leak would be far outside bf16's rounding
            assert torch.allclose(out.double(), expected, atol=2e-2), (dtype, two_rows)


def test_two_rows_are_chosen_on_cpus_without_amx(monkeypatch):
    import specdeploy.attention as attention
    import specdeploy.device as device

    for flags, two_rows in (({"avx512f", "avx512_bf16"}, True), ({"avx512_bf16", "amx_bf16", "amx_tile"}, False),
                            (set(), True)):
        monkeypatch.setattr(device, "cpu_flags", lambda flags=flags: flags)
        attention.single_query_as_two_rows.cache_clear()
        assert attention.single_query_as_two_rows() is two_rows, flags
    attention.single_query_as_two_rows.cache_clear()
