"""Greedy speculative decoding is exact: token-identical to transformers generate(do_sample=False)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdeploy.runtime.decoding import generate, prune
from specdeploy.runtime.kv_cache import keep_path
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import DraftTree, SamplingParams
from specdeploy.runtime.verify import accept_greedy, ancestry, tree_attention_mask, tree_position_ids
from tests.test_runtime_helpers import PROMPTS, OracleTreeProposer, draft, hf_greedy, one_thread, target, tokenizer  # noqa: F401

NEW = 40


@pytest.fixture(scope="module")
def references(target, tokenizer):
    refs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        refs.append((ids, hf_greedy(target, ids, NEW)))
    return refs


@pytest.mark.parametrize("kind", ["none", "ngram", "draft", "draft_restricted", "self_draft"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_matches_transformers(kind, adaptive, target, draft, references):
    proposer = {
        "none": lambda: None,
        "ngram": lambda: build_proposer("ngram", target),
        "draft": lambda: build_proposer("draft", target, draft_model=draft),
        # a head over 64 of 384 ids (+ the request's own) that stops at unsure tokens
        "draft_restricted": lambda: build_proposer("draft", target, draft_model=draft, head_rows=64, stop_below=0.5),
        # the target drafting for itself: every token accepted, exercises long accepted groups
        "self_draft": lambda: build_proposer("draft", target, draft_model=target),
    }[kind]()
    for ids, ref in references:
        result = generate(target, ids, SamplingParams(max_new_tokens=NEW), proposer, draft_len=4, adaptive=adaptive)
        assert result.token_ids == ref
        assert result.metrics.new_tokens == len(ref)
    if kind == "self_draft" and not adaptive:
        assert result.metrics.acceptance_rate == 1.0
        assert result.metrics.acceptance_length > 4.0


def test_greedy_with_hand_made_trees(target, references):
    for ids, ref in references:
        proposer = OracleTreeProposer(ids + ref, vocab=target.config.vocab_size)
        result = generate(target, ids, SamplingParams(max_new_tokens=NEW), proposer, adaptive=False)
        assert result.token_ids == ref
        # true paths were accepted (not only the target's own corrections), through wrong siblings
        assert result.metrics.accepted_draft_tokens >= NEW // 2
        assert result.metrics.target_forwards < NEW // 2


def test_tree_logits_equal_sequential_forward(target):
    """Every root-to-node path of a tree forward sees exactly its own ancestors."""
    prefix = torch.tensor([[5, 17, 42, 99, 7]])
    tree = DraftTree(tokens=torch.tensor([11, 12, 13, 14, 15, 16]), parents=[-1, -1, 0, 0, 2, 1])
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=prefix[:, :-1], past_key_values=cache, use_cache=True)
        ids = torch.cat([prefix[0, -1:], tree.tokens])[None]
        mask = tree_attention_mask(tree.parents, 4, torch.float32)
        logits = target(
            input_ids=ids, past_key_values=cache, attention_mask=mask, position_ids=tree_position_ids(tree, 4)
        ).logits[0]
        allowed = ancestry(tree.parents)
        for row in range(len(tree) + 1):
            path = ids[0][allowed[row]]
            full = target(input_ids=torch.cat([prefix[0, :-1], path])[None]).logits[0, -1]
            torch.testing.assert_close(logits[row], full, atol=1e-4, rtol=1e-4)


def test_keep_path_equals_fresh_forward(target):
    prefix = torch.tensor([[3, 8, 21, 34]])
    tree = DraftTree(tokens=torch.tensor([40, 41, 42, 43, 44]), parents=[-1, -1, 1, 1, 3])
    path = [1, 3, 4]  # a path that skips nodes 0 and 2: needs a gather, not a crop
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=prefix[:, :-1], past_key_values=cache, use_cache=True)
        ids = torch.cat([prefix[0, -1:], tree.tokens])[None]
        target(
            input_ids=ids,
            past_key_values=cache,
            attention_mask=tree_attention_mask(tree.parents, 3, torch.float32),
            position_ids=tree_position_ids(tree, 3),
        )
        keep_path(cache, 3, path)
        fresh = DynamicCache(config=target.config)
        target(input_ids=torch.cat([prefix[0], tree.tokens[path]])[None], past_key_values=fresh, use_cache=True)
    assert cache.get_seq_length() == fresh.get_seq_length() == 4 + len(path)
    for kept, ref in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(kept.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kept.values, ref.values, atol=1e-5, rtol=1e-5)


def test_keep_path_crops_a_chain_prefix(target):
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=torch.arange(10)[None], past_key_values=cache, use_cache=True)
        before = cache.layers[0].keys.clone()
        keep_path(cache, 4, [0, 1])  # root + two chain nodes
    assert cache.get_seq_length() == 7
    torch.testing.assert_close(cache.layers[0].keys, before[..., :7, :])


def test_accept_greedy_walks_the_tree():
    vocab = 10
    tree = DraftTree(tokens=torch.tensor([1, 2, 3, 4, 5]), parents=[-1, -1, 1, 1, 2])
    logits = torch.zeros(6, vocab)
    logits[0, 2] = 1  # root wants 2: node 1 (second child)
    logits[2, 4] = 1  # node 1 wants 4: node 3 (its second child)
    logits[4, 9] = 1  # node 3 is a leaf: bonus token 9
    acceptance = accept_greedy(tree, logits)
    assert acceptance.path == [1, 3]
    assert acceptance.tokens(tree) == [2, 4, 9]
    logits[0] = 0
    logits[0, 7] = 1  # nothing matches at the root: only the correction
    assert accept_greedy(tree, logits).tokens(tree) == [7]


def test_prune_keeps_a_valid_tree():
    tree = DraftTree(tokens=torch.arange(6), parents=[-1, 0, 1, -1, 3, 0])
    pruned = prune(tree, max_nodes=10, max_depth=2)
    assert pruned.tokens.tolist() == [0, 1, 3, 4, 5]
    assert pruned.parents == [-1, 0, -1, 2, 0]
    assert len(prune(tree, max_nodes=2, max_depth=9)) == 2


class HiddenRecorder(OracleTreeProposer):
    """Checks the TargetState contract: hidden covers exactly the tokens consumed since the last call."""

    hidden_layers = (-1, 1)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[torch.Tensor] = []
        self.lengths: list[int] = []

    def propose(self, state, max_tokens):
        self.seen.append(state.hidden[-1])
        self.lengths.append(state.tokens.shape[1])
        assert state.hidden[1].shape[1] == state.hidden[-1].shape[1]
        return super().propose(state, max_tokens)


@pytest.mark.parametrize("adaptive", [False, True])
def test_hidden_states_cover_consumed_tokens(target, references, adaptive):
    ids, ref = references[0]
    proposer = HiddenRecorder(ids + ref, vocab=target.config.vocab_size, wrong_every=2)
    generate(target, ids, SamplingParams(max_new_tokens=NEW), proposer, adaptive=adaptive)
    consumed = torch.cat(proposer.seen, dim=1)
    # before each call the target has consumed every token but the pending one
    assert consumed.shape[1] == proposer.lengths[-1] - 1
    with torch.inference_mode():
        full = target(input_ids=torch.tensor([(ids + ref)[: consumed.shape[1]]]), output_hidden_states=True)
    torch.testing.assert_close(consumed, full.hidden_states[-1], atol=1e-4, rtol=1e-4)
