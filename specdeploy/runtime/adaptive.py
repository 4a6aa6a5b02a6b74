"""Adaptive draft length, per request: speculate only while it pays.

Two signals, both cheap:
- acceptance: grow the draft after a fully accepted round, shrink it after a rejection
  (the transformers assisted-generation heuristic), and stop speculating after a few rounds in
  a row that accepted nothing;
- measured speed: tokens per second of speculative rounds (propose + verify) against plain
  decoding steps. A verify over k tokens costs ~1.6 plain steps in fp32 but ~1 in bf16 on a 2-core
  CPU (docs/measurements.md, 2026-11-22), so acceptance alone cannot say whether speculation is winning.
When speculation loses, the request decodes plainly for a while and then probes again with
one round; each failed probe doubles the wait, so a hopeless proposer costs a handful of rounds.

Timing makes the draft schedule, and with it the order of random draws, depend on the machine's
load. A seeded sampled request must be reproducible, so it adapts on acceptance only (`timed`
False); greedy output is exact whatever the schedule.
"""

from __future__ import annotations

# Weight of the newest measurement in the running rates: reacts within a few rounds, yet one
# noisy round on a shared machine does not flip the decision alone.
_EMA = 0.5


class AdaptiveDraftLength:
    def __init__(
        self,
        max_len: int,
        *,
        adaptive: bool = True,
        timed: bool = True,
        start: int = 4,
        patience: int = 3,
        backoff: int = 8,
        max_backoff: int = 128,
        warmup_plain_steps: int = 2,
    ) -> None:
        self.max_len = max_len
        self.adaptive = adaptive
        self.timed = timed
        self.length = max_len if not adaptive else max(1, min(start, max_len))
        self.patience = patience
        self.min_backoff = backoff
        self.backoff = backoff
        self.max_backoff = max_backoff
        # a couple of plain steps first: they measure the speed speculation has to beat
        self.plain_left = warmup_plain_steps if adaptive and timed else 0
        self.misses = 0  # rounds in a row without an accepted token (kept across probes)
        self.plain_rate: float | None = None  # tokens/s of plain decoding steps
        self.spec_rate: float | None = None  # tokens/s of speculative rounds since the last probe
        # the first speculative round also pays for the proposer's own prefill (a draft model
        # reads the whole prompt): its time says nothing about the rounds after it
        self.first_round = True

    def next_length(self) -> int:
        """Draft tokens to ask for this round; 0 means one plain decoding step."""
        if self.plain_left > 0:
            self.plain_left -= 1
            return 0
        return self.length

    def record(self, accepted: int, proposed: int, seconds: float) -> None:
        """One finished round: `proposed` 0 is a plain step (one token)."""
        if not self.adaptive:
            return
        if proposed == 0:
            if self.timed:
                self.plain_rate = _mix(self.plain_rate, 1.0 / max(seconds, 1e-9))
            return
        if self.timed and not self.first_round:
            self.spec_rate = _mix(self.spec_rate, (accepted + 1) / max(seconds, 1e-9))
        self.first_round = False
        self.misses = self.misses + 1 if accepted == 0 else 0
        if accepted == proposed:
            self.length = min(self.max_len, self.length + 2)
        else:
            self.length = max(1, self.length - 1)
        slower = None not in (self.plain_rate, self.spec_rate) and self.spec_rate < self.plain_rate
        if slower or self.misses >= self.patience:
            self._fall_back()
        elif accepted > 0:
            self.backoff = self.min_backoff  # speculation is paying again

    def _fall_back(self) -> None:
        self.plain_left = self.backoff
        self.backoff = min(2 * self.backoff, self.max_backoff)
        self.spec_rate = None  # the next probe is judged on its own


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new
