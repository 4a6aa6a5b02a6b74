"""The load up to which speculation pays: `spec_off_above`, measured.

Under load the balance moves: an in-flight batch verifies every row in one forward, whose cost
grows slowly with the batch, while most proposers draft row by row (EAGLE drafts the batch
together, at a cost that still grows with it), and every answer's prompt is prefilled on its own
(EAGLE's module reads it too). `measure_load_curve` runs `make loadtest`'s closed loop in-process
for each batch size n: n clients, each sending its next request when its answer is complete, on
the deployment and on its plain twin (the AR twin a server is compared with), the two stepping
side by side over the same requests. `spec_off_above` is the largest batch where speculating paid
(Arctic's disable_by_batch_size).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from specdeploy.errors import SpecDeployError
from specdeploy.runtime.batch import InflightBatcher
from specdeploy.runtime.batch_requests import BatchRequest
from specdeploy.runtime.planner import synchronize
from specdeploy.runtime.types import SamplingParams

# The answers the load plan asks for: `make loadtest`'s default --max-tokens and --length-spread (its
# figures are what the plan predicts). Timing whole answers of the load test's lengths, prefill
# included, the plan read within 0.02 of what the load test served with speculation always on
# (docs/measurements.md, 2026-11-29): bf16 1.13-1.14x / 1.07-1.10x at 4 / 8 (served 1.12x / 1.09x),
# float32 1.01-1.02x / 0.94-0.96x (served 1.01x / 0.94x). Rounds timed 24 tokens into answers that
# could end had read 1.06x / 1.00x and 0.98x / 0.90x.
LOAD_ANSWER_TOKENS, LOAD_ANSWER_SPREAD = 32, 0.5
# Requests per client and size (and every prompt at least once): with 3, the readings of one build
# moved by up to 0.04 from run to run; sizes 1, 2, 4 and 8 took 58-61 s on two cores (bf16), 109-111 s
# (float32). The load test sends 6: an n-gram deployment read 1.16x at 2 clients with 3, 1.29x with 6
# (served 1.34x), at about 1.5x the time.
LOAD_REQUESTS_PER_CLIENT = 3


@dataclass
class LoadPoint:
    """One in-flight batch of `batch` sequences: tokens/s of the deployment and of its plain twin
    over the same requests."""

    batch: int
    spec_tokens: int
    spec_s: float
    plain_tokens: int
    plain_s: float

    @property
    def speedup(self) -> float:
        return (self.spec_tokens / self.spec_s) / (self.plain_tokens / self.plain_s)

    def pooled(self, other: "LoadPoint") -> "LoadPoint":
        """This size's measurement and another of it, their requests together."""
        return LoadPoint(self.batch, self.spec_tokens + other.spec_tokens, self.spec_s + other.spec_s,
                         self.plain_tokens + other.plain_tokens, self.plain_s + other.plain_s)

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "spec_tokens_per_s": self.spec_tokens / self.spec_s,
                "plain_tokens_per_s": self.plain_tokens / self.plain_s, "speedup": self.speedup}


def answer_lengths(n: int, mean: int, spread: float, seed: int = 0) -> list[int]:
    """Each of `n` prompts' answer length: `mean` x factors evenly spread over [1 - spread, 1 + spread],
    dealt to the prompts in a seeded order. Answers of one length would keep a closed loop's clients
    in lockstep: they finish in the same round and come back as one burst."""
    factors = np.linspace(1 - spread, 1 + spread, n) if n > 1 else [1.0]
    dealt = np.random.default_rng(seed).permutation(n)
    return [max(1, round(mean * float(factors[i]))) for i in dealt]


def measure_load_curve(make_batcher: Callable[[int], InflightBatcher], prompts: list[list[int]], batch_sizes: list[int], *,
                       lengths: list[int] | None = None,
                       requests_per_client: int = LOAD_REQUESTS_PER_CLIENT) -> list[LoadPoint]:
    """For each size: a closed loop of that many clients on `make_batcher(size)` (speculating in
    every round) and on its plain twin, the prompts sent in turn, requests_per_client per client
    and every prompt at least once. Each answer has exactly its length (`lengths`, default the
    load test's), as the load test asks (min_tokens): both arms emit the same tokens. A prompt
    that leaves no room for its answer in the model's context is left out."""
    lengths = lengths or answer_lengths(len(prompts), LOAD_ANSWER_TOKENS, LOAD_ANSWER_SPREAD)
    points = []
    for size in batch_sizes:
        speculative = make_batcher(size)
        speculative.spec_off_above = None
        fitting = [(ids, n) for ids, n in zip(prompts, lengths) if len(ids) + n <= speculative.context_length]
        if not fitting:
            raise SpecDeployError(f"no load-plan prompt leaves room for its answer in the model's context "
                                  f"({speculative.context_length} tokens)",
                                  hint="pass --spec-off-above N to package or engine (the load plan is then not run)")
        requests = [fitting[i % len(fitting)] for i in range(max(len(fitting), requests_per_client * size))]
        spec, plain = _ClosedLoop(speculative, requests, size), _ClosedLoop(_plain_twin(speculative), requests, size)
        _side_by_side([spec, plain])
        points.append(LoadPoint(size, spec.tokens, spec.seconds, plain.tokens, plain.seconds))
    return points


def _plain_twin(batcher: InflightBatcher) -> InflightBatcher:
    """`batcher`'s deployment without its proposer."""
    return InflightBatcher(batcher.target, None, max_batch_size=batcher.max_batch_size, decode=batcher.decode,
                           context_length=batcher.context_length)


class _ClosedLoop:
    """One arm: `clients` requests in flight on `batcher`, the next sent as one completes; the time
    of its steps (each admits the requests sent, prefilling them, and runs one round) and the
    tokens they emitted."""

    def __init__(self, batcher: InflightBatcher, requests: list[tuple[list[int], int]], clients: int) -> None:
        self.batcher, self.clients = batcher, clients
        self.to_send = deque(requests)
        self.seconds, self.tokens = 0.0, 0

    @property
    def done(self) -> bool:
        return not self.to_send and not self.batcher.active and not self.batcher.waiting

    def step(self) -> None:
        while self.to_send and self.batcher.active + self.batcher.waiting < self.clients:
            ids, length = self.to_send.popleft()
            self.batcher.add(BatchRequest(ids, SamplingParams(max_new_tokens=length, min_tokens=length),
                                          on_tokens=self._count))
        synchronize(self.batcher.device)
        start = time.perf_counter()
        self.batcher.step()
        synchronize(self.batcher.device)
        self.seconds += time.perf_counter() - start

    def _count(self, tokens: list[int]) -> None:
        self.tokens += len(tokens)


def _side_by_side(arms: list[_ClosedLoop]) -> None:
    """Step the arms until each is done, the one behind (fewest tokens so far) next: they go through
    their requests together, so a slow spell of the host falls on both."""
    while running := [arm for arm in arms if not arm.done]:
        min(running, key=lambda arm: arm.tokens).step()


def break_even(levels: list[int], speedups: list[float | None], pays: float = 1.0) -> int | None:
    """The level (concurrency, batch size) from which speculation stops paying: the measured level
    after the last one whose speed-up reached `pays` (None: the last measured level paid). The
    speed-up falls with the load, so a level below `pays` with a paying level above it is noise:
    served, two passes at concurrency 2 lost by 2% between levels 1, 4 and 8 that paid 1.04-1.20x,
    and the next run's four passes there paid 1.01-1.09x (docs/measurements.md, 2026-11-27)."""
    measured = [(level, s) for level, s in zip(levels, speedups) if s is not None]
    last = max((i for i, (_, s) in enumerate(measured) if s >= pays), default=-1)
    return measured[last + 1][0] if last + 1 < len(measured) else None


def suggested_spec_off_above(levels: list[int], speedups: list[float | None], pays: float = 1.0) -> int | None:
    """`spec_off_above` from a speed-up curve: speculate only in batches as large as the largest
    level before the break-even (None: it paid at the last level; 0: not even alone)."""
    point = break_even(levels, speedups, pays)
    if point is None:
        return None
    paying = [level for level, s in zip(levels, speedups) if s is not None and level < point]  # measured ones only
    return max(paying) if paying else 0
