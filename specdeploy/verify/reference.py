"""The reference side of verify: the held-out prompts, the Hugging Face reference model that
computes the greedy answer on the served weights and checks a served answer along it, the near-tie
limit measured on the served model's own rounding, and the fidelity report against the user's
original model."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specdeploy.parity import NEAR_TIE, NEAR_TIE_CAP, ParityResult, compare, hf_reference, margin_shift
from specdeploy.parity import Reference as Greedy  # verify's Reference is the model that computes it
from specdeploy.prompts import chat_text, text_ids
from specdeploy.stats import percentiles


class Prompt(NamedTuple):
    category: str
    shown: str  # what the user wrote (reports show this, not the chat template around it)
    text_input: str  # what is sent


def load_prompts(per_category: int, tokenizer: Any) -> list[Prompt]:
    """Held-out ShareGPT chat turns in the model's chat template (as a chat client sends them; the
    module was trained on that format) and HumanEval code completions. Long pasted chat turns are
    left out: they measure prefill, not speculation."""
    from specdeploy.data import humaneval_prompts, sharegpt_prompts

    chats = sharegpt_prompts(per_category, split="heldout", max_chars=800)
    return ([Prompt("chat", p, chat_text(tokenizer, p)) for p in chats]
            + [Prompt("code", p, p) for p in humaneval_prompts(per_category)])


class Reference(NamedTuple):
    """The Hugging Face reference: the model, its tokenizer, where it computes."""

    model: Any
    tokenizer: Any

    def ids(self, text: str) -> torch.Tensor:
        """The prompt as the served preprocessing tokenizes it (specdeploy.prompts)."""
        from specdeploy.runtime.types import model_device

        return torch.tensor([text_ids(self.tokenizer, text)], device=model_device(self.model))

    def check(self, prompt: str, served: str, max_new_tokens: int, *, complete: bool = True,
              min_tokens: int = 0) -> tuple[Greedy, ParityResult]:
        """The greedy reference for `prompt`, checked along the served answer (parity.hf_reference;
        `complete` False stops where they part; `min_tokens` as the request sent it), and how the
        served answer compares with it."""
        ref = hf_reference(self.model, self.tokenizer, self.ids(prompt), max_new_tokens, guess=served, complete=complete,
                           min_tokens=min_tokens)
        return ref, compare(prompt, ref, served, self.tokenizer)


def measured_near_tie(reference: Reference, answers: list[tuple[str, str]], max_new_tokens: int,
                      chunk: int) -> dict[str, Any]:
    """The near-tie limit from the served numerics themselves: the p99 of the top-2 margin shifts
    between the reference's one forward and rounds of `chunk` tokens over the served answers
    ((prompt, answer) texts; parity.margin_shift), within [NEAR_TIE, NEAR_TIE_CAP]. The reference
    is the served model (weights, dtype, fake quantization): this is how far its own rounding
    moves a margin, speculation apart. Not the largest shift: a maximum grows with the positions
    measured, up to a limit that passes almost any divergence on an FP8 build; the cap keeps one
    the reference clearly preferred a failure whatever the rounding."""
    shifts: list[float] = []
    for prompt, text in answers:
        answer = reference.tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
        if answer:
            shifts += margin_shift(reference.model, reference.ids(prompt), answer, chunk)
    p99 = percentiles(shifts)["p99"] or 0.0
    return {"limit": min(max(p99, NEAR_TIE), NEAR_TIE_CAP), "largest_shift": max(shifts, default=0.0), "p99_shift": p99,
            "positions": len(shifts), "round_tokens": chunk,
            "rule": f"the p99 top-2 logit margin shift between one forward and rounds of {chunk} tokens over the "
                    f"served answers on the served model, at least {NEAR_TIE:g} and at most {NEAR_TIE_CAP:g}"}


def near_tie_limit(reference: Reference, answers: list[tuple[str, str]], max_new_tokens: int, chunk: int,
                   given: float | None) -> tuple[float, dict[str, Any] | None]:
    """The near-tie limit: `given`, or (None) measured on the served model, with its report."""
    if given is not None:
        return given, None
    measured = measured_near_tie(reference, answers, max_new_tokens, chunk)
    return measured["limit"], measured


def load_reference(model_dir: Path, dtype: str, device: str, role: str = "reference") -> Reference:
    from specdeploy.device import announce, resolve_device
    from specdeploy.checkpoints import load_causal_lm, load_tokenizer, plain_greedy

    where = resolve_device(device)
    announce(f"verify ({role}, {dtype})", where)
    return Reference(plain_greedy(load_causal_lm(model_dir, dtype=dtype, device=str(where))), load_tokenizer(model_dir))


def fidelity(original: Reference, prompts: list[Prompt], rows: list[dict[str, Any]], max_new_tokens: int,
             served: str, dtype: str) -> dict[str, Any]:
    """Greedy agreement of the served answers (`rows`) with the user's original model."""
    agreement = []
    for prompt, row in zip(prompts, rows):
        # where they part is all this report needs
        ref, result = original.check(prompt.text_input, row["served"], max_new_tokens, complete=False)
        agreement.append({"category": prompt.category, "identical": result.match, "tokens_checked": len(ref.token_ids),
                          "first_divergence_token": result.first_divergence_token})
    differing = [a["first_divergence_token"] for a in agreement if not a["identical"]]
    return {
        "original": f"the resolved base checkpoint in its own dtype ({dtype}), unquantized",
        "served": served,
        "prompts": len(agreement),
        "identical": sum(a["identical"] for a in agreement),
        # where answers part: early = the deployment changed what the model says, late = a detail
        "mean_first_divergence_token": statistics.fmean(differing) if differing else None,
        "rule": "reported, not judged: the effect of quantization and the deployment dtype, apart from speculation",
        "rows": agreement,
    }
