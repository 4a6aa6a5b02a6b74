"""What the CPU `tensorrt_llm` model measures and reports: TensorRT-LLM's perf outputs on each
response (return_perf_metrics), and the speculative-decoding counters it puts on Triton's metrics
endpoint (pb_utils.MetricFamily, served on tritonserver's metrics port beside its own nv_* ones).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from specdeploy.triton.serving.stub import pb_utils

if TYPE_CHECKING:
    from specdeploy.triton.serving.requests import Entry


class Metrics:
    """Triton custom metrics (served on tritonserver's metrics port beside its own nv_* ones):
    speculative-decoding counters, requests by outcome, the batch's occupancy. Used from the
    execute() and scheduler threads."""

    def __init__(self, labels: dict[str, str]) -> None:
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self.labels = labels
        self.lock = threading.Lock()
        self.families = {name: pb_utils.MetricFamily(name=name, description=text, kind=kind) for name, text, kind in (
            ("specdeploy_draft_tokens_total", "draft tokens sent to verification", counter),
            ("specdeploy_accepted_draft_tokens_total", "draft tokens the target accepted", counter),
            ("specdeploy_target_forwards_total", "batched target forwards (rounds of the in-flight batch)", counter),
            ("specdeploy_sequence_forwards_total", "target forwards summed over requests, added as each ends "
             "(/ target_forwards_total = the mean batch size)", counter),
            ("specdeploy_drafted_at_position_total", "draft tokens verified at each draft position (1 = first)", counter),
            ("specdeploy_accepted_at_position_total", "draft tokens accepted at each draft position (1 = first)", counter),
            ("specdeploy_requests_total", "requests answered, by outcome (stop, length, cancelled, error, "
                                          "bad_request, rejected = server busy)", counter),
            ("specdeploy_requests_in_flight", "requests in the batch (active) or queued for it (waiting)", gauge),
        )}
        self.metrics: dict[tuple, object] = {}
        self.shown: dict[str, int] = {}  # gauge values last set: set only on change (each set is an IPC)

    def _metric(self, family: str, **labels: str):
        key = (family, *sorted(labels.items()))
        with self.lock:
            if key not in self.metrics:
                self.metrics[key] = self.families[family].Metric(labels={**self.labels, **labels})
            return self.metrics[key]

    def request(self, outcome: str, forwards: int = 0) -> None:
        """A request answered; `forwards`: the batched target forwards it took part in."""
        self._metric("specdeploy_requests_total", outcome=outcome).increment(1)
        self._add("specdeploy_sequence_forwards_total", forwards)

    def gauges(self, **states: int) -> None:
        for state, value in states.items():
            if self.shown.get(state) != value:
                self._metric("specdeploy_requests_in_flight", state=state).set(value)
                self.shown[state] = value

    def round(self, before, after) -> None:
        """One step(): the batcher's cumulative BatchStats before and after it."""
        for family, name in (("specdeploy_draft_tokens_total", "draft_tokens"),
                             ("specdeploy_accepted_draft_tokens_total", "accepted_draft_tokens"),
                             ("specdeploy_target_forwards_total", "rounds")):
            self._add(family, getattr(after, name) - getattr(before, name))
        for family, name in (("specdeploy_drafted_at_position_total", "drafted_at_position"),
                             ("specdeploy_accepted_at_position_total", "accepted_at_position")):
            old = getattr(before, name)
            for position, count in enumerate(getattr(after, name)):
                self._add(family, count - (old[position] if position < len(old) else 0), position=str(position + 1))

    def _add(self, family: str, amount: int, **labels: str) -> None:
        if amount:
            self._metric(family, **labels).increment(amount)

    def close(self) -> None:
        """Metrics before their families (the backend's rule)."""
        with self.lock:
            self.metrics.clear()
            self.families.clear()


def perf_tensors(entry: Entry, generated: int) -> list:
    """TRT-LLM's perf outputs from the runtime's own counters. The times are the request's own:
    arrival when execute() got it, scheduled when the batcher admitted it (the difference is its
    queue time). The runtime's KV cache is not paged: its positions count as blocks of one token,
    all newly allocated (no prefix reuse)."""
    seq = entry.seq
    metrics = seq.result.metrics if seq.result is not None else seq.metrics
    scheduled = seq.first_scheduled_ns or entry.arrival_ns
    first = seq.first_token_ns or scheduled
    last = seq.last_token_ns or first
    positions = len(entry.prompt) + generated

    def one(name: str, value, dtype) -> object:
        return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))

    return [
        one("kv_cache_alloc_new_blocks", positions, np.int32),
        one("kv_cache_reused_blocks", 0, np.int32),
        one("kv_cache_alloc_total_blocks", positions, np.int32),
        one("arrival_time_ns", entry.arrival_ns, np.int64),
        one("first_scheduled_time_ns", scheduled, np.int64),
        one("first_token_time_ns", first, np.int64),
        one("last_token_time_ns", last, np.int64),
        one("acceptance_rate", metrics.acceptance_rate, np.float32),
        one("total_accepted_draft_tokens", metrics.accepted_draft_tokens, np.int32),
        one("total_draft_tokens", metrics.draft_tokens, np.int32),
        # specdeploy's own, beside NVIDIA's: what the acceptance length is counted on (emitted tokens
        # and the target forwards after the prefill), so no client has to re-tokenize the text for it
        one("total_generated_tokens", generated, np.int32),
        one("total_target_forwards", metrics.target_forwards, np.int32),
    ]
