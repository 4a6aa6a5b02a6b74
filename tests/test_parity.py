"""Parity bookkeeping: exact matches, the first divergence and the margin there, and which rule applies."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdeploy.parity import compare, hf_reference
from specdeploy.quantize import parity_dtype
from specdeploy.verify import parity_rule, summarize


def test_reference_match_and_divergence(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompt_ids = tokenizer("def add(a, b):", return_tensors="pt").input_ids
    ref = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=12)
    assert len(ref.token_ids) == len(ref.margins) == 12
    assert all(m >= 0 for m in ref.margins)

    same = compare("p", ref, ref.text, tokenizer)
    assert same.match and same.first_divergence_token is None

    # keep the first 5 reference tokens, then go elsewhere: divergence is at token 5
    kept = tokenizer.decode(ref.token_ids[:5], skip_special_tokens=True)
    other = compare("p", ref, kept + "\x00zzz", tokenizer)
    assert not other.match
    assert other.first_divergence_token == 5
    assert other.margin_at_divergence == ref.margins[5]


@pytest.mark.parametrize("dtype, quant, rule", [
    ("float64", {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, "exact"),
    ("float32", {}, "exact"),
    ("float32", {"quant_algo": "W4A16_AWQ"}, "exact"),  # weight-only: activations are not rounded
    ("float32", {"quant_algo": "FP8"}, "near-tie"),
    ("float32", {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": "FP8"}, "near-tie"),
    ("bfloat16", {}, "near-tie"),
])
def test_parity_is_exact_only_where_the_runtime_can_be(dtype, quant, rule):
    assert parity_rule(dtype, quant) == rule


def test_a_divergence_fails_the_exact_rule_and_passes_near_tie_only_when_small():
    row = {"prompt": "<|im_start|>system\nYou are a helpful AI assistant", "shown": "Why is the sky blue?", "reference": "ab", "served": "ac", "match": False, "first_divergence_token": 1,
           "margin_at_divergence": 0.3, "tokens": 2, "acceptance_length": 1.0, "latency_s": 1.0, "ttft_s": 0.1,
           "speedup": None, "ar_latency_s": None, "category": "chat"}
    exact = summarize([row], "float64", "exact", near_tie=1.0)
    assert not exact["parity_ok"] and exact["divergences"][0]["prompt"] == "Why is the sky blue?"  # not the template
    assert summarize([row], "bfloat16", "near-tie", near_tie=1.0)["parity_ok"]
    assert not summarize([row], "bfloat16", "near-tie", near_tie=0.1)["parity_ok"]


def test_parity_dtype_follows_the_quantized_checkpoint(tmp_path):
    assert parity_dtype(tmp_path) == "float32"  # not quantized
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    assert parity_dtype(tmp_path) == "float64"
