"""A greedy draft's top-1 over a restricted vocabulary, without the full-vocabulary head.

A draft that runs a model's whole lm_head per drafted token pays for every row of it (151,936
for Qwen2.5, 49,152 for SmolLM2) although greedy drafting needs only the likeliest token. The
restricted head scores the first `rows` token ids plus every id the request has shown (prompt
and output so far): byte-level BPE vocabularies number their tokens in merge order, frequent
first (Qwen2.5's first 32,768 ids cover ~96% of HumanEval solution tokens and ~93% of ShareGPT
answer tokens; ~98% / ~96% with the request's own tokens added).

The target verifies every drafted token, so the output stays exactly the target's greedy
output; only how often a draft is accepted can change.
"""

from __future__ import annotations

from typing import Any

import torch

from specdeploy.errors import SpecDeployError


class RestrictedHead:
    def __init__(self, weight: torch.Tensor, rows: int) -> None:
        self.weight = weight.detach()
        self.rows = min(rows, weight.shape[0])
        self.base = self.weight[: self.rows]  # a view: no copy of the common rows
        self.reset()

    def reset(self) -> None:
        self.extra_ids: list[int] = []
        self.extra_index: torch.Tensor | None = None
        self.extra: torch.Tensor | None = None

    def see(self, tokens: list[int]) -> None:
        """Add the request's rare tokens (ids past the common rows) to the vocabulary."""
        new = {t for t in tokens if self.rows <= t < self.weight.shape[0]} - set(self.extra_ids)
        if new:
            self.extra_ids = sorted(set(self.extra_ids) | new)
            self.extra_index = torch.tensor(self.extra_ids, dtype=torch.long, device=self.weight.device)
            self.extra = self.weight.index_select(0, self.extra_index)

    def top1(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For final states (n, hidden): the argmax ids (n,) over the restricted vocabulary and
        their probabilities (n,) under a softmax over that vocabulary."""
        logits = torch.nn.functional.linear(hidden, self.base).float()
        if self.extra is not None:
            logits = torch.cat([logits, torch.nn.functional.linear(hidden, self.extra).float()], dim=-1)
        best = logits.argmax(dim=-1)
        confidence = torch.exp(logits.gather(-1, best[:, None])[:, 0] - torch.logsumexp(logits, dim=-1))
        if self.extra is not None:
            best = torch.where(best < self.rows, best, self.extra_index[(best - self.rows).clamp_min(0)])
        return best, confidence


def restricted_head(model: Any, rows: int | None) -> RestrictedHead | None:
    """A RestrictedHead over `model`'s lm_head, or None where the full head must run: no
    restriction asked, or a head that is not a plain bias-free projection of the final states
    (logit soft-capping or scaling, a quantized Linear)."""
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
        raise SpecDeployError(f"head_rows must be a number of token ids, got {rows!r}",
                              hint="e.g. 32768; unset or 0: the full head")
    head = model.get_output_embeddings()
    config = model.config
    plain = type(head) is torch.nn.Linear and head.bias is None
    transformed = getattr(config, "final_logit_softcapping", None) is not None or hasattr(config, "logit_scale")
    if not rows or not plain or transformed or rows >= head.weight.shape[0]:
        return None
    return RestrictedHead(head.weight, rows)
