"""`specdeploy client`: talk to the served model with tritonclient, as TRT-LLM's ensemble expects.

The same code drives a GPU deployment (TensorRT-LLM backend) and the CPU one (Python backend):
inputs are built from the model's own config as the server reports it, so names, dtypes and
shapes always match what is deployed.

    client = TritonLLMClient("127.0.0.1:8001", protocol="grpc")
    completion = client.generate(Request("Hello"), stream=True, on_text=print)
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from specdeploy.errors import SpecDeployError

DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "127.0.0.1:8000"}
# TensorRT-LLM's speculative-decoding perf outputs, then the two the CPU repository adds (emitted tokens and
# target forwards after the prefill: what the acceptance length is counted on)
PERF_OUTPUTS = ("total_accepted_draft_tokens", "total_draft_tokens", "acceptance_rate", "total_generated_tokens",
                "total_target_forwards")
# What the server does when an HTTP client gives up (tritonserver 2.51, measured): a generate_stream
# request to tensorrt_llm or tensorrt_llm_bls is cancelled (within a round); a non-streaming generate
# request is not, nor is either through the ensemble (Triton does not pass a cancellation on to the step
# already running)
HTTP_CANCEL_HINT = ("the server may still finish the request: over HTTP, Triton cancels on a disconnect only "
                    "generate_stream requests, and through the ensemble not even those (use --model "
                    "tensorrt_llm_bls); raise --timeout")


@dataclass
class Request:
    """One generation request, in the ensemble's own input names."""

    text_input: str
    max_tokens: int = 64
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    random_seed: int | None = None
    end_id: int | None = None
    pad_id: int | None = None
    min_tokens: int | None = None  # TensorRT-LLM's: no end token until the answer has this many tokens
    stop_words: list[str] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    return_perf_metrics: bool = True

    def tensors(self, stream: bool) -> dict[str, Any]:
        """Input name -> value, leaving out what the request does not set. The answer never
        repeats the prompt, whatever the deployment's default (TensorRT-LLM's is to repeat it)."""
        values: dict[str, Any] = {
            "text_input": self.text_input, "max_tokens": self.max_tokens, "stream": stream,
            "return_perf_metrics": self.return_perf_metrics, "exclude_input_in_output": True,
        }
        for name in ("temperature", "top_k", "top_p", "end_id", "pad_id", "min_tokens"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if self.random_seed is not None:
            values["seed"] = self.random_seed
        for name in ("stop_words", "bad_words"):
            if getattr(self, name):
                values[name] = getattr(self, name)
        return values


@dataclass
class Completion:
    text: str
    chunks: list[str]
    perf: dict[str, float]
    latency_s: float
    time_to_first_chunk_s: float


class TritonLLMClient:
    """A text-in/text-out client for the deployed ensemble over gRPC or HTTP."""

    def __init__(self, url: str | None = None, protocol: str = "grpc", model: str = "ensemble", timeout_s: float = 300.0) -> None:
        if protocol not in DEFAULT_URLS:
            raise SpecDeployError(f"unknown protocol {protocol!r}", hint="use grpc or http")
        self.protocol, self.model, self.timeout_s = protocol, model, timeout_s
        self.url = url or DEFAULT_URLS[protocol]
        if protocol == "grpc":
            import tritonclient.grpc as triton
        else:
            import tritonclient.http as triton
        self._triton = triton
        self._client = triton.InferenceServerClient(self.url, **({"network_timeout": timeout_s} if protocol == "http" else {}))
        self._inputs: dict[str, tuple[Any, list[int]]] | None = None

    # -- readiness -------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Return when the model is ready, its input config read (so no request pays for that); a
        clear error says whether the server or the model is missing."""
        deadline = time.monotonic() + timeout_s
        reached = False
        while time.monotonic() < deadline:
            try:
                reached = True if self._client.is_server_live() else reached
                ready = self._client.is_model_ready(self.model)
            except Exception:  # connection refused, server starting: keep polling
                ready = False
            if ready:
                self._input_specs()
                return
            time.sleep(0.25)
        if not reached:
            raise SpecDeployError(
                f"no Triton server answers at {self.url} ({self.protocol})",
                hint="start one with `make serve` (or `specdeploy serve`), or pass the right --url/--protocol",
            )
        raise SpecDeployError(
            f"the server at {self.url} is up but model '{self.model}' is not ready",
            hint=f"models it knows: {self._model_names()}; check the server log for load errors",
        )

    def _model_names(self) -> list[str]:
        index = self._client.get_model_repository_index()
        entries = index.models if self.protocol == "grpc" else index
        return [e.name if self.protocol == "grpc" else e["name"] for e in entries]

    # -- requests --------------------------------------------------------------------------
    def generate(self, request: Request, stream: bool = False, on_text: Callable[[str], None] | None = None) -> Completion:
        """Send one request; with stream=True, `on_text` gets each chunk as it arrives."""
        self._check_ranges(request.tensors(stream))
        if self.protocol == "http":
            return self._http_generate(request, stream, on_text)
        return self._grpc_stream(request, stream, on_text)

    def _input_specs(self) -> dict[str, tuple[Any, list[int]]]:
        """name -> (numpy dtype, shape of one request) from the model's config on the server."""
        if self._inputs is None:
            config = self._client.get_model_config(self.model, **({"as_json": True} if self.protocol == "grpc" else {}))
            config = config.get("config", config)
            batched = int(config.get("max_batch_size", 0)) > 0
            self._inputs = {
                spec["name"]: (_numpy_type(spec["data_type"]), ([1] if batched else []) + [int(d) for d in spec.get("dims", [])])
                for spec in config["input"]
            }
        return self._inputs

    def _check_ranges(self, values: dict[str, Any]) -> None:
        """Refuse an integer the model's input cannot hold: gRPC would wrap it in numpy, and
        Triton's HTTP JSON parser casts it as silently (max_tokens 2**32 + 4 asks for 4 tokens)."""
        specs = self._input_specs()
        for name, value in values.items():
            if name in specs:
                _check_range(name, value if isinstance(value, list) else [value], specs[name][0])

    def _build_inputs(self, request: Request, stream: bool) -> list[Any]:
        specs = self._input_specs()
        built = []
        for name, value in request.tensors(stream).items():
            if name not in specs:
                if name in ("text_input", "max_tokens"):
                    raise SpecDeployError(f"model '{self.model}' has no input '{name}'", hint="is this a TRT-LLM style ensemble?")
                continue  # optional inputs the deployment does not declare
            dtype, shape = specs[name]
            values = value if isinstance(value, list) else [value]
            if dtype is np.object_:
                values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
            shape = [len(values) if d == -1 else d for d in shape]
            array = np.array(values, dtype=dtype).reshape(shape)
            tensor = self._triton.InferInput(name, list(array.shape), "BYTES" if dtype is np.object_ else _triton_dtype(array))
            tensor.set_data_from_numpy(array)
            built.append(tensor)
        return built

    def _grpc_stream(self, request: Request, stream: bool, on_text: Callable[[str], None] | None) -> Completion:
        responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)))
        started = time.perf_counter()
        chunks, perf, first = [], {}, 0.0
        deadline, finished = time.monotonic() + self.timeout_s, False
        try:
            self._client.async_stream_infer(self.model, self._build_inputs(request, stream), enable_empty_final_response=True)
            while True:
                result, error = responses.get(timeout=max(deadline - time.monotonic(), 0.0))
                if error is not None:
                    raise SpecDeployError(f"the server rejected the request: {error.message()}", hint="see the message above")
                text = _text_of(result)
                if text:
                    first = first or time.perf_counter() - started
                    chunks.append(text)
                    if on_text:
                        on_text(text)
                perf.update(_perf_of(result))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    finished = True
                    break
        except queue.Empty as err:
            raise SpecDeployError(f"no complete answer within {self.timeout_s:g} s (request cancelled)",
                                  hint="raise --timeout or check the server log") from err
        finally:
            # a timeout, an error or Ctrl-C cancels the request on the server: without it, closing
            # the stream waits for the whole generation
            self._client.stop_stream(cancel_requests=not finished)
        return _completion(chunks, perf, time.perf_counter() - started, first)

    def _http_generate(self, request: Request, stream: bool, on_text: Callable[[str], None] | None) -> Completion:
        """Triton's generate extension: JSON in; one JSON answer (generate) or server-sent events
        (generate_stream). KServe infer is no option: Triton refuses it for the ensemble, whose
        tensorrt_llm step is decoupled. The whole answer must come within timeout_s; leaving the
        `with` (timeout, error, Ctrl-C) closes the connection (what the server does then:
        HTTP_CANCEL_HINT)."""
        import requests

        started = time.perf_counter()
        url = f"http://{self.url}/v2/models/{self.model}/generate{'_stream' if stream else ''}"
        try:
            with requests.post(url, json=request.tensors(stream), stream=True, timeout=self.timeout_s) as response:
                if response.status_code != 200:
                    raise SpecDeployError(f"the server rejected the request: {_http_error(response)}",
                                          hint="see the message above")
                if stream:
                    chunks, perf, first = self._read_events(response, started, on_text)
                else:
                    answer = response.json()
                    chunks, perf, first = [answer.get("text_output", "")], _perf_in(answer), time.perf_counter() - started
        except (requests.exceptions.Timeout, requests.exceptions.ConnectionError) as err:
            raise SpecDeployError(f"no complete answer within {self.timeout_s:g} s (connection closed): {err}",
                                  hint=HTTP_CANCEL_HINT) from err
        return _completion(chunks, perf, time.perf_counter() - started, first)

    def _read_events(self, response: Any, started: float,
                     on_text: Callable[[str], None] | None) -> tuple[list[str], dict[str, float], float]:
        """The SSE events of one generate_stream answer: text chunks, perf outputs, time to the first chunk."""
        chunks, perf, first = [], {}, 0.0
        for line in response.iter_lines(decode_unicode=True):
            if time.perf_counter() - started > self.timeout_s:
                raise SpecDeployError(f"no complete answer within {self.timeout_s:g} s (connection closed)",
                                      hint=HTTP_CANCEL_HINT)
            if not line or not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:"):])
            if "error" in event:
                raise SpecDeployError(f"the server rejected the request: {event['error']}", hint="see the message above")
            text = event.get("text_output", "")
            if text:
                first = first or time.perf_counter() - started
                chunks.append(text)
                if on_text:
                    on_text(text)
            perf.update(_perf_in(event))
        return chunks, perf, first

    def close(self) -> None:
        self._client.close()


def _http_error(response: Any) -> str:
    """The server's error message: a JSON body, or (generate_stream) one server-sent event holding it."""
    body = response.text.strip()
    try:
        return json.loads(body.removeprefix("data:"))["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {body[:300]}"


def _completion(chunks: list[str], perf: dict[str, float], latency_s: float, first_s: float) -> Completion:
    """An answer without text (one empty final response) had its first response at its end."""
    return Completion("".join(chunks), chunks, perf, latency_s, first_s or latency_s)


def _perf_in(answer: dict[str, Any]) -> dict[str, float]:
    return {k: float(_scalar(answer[k])) for k in PERF_OUTPUTS if k in answer}


def _numpy_type(config_type: str) -> Any:
    """The numpy type of a model config's data_type (TYPE_INT32, TYPE_STRING, TYPE_UINT8, ...)."""
    from tritonclient.utils import triton_to_np_dtype

    name = config_type.removeprefix("TYPE_")
    return np.object_ if name == "STRING" else triton_to_np_dtype(name)


def _check_range(name: str, values: list[Any], dtype: Any) -> None:
    """numpy wraps an out-of-range integer silently (2**31 becomes -2**31 in int32): refuse it instead."""
    if not np.issubdtype(dtype, np.integer):
        return
    limits = np.iinfo(dtype)
    for value in values:
        if isinstance(value, (int, np.integer)) and not limits.min <= value <= limits.max:
            raise SpecDeployError(f"{name}={value} does not fit the model's {np.dtype(dtype).name} input",
                                  hint=f"use a value from {limits.min} to {limits.max}")


def _triton_dtype(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(array.dtype)


def _scalar(value: Any) -> Any:
    while isinstance(value, list):
        value = value[0]
    return value


def _text_of(result: Any) -> str:
    output = result.as_numpy("text_output")
    if output is None or output.size == 0:
        return ""
    return b"".join(v if isinstance(v, bytes) else str(v).encode() for v in output.reshape(-1)).decode("utf-8", errors="replace")


def _perf_of(result: Any) -> dict[str, float]:
    found = {}
    for name in PERF_OUTPUTS:
        try:
            value = result.as_numpy(name)
        except Exception:  # the output was not requested or not declared
            value = None
        if value is not None and value.size:
            found[name] = float(value.reshape(-1)[0])
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="text to send (text_input)")
    parser.add_argument("--url", help="server address (default 127.0.0.1:8001 for grpc, :8000 for http)")
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    parser.add_argument("--model", default="ensemble",
                        help="model to call (default: ensemble; tensorrt_llm_bls, same inputs, is cancelled on timeout or Ctrl-C)")
    parser.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float,
                        help="sampling temperature; as in TensorRT-LLM it samples only with --top-k > 1 or --top-p > 0 "
                             "(otherwise greedy)")
    parser.add_argument("--top-k", type=int, help="top-k sampling (0: unset, 1: greedy)")
    parser.add_argument("--top-p", type=float, help="top-p sampling (0 or less: unset)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--min-tokens", type=int,
                        help="no end token until the answer has this many tokens (TensorRT-LLM's min_tokens; with "
                             "--max-tokens the same: answers of exactly that length, as benchmarks send)")
    parser.add_argument("--stop-word", action="append", default=[], help="repeatable")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the whole answer; then the request is cancelled")


def main(args: argparse.Namespace) -> int:
    client = TritonLLMClient(args.url, args.protocol, args.model, timeout_s=args.timeout)
    client.wait_ready(timeout_s=10)
    request = Request(
        args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, random_seed=args.seed, min_tokens=args.min_tokens, stop_words=args.stop_word,
    )
    printer = (lambda text: print(text, end="", flush=True)) if args.stream else None
    completion = client.generate(request, stream=args.stream, on_text=printer)
    print("" if args.stream else completion.text)
    metrics = {"latency_s": round(completion.latency_s, 4), "time_to_first_chunk_s": round(completion.time_to_first_chunk_s, 4),
               "chunks": len(completion.chunks), **completion.perf}
    print(json.dumps(metrics), file=sys.stderr)
    return 0
