"""The load up to which speculation pays: `spec_off_above`, measured.

Under load the balance moves: an in-flight batch verifies every row in one forward, whose cost
grows slowly with the batch, while most proposers draft row by row (EAGLE drafts the batch
together, at a cost that still grows with it). `measure_load_curve` runs batches of 1..n
requests on the deployment and on its plain twin (the AR twin a server is compared with), their
rounds interleaved, and `spec_off_above` is the largest batch where speculating paid
(Arctic's disable_by_batch_size).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from specdeploy.runtime.batch import InflightBatcher
from specdeploy.runtime.batch_requests import BatchRequest
from specdeploy.runtime.decoding import DEFAULT_DRAFT_LEN
from specdeploy.runtime.planner import synchronize
from specdeploy.runtime.types import SamplingParams

# Acceptance falls along an answer (planner.CALIBRATION_TOKENS): the load plan measures after this
# many plain rounds.
LOAD_WARMUP = 24


@dataclass
class LoadPoint:
    """One in-flight batch of `batch` sequences: tokens/s of its speculative rounds and of its
    plain twin's rounds."""

    batch: int
    spec_tokens: int
    spec_s: float
    plain_tokens: int
    plain_s: float

    @property
    def speedup(self) -> float:
        return (self.spec_tokens / self.spec_s) / (self.plain_tokens / self.plain_s)

    def pooled(self, other: "LoadPoint") -> "LoadPoint":
        """This size's measurement and another of it, their rounds together."""
        return LoadPoint(self.batch, self.spec_tokens + other.spec_tokens, self.spec_s + other.spec_s,
                         self.plain_tokens + other.plain_tokens, self.plain_s + other.plain_s)

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "spec_tokens_per_s": self.spec_tokens / self.spec_s,
                "plain_tokens_per_s": self.plain_tokens / self.plain_s, "speedup": self.speedup}


def measure_load_curve(make_batcher: Callable[[int], InflightBatcher], prompts: list[list[int]], batch_sizes: list[int], *,
                       rounds: int = 12, max_draft: int = DEFAULT_DRAFT_LEN, warmup: int = LOAD_WARMUP) -> list[LoadPoint]:
    """For each size: batches of that many greedy requests on `make_batcher(size)` and the same
    requests on its plain twin (the deployment without its proposer: what a server's AR twin runs),
    as many as it takes for every prompt to be in one (a batch of 1 measured on one prompt alone is
    one prompt's acceptance). Each decodes `warmup` plain rounds untimed; the deployment then
    resumes speculating with one untimed round (it takes in the warm-up's target states), and
    `rounds` of its speculative rounds and `rounds` of the twin's run in ABBA order; tokens/s of
    each over them all. A size whose rows end before both ran is left out."""
    points = []
    for size in batch_sizes:
        seconds, tokens = {True: 0.0, False: 0.0}, {True: 0, False: 0}
        for first in range(0, max(len(prompts), 1), size):
            batch = [prompts[(first + i) % len(prompts)] for i in range(size)]
            speculative = make_batcher(size)
            _time_rounds({True: speculative, False: _plain_twin(speculative)}, batch, rounds, max_draft, warmup,
                         seconds, tokens)
        if seconds[True] and seconds[False]:
            points.append(LoadPoint(size, tokens[True], seconds[True], tokens[False], seconds[False]))
    return points


def _plain_twin(batcher: InflightBatcher) -> InflightBatcher:
    """`batcher`'s deployment without its proposer."""
    return InflightBatcher(batcher.target, None, max_batch_size=batcher.max_batch_size, decode=batcher.decode,
                           context_length=batcher.context_length)


def _time_rounds(batchers: dict[bool, InflightBatcher], batch: list[list[int]], rounds: int, max_draft: int,
                 warmup: int, seconds: dict[bool, float], tokens: dict[bool, int]) -> None:
    """Decode `batch` on the speculative (True) and the plain (False) batcher, adding the time and
    tokens of their timed rounds."""
    emitted: dict[bool, list[int]] = {True: [], False: []}
    # room for the warm-up twice over: a row is caught up after plain rounds only while it has at
    # least as many tokens to go as it missed (InflightBatcher._worth_catching_up)
    params = SamplingParams(max_new_tokens=2 * (warmup + 1) + (rounds + 1) * (max_draft + 1) + 2)
    for speculate, batcher in batchers.items():
        count = emitted[speculate].append
        for ids in batch:
            batcher.add(BatchRequest(ids, params, on_tokens=lambda group, count=count: count(len(group))))
        batcher.spec_off_above = 0
        for _ in range(1 + warmup):  # the first admits (prefills) every request; none is counted
            batcher.step()
    batchers[True].spec_off_above = None
    batchers[True].step()
    for r in range(2 * rounds):
        speculate = r % 4 in (0, 3)
        batcher = batchers[speculate]
        if batcher.active < len(batch):
            break
        before = len(emitted[speculate])
        synchronize(batcher.device)
        start = time.perf_counter()
        batcher.step()
        synchronize(batcher.device)
        seconds[speculate] += time.perf_counter() - start
        tokens[speculate] += sum(emitted[speculate][before:])


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
