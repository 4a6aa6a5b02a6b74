"""Served speed: tokens/s and time to first token through Triton's gRPC stream (the same
TritonLLMClient users call), beside the same runtime in-process, for `make bench`'s served rows."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

from specdeploy.client import Request, TritonLLMClient


def _summary(tokens: list[int], seconds: list[float], ttfts: list[float]) -> dict[str, float]:
    return {
        "requests": len(tokens),
        "new_tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / sum(seconds) if sum(seconds) > 0 else 0.0,
        "ttft_median_s": statistics.median(ttfts) if ttfts else 0.0,
        "latency_median_s": statistics.median(seconds) if seconds else 0.0,
    }


def served_speed(grpc_url: str, prompts: list[str], max_tokens: int, *,
                 count_tokens: Callable[[str, str], int]) -> dict[str, float]:
    """Tokens/s and median time to first streamed token through the ensemble's gRPC stream.

    The ensemble returns text, not token counts: `count_tokens(prompt, text)` gives the number of
    new tokens (at greedy, the in-process run's count for the same prompt is exact)."""
    client = TritonLLMClient(grpc_url)
    tokens, seconds, ttfts = [], [], []
    for prompt in prompts:
        got = client.generate(Request(prompt, max_tokens=max_tokens), stream=True)
        tokens.append(count_tokens(prompt, got.text))
        seconds.append(got.latency_s)
        ttfts.append(got.time_to_first_chunk_s)
    client.close()
    return _summary(tokens, seconds, ttfts)


def inprocess_speed(decoder: Any, prompts: list[str], params: Any) -> dict[str, Any]:
    """The same measurement on a runtime Decoder in this process (no server); also returns the
    new-token count per prompt ("tokens_by_prompt"), exact counts for served_speed at greedy."""
    tokens, seconds, ttfts = [], [], []
    for prompt in prompts:
        first: list[float] = []
        start = time.perf_counter()
        _, result = decoder.generate(prompt, params, on_text=lambda _: first or first.append(time.perf_counter()))
        seconds.append(time.perf_counter() - start)
        tokens.append(result.metrics.new_tokens)
        ttfts.append((first[0] if first else time.perf_counter()) - start)
    return {**_summary(tokens, seconds, ttfts), "tokens_by_prompt": dict(zip(prompts, tokens))}


def compare_served_inprocess(repo: str | Path, prompts: list[str], max_tokens: int, *,
                             threads: int = 1, server: Any = None) -> dict[str, Any]:
    """Served (gRPC streaming through the ensemble) vs the same deployment in this process, at
    greedy: same prompts, same token counts, same torch thread count on both sides (on a busy
    2-core machine two OpenMP threads can be 10x slower than one for small models). Starts a
    TritonServer on `repo` unless given one."""
    import torch

    from specdeploy.runtime.deployment import load_decoder
    from specdeploy.runtime.types import SamplingParams
    from specdeploy.triton.serve import TritonServer

    repo = Path(repo)
    torch.set_num_threads(threads)
    decoder = load_decoder(repo / "tensorrt_llm" / "1" / "deployment.json")
    params = SamplingParams(max_new_tokens=max_tokens)
    decoder.generate(prompts[0], SamplingParams(max_new_tokens=4))  # warm-up: first-call allocations
    local = inprocess_speed(decoder, prompts, params)
    counts = local.pop("tokens_by_prompt")
    owned = server is None
    server = TritonServer(repo, threads=threads).start() if owned else server
    try:
        TritonLLMClient(server.grpc_url).generate(Request(prompts[0], max_tokens=4), stream=True)  # warm-up
        served = served_speed(server.grpc_url, prompts, max_tokens, count_tokens=lambda p, _: counts[p])
    finally:
        if owned:
            server.stop()
    ratio = served["tokens_per_s"] / local["tokens_per_s"] if local["tokens_per_s"] else 0.0
    return {"served": served, "inprocess": local, "served_over_inprocess": ratio, "threads": threads}
