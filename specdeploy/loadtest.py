"""`make loadtest`: N concurrent streaming clients x M requests against a live server.

Every output must equal the same request sent alone (greedy): concurrency may change speed,
never text. Reports errors, mismatches and latency / time-to-first-token percentiles.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from specdeploy.client import Request, TritonLLMClient
from specdeploy.errors import SpecDeployError


@dataclass
class LoadResult:
    requests: int
    errors: list[str]
    mismatches: int
    wall_s: float
    latency_s: dict[str, float]
    ttft_s: dict[str, float]

    def as_dict(self) -> dict:
        return {**self.__dict__, "errors": self.errors[:20], "num_errors": len(self.errors)}


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(ordered)}


def run_load(
    url: str, prompts: list[str], *, clients: int = 8, requests_per_client: int = 10,
    max_tokens: int = 32, protocol: str = "grpc", model: str = "ensemble",
) -> LoadResult:
    """Send every prompt alone first (the expected text), then all of them concurrently."""
    solo = TritonLLMClient(url, protocol, model)
    solo.wait_ready()
    expected = {p: solo.generate(Request(p, max_tokens=max_tokens), stream=True).text for p in set(prompts)}
    solo.close()

    def one_client(index: int) -> list[tuple[str, str | None, float, float]]:
        client = TritonLLMClient(url, protocol, model)
        rows = []
        for j in range(requests_per_client):
            prompt = prompts[(index * requests_per_client + j) % len(prompts)]
            try:
                done = client.generate(Request(prompt, max_tokens=max_tokens), stream=True)
                rows.append((prompt, done.text, done.latency_s, done.time_to_first_chunk_s))
            except (SpecDeployError, OSError) as err:
                rows.append((prompt, None, 0.0, str(err)))
        client.close()
        return rows

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        rows = [row for result in pool.map(one_client, range(clients)) for row in result]
    wall = time.perf_counter() - started
    ok = [r for r in rows if r[1] is not None]
    return LoadResult(
        requests=len(rows),
        errors=[f"{r[0][:40]!r}: {r[3]}" for r in rows if r[1] is None],
        mismatches=sum(1 for r in ok if r[1] != expected[r[0]]),
        wall_s=wall,
        latency_s=percentiles([r[2] for r in ok]),
        ttft_s=percentiles([r[3] for r in ok]),
    )
