"""Parity of served text against the Hugging Face reference: exact match, where the first
divergence sits, and whether it sits at a near-tie (small logit margin in the reference).

At greedy, speculative decoding is exact in fp32; at reduced precision a k-token verify rounds
differently from a 1-token step, so a divergence is acceptable only where the reference itself
hesitated between two tokens. The margin at the divergence point is what tells the two apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class Reference:
    """Greedy output of `transformers.generate` and the logit margin (top1 - top2) at each step."""

    token_ids: list[int]
    text: str
    margins: list[float]


@dataclass
class ParityResult:
    prompt: str
    reference: str
    served: str
    match: bool
    first_divergence_token: int | None  # index into the reference's new tokens
    margin_at_divergence: float | None

    def as_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def hf_reference(model, tokenizer, prompt_ids: torch.Tensor, max_new_tokens: int) -> Reference:
    """The reference: plain `generate(do_sample=False)` on the same weights and dtype."""
    out = model.generate(
        prompt_ids,
        attention_mask=torch.ones_like(prompt_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    new_ids = out.sequences[0, prompt_ids.shape[1]:].tolist()
    margins = []
    for scores in out.scores:
        top2 = torch.topk(scores[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return Reference(new_ids, tokenizer.decode(new_ids, skip_special_tokens=True), margins)


def compare(prompt: str, reference: Reference, served: str, tokenizer) -> ParityResult:
    """Exact text match; otherwise the first reference token whose text the served output leaves."""
    if served == reference.text:
        return ParityResult(prompt, reference.text, served, True, None, None)
    divergence = len(reference.token_ids)
    for i in range(len(reference.token_ids)):
        prefix = tokenizer.decode(reference.token_ids[: i + 1], skip_special_tokens=True)
        if not served.startswith(prefix):
            divergence = i
            break
    margin = reference.margins[divergence] if divergence < len(reference.margins) else None
    return ParityResult(prompt, reference.text, served, False, divergence, margin)
