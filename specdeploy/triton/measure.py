"""Served speed: tokens/s and time to first token through Triton's gRPC stream, beside the same
runtime in-process, for `make bench`'s served rows.

The final response of a streamed request carries only the perf metrics (draft and accepted
counts); the text pieces arrive before it, one per accepted group.
"""

from __future__ import annotations

import queue
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

_NP_TO_TRITON = {np.int32: "INT32", np.int64: "INT64", np.uint64: "UINT64", np.float32: "FP32", np.bool_: "BOOL"}


@dataclass
class StreamedGeneration:
    """One request's streamed responses: text pieces, their arrival times, the final outputs."""

    pieces: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # seconds since the request was sent
    final: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def time_to_first_token_s(self) -> float:
        first = [t for t, p in zip(self.arrivals, self.pieces) if p]
        return first[0] if first else self.elapsed_s


def grpc_inputs(prompt: str, max_tokens: int | np.ndarray, **extra: Any) -> list:
    """tritonclient gRPC inputs for the ensemble: text_input, max_tokens and any optional input
    given as a Python scalar (its numpy dtype decides the Triton dtype) or a numpy array (which
    may also replace text_input / max_tokens, e.g. to send a wrong dtype on purpose)."""
    import tritonclient.grpc as grpcclient

    arrays = {
        "text_input": np.array([[prompt.encode("utf-8")]], dtype=object),
        "max_tokens": max_tokens if isinstance(max_tokens, np.ndarray) else np.array([[max_tokens]], dtype=np.int32),
    }
    for name, value in extra.items():
        arrays[name] = value if isinstance(value, np.ndarray) else np.array([[value]], dtype=_default_dtype(name, value))
    inputs = []
    for name, array in arrays.items():
        dtype = "BYTES" if array.dtype == object else _NP_TO_TRITON[array.dtype.type]
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _default_dtype(name: str, value: Any) -> Any:
    if isinstance(value, bool):
        return np.bool_
    if isinstance(value, float):
        return np.float32
    if isinstance(value, (bytes, str)):
        return object
    return np.uint64 if name == "seed" else np.int32


class StreamClient:
    """One gRPC stream to a server; requests run one after another on it."""

    def __init__(self, grpc_url: str) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(grpc_url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def generate(self, prompt: str, max_tokens: int, *, model: str = "ensemble", timeout: float = 300.0,
                 **extra: Any) -> StreamedGeneration:
        """Send one request (streaming unless stream=False is given) and collect every response."""
        extra.setdefault("stream", True)
        out = StreamedGeneration()
        start = time.perf_counter()
        self.client.async_stream_infer(model, grpc_inputs(prompt, max_tokens, **extra),
                                       enable_empty_final_response=True)
        while True:
            result, error = self.responses.get(timeout=timeout)
            if error is not None:
                raise error
            if self._collect(result, out, time.perf_counter() - start):
                break
        out.elapsed_s = time.perf_counter() - start
        return out

    @staticmethod
    def _collect(result: Any, out: StreamedGeneration, at: float) -> bool:
        response = result.get_response()
        outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
        text = outputs.pop("text_output", None)
        piece = b"".join(np.asarray(text).reshape(-1)).decode("utf-8") if text is not None else ""
        final = response.parameters["triton_final_response"].bool_param
        if piece or not final:
            out.pieces.append(piece)
            out.arrivals.append(at)
        if final:
            out.final = {k: np.asarray(v).reshape(-1)[0].item() for k, v in outputs.items()}
        return final

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()

    def __enter__(self) -> "StreamClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _summary(tokens: list[int], seconds: list[float], ttfts: list[float]) -> dict[str, float]:
    return {
        "requests": len(tokens),
        "new_tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / sum(seconds) if sum(seconds) > 0 else 0.0,
        "ttft_median_s": statistics.median(ttfts) if ttfts else 0.0,
        "latency_median_s": statistics.median(seconds) if seconds else 0.0,
    }


def served_speed(grpc_url: str, prompts: list[str], max_tokens: int, *,
                 count_tokens: Callable[[str, str], int], **extra: Any) -> dict[str, float]:
    """Tokens/s and median time to first streamed token through the ensemble's gRPC stream.

    The ensemble returns text, not token counts: `count_tokens(prompt, text)` gives the number of
    new tokens (at greedy, the in-process run's count for the same prompt is exact)."""
    tokens, seconds, ttfts = [], [], []
    with StreamClient(grpc_url) as client:
        for prompt in prompts:
            got = client.generate(prompt, max_tokens, return_perf_metrics=True, **extra)
            tokens.append(count_tokens(prompt, got.text))
            seconds.append(got.elapsed_s)
            ttfts.append(got.time_to_first_token_s)
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
        with StreamClient(server.grpc_url) as client:
            client.generate(prompts[0], 4)  # warm-up
        served = served_speed(server.grpc_url, prompts, max_tokens, count_tokens=lambda p, _: counts[p])
    finally:
        if owned:
            server.stop()
    ratio = served["tokens_per_s"] / local["tokens_per_s"] if local["tokens_per_s"] else 0.0
    return {"served": served, "inprocess": local, "served_over_inprocess": ratio, "threads": threads}
