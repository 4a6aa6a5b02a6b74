"""`specdeploy spec validate`: acceptance length of a trained module on held-out prompts, per
category (chat: held-out ShareGPT, code: HumanEval), like ModelOpt's ar_validate; optionally
the wall-clock speed-up over plain decoding, both measured interleaved prompt by prompt in one run
(the machine is shared: interleaving spreads other load over both arms)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdeploy.device import resolve_device
from specdeploy.errors import SpecDeployError
from specdeploy.prompts import chat_ids, text_ids
from specdeploy.runtime.types import acceptance_length
from specdeploy.speculator import memory
from specdeploy.speculator.common import chat_prompts, code_prompts

CATEGORIES = ("chat", "code")


@dataclass
class CategoryResult:
    prompts: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    accepted_draft_tokens: int = 0
    spec_seconds: float = 0.0
    plain_tokens: int = 0
    plain_seconds: float = 0.0
    exact: int = 0  # prompts whose speculative output equals plain decoding (when measured)
    draft_seconds: float = 0.0  # time inside proposer.propose (the draft's share of spec_seconds)
    draft_tokens: int = 0
    per_prompt: list[float] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.accepted_draft_tokens, self.target_forwards)

    @property
    def speedup(self) -> float | None:
        if not self.plain_seconds or not self.spec_seconds:
            return None
        return (self.new_tokens / self.spec_seconds) / (self.plain_tokens / self.plain_seconds)

    def as_dict(self) -> dict[str, Any]:
        out = {"prompts": self.prompts, "acceptance_length": round(self.acceptance_length, 3),
               "new_tokens": self.new_tokens, "target_forwards": self.target_forwards,
               "accepted_draft_tokens": self.accepted_draft_tokens,
               "spec_tokens_per_s": round(self.new_tokens / self.spec_seconds, 2) if self.spec_seconds else None,
               "draft_share_of_time": round(self.draft_seconds / self.spec_seconds, 3) if self.spec_seconds else None,
               "draft_ms_per_round": round(1000 * self.draft_seconds / max(self.target_forwards, 1), 2),
               "draft_tokens_per_round": round(self.draft_tokens / max(self.target_forwards, 1), 2)}
        if self.plain_seconds:
            out.update(plain_tokens_per_s=round(self.plain_tokens / self.plain_seconds, 2),
                       speedup=round(self.speedup or 0.0, 3), exact_match=f"{self.exact}/{self.prompts}")
        return out


def encode(tokenizer: Any, text: str, category: str, max_prompt_tokens: int = 256) -> list[int]:
    """A prompt as served (specdeploy.prompts): chat in the chat template, code as a raw completion.
    A longer text is cut to `max_prompt_tokens` first: chat keeps its start, code its end."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_prompt_tokens:
        text = tokenizer.decode(ids[-max_prompt_tokens:] if category == "code" else ids[:max_prompt_tokens])
    return chat_ids(tokenizer, text) if category == "chat" else text_ids(tokenizer, text)


def prompts_for(category: str, n: int) -> list[str]:
    if category == "chat":
        return chat_prompts(n, "heldout")
    if category == "code":
        return code_prompts(n)
    raise SpecDeployError(f"unknown category '{category}'", hint=f"use {', '.join(CATEGORIES)}")


def measure(
    target: Any, tokenizer: Any, proposer: Any, *, categories: tuple[str, ...] = CATEGORIES, num_prompts: int = 8,
    max_new_tokens: int = 96, speedup: bool = False, draft_len: int | None = None, adaptive: bool = False,
) -> dict[str, CategoryResult]:
    """Per category: acceptance length (and plain vs speculative timings, interleaved)."""
    from tqdm import tqdm

    from specdeploy.runtime.decoding import generate
    from specdeploy.runtime.types import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens)
    timed = _Timed(proposer)
    context = target.config.max_position_embeddings
    room = min(256, context - max_new_tokens - 32)  # 32: chat template
    if room < 1:
        raise SpecDeployError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
                              f"{context}-token context", hint=f"use at most {context - 64} new tokens")
    results: dict[str, CategoryResult] = {}
    for category in categories:
        result = results.setdefault(category, CategoryResult())
        for text in tqdm(prompts_for(category, num_prompts), desc=f"validate {category}", unit="prompt"):
            ids = encode(tokenizer, text, category, room)
            plain = None
            if speedup:
                start = time.perf_counter()
                plain = generate(target, ids, params)
                result.plain_seconds += time.perf_counter() - start
                result.plain_tokens += len(plain.token_ids)
            start = time.perf_counter()
            timed.seconds = 0.0
            out = generate(target, ids, params, timed, draft_len=draft_len, adaptive=adaptive)
            result.draft_seconds += timed.seconds
            result.draft_tokens += out.metrics.draft_tokens
            result.spec_seconds += time.perf_counter() - start
            result.prompts += 1
            result.new_tokens += out.metrics.new_tokens
            result.target_forwards += out.metrics.target_forwards
            result.accepted_draft_tokens += out.metrics.accepted_draft_tokens
            result.per_prompt.append(round(out.metrics.acceptance_length, 3))
            result.exact += int(plain is not None and plain.token_ids == out.token_ids)
    return results


class _Timed:
    """The proposer, with the time spent proposing accumulated (the draft's cost)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0
        self.kind, self.hidden_layers = inner.kind, inner.hidden_layers

    def reset(self) -> None:
        self.inner.reset()

    def update(self, accepted: int, proposed: int) -> None:
        self.inner.update(accepted, proposed)

    def propose(self, state: Any, max_tokens: int) -> Any:
        start = time.perf_counter()
        try:
            return self.inner.propose(state, max_tokens)
        finally:
            self.seconds += time.perf_counter() - start


def overall(results: dict[str, CategoryResult]) -> float:
    """Acceptance length over every prompt: counts summed first (runtime.types.acceptance_length)."""
    return acceptance_length(sum(r.accepted_draft_tokens for r in results.values()),
                             sum(r.target_forwards for r in results.values()))


def check_bound(results: dict[str, CategoryResult], bound: float | None) -> None:
    """ModelOpt ar_validate-style gate: the mean acceptance length over all prompts."""
    if bound is None:
        return
    value = overall(results)
    if value < bound:
        per = ", ".join(f"{c} {r.acceptance_length:.2f}" for c, r in results.items())
        raise SpecDeployError(
            f"acceptance length {value:.2f} is below --ar-lower-bound {bound} ({per})",
            hint="train longer (--steps, --num-prompts), or lower the bound",
        )


def load_for_validation(base_dir: Path, spec_dir: Path, dtype: str, proposer_options: dict[str, Any], *,
                        device: Any = "auto", trust_remote_code: bool = False) -> tuple[Any, Any, Any]:
    """The target on `device` (memory checked first) and the proposer, which follows the target."""
    from specdeploy.checkpoints import load_causal_lm, load_tokenizer
    from specdeploy.runtime.proposers import build_proposer
    from specdeploy.checkpoints.modules import read_spec_config

    kind = read_spec_config(spec_dir)["kind"]
    device = resolve_device(device)
    memory.check_validation(base_dir, dtype, device)
    target = load_causal_lm(base_dir, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    proposer = build_proposer(kind, target, spec_dir=spec_dir, **proposer_options)
    return target, load_tokenizer(base_dir), proposer
