"""specdeploy CPU-repo `tensorrt_llm`: TensorRT-LLM's tensorrt_llm model contract (input_ids ->
output_ids, perf metrics) served by specdeploy's speculative-decoding runtime (Python backend), on
the deployment's device, or on the GPU of a KIND_GPU instance.

Decoupled: each accepted group of tokens is sent as soon as the verifier accepts it (several
tokens in one response when several drafts were accepted), then a final response carrying the
perf metrics (total_draft_tokens, total_accepted_draft_tokens, acceptance_rate) and the FINAL
flag. Client errors come back as the request's Triton error; the model keeps serving.
"""

from __future__ import annotations

import json
import locale
import math
import time
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# The stub's embedded Python starts in the C locale and ignores PYTHONUTF8, so open() decodes as
# ASCII; torch._inductor (imported with the EAGLE module) then fails on a non-ASCII template.
locale.setlocale(locale.LC_CTYPE, "C.UTF-8")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class BadRequest(ValueError):
    """A client error: reported on the request, the model keeps serving."""


class Cancelled(Exception):
    """The client went away (or cancelled): stop generating for it."""


def _param(config: dict, key: str, default: str = "") -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", default)
    return default if value.startswith("${") else value


def _scalar(request, name: str, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)
    if value.size != 1:
        raise BadRequest(f"{name} must hold one value per request, got {value.size}")
    item = value[0]
    if isinstance(item, bytes):
        return item.decode("utf-8", errors="replace")
    return item.item() if hasattr(item, "item") else item


def _word_sequences(request, name: str) -> list[list[int]]:
    """Undo TRT-LLM's [1, 2, n] word-list layout (ids; exclusive end offsets padded with -1)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    data = tensor.as_numpy().reshape(-1, 2, tensor.as_numpy().shape[-1])[0]
    ids, ends = data[0].tolist(), [int(e) for e in data[1] if e >= 0]
    return [ids[start:end] for start, end in zip([0] + ends[:-1], ends) if end > start]


def _finite(value, name: str) -> float:
    if not math.isfinite(float(value)):
        raise BadRequest(f"{name} must be a finite number, got {value}")
    return float(value)


# sampling knobs the specdeploy runtime does not implement: a request that sets one to anything but its
# neutral value gets a clear error instead of silently different output
_UNSUPPORTED = {
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "len_penalty": 1.0,
    "min_tokens": 0, "beam_width": 1, "num_return_sequences": 1, "return_log_probs": False,
    "return_context_logits": False, "return_generation_logits": False, "lora_task_id": None,
    "prompt_vocab_size": None, "runtime_top_p_min": None, "runtime_top_p_decay": None,
    "draft_acceptance_threshold": None,
}


class _Sink:
    """Where responses go: the decoupled response sender, or one collected response."""

    def __init__(self, request, decoupled: bool) -> None:
        self.sender = request.get_response_sender() if decoupled else None
        self.collected = None

    def send(self, tensors: list, final: bool) -> None:
        response = pb_utils.InferenceResponse(output_tensors=tensors)
        if self.sender is None:
            self.collected = response
        else:
            self.sender.send(response, flags=FINAL if final else 0)

    def error(self, message: str) -> None:
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        if self.sender is None:
            self.collected = response
        else:
            self.sender.send(response, flags=FINAL)


def instance_device(args: dict) -> str | None:
    """A KIND_GPU instance runs on the GPU Triton placed it on; any other instance where the
    deployment's "device" says (None)."""
    if args.get("model_instance_kind") == "GPU":
        return f"cuda:{int(args['model_instance_device_id'])}"
    return None


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from specdeploy.device import describe
        from specdeploy.runtime.deployment import load_decoder

        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.exclude_input = _param(config, "exclude_input_in_output", "true").lower() in ("true", "1")
        folder = Path(args["model_repository"]) / args["model_version"]
        path = folder / _param(config, "specdeploy_deployment", "deployment.json")
        self.decoder = load_decoder(path, device=instance_device(args))
        self.tokenizer = self.decoder.tokenizer
        self.context = int(getattr(self.decoder.target.config, "max_position_embeddings", 0) or 1 << 30)
        import torch

        pb_utils.Logger.log_info(f"specdeploy tensorrt_llm: {path}, computing on {describe(self.decoder.device)}, "
                                 f"instance {args.get('model_instance_name')} ({args.get('model_instance_kind')}), "
                                 f"torch threads {torch.get_num_threads()}")

    # -- requests ----------------------------------------------------------------------------
    def execute(self, requests):
        sinks = []
        for request in requests:
            try:
                sink = _Sink(request, self.decoupled)
                sinks.append(sink)
                self._serve(request, sink)
            except Exception:  # even the error path failed (a closed sender...): serve the others
                pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
        return None if self.decoupled else [s.collected for s in sinks]

    def _serve(self, request, sink: _Sink) -> None:
        from specdeploy.errors import SpecDeployError

        try:
            self._generate(request, sink)
        except BadRequest as err:
            sink.error(str(err))
        except Cancelled:
            sink.error("request cancelled")
        except SpecDeployError as err:
            sink.error(str(err).replace("\n  hint:", "; hint:"))
        except Exception as err:  # the server must survive whatever one request does
            pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
            sink.error(f"internal error in the specdeploy runtime: {type(err).__name__}: {err}")

    def _prompt(self, request) -> list[int]:
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids is None:
            raise BadRequest("input_ids is required (the ensemble fills it from text_input)")
        ids = ids.as_numpy()
        if ids.ndim == 2 and ids.shape[0] != 1:
            raise BadRequest(f"send one prompt per request (batch size 1), got {ids.shape[0]}")
        ids = ids.reshape(-1)
        length = _scalar(request, "input_lengths", len(ids))
        if not 0 < length <= len(ids):
            raise BadRequest(f"input_lengths {length} does not match {len(ids)} input_ids")
        return [int(t) for t in ids[:length]]

    def _check_unsupported(self, request) -> None:
        for name, neutral in _UNSUPPORTED.items():
            value = _scalar(request, name)
            if value is not None and value != neutral:
                raise BadRequest(f"{name}={value!r} is not supported by the specdeploy runtime")
        if _word_sequences(request, "bad_words_list"):
            raise BadRequest("bad_words is not supported by the specdeploy runtime")
        guide = _scalar(request, "guided_decoding_guide_type")
        if guide is not None:
            raise BadRequest(f"guided_decoding_guide_type={guide!r} is not supported by the specdeploy runtime")

    def _params(self, request, prompt_len: int):
        from specdeploy.runtime.types import SamplingParams

        max_tokens = _scalar(request, "request_output_len")
        if max_tokens is None or max_tokens <= 0:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}")
        if prompt_len + max_tokens > self.context:
            raise BadRequest(
                f"max_tokens {max_tokens} + prompt {prompt_len} tokens exceed the model's context of "
                f"{self.context} tokens: ask for at most {max(self.context - prompt_len, 0)}"
            )
        self._check_unsupported(request)
        end_id = self._token_id(_scalar(request, "end_id"), "end_id")
        seed = _scalar(request, "seed")
        stop_ids, stop_strings = self._stops(_word_sequences(request, "stop_words_list"))
        params = SamplingParams(
            max_new_tokens=int(max_tokens),
            temperature=_finite(_scalar(request, "temperature", 0.0), "temperature"),
            top_k=int(_scalar(request, "runtime_top_k", 0)),
            top_p=_finite(_scalar(request, "runtime_top_p", 1.0), "top_p"),
            seed=None if seed is None else int(seed) & ((1 << 63) - 1),
            stop_token_ids=(() if end_id is None else (end_id,)) + stop_ids,
            stop_strings=stop_strings,
        )
        params.validate()  # SpecDeployError: a clear message for the client
        return params

    def _token_id(self, value, name: str) -> int | None:
        vocab = len(self.tokenizer)
        if value is not None and not 0 <= int(value) < vocab:
            raise BadRequest(f"{name} {value} is outside the model's vocabulary of {vocab} tokens")
        return None if value is None else int(value)

    def _stops(self, words: list[list[int]]) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Stop words as ids and strings: a single special token (<|im_end|>) stops on its id,
        since the text the runtime matches stop strings against is decoded without specials."""
        special = set(self.tokenizer.all_special_ids)
        for token in {t for word in words for t in word}:
            self._token_id(token, "a stop_words token id")
        ids = tuple(w[0] for w in words if len(w) == 1 and w[0] in special)
        strings = (self.tokenizer.decode(w, skip_special_tokens=True) for w in words if not (len(w) == 1 and w[0] in special))
        return ids, tuple(s for s in strings if s)

    def _generate(self, request, sink: _Sink) -> None:
        arrival = time.time_ns()
        prompt = self._prompt(request)
        params = self._params(request, len(prompt))
        streaming = bool(_scalar(request, "streaming", False)) and self.decoupled
        exclude = bool(_scalar(request, "exclude_input_in_output", self.exclude_input))
        stream = _Streamer(self.tokenizer, sink, request) if streaming else None
        result = self.decoder.generate_ids(prompt, params, stream.on_tokens if stream else _cancel_check(request))
        tokens = [] if streaming else (result.token_ids if exclude else prompt + result.token_ids)
        if stream:
            stream.flush()
        outputs = _token_tensors(tokens)
        if _scalar(request, "return_perf_metrics", False):
            outputs += _perf_tensors(result.metrics, arrival, stream.first_ns if stream else None)
        sink.send(outputs, final=True)

    def finalize(self) -> None:
        self.decoder = None


def _cancel_check(request):
    """A non-streaming request's per-round callback: stop once the client cancelled."""

    def check(group: list[int]) -> None:
        if request.is_cancelled():
            raise Cancelled()

    return check


class _Streamer:
    """Sends each accepted group at once; holds back tokens that end inside a UTF-8 character
    so the postprocessing model (which decodes each response without the next one's bytes)
    never emits a broken one."""

    def __init__(self, tokenizer, sink: _Sink, request) -> None:
        self.tokenizer = tokenizer
        self.sink = sink
        self.request = request
        self.pending: list[int] = []
        self.first_ns: int | None = None

    def on_tokens(self, group: list[int]) -> None:
        if self.request.is_cancelled():  # a closed stream: no one reads the rest
            raise Cancelled()
        self.pending += group
        if self.tokenizer.decode(self.pending).endswith("\ufffd"):
            return
        self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.first_ns = self.first_ns or time.time_ns()
        self.sink.send(_token_tensors(self.pending), final=False)
        self.pending = []


def _token_tensors(tokens: list[int]) -> list:
    ids = np.array(tokens, dtype=np.int32).reshape(1, 1, len(tokens))
    return [
        pb_utils.Tensor("output_ids", ids),
        pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], dtype=np.int32)),
    ]


def _perf_tensors(metrics, arrival_ns: int, first_ns: int | None) -> list:
    now = time.time_ns()
    first = first_ns or arrival_ns + int(metrics.time_to_first_token_s * 1e9)

    def one(name: str, value, dtype) -> object:
        return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))

    return [
        one("total_draft_tokens", metrics.draft_tokens, np.int32),
        one("total_accepted_draft_tokens", metrics.accepted_draft_tokens, np.int32),
        one("acceptance_rate", metrics.acceptance_rate, np.float32),
        one("arrival_time_ns", arrival_ns, np.int64),
        one("first_scheduled_time_ns", arrival_ns, np.int64),
        one("first_token_time_ns", first, np.int64),
        one("last_token_time_ns", now, np.int64),
    ]
