"""Medusa heads without ModelOpt: ModelOpt 0.47's `medusa_heads` (plugins/hf_medusa.py
HFMedusaModel.modify, utils.ResBlock). Head h is medusa_num_layers ResBlocks (x + SiLU(linear(x)))
followed by its own bias-free projection to the base vocabulary: keys
`{h}.{l}.linear.{weight,bias}` and `{h}.{medusa_num_layers}.weight`, as the spec stage saves them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ResBlock(nn.Module):
    """x + SiLU(linear(x)), started as the identity (zero weight), as ModelOpt's."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def medusa_heads(num_heads: int, num_layers: int, hidden_size: int, vocab_size: int) -> nn.ModuleList:
    """The heads the proposer calls: head[:-1] (the ResBlocks) on the last hidden state, head[-1]
    (the vocabulary projection) on their output."""
    return nn.ModuleList(
        nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)), nn.Linear(hidden_size, vocab_size, bias=False))
        for _ in range(num_heads)
    )


def modelopt_config(num_heads: int = 3, num_layers: int = 1) -> dict[str, Any]:
    """The dict for mtsp.convert(model, [("medusa", cfg)]) and spec_config.json."""
    return {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers}


def hidden_layers(num_layers: int) -> list[int]:
    return [num_layers]  # the last, normed hidden state (output_hidden_states[-1])
