"""Shared fixtures and helpers for the runtime tests (imported by the other test_runtime_* files)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdeploy.runtime.types import DraftTree, Proposer, TargetState

PROMPTS = [
    "def add(a, b):\n    return",
    "The quick brown fox",
    "Hello! How can I help you today? Tell me about",
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run ~50x faster on one thread than on two busy shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="session")
def target(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def draft(tiny_draft_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_draft_dir, dtype=torch.float32).eval()


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(ids) :].tolist()


class OracleTreeProposer(Proposer):
    """Hand-made trees around a known continuation `truth` (prompt + expected tokens).

    Each round's tree mixes the true next tokens with wrong ones: a wrong first sibling, wrong
    children hanging off the true path, and every `wrong_every`-th round a wrong true-path token,
    so acceptance must pick a path that is not a prefix of the node order.
    """

    kind = "tree"

    def __init__(self, truth: list[int], vocab: int, depth: int = 3, wrong_every: int = 3) -> None:
        self.truth, self.vocab, self.depth, self.wrong_every = truth, vocab, depth, wrong_every
        self.rounds = 0

    def _wrong(self, token: int) -> int:
        return (token + 7) % self.vocab

    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        self.rounds += 1
        start = state.tokens.shape[1]
        future = self.truth[start : start + self.depth]
        if not future:
            return DraftTree.empty()
        if self.rounds % self.wrong_every == 0:
            future = [self._wrong(future[0])] + future[1:]
        tokens, parents = [self._wrong(future[0])], [-1]  # a wrong sibling before the true branch
        parent = -1
        for token in future:
            tokens.append(token)
            parents.append(parent)
            parent = len(tokens) - 1
            tokens.append(self._wrong(token))  # a wrong child beside the next true node
            parents.append(parent)
        return DraftTree(tokens=torch.tensor(tokens), parents=parents)


class GarbageProposer(Proposer):
    """Always proposes tokens the target will reject (greedy): the next true token + 1."""

    def __init__(self, truth: list[int], vocab: int) -> None:
        self.truth, self.vocab, self.calls = truth, vocab, 0

    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        self.calls += 1
        start = state.tokens.shape[1]
        bad = [(t + 1) % self.vocab for t in self.truth[start : start + max_tokens]]
        return DraftTree.chain(torch.tensor(bad, dtype=torch.long))
