"""`make loadtest`: N concurrent streaming clients x M requests against a live server.

Every output must equal the same request sent alone (greedy): concurrency may change speed,
never text. Reports errors, mismatches and latency / time-to-first-token percentiles.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from specdeploy.client import Request, TritonLLMClient
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json
from specdeploy.manifest import add_build_args, build_from_args


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    parser.add_argument("--url", help="use a running server (gRPC host:port) instead of starting one")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=10, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts (ShareGPT held-out)")


def main(args: argparse.Namespace) -> int:
    from specdeploy.data import sharegpt_prompts
    from specdeploy.triton.serve import TritonServer

    build = build_from_args(args)
    repo = build.path("triton_repo") / "cpu"
    if args.url is None and build.record("package") is None:
        raise SpecDeployError(f"no packaged repository in {build.root}", hint="run `make engine` first, or pass --url")
    prompts = sharegpt_prompts(args.prompts, split="heldout", max_chars=600)
    settings = {k: getattr(args, k) for k in ("clients", "requests", "max_tokens", "prompts")}
    with build.stage("loadtest", "loadtest", settings) as tmp, ExitStack() as stack:
        url = args.url or stack.enter_context(TritonServer(repo, log_path=tmp / "tritonserver.log")).grpc_url
        result = run_load(url, prompts, clients=args.clients, requests_per_client=args.requests, max_tokens=args.max_tokens)
        atomic_write_json(tmp / "loadtest.json", result.as_dict())
    table = Table(title=f"load test: {args.clients} clients x {args.requests} requests, {args.max_tokens} tokens")
    for column in ("requests", "errors", "mismatches", "wall s", "latency p50/p90/p99 s", "ttft p50/p90/p99 s"):
        table.add_column(column)
    fmt = lambda d: "/".join(f"{d.get(k, 0):.3f}" for k in ("p50", "p90", "p99"))  # noqa: E731
    table.add_row(str(result.requests), str(len(result.errors)), str(result.mismatches), f"{result.wall_s:.1f}",
                  fmt(result.latency_s), fmt(result.ttft_s))
    Console().print(table)
    print(f"report: {build.path('loadtest')}/loadtest.json")
    return 1 if result.errors or result.mismatches else 0
