"""Rejection sampling is lossless: sampled outputs follow the (warped) target distribution.

The check is a chi-square test of the joint distribution of the first generated tokens against
the exact one, computed from the target. Each check is also run with a deliberately wrong
acceptance rule, and must then fail: the test can tell a correct rule from a wrong one.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import product

import pytest
import torch

from specdeploy.runtime import verify
from specdeploy.runtime.decoding import eos_token_ids, generate
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.sampling import make_generator, sample, warp
from specdeploy.runtime.types import DraftTree, Proposer, SamplingParams
from tests.test_runtime_helpers import draft, one_thread, target, tokenizer  # noqa: F401

V = 5
WARPED = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)


def chi_square_ok(counts: Counter, expected: dict[tuple, float], n: int) -> bool:
    """True when the counts fit the expected distribution (threshold ~ mean + 6 sd)."""
    if any(key not in expected or expected[key] == 0 for key in counts):
        return False  # a sequence the target can never produce
    cells = [key for key, p in expected.items() if p > 0]
    stat = sum((counts[key] - n * expected[key]) ** 2 / (n * expected[key]) for key in cells)
    df = len(cells) - 1
    return stat < df + 6 * math.sqrt(2 * df)


# ------------------------------------------------------------------ a toy Markov "model"


def markov(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(V, V) * 1.5  # logits of the next token given the previous one


TARGET_LOGITS, DRAFT_LOGITS = markov(0), markov(1)


def toy_propose(last: int, shape: str, generator: torch.Generator) -> DraftTree:
    q = DRAFT_LOGITS.softmax(-1)
    if shape == "chain":  # sampled from q, q attached: the min(1, p/q) rule
        d1 = int(torch.multinomial(q[last], 1, generator=generator))
        d2 = int(torch.multinomial(q[d1], 1, generator=generator))
        return DraftTree.chain(torch.tensor([d1, d2]), probs=torch.stack([q[last], q[d1]]))
    # deterministic tree: the draft's top-2 first tokens, each with its top-1 child
    a, b = q[last].topk(2).indices.tolist()
    return DraftTree(
        tokens=torch.tensor([a, b, int(q[a].argmax()), int(q[b].argmax())]), parents=[-1, -1, 0, 1]
    )


def toy_samples(shape: str, n: int, length: int = 3) -> Counter:
    generator = make_generator(1234)
    counts: Counter = Counter()
    for _ in range(n):
        out = [0]
        while len(out) <= length:
            tree = toy_propose(out[-1], shape, generator)
            rows = [out[-1]] + tree.tokens.tolist()
            out += verify.accept(tree, TARGET_LOGITS[rows], WARPED, generator).tokens(tree)
        counts[tuple(out[1 : length + 1])] += 1
    return counts


def toy_expected(length: int = 3) -> dict[tuple, float]:
    p = warp(TARGET_LOGITS, WARPED)
    expected = {}
    for seq in product(range(V), repeat=length):
        prob, last = 1.0, 0
        for token in seq:
            prob, last = prob * float(p[last, token]), token
        expected[seq] = prob
    return expected


def wrong_residual(p, q, token):
    return p  # forgets to remove what the rejected draft already covered


def wrong_accept(p, q, token):
    return 1.0 if q is None else min(1.0, 2 * float(p[token]) / float(q[token]))


N_TOY = 4000


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_toy_sampling_follows_target(shape):
    assert chi_square_ok(toy_samples(shape, N_TOY), toy_expected(), N_TOY)


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("rule", ["residual", "accept_probability"])
def test_toy_check_fails_with_wrong_rule(shape, rule, monkeypatch):
    monkeypatch.setattr(verify, rule, {"residual": wrong_residual, "accept_probability": wrong_accept}[rule])
    assert not chi_square_ok(toy_samples(shape, N_TOY), toy_expected(), N_TOY)


# ------------------------------------------------------------------ the tiny Llama end to end

TINY = SamplingParams(temperature=1.0, top_k=2)


def tiny_expected(target, prompt: list[int], length: int) -> dict[tuple, float]:
    """Exact distribution of the first `length` tokens (shorter when EOS ends the sequence)."""
    eos = eos_token_ids(target)
    expected: dict[tuple, float] = {}

    def walk(seq: tuple, prob: float) -> None:
        if len(seq) == length or (seq and seq[-1] in eos):
            expected[seq] = expected.get(seq, 0.0) + prob
            return
        with torch.inference_mode():
            logits = target(input_ids=torch.tensor([prompt + list(seq)])).logits[0, -1]
        p = warp(logits, TINY)
        for token in p.nonzero().flatten().tolist():
            walk(seq + (token,), prob * float(p[token]))

    walk((), 1.0)
    return expected


class FlippedDraft(Proposer):
    """The target's own top-2 with its preference reversed: q shares p's support but is far from it,
    so rejections are frequent and a wrong residual shows."""

    def __init__(self, model) -> None:
        self.model = model

    def propose(self, state, max_tokens):
        seq, tokens, probs = state.tokens[0].tolist(), [], []
        for _ in range(max_tokens):
            with torch.inference_mode():
                p = warp(self.model(input_ids=torch.tensor([seq])).logits[0, -1], TINY)
            top = p.topk(2).indices
            q = torch.zeros_like(p)
            q[top] = p[top.flip(0)]
            tokens.append(sample(q, state.generator))
            probs.append(q)
            seq.append(tokens[-1])
        return DraftTree.chain(torch.tensor(tokens), torch.stack(probs))


def tiny_counts(target, prompt: list[int], proposer, n: int) -> Counter:
    counts: Counter = Counter()
    for seed in range(n):
        params = SamplingParams(temperature=1.0, top_k=2, max_new_tokens=4, seed=seed)
        result = generate(target, prompt, params, proposer, draft_len=3, adaptive=False)
        assert result.metrics.draft_tokens > 0
        counts[tuple(result.token_ids[:3])] += 1
    return counts


def test_tiny_llama_draft_sampling_follows_target(target, draft, tokenizer):
    prompt = tokenizer("The quick brown fox")["input_ids"]
    counts = tiny_counts(target, prompt, build_proposer("draft", target, draft_model=draft), 500)
    assert chi_square_ok(counts, tiny_expected(target, prompt, 3), 500)


@pytest.mark.parametrize("wrong", [False, True])
def test_tiny_llama_rejection_sampling(target, tokenizer, monkeypatch, wrong):
    prompt = tokenizer("The quick brown fox")["input_ids"]
    if wrong:
        monkeypatch.setattr(verify, "residual", wrong_residual)
    counts = tiny_counts(target, prompt, FlippedDraft(target), 800)
    assert chi_square_ok(counts, tiny_expected(target, prompt, 3), 800) != wrong


def test_seed_reproduces(target, draft, tokenizer):
    prompt = tokenizer("Hello! How can I help")["input_ids"]
    proposer = build_proposer("draft", target, draft_model=draft)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=7)
    first = generate(target, prompt, params, proposer).token_ids
    assert generate(target, prompt, params, proposer).token_ids == first
    other = SamplingParams(temperature=1.0, max_new_tokens=20, seed=8)
    assert generate(target, prompt, other, proposer).token_ids != first


def test_warp_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert warp(logits, SamplingParams(temperature=1.0, top_k=2)).nonzero().flatten().tolist() == [0, 1]
    # nucleus 0.8: 0.5 + 0.2 < 0.8, so the third token is still needed
    kept = warp(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert kept.nonzero().flatten().tolist() == [0, 1, 2]
    torch.testing.assert_close(kept[:3], torch.tensor([0.5, 0.2, 0.15]) / 0.85)
    sharp = warp(logits, SamplingParams(temperature=0.5))
    assert sharp[0] > 0.5 and abs(float(sharp.sum()) - 1) < 1e-6


def test_top_k_keeps_exactly_k_tokens_at_a_tie():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    kept = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (kept > 0).sum(dim=-1).tolist() == [2, 2]  # not every token tied at the 2nd logit
    assert kept[0, 0] > kept[0, 1:].max() and kept[0, 4] == 0
    torch.testing.assert_close(kept.sum(dim=-1), torch.ones(2))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (2, 1.0), (0, 0.9)])
def test_a_tiny_temperature_is_near_greedy_not_nan(top_k, top_p):
    """Divided by 1e-38, logits overflow to inf; the warped distribution must still be one."""
    logits = torch.tensor([[2.0, 5.0, 1.0, 4.0], [7.0, 7.0, -3.0, 0.0]])
    probs = warp(logits, SamplingParams(temperature=1e-38, top_k=top_k, top_p=top_p))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(probs[1, :2].sum(), torch.tensor(1.0))  # a tie at the top keeps both
