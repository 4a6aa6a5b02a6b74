"""Sending the load: a sweep's plan (prompts, lengths, requests per level, arrivals), one worker
thread per client taking requests in order (closed loop, or Poisson arrivals for the open loop),
each request timed as the client saw it, and the sweep over levels and passes with the arms'
order alternating (ABBA)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from specdeploy.client import Request, TritonLLMClient
from specdeploy.runtime.load_plan import answer_lengths

# the default requests per arm, level and pass (Sweep.requests_at). 6 per client: a pass at concurrency 8
# runs ~15 s on 2 cores; with 3 per client (~8 s), two copies of the AR twin differed by 0.89-1.11x in
# single passes, with 6 by 0.98-1.04x (docs/measurements.md, 2026-11-29)
MIN_REQUESTS, REQUESTS_PER_CLIENT = 8, 6


def arrival_times(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """When each request may be sent (s after the level starts): all at once (rate None), or a
    Poisson process of `rate` requests/s. Seeded: both arms see the same arrivals."""
    if rate is None:
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


@dataclass
class Timed:
    """One request as the client saw it; tokens are counted after the level, off the clock."""

    prompt: int
    start_s: float  # after its pass of the level started
    latency_s: float = 0.0
    # each streamed chunk's arrival after the send, as the client's on_text sees it (a busy client
    # thread can see a few chunks at once: at a few ms per token the gaps bunch up)
    chunk_s: list[float] = field(default_factory=list)
    chunks: list[str] = field(default_factory=list)
    perf: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    cold: bool = False  # one of the pass's first `concurrency` requests (DEFINITIONS["ttft_steady_s"])


def send(client: TritonLLMClient, prompt: int, text: str, max_tokens: int, level_start: float, fixed: bool) -> Timed:
    """One request, timed; `fixed`: with min_tokens = max_tokens, an answer of exactly that length."""
    timed = Timed(prompt, time.perf_counter() - level_start)
    sent = time.perf_counter()
    stamp = lambda _: timed.chunk_s.append(time.perf_counter() - sent)  # noqa: E731
    request = Request(text, max_tokens=max_tokens, min_tokens=max_tokens if fixed else None)
    try:
        done = client.generate(request, stream=True, on_text=stamp)
    except Exception as err:  # any failure is this request's counted error; the level goes on
        timed.error = f"{type(err).__name__}: {err}"
        return timed
    timed.latency_s, timed.chunks, timed.perf = time.perf_counter() - sent, done.chunks, done.perf
    return timed


def run_level(clients: list[TritonLLMClient], prompts: list[str], order: list[int], lengths: list[int],
              arrivals: list[float], fixed: bool) -> tuple[list[Timed], float]:
    """One worker per client (the concurrency) takes the requests in order, each no earlier than
    its arrival time (`fixed`: as `send`). Returns the requests and the level's wall time."""
    jobs: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(order)):
        jobs.put(i)
    done: list[Timed] = [Timed(order[i], 0.0, error="not sent") for i in range(len(order))]
    started = time.perf_counter()

    def worker(client: TritonLLMClient) -> None:
        while True:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            time.sleep(max(started + arrivals[i] - time.perf_counter(), 0.0))
            done[i] = send(client, order[i], prompts[order[i]], lengths[order[i]], started, fixed)

    threads = [threading.Thread(target=worker, args=(client,), daemon=True) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for timed in done[: len(clients)]:
        timed.cold = True
    return done, time.perf_counter() - started


Results = dict[str, dict[int, tuple[list[Timed], list[float]]]]  # arm -> concurrency -> (requests, wall s per pass)


@dataclass
class Sweep:
    """What the sweep sends: prompts, how many requests per level, their arrivals."""

    prompts: list[str]
    levels: list[int]
    requests: int | None  # per arm, level and pass; None: requests_at's default
    max_tokens: int  # the mean of the prompts' lengths
    rate: float | None = None
    seed: int = 0
    passes: int = 1
    spread: float = 0.0
    # every answer exactly its length (min_tokens = max_tokens), as trtllm-bench (--eos_id -1) and GenAI-Perf's
    # TensorRT-LLM runs (min_tokens) send: an answer that ends at EOS in one pass and runs on in another (a
    # near-tie in bf16, decided by the batch's shape) would hand the two arms unequal work
    fixed: bool = True

    @property
    def lengths(self) -> list[int]:
        """Each prompt's max tokens (load_plan.answer_lengths: spread about max_tokens, seeded)."""
        return answer_lengths(len(self.prompts), self.max_tokens, self.spread, self.seed)

    def requests_at(self, level: int) -> int:
        """The asked number, or MIN_REQUESTS and at least REQUESTS_PER_CLIENT per client: a pass
        then measures beyond its cold start (each client's first request)."""
        return self.requests or max(MIN_REQUESTS, REQUESTS_PER_CLIENT * level)

    def order(self, level: int) -> list[int]:
        return [i % len(self.prompts) for i in range(self.requests_at(level))]

    def needs_solo_pass(self) -> bool:
        """Every prompt's solo output is what the others are compared with: concurrency 1 gives
        them only when the sweep has it first and sends every prompt there."""
        return self.levels[0] != 1 or len(set(self.order(1))) < len(self.prompts)


def sweep(urls: dict[str, str], plan: Sweep, say: Callable[[str], None] = print, solo: bool = True,
          reference: str | None = None) -> Results:
    """Every level for every arm in `plan.passes` passes, the arms' order reversing from pass to
    pass and level to level (two arms: ABBA); a level's passes pool (requests joined in pass order,
    a wall time per pass). With `solo`, the reference arm (default: the last) has a solo pass of
    every prompt first (key 0) when the sweep has no concurrency 1 or its requests there leave a
    prompt out."""
    clients = {arm: [TritonLLMClient(url) for _ in range(plan.levels[-1])] for arm, url in urls.items()}
    results: Results = {arm: {} for arm in urls}
    try:
        for pool in clients.values():  # warm-up: first requests pay one-off costs
            for client in pool:
                client.wait_ready()  # each client reads the model's config now, not inside its first timed request
            pool[0].generate(Request(plan.prompts[0], max_tokens=4), stream=True)
        reference = reference or list(urls)[-1]
        if solo and plan.needs_solo_pass():
            alone = list(range(len(plan.prompts)))
            timed, wall = run_level(clients[reference][:1], plan.prompts, alone, plan.lengths, [0.0] * len(alone), plan.fixed)
            results[reference][0] = (timed, [wall])
        for n, level in enumerate(plan.levels):
            for p in range(plan.passes):
                for arm in list(urls)[:: 1 if (n + p) % 2 == 0 else -1]:
                    order = plan.order(level)
                    timed, wall = run_level(clients[arm][:level], plan.prompts, order, plan.lengths,
                                            arrival_times(len(order), plan.rate, plan.seed), plan.fixed)
                    before, walls = results[arm].get(level, ([], []))
                    results[arm][level] = (before + timed, walls + [wall])
                    say(f"concurrency {level}, pass {p + 1}/{plan.passes}: {arm} done in {wall:.1f} s")
    finally:
        for pool in clients.values():
            for client in pool:
                client.close()
    return results
