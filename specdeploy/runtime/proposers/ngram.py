"""Prompt lookup (n-gram) proposer: if the last n tokens appeared earlier in the sequence,
propose what followed them then. Free to run, strong on code and on answers quoting the prompt.
"""

from __future__ import annotations

from specdeploy.errors import SpecDeployError
from specdeploy.runtime.types import DraftTree, Proposer, TargetState


class NgramProposer(Proposer):
    kind = "chain"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise SpecDeployError(
                f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}",
                hint="e.g. min_ngram=1, max_ngram=3",
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        tokens = state.tokens[0]
        # longest n-gram first: a longer match is a better predictor
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            windows = tokens[:-1].unfold(0, n, 1)  # every earlier n-gram, excluding the suffix itself
            hits = (windows == tokens[-n:]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n  # the most recent occurrence: closest in topic
                return DraftTree.chain(tokens[start : start + max_tokens].clone())
        return DraftTree.empty(tokens.device)


def build(target: object = None, *, max_ngram: int = 3, min_ngram: int = 1) -> NgramProposer:
    """The target is not needed: the lookup reads only the token sequence."""
    return NgramProposer(max_ngram=max_ngram, min_ngram=min_ngram)
