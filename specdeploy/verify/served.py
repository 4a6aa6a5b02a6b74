"""The served side of verify: what is sent (a Target: the model, its input names and extra
inputs), the prompts asked of the speculative server and its autoregressive twin in alternation,
each answer checked against the reference, and the token counts taken from the server's own perf
outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from specdeploy.client import Request, TritonLLMClient
from specdeploy.runtime.types import acceptance_length
from specdeploy.verify.reference import Prompt, Reference
from specdeploy.verify.summary import _speedup


@dataclass
class RouteRequest(Request):
    """A Request in the served model's own input names, with the inputs its route needs."""

    names: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def tensors(self, stream: bool) -> dict[str, Any]:
        values = {self.names.get(k, k): v for k, v in super().tensors(stream).items()}
        return {**values, **self.extra}


@dataclass
class Target:
    """What verify talks to and how: the model it sends to, names, extra inputs, streaming."""

    model: str = "ensemble"
    names: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    stream: bool = True

    def request(self, text: str, max_tokens: int) -> RouteRequest:
        return RouteRequest(text, max_tokens=max_tokens, names=self.names, extra=self.extra)


def served_forwards(tokens: int, accepted: int) -> int:
    """Target forwards after the prefill: the prefill yields the first token, every later
    forward its accepted drafts plus one."""
    return max(tokens - 1 - accepted, 0)


def served_counts(perf: dict[str, float], text_tokens: int) -> tuple[int, int, int]:
    """(emitted tokens, accepted draft tokens, target forwards after the prefill) of one answer,
    from the server's counters where it has them (the CPU repository): accepted are then the
    emitted tokens no forward's own token accounts for, so only tokens that were sent count. A
    TensorRT-LLM server reports only its draft counts: then `text_tokens` (the answer counted on
    its text) and its total_accepted_draft_tokens."""
    if "total_generated_tokens" in perf and "total_target_forwards" in perf:
        tokens, forwards = int(perf["total_generated_tokens"]), int(perf["total_target_forwards"])
        return tokens, max(tokens - 1 - forwards, 0), forwards
    accepted = int(perf.get("total_accepted_draft_tokens", 0))
    return text_tokens, accepted, served_forwards(text_tokens, accepted)


def run_prompts(spec: TritonLLMClient, ar: TritonLLMClient | None, reference: Reference, prompts: list[Prompt],
                max_new_tokens: int, target: Target = Target()) -> list[dict[str, Any]]:
    """Interleave speculative and autoregressive requests; compute each HF reference."""
    rows = []
    for client in filter(None, (spec, ar)):  # warm-up: first requests pay one-off costs
        client.generate(target.request(prompts[0].text_input, 4), stream=target.stream)
    for i, (category, shown, prompt) in enumerate(tqdm(prompts, desc="verify", unit="prompt")):
        request = target.request(prompt, max_new_tokens)
        baseline = ar.generate(request, stream=True) if ar and i % 2 else None  # alternate who goes first
        served = spec.generate(request, stream=target.stream)
        if ar and not i % 2:
            baseline = ar.generate(request, stream=True)
        ref, parity = reference.check(prompt, served.text, max_new_tokens)
        text_tokens = answer_tokens(ref.token_ids if parity.match else None, reference.tokenizer, served.text, max_new_tokens)
        tokens, accepted, forwards = served_counts(served.perf, text_tokens)
        ar_tokens = None
        if baseline is not None:
            same = baseline.text == served.text
            ar_text_tokens = text_tokens if same else answer_tokens(None, reference.tokenizer, baseline.text, max_new_tokens)
            ar_tokens = served_counts(baseline.perf, ar_text_tokens)[0]
        rows.append({
            "category": category, "shown": shown, **parity.as_dict(), "tokens": tokens, "perf": served.perf,
            "accepted_draft_tokens": accepted, "target_forwards": forwards,
            "acceptance_length": acceptance_length(accepted, forwards),
            "latency_s": served.latency_s, "ttft_s": served.time_to_first_chunk_s,
            "ar_latency_s": baseline.latency_s if baseline else None, "ar_tokens": ar_tokens,
            "ar_matches": baseline.text == served.text if baseline else None,
            "speedup": _speedup([(tokens, served.latency_s, ar_tokens, baseline.latency_s)]) if baseline else None,
        })
    return rows


def answer_tokens(reference_ids: list[int] | None, tokenizer: Any, text: str, max_new_tokens: int) -> int:
    """The tokens an answer took, for a server that does not count them: the reference's, its end
    token included, where the answer is the reference's; else its text counted, plus the end token
    it stopped at when it stopped short of max_new_tokens (the text does not show it)."""
    if reference_ids is not None:
        return len(reference_ids)
    counted = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return counted + 1 if counted < max_new_tokens else counted
