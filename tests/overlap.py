"""For server tests that need requests in flight together: on a loaded host the test's own process
may send one request only after another has ended, which tests nothing. `until_overlapping` repeats
such an attempt until the server's own stamps show a request arriving while an earlier one ran."""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

import pytest

T = TypeVar("T")


def overlapping(perfs: Iterable[dict]) -> bool:
    """Each request's perf outputs (arrival_time_ns, last_token_time_ns): whether one arrived before an
    earlier one ended."""
    spans = sorted((perf["arrival_time_ns"], perf["last_token_time_ns"]) for perf in perfs)
    ended = spans[0][1]
    for arrival, last in spans[1:]:
        if arrival < ended:
            return True
        ended = max(ended, last)
    return False


def until_overlapping(attempt: Callable[[], T], perfs: Callable[[T], Iterable[dict]] = lambda result: result,
                      tries: int = 5) -> T:
    """The first result of `attempt()` whose requests (their perf outputs: `perfs(result)`, by default
    the result itself) overlapped; a failure after `tries` attempts (what a server that answers one
    request at a time gives)."""
    for _ in range(tries):
        result = attempt()
        if overlapping(perfs(result)):
            return result
    pytest.fail(f"in {tries} tries no request reached the server while an earlier one ran")
