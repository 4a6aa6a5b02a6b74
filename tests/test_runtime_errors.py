"""Bad inputs give a SpecDeployError with a hint, before any work is done."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from specdeploy.errors import SpecDeployError
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import SamplingParams
from tests.test_runtime_helpers import draft, one_thread, target, tokenizer  # noqa: F401
from tests.tiny import make_tokenizer


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(), "prompt is empty"),
        (torch.zeros(2, 3, dtype=torch.long), SamplingParams(), "one prompt"),
        ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([1, 2], SamplingParams(max_new_tokens=-3), "max_new_tokens"),
        ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
        ([1, 2], SamplingParams(temperature=1.0, top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(stop_strings=("x",)), "stop strings need the tokenizer"),
        ([1] * 256, SamplingParams(), "context is 256"),
    ],
)
def test_bad_inputs(target, prompt, params, match):
    with pytest.raises(SpecDeployError, match=match) as err:
        generate(target, prompt, params)
    assert err.value.hint


def test_context_length_override(target):
    with pytest.raises(SpecDeployError, match="context is 8"):
        generate(target, list(range(8)), SamplingParams(), context_length=8)
    # near the end of the context, generation stops at the context, not past it
    result = generate(target, list(range(6)), SamplingParams(max_new_tokens=50), context_length=8)
    assert len(result.token_ids) <= 2 and result.finish_reason in ("length", "stop")


def test_mismatched_tokenizers(target, draft, tokenizer, tmp_path):
    other = make_tokenizer(tmp_path, vocab_size=300)
    with pytest.raises(SpecDeployError, match=r"300 tokens.*384 tokens|does not match") as err:
        build_proposer("draft", target, draft_model=draft, tokenizer=tokenizer, draft_tokenizer=other)
    assert "same family" in err.value.hint
    # the same tokenizer loaded twice is accepted
    same = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    build_proposer("draft", target, draft_model=draft, tokenizer=tokenizer, draft_tokenizer=same)


def test_unknown_proposer(target):
    with pytest.raises(SpecDeployError, match="unknown proposer kind 'lookahead'") as err:
        build_proposer("lookahead", target)
    assert "ngram" in err.value.hint


def test_draft_without_model(target):
    with pytest.raises(SpecDeployError, match="needs a draft model"):
        build_proposer("draft", target)


@pytest.mark.parametrize(("kind", "options", "match"), [
    ("draft", {"head_rows": -5}, "head_rows must be a number of token ids, got -5"),
    ("draft", {"head_rows": 2.5}, "head_rows must be a number of token ids, got 2.5"),
    ("draft", {"stop_below": 5.0}, "stop_below 5.0 is not a probability"),
    ("draft", {"stop_below": -1.0}, "stop_below -1.0 is not a probability"),
    ("dflash", {"head_rows": -5}, "head_rows must be a number of token ids"),
    ("eagle", {"mode": "chain", "choices": [[0], [1]]}, "mode 'chain' would ignore them"),
    ("eagle", {"mode": "dynamic", "choices": [[0], [1]]}, "mode 'dynamic' would ignore them"),
])
def test_proposer_settings_that_would_crash_a_request_or_go_unused_are_refused(target, draft, kind, options, match):
    """A negative head_rows ended each request in an IndexError; stop_below 5 drafted one token a
    round, -1 never stopped; choices beside a chain or dynamic mode were dropped."""
    extra = {"draft_model": draft} if kind == "draft" else {}
    with pytest.raises(SpecDeployError, match=match) as err:
        build_proposer(kind, target, **extra, **options)
    assert err.value.hint


@pytest.mark.parametrize("draft_len", [0, -2, 2.5])
def test_a_draft_length_below_one_is_refused_not_replaced_or_turned_off(target, draft, draft_len):
    """0 drafted the default length, a negative one never drafted: neither said so."""
    from specdeploy.runtime.batch import InflightBatcher

    proposer = build_proposer("draft", target, draft_model=draft)
    with pytest.raises(SpecDeployError, match="max_draft_len must be a positive integer"):
        generate(target, [1, 2, 3], SamplingParams(max_new_tokens=4), proposer, draft_len=draft_len)
    with pytest.raises(SpecDeployError, match="max_draft_len must be a positive integer"):
        InflightBatcher(target, proposer.fork, draft_len=draft_len)


def test_spec_validate_refuses_a_max_new_tokens_that_leaves_no_room_for_a_prompt(target, tokenizer):
    """The prompt budget went to 0 or below: a code prompt was then kept whole (ids[-0:]) and a chat
    one cut from the wrong end, without a word."""
    from specdeploy.speculator.validate import measure

    context = target.config.max_position_embeddings
    with pytest.raises(SpecDeployError, match=f"--max-new-tokens {context - 20} leaves no room") as err:
        measure(target, tokenizer, build_proposer("ngram", target), categories=("code",), num_prompts=1,
                max_new_tokens=context - 20)
    assert f"at most {context - 64}" in err.value.hint
