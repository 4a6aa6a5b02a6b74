"""The CPU model's scheduler thread in-process, with stand-ins for Triton's pb_utils, the metrics and
the runtime: a failure anywhere in a round, even while recovering from one, leaves the thread
serving (a dead thread would leave every later request without an answer)."""

from __future__ import annotations

import queue
import sys
import types
from dataclasses import dataclass

import pytest

from specdeploy.runtime.types import SamplingParams
from specdeploy.triton.serving.requests import Entry
from specdeploy.triton.serving.scheduler import Scheduler


class Sink:
    def __init__(self, answers: queue.Queue) -> None:
        self.answers = answers

    def error(self, message: str) -> None:
        self.answers.put(("error", message))

    def send(self, outputs, final: bool = False) -> None:
        self.answers.put(("sent", outputs))

    def cancelled(self) -> bool:
        return False


class Metrics:
    def request(self, outcome, forwards) -> None: ...
    def gauges(self, **counts) -> None: ...
    def round(self, before, after) -> None: ...
    def close(self) -> None: ...


@dataclass
class Sequence:
    done: bool = False
    result: object = None


class BrokenBatcher:
    """Admits requests; every step fails, as a bug in the runtime would."""

    active = waiting = 0
    stats = None

    def __init__(self) -> None:
        self.cancelled: list[Sequence] = []

    def add(self, request) -> Sequence:
        return Sequence()

    def cancel(self, seq: Sequence) -> None:
        self.cancelled.append(seq)

    def step(self) -> list:
        raise RuntimeError("a bug in a round")


class Decoder:
    """Its first batcher is made at load; making another one fails too."""

    def __init__(self) -> None:
        self.made: list[BrokenBatcher] = []

    def batcher(self, max_batch_size: int) -> BrokenBatcher:
        if self.made:
            raise MemoryError("no room for a fresh batch")
        self.made.append(BrokenBatcher())
        return self.made[-1]


def entry(answers: queue.Queue) -> Entry:
    return Entry(Sink(answers), [1, 2, 3], SamplingParams(max_new_tokens=4), "", True, False, (False, False), 0, None, None)


def test_a_failed_round_whose_recovery_fails_too_leaves_the_thread_serving(monkeypatch):
    logged: list[str] = []
    logger = types.SimpleNamespace(log_error=logged.append, log_warn=logged.append)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.SimpleNamespace(Logger=logger))
    decoder = Decoder()
    scheduler = Scheduler(lambda: decoder, max_batch_size=2, max_queue=8, metrics=Metrics())
    try:
        for _ in range(2):  # the second request comes after the failed recovery
            answers: queue.Queue = queue.Queue()
            scheduler.submit([entry(answers)])
            outcome, message = answers.get(timeout=30)
            assert outcome == "error" and "RuntimeError: a bug in a round" in message
        assert scheduler.thread.is_alive() and len(decoder.made) == 1
    finally:
        scheduler.close(timeout_s=5)  # the thread finishes its round (the recovery after the answer) first
    assert not scheduler.thread.is_alive()
    assert any("no fresh batch, the old one goes on" in line for line in logged)
    assert len(decoder.made[0].cancelled) == 2  # the failed sequences leave the old batch
    with pytest.raises(queue.Empty):
        answers.get_nowait()  # one answer a request
