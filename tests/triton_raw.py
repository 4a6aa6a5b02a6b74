"""A raw gRPC stream client for the server tests: it sends whatever arrays it is given (a wrong
dtype, invalid UTF-8), which specdeploy.client.TritonLLMClient by design never does, and keeps
every response of a stream with its arrival time. The final response of a streamed request
carries only the perf metrics; the text pieces arrive before it, one per accepted group."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any

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
        """Send one request (streaming unless stream=False is given) and collect every response. The
        answer leaves the prompt out unless exclude_input_in_output=False is given (TensorRT-LLM's
        default, which the deployment keeps, is to repeat it)."""
        extra.setdefault("stream", True)
        extra.setdefault("exclude_input_in_output", True)
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
