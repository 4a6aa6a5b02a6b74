"""Parity bookkeeping: exact matches, the first divergence and the margin there."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer

from specdeploy.parity import compare, hf_reference


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
