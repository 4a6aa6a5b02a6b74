"""Turning logits into the distribution a request samples from (temperature, top-k, top-p).

Target and draft go through the same warping, so the rejection rule compares like with like and
the output follows the warped target distribution exactly.
"""

from __future__ import annotations

import torch

from specdeploy.runtime.types import SamplingParams


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (float32, same leading shape) after temperature, top-k and top-p."""
    logits = logits.float()
    # shifted first: divided by a tiny temperature, logits overflow to inf and softmax gives NaN;
    # shifted, the largest is 0 and the others go to -inf (the distribution is unchanged)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        # exactly k tokens survive: a threshold at the k-th logit would keep every token tied with it
        top = torch.topk(logits, params.top_k, dim=-1).indices
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, top, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens strictly more likely already cover top_p (the top one stays)
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a 1-D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from one row of logits: argmax when greedy, else a warped sample."""
    if params.greedy:
        return int(logits.argmax())
    return sample(warp(logits, params), generator)


def uniform(generator: torch.Generator | None, device: torch.device) -> float:
    """One draw from U[0, 1), from the request's generator when there is one (on its device)."""
    return float(torch.rand((), generator=generator, device=generator.device if generator is not None else device))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """The request's generator, on the device its draws are made on (a CUDA tensor cannot be
    sampled with a CPU generator)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
