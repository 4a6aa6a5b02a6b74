"""The request side of in-flight batching: what `InflightBatcher.add` takes (BatchRequest) and
returns (Sequence), the batcher's counters (BatchStats), and one sequence's decoding state while it
is in the batch (Row: what `decoding.generate` keeps in its locals for a single request).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdeploy.runtime.adaptive import AdaptiveDraftLength
from specdeploy.runtime.decoding import Hidden, _Output, draft_budget
from specdeploy.runtime.sampling import make_generator
from specdeploy.runtime.types import GenerationMetrics, GenerationResult, Proposer, SamplingParams, TargetState


@dataclass
class BatchRequest:
    prompt_ids: list[int]
    params: SamplingParams
    #: each accepted group of tokens, called from step()'s thread; raising cancels the sequence
    on_tokens: Callable[[list[int]], None] | None = None
    #: this request's own proposer instead of the deployment's (e.g. draft tokens a client sent)
    proposer: Proposer | None = None


@dataclass(eq=False)  # compared and hashed by identity: usable as a dict key
class Sequence:
    """The handle `add()` returns. `result` is set when done (finish_reason stop | length |
    cancelled); `error` too when this sequence failed on its own (then finish_reason cancelled).
    Timestamps are time.time_ns()."""

    id: int
    arrival_ns: int
    done: bool = False
    result: GenerationResult | None = None
    error: Exception | None = None
    first_scheduled_ns: int | None = None
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    #: the running counts while it decodes (what on_tokens may report); result.metrics when done
    metrics: GenerationMetrics | None = None


@dataclass
class BatchStats:
    """Cumulative over the batcher's life. Positions count per sequence-round verification:
    drafted_at_position[i] = verifications whose draft reached depth i + 1, accepted_at_position[i]
    = those that accepted at least i + 1 draft tokens (vLLM's per-position acceptance). Accepted
    tokens are those emitted: a stop inside an accepted path drops the rest of it."""

    rounds: int = 0  # batched target forwards (prefills not counted)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    accepted_at_position: list[int] = field(default_factory=list)
    drafted_at_position: list[int] = field(default_factory=list)

    def record(self, drafted_depth: int, accepted: int, draft_tokens: int) -> None:
        self.draft_tokens += draft_tokens
        self.accepted_draft_tokens += accepted
        _count_up_to(self.drafted_at_position, drafted_depth)
        _count_up_to(self.accepted_at_position, accepted)


def _count_up_to(counts: list[int], n: int) -> None:
    counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1


class Row:
    """One sequence's decoding state in the batch. The keyword arguments are the batcher's
    settings (as `decoding.generate` takes them); `eos` its target's end-of-sequence ids."""

    def __init__(self, seq: Sequence, request: BatchRequest, prompt: torch.Tensor, proposer: Proposer | None, *,
                 draft_len: int | None, adaptive: bool, device: torch.device, context_length: int,
                 eos: set[int], decode: Callable | None) -> None:
        params = request.params
        self.seq, self.params, self.prompt, self.proposer = seq, params, prompt, proposer
        self.chain = proposer is None or proposer.kind == "chain"
        self.max_draft = draft_budget(draft_len, self.chain)
        # seeded sampling must not depend on timing (adaptive.py); greedy output cannot
        timed = params.greedy or params.seed is None
        self.controller = AdaptiveDraftLength(self.max_draft, adaptive=adaptive and proposer is not None, timed=timed)
        self.hidden_layers = proposer.hidden_layers if proposer else ()
        self.generator = make_generator(params.seed, device)
        self.max_new = min(params.max_new_tokens, context_length - prompt.shape[1])
        self.output = _Output(self.max_new, eos | set(params.stop_token_ids), params.stop_strings, decode,
                              request.on_tokens, params.min_tokens)
        self.metrics = seq.metrics = GenerationMetrics(prompt_tokens=prompt.shape[1])
        self.pending = -1  # the emitted token not yet run through the target
        self.consumed = prompt.shape[1]  # tokens in the cache: the pending token's position
        self.unseen: Hidden = {}  # target states the proposer has not read yet
        # positions whose target states the proposer has read or holds in `unseen` (prefill's on joining)
        self.captured = prompt.shape[1]
        self.start = 0.0

    def tokens(self) -> torch.Tensor:
        """The sequence so far (1, consumed + 1): prompt, emitted tokens, the pending one last."""
        return torch.cat([self.prompt, torch.tensor([self.output.tokens], device=self.prompt.device)], dim=1)

    def state(self) -> TargetState:
        return TargetState(tokens=self.tokens(), hidden=self.unseen, params=self.params, generator=self.generator)

    def emit(self, taken: list[int]) -> bool:
        """Stream the tokens `output.take` took (on_tokens may raise); True when the sequence is finished."""
        now = time.time_ns()
        self.seq.first_token_ns = self.seq.first_token_ns or now
        self.seq.last_token_ns = now
        self.pending = taken[-1]
        self.output.send(taken)
        return self.output.done

    def see(self, hidden: Hidden) -> None:
        """A proposer sees the states of every token consumed since it last proposed."""
        self.unseen = {layer: torch.cat([self.unseen[layer], h], dim=1) if layer in self.unseen else h
                       for layer, h in hidden.items()}

    def result(self, reason: str | None) -> GenerationResult:
        self.metrics.elapsed_s = time.perf_counter() - self.start if self.start else 0.0
        self.metrics.new_tokens = len(self.output.tokens)
        return GenerationResult(token_ids=self.output.tokens, finish_reason=reason, metrics=self.metrics)
