"""Medusa proposer: a static tree (medusa_choices) over the heads' top-k.

Head i reads the target's last hidden state at the last consumed position and proposes the token
at depth i + 1 (the pending token is depth 0). A tree path [a, b, c] means "head 0's top-(a+1),
then head 1's top-(b+1), then head 2's top-(c+1)": the tokens of a node depend only on its own
depth and index, which is what makes Medusa's tree cheap (one head call per depth per round).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from specdeploy.choices import ChoicesTree, validate_choices
from specdeploy.errors import SpecDeployError
from specdeploy.runtime.types import DraftTree, Proposer, TargetState


class MedusaProposer(Proposer):
    kind = "tree"
    hidden_layers = (-1,)

    def __init__(self, heads: torch.nn.ModuleList, choices: ChoicesTree, vocab_ids: torch.Tensor | None = None) -> None:
        """vocab_ids: propose only among these tokens (the frequent ones of the training data):
        each head's 49k-row projection is the draft's main cost on a CPU; a subset is ~6x cheaper."""
        self.heads = heads
        self.device = heads[0][-1].weight.device
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(self.device)
        # reduced rows are sliced once; the full projection is called as a module each time
        # (the quantize stage may swap it for a fake-quantized Linear)
        self.projections = [None if self.vocab_ids is None else head[-1].weight[self.vocab_ids] for head in heads]
        self.choices = choices
        self.parents = choices.parents()
        depth = choices.depth
        # how many candidates each head must offer (largest top-k index at that depth, + 1)
        self.topk = [1 + max(p[d] for p in choices.paths if len(p) > d) for d in range(depth)]

    @torch.no_grad()
    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        return self.propose_batch([self], [state], [max_tokens])[0]

    @staticmethod
    @torch.no_grad()
    def propose_batch(proposers: list[Proposer], states: list[TargetState], max_tokens: list[int]) -> list[DraftTree]:
        """Every request's last hidden state through the heads at once (one call per head): the
        forks share the heads and the tree."""
        trees = [DraftTree.empty(state.tokens.device) for state in states]
        rows = [i for i, (state, n) in enumerate(zip(states, max_tokens)) if n > 0 and -1 in state.hidden]
        if not rows:
            return trees
        first = proposers[rows[0]]
        if any(proposers[i].heads is not first.heads or proposers[i].choices is not first.choices for i in rows):
            return Proposer.propose_batch(proposers, states, max_tokens)  # not forks of one proposer
        h = torch.cat([states[i].hidden[-1][0, -1:] for i in rows]).to(first.device)  # each last consumed position
        top = first._top(h)
        for r, i in enumerate(rows):
            paths = first.choices.paths[: max_tokens[i]]  # sorted by depth: any prefix is a valid tree
            tokens = torch.stack([top[len(p) - 1][r, p[-1]] for p in paths]).long()
            trees[i] = DraftTree(tokens=tokens.to(states[i].tokens.device), parents=first.parents[: len(paths)])
        return trees

    def _top(self, h: torch.Tensor) -> list[torch.Tensor]:
        """For last hidden states (rows, H): each head's top-k token ids, (rows, k) per head."""
        top = []
        for head, weight, k in zip(self.heads, self.projections, self.topk):
            features = head[:-1](h.to(head[-1].weight.dtype))  # the ResBlocks
            logits = head[-1](features) if weight is None else features @ weight.T
            ids = logits.topk(k, dim=-1).indices
            top.append(ids if self.vocab_ids is None else self.vocab_ids[ids])
        return top


def _heads_from(target: Any, spec_dir: str | os.PathLike | None, num_heads: int, num_layers: int, seed: int) -> tuple[torch.nn.ModuleList, dict]:
    from specdeploy.checkpoints.modules import load_module, read_spec_config
    from specdeploy.checkpoints.modules import medusa as medusa_spec

    if spec_dir is not None:
        config = read_spec_config(spec_dir)
        if config["kind"] != "medusa":
            raise SpecDeployError(f"{spec_dir} holds a {config['kind']} module, not Medusa heads", hint="use --spec eagle")
        modelopt_config = config["modelopt_config"]
    else:
        config, modelopt_config = {}, medusa_spec.modelopt_config(num_heads, num_layers)
    lm_head = target.get_output_embeddings().weight
    # beside the lm_head: the heads read the last hidden state, which the target computes there
    heads = load_module("medusa", target.config, modelopt_config, spec_dir, dtype=next(target.parameters()).dtype,
                        device=lm_head.device, seed=seed)
    if spec_dir is None:  # untrained: start each head at the target's own lm_head, like training does
        with torch.no_grad():
            for head in heads:
                head[-1].weight.copy_(lm_head)
    return heads, config


def build(
    target: Any, *, spec_dir: str | os.PathLike | None = None, path: str | os.PathLike | None = None, choices: list[list[int]] | str | None = None,
    num_heads: int = 3, num_layers: int = 1, max_draft_len: int | None = None, seed: int = 0,
    full_vocab: bool = False,
) -> MedusaProposer:
    """Medusa heads from a spec/ folder (trained; `path` is an alias), or fresh ones (tests)."""
    spec_dir = spec_dir if spec_dir is not None else path
    heads, config = _heads_from(target, spec_dir, num_heads, num_layers, seed)
    tree = validate_choices(
        choices if choices is not None else config.get("choices", [[0], [0, 0], [0, 0, 0]][: len(heads)]),
        max_depth=len(heads), max_draft_len=max_draft_len, name="medusa_choices",
    )
    vocab = config.get("draft_vocab_ids") if not full_vocab else None
    vocab_ids = torch.tensor(vocab, dtype=torch.long, device=heads[0][-1].weight.device) if vocab else None
    return MedusaProposer(heads, tree, vocab_ids)
