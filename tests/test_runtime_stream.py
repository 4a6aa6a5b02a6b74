"""Stops (EOS, stop ids, stop strings, length) and the streaming callback."""

from __future__ import annotations

import pytest
import torch

from specdeploy.errors import SpecDeployError
from specdeploy.runtime.batch import InflightBatcher
from specdeploy.runtime.batch_requests import BatchRequest
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.deployment import Decoder, TextStream
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import SamplingParams
from tests.test_runtime_helpers import PROMPTS, hf_greedy, one_thread, target, tokenizer  # noqa: F401


def test_streaming_groups_concatenate_to_result(target, tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    groups: list[list[int]] = []
    proposer = build_proposer("draft", target, draft_model=target)  # accepts everything
    result = generate(target, ids, SamplingParams(max_new_tokens=30), proposer, on_tokens=groups.append, adaptive=False)
    assert [t for g in groups for t in g] == result.token_ids
    assert groups[0] == result.token_ids[:1]  # the first token comes alone, straight from prefill
    assert max(len(g) for g in groups) > 1  # accepted groups arrive whole
    assert len(groups) == result.metrics.target_forwards + 1


def test_stop_token_and_length(target, tokenizer):
    ids = tokenizer(PROMPTS[1])["input_ids"]
    ref = hf_greedy(target, ids, 30)
    stop = ref[12]
    first = ref.index(stop)
    for proposer in (None, build_proposer("draft", target, draft_model=target)):
        groups: list[list[int]] = []
        params = SamplingParams(max_new_tokens=30, stop_token_ids=(stop,))
        result = generate(target, ids, params, proposer, on_tokens=groups.append, adaptive=False)
        assert result.token_ids == ref[: first + 1] and result.finish_reason == "stop"
        assert [t for g in groups for t in g] == result.token_ids  # nothing streamed past the stop
        short = generate(target, ids, SamplingParams(max_new_tokens=5), proposer, adaptive=False)
        assert short.token_ids == ref[:5] and short.finish_reason == "length"


def test_eos_stops_like_transformers(target, tokenizer):
    ids = tokenizer(PROMPTS[2])["input_ids"]
    ref = hf_greedy(target, ids, 30)
    eos = ref[7]
    target.generation_config.eos_token_id = eos
    try:
        ref_eos = hf_greedy(target, ids, 30)
        result = generate(target, ids, SamplingParams(max_new_tokens=30), build_proposer("ngram", target))
    finally:
        target.generation_config.eos_token_id = target.config.eos_token_id
    assert result.token_ids == ref_eos and ref_eos[-1] == eos and result.finish_reason == "stop"


@pytest.mark.parametrize("min_tokens", [0, 1, 7, 8, 9, 14, 30])
def test_min_tokens_holds_off_the_end_as_transformers_min_new_tokens(target, tokenizer, min_tokens):
    """TensorRT-LLM's min_tokens N (its penalty kernel masks the end id while fewer than N tokens were
    generated, the end token never counted) is transformers' min_new_tokens N: plain, speculative (the
    target drafting for itself proposes the end token the mask then refuses) and in-flight batched,
    beside a request without it."""
    ids = tokenizer(PROMPTS[2])["input_ids"]
    eos = hf_greedy(target, ids, 30)[7]
    target.generation_config.eos_token_id = eos
    try:
        out = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=30, min_new_tokens=min_tokens)
        expected = out[0, len(ids):].tolist()
        params = SamplingParams(max_new_tokens=30, min_tokens=min_tokens)
        results = [generate(target, ids, params, proposer, adaptive=False).token_ids
                   for proposer in (None, build_proposer("draft", target, draft_model=target))]
        batcher = InflightBatcher(target, build_proposer("draft", target, draft_model=target).fork, draft_len=4)
        seqs = [batcher.add(BatchRequest(ids, p)) for p in (params, SamplingParams(max_new_tokens=30))]
        while not all(seq.done for seq in seqs):
            batcher.step()
        plain = hf_greedy(target, ids, 30)
    finally:
        target.generation_config.eos_token_id = target.config.eos_token_id
    assert plain[-1] == eos and len(plain) == 8  # the answer ends early without min_tokens
    assert eos not in expected[:min_tokens] and len(expected) > min(min_tokens, 29)
    assert results == [expected, expected]
    assert [seq.result.token_ids for seq in seqs] == [expected, plain]


def test_min_tokens_holds_off_only_stop_ids_in_the_vocabulary(target, tokenizer):
    """A negative stop id names no token (an index of -k would mask the k-th from the end)."""
    ids = tokenizer(PROMPTS[2])["input_ids"]
    plain = hf_greedy(target, ids, 12)
    vocab = target.config.vocab_size
    tail = plain[3] - vocab  # the same token counted from the end
    params = SamplingParams(max_new_tokens=12, min_tokens=12, stop_token_ids=(tail,))
    assert generate(target, ids, params).token_ids == plain


def test_min_tokens_below_zero_is_refused():
    with pytest.raises(SpecDeployError, match="min_tokens must be an integer >= 0"):
        SamplingParams(min_tokens=-1).validate()


def test_stop_strings(target, tokenizer):
    decoder = Decoder(target, tokenizer, build_proposer("draft", target, draft_model=target), draft_len=4)
    full, _ = decoder.generate(PROMPTS[0], SamplingParams(max_new_tokens=30))
    stop = full[10:13]
    assert len(stop) == 3 and stop not in full[:12]  # a stop string that first completes at char 13
    pieces: list[str] = []
    text, result = decoder.generate(PROMPTS[0], SamplingParams(max_new_tokens=30, stop_strings=(stop,)), pieces.append)
    assert text == full[:10] and result.finish_reason == "stop"
    assert "".join(pieces) == text
    assert stop in decoder.decode(result.token_ids)  # generation stopped at the completing token
    assert stop not in decoder.decode(result.token_ids[:-1])


def test_text_stream_waits_for_whole_characters(tokenizer):
    text = "héllo 🙂 wörld ✓"
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(lambda t: tokenizer.decode(t))
    pieces = [stream.push([token]) for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + stream.finish(text) == text
    assert len(ids) > len(text)  # byte-level: the emoji really was split across tokens


def test_decoder_streams_text(target, tokenizer):
    decoder = Decoder(target, tokenizer, build_proposer("ngram", target))
    pieces: list[str] = []
    text, result = decoder.generate(PROMPTS[2], SamplingParams(max_new_tokens=25), pieces.append)
    assert "".join(pieces) == text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.token_ids == hf_greedy(target, tokenizer(PROMPTS[2])["input_ids"], 25)


def test_a_stop_inside_an_accepted_draft_counts_only_what_was_emitted(target, tokenizer):
    """A round whose accepted draft runs past a stop emits up to the stop; the accepted tokens it
    drops after it are never emitted, so they are not counted as accepted."""
    ids = tokenizer(PROMPTS[1])["input_ids"]
    ref = hf_greedy(target, ids, 30)
    # a perfect chain of 4 emits ref[0] from prefill, then ref[1:6], ref[6:11], ... (4 drafts + 1 each):
    # stop on a draft token with more accepted drafts after it in its round
    stop_at = next(i for i in range(6, 30) if (i - 1) % 5 < 3 and ref[i] not in ref[:i])
    rounds, drafts_emitted = (stop_at - 1) // 5 + 1, (stop_at - 1) % 5 + 1
    groups: list[list[int]] = []
    params = SamplingParams(max_new_tokens=40, stop_token_ids=(ref[stop_at],))
    result = generate(target, ids, params, build_proposer("draft", target, draft_model=target), draft_len=4,
                      on_tokens=groups.append, adaptive=False)
    assert result.token_ids == ref[: stop_at + 1] and result.finish_reason == "stop"
    assert [len(g) for g in groups] == [1] + [5] * (rounds - 1) + [drafts_emitted]  # every draft accepted
    metrics = result.metrics
    assert metrics.target_forwards == rounds and metrics.draft_tokens == 4 * rounds
    assert metrics.accepted_draft_tokens == 4 * (rounds - 1) + drafts_emitted
