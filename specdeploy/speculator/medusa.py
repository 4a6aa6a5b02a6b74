"""Medusa heads with ModelOpt: the conversion config and a training step on precomputed hidden
states. Head i reads the base's last (normed) hidden state at position t and predicts token
t + 2 + i, as in ModelOpt's HFMedusaModel loss; the frozen base never runs during training."""

from __future__ import annotations

from typing import Any

import torch

DECAY = 0.8  # later heads matter less: a token is only accepted if every earlier one was


@torch.no_grad()
def init_module(model: Any) -> None:
    """Each head's vocabulary projection starts as the base lm_head (ResBlocks start as identity)."""
    for head in model.medusa_heads:
        head[-1].weight.copy_(model.lm_head.weight)


def trainable(model: Any, train_lm_head: bool = False) -> list[torch.nn.Parameter]:
    """ResBlocks (and optionally each head's 49k-row projection: 3x the compute and memory per
    head on this CPU; frozen, it stays the base lm_head the head was started from)."""
    params = []
    for head in model.medusa_heads:
        for i, block in enumerate(head):
            train = train_lm_head or i < len(head) - 1
            for p in block.parameters():
                p.requires_grad_(train)
                if train:
                    params.append(p)
    return params


def sample_ids(valid: torch.Tensor) -> torch.Tensor:
    """Which sample each position belongs to (every sample ends with one invalid position)."""
    ends = (~valid).long()
    return torch.cumsum(ends, 0) - ends


def training_step(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
    """batch: positions (P,) and their last-layer hidden states h (P, H); the whole data's
    tokens and sample ids; optionally vocab_ids, the tokens the runtime ranks: logits and loss
    over those rows only (~6x cheaper than 49k rows, and the same ranking the proposer uses)."""
    pos, h = batch["positions"], batch["h"].float()
    tokens, sid = batch["tokens"], batch["sample_ids"]
    vocab = batch.get("vocab_ids")
    index = None
    if vocab is not None:  # target id -> row in the reduced vocabulary (-100: not draftable)
        top = int(tokens.max())
        index = torch.full((top + 1,), -100, dtype=torch.long, device=tokens.device)
        index[vocab[vocab <= top]] = torch.nonzero(vocab <= top).squeeze(1)
    loss = h.new_zeros(())
    accs = []
    for i, head in enumerate(model.medusa_heads):
        target_pos = (pos + 2 + i).clamp(max=len(tokens) - 1)
        ok = (sid[target_pos] == sid[pos]) & (pos + 2 + i < len(tokens))
        weight = head[-1].weight if vocab is None else head[-1].weight[vocab]
        logits = (head[:-1](h) @ weight.T).float()
        target = tokens[target_pos] if index is None else index[tokens[target_pos]]
        ok = ok & (target >= 0)
        ce = torch.nn.functional.cross_entropy(logits, target.clamp(min=0), reduction="none")
        loss = loss + (ce * ok).sum() / ok.sum().clamp(min=1) * DECAY**i
        accs.append(float(((logits.argmax(-1) == target) & ok).sum() / ok.sum().clamp(min=1)))
    return loss, accs
