"""SmolLM2-135M on real prompts: greedy speculative output equals transformers, token for token (fp32)."""

from __future__ import annotations

import pytest

from specdeploy.runtime.decoding import generate
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import SamplingParams
from tests.test_runtime_helpers import OracleTreeProposer, hf_greedy, one_thread  # noqa: F401

NEW = 24


@pytest.fixture(scope="module")
def smollm2():
    from specdeploy.checkpoints import load_causal_lm, load_tokenizer
    from specdeploy.resolve import resolve_model_dir

    path = resolve_model_dir("smollm2-135m")
    return load_causal_lm(path, dtype="float32"), load_tokenizer(path)


@pytest.fixture(scope="module")
def real_prompts(smollm2):
    from specdeploy.data import humaneval_prompts, sharegpt_prompts

    _, tokenizer = smollm2
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in sharegpt_prompts(1, "heldout", max_chars=400)
    ]
    return [tokenizer(p)["input_ids"] for p in humaneval_prompts(2)] + [
        tokenizer(c, add_special_tokens=False)["input_ids"] for c in chats
    ]


@pytest.mark.slow
def test_smollm2_greedy_parity(smollm2, real_prompts):
    model, _ = smollm2
    for ids in real_prompts:
        ref = hf_greedy(model, ids, NEW)
        proposers = {
            "ngram": build_proposer("ngram", model),
            "self-draft": build_proposer("draft", model, draft_model=model),
            "tree": OracleTreeProposer(ids + ref, vocab=model.config.vocab_size),
        }
        for name, proposer in proposers.items():
            result = generate(model, ids, SamplingParams(max_new_tokens=NEW), proposer, draft_len=4, adaptive=False)
            assert result.token_ids == ref, name
        assert result.metrics.accepted_draft_tokens > 0
