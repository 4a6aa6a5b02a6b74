"""One verifier for chains and trees: the tree attention mask, and the acceptance walk.

The target runs once over [pending token] + tree nodes. Row 0 of its output is the root (the
pending token), row i + 1 is tree node i. Acceptance walks down from the root: at each node it
either moves to one of the node's children or stops and emits one more token of its own (the
correction, or the bonus token at a leaf). Greedy acceptance is exact; with temperature > 0 the
walk is recursive rejection sampling, which leaves the output distribution equal to the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdeploy.runtime.sampling import sample, uniform, warp
from specdeploy.runtime.types import DraftTree, SamplingParams


@dataclass
class Acceptance:
    path: list[int]  # accepted tree nodes, root to deepest
    next_token: int  # the target's own token after the path: the new pending token

    def tokens(self, tree: DraftTree) -> list[int]:
        """Everything this round emits: the accepted draft tokens, then the target's token."""
        return [int(tree.tokens[i]) for i in self.path] + [self.next_token]


def ancestry(parents: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    """(n+1, n+1) bool: row r may attend to column c (the root is row 0, node i is row i+1).

    Built as Python rows and sent to `device` in one copy (row-by-row writes into a GPU tensor
    would be one kernel launch each)."""
    size = len(parents) + 1
    rows = [[True] + [False] * (size - 1)]
    for i, parent in enumerate(parents):
        row = list(rows[parent + 1])  # a parent's row is complete before its children's
        row[i + 1] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool, device=device)


def is_chain(parents: list[int]) -> bool:
    return parents == list(range(-1, len(parents) - 1))


def tree_attention_mask(
    parents: list[int], prefix_len: int, dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    """(1, 1, n+1, prefix_len+n+1) additive mask on `device`: 0 where allowed, dtype min where not."""
    tree = ancestry(parents, device)
    allowed = torch.cat([torch.ones(len(parents) + 1, prefix_len, dtype=torch.bool, device=tree.device), tree], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=tree.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def tree_position_ids(tree: DraftTree, prefix_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(1, n+1) on `device`: each node sits at prefix length + its depth, as in its own sequence."""
    return torch.tensor([[prefix_len] + [prefix_len + d for d in tree.depths()]], dtype=torch.long, device=device)


def _children(parents: list[int]) -> list[list[int]]:
    """children[row]: the tree nodes under row (row 0 = root, row i+1 = node i), in tree order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        children[parent + 1].append(i)
    return children


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """Follow the target's argmax down the tree: exact, the output equals plain greedy decoding."""
    best = logits.argmax(dim=-1).tolist()
    tokens = tree.tokens.tolist()
    children = _children(tree.parents)
    path: list[int] = []
    row = 0
    while True:
        child = next((c for c in children[row] if tokens[c] == best[row]), None)
        if child is None:
            return Acceptance(path, best[row])
        path.append(child)
        row = child + 1


def accept_probability(p: torch.Tensor, q: torch.Tensor | None, token: int) -> float:
    """min(1, p(x) / q(x)); a deterministic proposal is a one-hot q, so this is p(x)."""
    if q is None:
        return float(p[token])
    q_x = float(q[token])
    return 1.0 if q_x <= 0.0 else min(1.0, float(p[token]) / q_x)


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)): what the target still owes after rejecting `token`."""
    if q is None:
        rest = p.clone()
        rest[token] = 0.0
    else:
        rest = (p - q).clamp_min(0.0)
    total = rest.sum()
    # zero mass left only when p == q up to rounding: then p itself is the right fallback
    return rest / total if total > 0 else p


def accept_sampled(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> Acceptance:
    """Recursive rejection sampling over (warped) target probabilities `probs` (n+1, vocab).

    At each node its children are tried in order: child x is accepted with min(1, p(x)/q(x)),
    otherwise p becomes the residual and the next child is tried. When none is accepted the
    round ends with a sample from the last residual; at a leaf, with a sample from p.
    """
    tokens = tree.tokens.tolist()
    children = _children(tree.parents)
    path: list[int] = []
    row = 0
    while True:
        p = probs[row]
        for child in children[row]:
            q = None if tree.probs is None else tree.probs[child]
            if uniform(generator, p.device) < accept_probability(p, q, tokens[child]):
                path.append(child)
                row = child + 1
                break
            p = residual(p, q, tokens[child])
        else:
            return Acceptance(path, sample(p, generator))


def accept(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> Acceptance:
    """The accepted path for target logits (n+1, vocab) over [pending] + tree."""
    if params.greedy:
        return accept_greedy(tree, logits)
    return accept_sampled(tree, warp(logits, params), generator)
