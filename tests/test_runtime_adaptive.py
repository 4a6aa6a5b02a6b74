"""Adaptive draft length: speculation backs off to plain decoding when it does not pay."""

from __future__ import annotations

from specdeploy.runtime.adaptive import AdaptiveDraftLength
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.types import SamplingParams
from tests.test_runtime_helpers import PROMPTS, GarbageProposer, hf_greedy, one_thread, target, tokenizer  # noqa: F401


def test_garbage_proposer_falls_back_to_plain_decoding(target, tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    ref = hf_greedy(target, ids, 100)
    proposer = GarbageProposer(ids + ref, vocab=target.config.vocab_size)
    result = generate(target, ids, SamplingParams(max_new_tokens=100), proposer, draft_len=8)
    assert result.token_ids == ref
    assert result.metrics.accepted_draft_tokens == 0
    # without adaptivity it would be 99 rounds of up to 8 drafted tokens
    assert result.metrics.draft_tokens <= 20
    assert 3 <= proposer.calls <= 8  # gave up quickly, yet probed again later
    fixed = generate(target, ids, SamplingParams(max_new_tokens=100), proposer, draft_len=8, adaptive=False)
    assert fixed.metrics.draft_tokens > 200


def test_length_follows_acceptance():
    control = AdaptiveDraftLength(8, warmup_plain_steps=0)
    assert control.next_length() == 4
    control.record(accepted=4, proposed=4, seconds=1.0)
    assert control.next_length() == 6
    control.record(accepted=6, proposed=6, seconds=1.0)
    control.record(accepted=8, proposed=8, seconds=1.0)
    assert control.next_length() == 8  # capped
    control.record(accepted=2, proposed=8, seconds=1.0)
    assert control.next_length() == 7


def test_falls_back_when_slower_than_plain_then_probes():
    control = AdaptiveDraftLength(8, warmup_plain_steps=2, backoff=4)
    assert [control.next_length() for _ in range(2)] == [0, 0]  # measure plain decoding first
    control.record(0, 0, seconds=0.10)
    control.record(0, 0, seconds=0.10)  # plain: 10 tokens/s
    assert control.next_length() == 4
    control.record(accepted=4, proposed=4, seconds=5.0)  # the first round includes the draft's prefill
    assert control.next_length() == 6  # so its time is not held against speculation
    control.record(accepted=1, proposed=6, seconds=0.25)  # 8 tokens/s: slower than plain
    assert [control.next_length() for _ in range(5)] == [0, 0, 0, 0, 5]  # 4 plain steps, then a probe
    control.record(accepted=0, proposed=5, seconds=0.20)  # the probe fails: wait twice as long
    assert [control.next_length() for _ in range(9)] == [0] * 8 + [4]
    control.record(accepted=4, proposed=4, seconds=0.25)  # 20 tokens/s: speculation pays again
    assert control.next_length() == 6
    control.record(accepted=1, proposed=6, seconds=0.40)  # one slow round alone does not flip it
    assert control.next_length() == 5
    control.record(accepted=1, proposed=5, seconds=0.40)  # the running rate is now below plain
    assert [control.next_length() for _ in range(5)] == [0, 0, 0, 0, 4]  # the wait was reset to 4


def test_fixed_length_never_adapts():
    control = AdaptiveDraftLength(5, adaptive=False)
    for _ in range(10):
        assert control.next_length() == 5
        control.record(accepted=0, proposed=5, seconds=10.0)


def test_untimed_adapts_on_acceptance_only():
    """Seeded sampling: the schedule must not depend on how long rounds took."""
    control = AdaptiveDraftLength(8, timed=False, patience=2, backoff=3)
    assert control.next_length() == 4  # no plain warm-up: there is nothing to measure
    control.record(accepted=4, proposed=4, seconds=100.0)  # slow, but timing is ignored
    assert control.next_length() == 6
    control.record(accepted=0, proposed=6, seconds=0.0)
    control.record(accepted=0, proposed=5, seconds=0.0)  # two misses: plain for a while
    assert [control.next_length() for _ in range(4)] == [0, 0, 0, 4]
