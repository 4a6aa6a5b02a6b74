"""The draft-model proposer's cheaper drafting: a restricted head (common ids + the request's own
tokens), a confidence stop, an int8 draft. Output exactness is tested in test_runtime_greedy;
here, what the draft proposes and what it costs in target forwards."""

from __future__ import annotations

import pytest
import torch

from specdeploy.errors import SpecDeployError
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.proposers.head import RestrictedHead, restricted_head
from specdeploy.runtime.types import SamplingParams, TargetState
from tests.test_runtime_helpers import PROMPTS, draft, one_thread, target, tokenizer  # noqa: F401


def test_restricted_top1_is_the_argmax_over_its_vocabulary():
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    head = RestrictedHead(weight, rows=10)
    hidden = torch.randn(20, 8)
    logits = hidden @ weight.T
    tokens, confidence = head.top1(hidden)
    assert tokens.tolist() == logits[:, :10].argmax(dim=-1).tolist()
    torch.testing.assert_close(confidence, logits[:, :10].softmax(-1).max(dim=-1).values)
    head.see([3, 42, 17, 42])  # ids past the common rows join the vocabulary, once
    assert head.extra_ids == [17, 42]
    candidates = torch.tensor([*range(10), 17, 42])
    hidden = torch.cat([hidden, weight[42][None] * 10])  # the last state points at the rare token 42
    tokens, confidence = head.top1(hidden)
    assert tokens.tolist() == candidates[(hidden @ weight[candidates].T).argmax(dim=-1)].tolist()
    assert tokens[-1] == 42
    head.reset()
    assert head.extra_ids == [] and head.top1(hidden)[0].max() < 10


def test_no_restriction_where_the_head_is_not_a_plain_projection(draft):
    assert isinstance(restricted_head(draft, 64), RestrictedHead)
    assert restricted_head(draft, None) is None
    assert restricted_head(draft, 10_000) is None  # no smaller than the vocabulary
    draft.config.final_logit_softcapping = 30.0  # soft-capping (Gemma): the full head decides
    try:
        assert restricted_head(draft, 64) is None
    finally:
        del draft.config.final_logit_softcapping


def test_greedy_draft_stays_inside_the_restricted_vocabulary(target, draft, tokenizer):
    ids = tokenizer(PROMPTS[2])["input_ids"]
    proposer = build_proposer("draft", target, draft_model=draft, head_rows=32)
    proposer.reset()
    tree = proposer.propose(TargetState(tokens=torch.tensor([ids])), 6)
    allowed = set(range(32)) | set(ids)
    assert len(tree) == 6 and set(tree.tokens.tolist()) <= allowed


def test_confidence_stop_shortens_rounds(target, draft, tokenizer):
    """A threshold of 1 (above any draft probability short of certainty) stops after the first
    token of every round; none never stops early."""
    ids = tokenizer(PROMPTS[0])["input_ids"]
    params = SamplingParams(max_new_tokens=24)
    for head_rows in (None, 64):
        always = build_proposer("draft", target, draft_model=draft, head_rows=head_rows, stop_below=1.0)
        result = generate(target, ids, params, always, draft_len=6, adaptive=False)
        assert result.metrics.draft_tokens <= result.metrics.target_forwards  # one token a round
        never = build_proposer("draft", target, draft_model=draft, head_rows=head_rows)
        full = generate(target, ids, params, never, draft_len=6, adaptive=False)
        assert full.metrics.draft_tokens > full.metrics.target_forwards
        assert result.token_ids == full.token_ids


def test_int8_draft_is_exact_and_leaves_the_given_model_alone(target, draft, tokenizer):
    ids = tokenizer(PROMPTS[1])["input_ids"]
    params = SamplingParams(max_new_tokens=24)
    proposer = build_proposer("draft", target, draft_model=draft, draft_quant="int8")
    linears = [m for m in proposer.draft.modules() if "Linear" in type(m).__name__]
    assert linears and all(type(m) is not torch.nn.Linear for m in linears)  # every Linear quantized
    assert all(type(m) is torch.nn.Linear for m in draft.modules() if "Linear" in type(m).__name__)
    assert next(draft.parameters()).dtype == torch.float32  # the caller's model: not converted
    result = generate(target, ids, params, proposer, draft_len=4, adaptive=False)
    assert result.token_ids == generate(target, ids, params).token_ids
    assert result.metrics.draft_tokens > 0
    with pytest.raises(SpecDeployError, match="unknown draft_quant"):
        build_proposer("draft", target, draft_model=draft, draft_quant="int4")
