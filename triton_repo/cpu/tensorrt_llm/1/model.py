"""specdeploy CPU-repo `tensorrt_llm`: TensorRT-LLM's tensorrt_llm model contract (input_ids ->
output_ids, perf metrics) served by specdeploy's speculative-decoding runtime (Python backend), on
the deployment's device, or on the GPU of a KIND_GPU instance.

In-flight batching, as TensorRT-LLM's own Python-executor model.py does it: execute() only
validates a request and queues it, then returns; one scheduler thread owns the runtime's
InflightBatcher, admits queued requests between rounds, stops cancelled ones and steps the batch
while there is work, and answers each request through its response sender, in decoupled and
non-decoupled mode alike (so a non-decoupled model batches in flight too).

Requests mean what they mean to TensorRT-LLM's C++ backend (tensorrtllm_backend's utils.cc and
the top-k kernel it feeds): top_p <= 0 and top_k 0 are "off", neither on (or top_k 1) is greedy
whatever the temperature, the seed defaults to 0, min_tokens 1, temperature 1.0, an unset
exclude_input_in_output takes the config parameter, and knobs that only act in beam search
(length penalty, early stopping, diversity rate) change nothing at beam_width 1. Anything else
the runtime does not implement is refused with a clear error, never ignored.

Streaming (decoupled only, as in TensorRT-LLM): each accepted group of tokens is sent as soon as
the verifier accepts it (several tokens in one response when several drafts were accepted), then
a final response without tokens and the FINAL flag; otherwise one response holds every token.
With return_perf_metrics every response carries TensorRT-LLM's perf outputs as of that response
(draft counts and acceptance rate from the runtime's counters, the request's arrival / scheduled /
first-token / last-token times; KV "blocks" count token positions, one per block, none reused), and
two of specdeploy's: total_generated_tokens (sent or held back) and total_target_forwards.
Client errors come back as the request's Triton error; the model keeps serving. Beyond
`specdeploy_max_queue` requests in flight a request is refused at once ("server busy").
Speculative-decoding counters go to Triton's metrics endpoint (pb_utils.MetricFamily).
"""

from __future__ import annotations

import copy
import json
import locale
import math
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# The stub's embedded Python starts in the C locale and ignores PYTHONUTF8, so open() decodes as
# ASCII; torch._inductor (imported with the EAGLE module) then fails on a non-ASCII template.
locale.setlocale(locale.LC_CTYPE, "C.UTF-8")

import torch  # noqa: E402  (after the locale fix)
from specdeploy.runtime.types import DraftTree, Proposer, SamplingParams, TargetState  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_QUEUE = 64


class BadRequest(ValueError):
    """A client error: reported on the request, the model keeps serving."""


def _param(config: dict, key: str, default: str = "") -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", default)
    return default if value.startswith("${") else value


def _positive_param(config: dict, key: str, default: int) -> int:
    value = _param(config, key, str(default))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"config.pbtxt parameter {key} must be a positive integer, got {value!r}")
    return int(value)


def _rows(request) -> int:
    """The request's batch size: TensorRT-LLM serves each row as a request of its own."""
    ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
    return 1 if ids is None else int(ids.as_numpy().shape[0])


class _Inputs:
    """The inputs of one batch row of a request (every input's first dimension is the batch)."""

    def __init__(self, request, row: int = 0) -> None:
        self.request, self.row = request, row

    def has(self, name: str) -> bool:
        return pb_utils.get_input_tensor_by_name(self.request, name) is not None

    def array(self, name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(self.request, name)
        return None if tensor is None else tensor.as_numpy()[self.row]  # Triton checked the batch sizes agree

    def scalar(self, name: str, default=None):
        array = self.array(name)
        if array is None:
            return default
        value = np.asarray(array).reshape(-1)
        if value.size != 1:
            raise BadRequest(f"{name} must hold one value per request, got {value.size}")
        item = value[0]
        if isinstance(item, bytes):
            return item.decode("utf-8", errors="replace")
        return item.item() if hasattr(item, "item") else item

    def words(self, name: str) -> list[list[int]]:
        """Undo TRT-LLM's [2, n] word-list layout (ids; exclusive end offsets padded with -1)."""
        array = self.array(name)
        if array is None:
            return []
        data = np.asarray(array).reshape(2, -1)
        ids, ends = data[0].tolist(), [int(e) for e in data[1] if e >= 0]
        return [ids[start:end] for start, end in zip([0] + ends[:-1], ends) if end > start]


def _finite(value, name: str) -> float:
    if not math.isfinite(float(value)):
        raise BadRequest(f"{name} must be a finite number, got {value}")
    return float(value)


def _error_text(err: Exception) -> str:
    """A SpecDeployError's message and hint on one line (what the client sees)."""
    return str(err).replace("\n  hint:", "; hint:")


# TensorRT-LLM features the specdeploy runtime does not implement: a request carrying one of these
# inputs is refused (its answer would silently differ from TensorRT-LLM's otherwise)
_REFUSED = {
    **dict.fromkeys(("prompt_embedding_table", "prompt_vocab_size"), "prompt tuning"),
    **dict.fromkeys(("lora_task_id", "lora_weights", "lora_config"), "LoRA"),
    **dict.fromkeys(("encoder_input_features", "encoder_output_lengths", "cross_attention_mask",
                     "skip_cross_attn_blocks"), "encoder-decoder models"),
    **dict.fromkeys(("mrope_rotary_cos_sin", "mrope_position_deltas"), "multimodal rotary embeddings"),
    "context_phase_params": "disaggregated serving",
    **dict.fromkeys(("draft_logits", "draft_acceptance_threshold"), "draft logits (send draft_input_ids alone)"),
    **dict.fromkeys(("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size"),
                    "lookahead decoding"),
    **dict.fromkeys(("retention_token_range_starts", "retention_token_range_ends", "retention_token_range_priorities",
                     "retention_token_range_durations_ms", "retention_decode_priority",
                     "retention_decode_duration_ms"), "KV cache retention"),
    **dict.fromkeys(("guided_decoding_guide_type", "guided_decoding_guide"), "guided decoding"),
}
# knobs refused unless set to a value that leaves TensorRT-LLM's output unchanged (its defaults).
# Not listed, as they change nothing at beam_width 1 in TensorRT-LLM either: len_penalty,
# early_stopping, beam_search_diversity_rate; and runtime_top_p_min / runtime_top_p_reset_ids, which
# act only with a top-p decay; decoder_input_ids / prompt_table_extra_ids (encoder-decoder, prompt tuning)
_NEUTRAL = {
    "beam_width": lambda v: v == 1, "num_return_sequences": lambda v: v == 1,
    "repetition_penalty": lambda v: v == 1.0, "presence_penalty": lambda v: v == 0.0,
    "frequency_penalty": lambda v: v == 0.0, "runtime_top_p_decay": lambda v: v == 1.0,
    "min_tokens": lambda v: 0 <= v <= 1,  # TensorRT-LLM's default 1: one token is always generated
    "return_log_probs": lambda v: not v, "return_context_logits": lambda v: not v,
    "return_generation_logits": lambda v: not v,
}
NO_END_ID = -1  # TensorRT-LLM: never stop at an end token
STREAMING_NEEDS_DECOUPLED = ("Streaming is only supported if model is deployed using decoupled mode "
                             "(this repository was packaged with --no-stream); send stream=false")
BATCH_NEEDS_DECOUPLED = ("Batch size > 1 requires the tensorrt_llm backend to be using decoupled transaction policy "
                         "(this repository was packaged with --no-stream); send one prompt per request")


class _Sink:
    """Where a request's responses go: its response sender, which outlives execute(). A
    non-decoupled model may send exactly one response (with the FINAL flag) through it. A
    batched request's rows share it: only the last row's final response carries the FINAL flag."""

    def __init__(self, request) -> None:
        self.sender = request.get_response_sender()
        self.open = 1  # rows still to give their final response
        self.lock = threading.Lock()  # rows end on the scheduler thread, refusals on execute()'s

    def expect(self, rows: int) -> None:
        self.open = rows

    def send(self, tensors: list, final: bool) -> None:
        self._send(pb_utils.InferenceResponse(output_tensors=tensors), final)

    def error(self, message: str) -> None:
        """One row's error, its final response."""
        self._send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), True)

    def refuse(self, message: str) -> None:
        """The whole request refused before any of its rows was queued: its one and final response."""
        self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)

    def _send(self, response, final: bool) -> None:
        with self.lock:
            self.open -= final
            last = final and self.open == 0
        self.sender.send(response, flags=FINAL if last else 0)

    def cancelled(self) -> bool:
        """The client went away or cancelled."""
        return self.sender.is_cancelled()


@dataclass
class _Entry:
    """One request from execute() to its final response."""

    sink: _Sink
    prompt: list[int]
    params: SamplingParams
    request_id: str
    exclude_input: bool
    perf: bool
    arrival_ns: int
    draft: list[int] | None  # draft_input_ids: the client's own draft tokens
    batch_index: int | None  # the row of a batched request (None: a request of one row)
    seq: object = None  # the batcher's Sequence once admitted
    gone: bool = False  # the client cancelled: no one reads an answer
    stream: "_Streamer | None" = None


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
        # TensorRT-LLM's backend default when the parameter is unset: the prompt is in the output
        self.exclude_input = _param(config, "exclude_input_in_output", "false").lower() in ("true", "1")
        max_batch = _positive_param(config, "specdeploy_max_batch_size", DEFAULT_MAX_BATCH_SIZE)
        max_queue = _positive_param(config, "specdeploy_max_queue", DEFAULT_MAX_QUEUE)
        folder = Path(args["model_repository"]) / args["model_version"]
        path = folder / _param(config, "specdeploy_deployment", "deployment.json")
        metrics = _Metrics({"model": args["model_name"], "version": args["model_version"]})
        device = instance_device(args)
        self.scheduler = _Scheduler(lambda: load_decoder(path, device=device), max_batch, max_queue, metrics)
        self.decoder = self.scheduler.decoder
        self.tokenizer = self.decoder.tokenizer
        self.vocab = int(self.decoder.target.config.vocab_size)
        self.context = int(getattr(self.decoder.target.config, "max_position_embeddings", 0) or 1 << 30)
        pb_utils.Logger.log_info(f"specdeploy tensorrt_llm: {path}, computing on {describe(self.decoder.device)}, "
                                 f"instance {args.get('model_instance_name')} ({args.get('model_instance_kind')}), "
                                 f"torch threads {torch.get_num_threads()}, in-flight batch {max_batch}, "
                                 f"max queue {max_queue}, {'decoupled' if self.decoupled else 'not decoupled'}")

    # -- requests ----------------------------------------------------------------------------
    def execute(self, requests):
        """Validate and queue; the scheduler thread answers through each request's sender."""
        for request in requests:
            try:
                self._accept(request, _Sink(request))
            except Exception:  # even the error path failed (a closed sender...): serve the others
                pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
        return None

    def _accept(self, request, sink: _Sink) -> None:
        from specdeploy.errors import SpecDeployError

        arrival = time.time_ns()
        try:
            if _Inputs(request).scalar("stop", False):
                self._stop(request, sink)
                return
            rows = _rows(request)
            if rows > 1 and not self.decoupled:
                raise BadRequest(BATCH_NEEDS_DECOUPLED)
            entries = [self._entry(_Inputs(request, row), sink, arrival, row if rows > 1 else None)
                       for row in range(rows)]
            sink.expect(rows)
            self.scheduler.submit(entries)
        except (BadRequest, Busy, SpecDeployError) as err:
            self.scheduler.metrics.request("rejected" if isinstance(err, Busy) else "bad_request")
            sink.refuse(_error_text(err))
        except Exception as err:  # the server must survive whatever one request does
            pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
            self.scheduler.metrics.request("error")
            sink.refuse(f"internal error in the specdeploy runtime: {type(err).__name__}: {err}")

    def _stop(self, request, sink: _Sink) -> None:
        """TRT-LLM's `stop` input: cancel the requests carrying this request's id (the C++
        backend's handleStopRequest, the Python one's handle_stop_request); they end with what
        they generated so far. The stop request itself gets an empty final response."""
        request_id = request.request_id()
        if not request_id:
            raise BadRequest("a request id must be provided for request cancellation (stop=true)")
        self.scheduler.stop(request_id)
        sink.send([], final=True)

    def _entry(self, inputs: _Inputs, sink: _Sink, arrival_ns: int, batch_index: int | None) -> _Entry:
        streaming = bool(inputs.scalar("streaming", False))
        if streaming and not self.decoupled:
            raise BadRequest(STREAMING_NEEDS_DECOUPLED)
        prompt = self._prompt(inputs)
        params = self._params(inputs, len(prompt))
        entry = _Entry(
            sink=sink, prompt=prompt, params=params, request_id=inputs.request.request_id(),
            exclude_input=bool(inputs.scalar("exclude_input_in_output", self.exclude_input)),
            perf=bool(inputs.scalar("return_perf_metrics", False)), arrival_ns=arrival_ns,
            draft=self._draft(inputs), batch_index=batch_index,
        )
        entry.stream = _Streamer(self.tokenizer, entry) if streaming else None
        return entry

    def _prompt(self, inputs: _Inputs) -> list[int]:
        ids = inputs.array("input_ids")
        if ids is None:
            raise BadRequest("input_ids is required (the ensemble fills it from text_input)")
        ids = np.asarray(ids).reshape(-1)
        length = inputs.scalar("input_lengths", len(ids))
        if not 0 < length <= len(ids):
            raise BadRequest(f"input_lengths {length} does not match {len(ids)} input_ids")
        return self._token_ids([int(t) for t in ids[:length]], "input_ids")

    def _token_ids(self, ids: list[int], name: str) -> list[int]:
        outside = [t for t in ids if not 0 <= t < self.vocab]
        if outside:
            raise BadRequest(f"{name} hold {len(outside)} token ids outside the model's vocabulary of "
                             f"{self.vocab} (e.g. {outside[0]})")
        return ids

    def _draft(self, inputs: _Inputs) -> list[int] | None:
        """TRT-LLM's draft_input_ids: tokens a client drafted (e.g. with a draft model) for the
        target to verify, as in its draft-target speculative decoding."""
        draft = inputs.array("draft_input_ids")
        if draft is None:
            return None
        return self._token_ids([int(t) for t in np.asarray(draft).reshape(-1)], "draft_input_ids")

    def _check_supported(self, inputs: _Inputs) -> None:
        for name, feature in _REFUSED.items():
            if inputs.has(name):
                raise BadRequest(f"{name}: {feature} is not supported by the specdeploy runtime")
        for name, neutral in _NEUTRAL.items():
            value = inputs.scalar(name)
            if value is not None and not neutral(value):
                shown = f"{value:.6g}" if isinstance(value, float) else repr(value)  # FP32 inputs: 1.3, not 1.2999...
                raise BadRequest(f"{name}={shown} is not supported by the specdeploy runtime")
        if inputs.words("bad_words_list"):
            raise BadRequest("bad_words is not supported by the specdeploy runtime")
        bias = inputs.array("embedding_bias")
        if bias is not None and np.any(bias):
            raise BadRequest("embedding_bias is not supported by the specdeploy runtime")

    def _params(self, inputs: _Inputs, prompt_len: int) -> SamplingParams:
        max_tokens = inputs.scalar("request_output_len")
        if max_tokens is None or max_tokens <= 0:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}")
        if prompt_len + max_tokens > self.context:
            raise BadRequest(
                f"max_tokens {max_tokens} + prompt {prompt_len} tokens exceed the model's context of "
                f"{self.context} tokens: ask for at most {max(self.context - prompt_len, 0)}"
            )
        self._check_supported(inputs)
        end_id = inputs.scalar("end_id")
        if end_id == NO_END_ID:
            raise BadRequest("end_id -1 (never stop at an end token) is not supported: the specdeploy runtime "
                             "always stops at the model's own end tokens; leave end_id out")
        end_id = self._token_id(end_id, "end_id")
        stop_ids, stop_strings = self._stops(inputs.words("stop_words_list"))
        params = SamplingParams(
            max_new_tokens=int(max_tokens),
            **_sampling(inputs),
            seed=int(inputs.scalar("seed", 0)) & ((1 << 63) - 1),  # TRT-LLM's default seed is 0
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

    def finalize(self) -> None:
        """Stop the scheduler and drop the model. Triton unloads a model only once its requests have
        their final responses (on SIGTERM it lets them run for --exit-timeout-secs, then exits without
        finalize), so normally nothing is left here; whatever is gets an error."""
        self.scheduler.close()
        self.scheduler = None
        self.decoder = None


def _sampling(inputs: _Inputs) -> dict:
    """temperature / top_k / top_p as TensorRT-LLM reads them: top_p <= 0 is unset, top_k 0 is
    unset, and with neither set (or top_k 1) it decodes greedily whatever the temperature."""
    top_k = int(inputs.scalar("runtime_top_k", 0))
    top_p = _finite(inputs.scalar("runtime_top_p", 0.0), "top_p")
    temperature = _finite(inputs.scalar("temperature", 1.0), "temperature")
    if top_k < 0:  # the checks TensorRT-LLM's SamplingConfig makes
        raise BadRequest(f"top_k must be >= 0 (0: unset), got {top_k}")
    if top_p > 1.0:
        raise BadRequest(f"top_p must be <= 1 (0 or less: unset), got {top_p:.6g}")
    if temperature < 0.0:
        raise BadRequest(f"temperature must be >= 0, got {temperature:.6g}")
    if top_k == 1 or (top_k == 0 and top_p <= 0.0):
        return {"temperature": 0.0}
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p if top_p > 0.0 else 1.0}


class _ClientDraft(Proposer):
    """The draft tokens a client sent for one request (TRT-LLM's draft_input_ids): proposed as a
    chain while the output follows them, nothing once it parts from them (plain decoding)."""

    def __init__(self, prompt_len: int, draft: list[int]) -> None:
        self.prompt_len, self.draft = prompt_len, draft

    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        emitted = state.tokens[0, self.prompt_len:].tolist()
        rest = self.draft[len(emitted):] if self.draft[:len(emitted)] == emitted else []
        return DraftTree.chain(torch.tensor(rest[:max_tokens], dtype=torch.long, device=state.tokens.device))


class Busy(Exception):
    """Back-pressure: too many requests in flight; the client should retry later."""


class _Scheduler:
    """Owns the runtime's InflightBatcher: its thread admits queued requests between rounds,
    cancels the ones whose client went away (or that a `stop` request named), steps the batch
    while there is work and answers each request as its sequence finishes.

    The thread also loads the model: all of torch's work happens on it. A thread that has run
    parallel torch ops keeps its OpenMP team alive; with two teams (the stub's main thread's and
    this one's) there are more OpenMP threads than cores, and libgomp then spins only briefly
    before sleeping (GOMP_SPINCOUNT's throttled mode), so every parallel op pays a wake-up: measured
    on 2 cores, decoding from a second thread took 1.5x as long."""

    def __init__(self, load, max_batch_size: int, max_queue: int, metrics: "_Metrics") -> None:
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.metrics = metrics
        self.cond = threading.Condition()
        self.inbox: list[_Entry] = []  # queued by execute(), not yet given to the batcher
        self.stops: list[str] = []  # request ids a `stop` request named
        self.in_flight = 0  # inbox + live: what back-pressure bounds
        self.live: list[_Entry] = []  # in the batcher (waiting or active); the scheduler thread's own
        self.running = True
        self.decoder = self.batcher = self.load_error = None
        loaded = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(load, loaded), name="specdeploy-scheduler", daemon=True)
        self.thread.start()
        loaded.wait()
        if self.load_error is not None:
            raise self.load_error

    def _run(self, load, loaded: threading.Event) -> None:
        try:
            self.decoder = load()
            self.batcher = self.decoder.batcher(max_batch_size=self.max_batch_size)
        except BaseException as err:  # initialize() re-raises it: Triton reports the model as failed
            self.load_error = err
            return
        finally:
            loaded.set()
        self._loop()

    # -- from execute() ------------------------------------------------------------------------
    def submit(self, entries: list[_Entry]) -> None:
        """A request's rows, all queued or (server busy) none."""
        with self.cond:
            if self.in_flight + len(entries) > self.max_queue:
                raise Busy(f"server busy: {self.in_flight} requests queued (max_queue {self.max_queue}); retry later")
            self.in_flight += len(entries)
            self.inbox += entries
            self.cond.notify()

    def stop(self, request_id: str) -> None:
        with self.cond:
            self.stops.append(request_id)
            self.cond.notify()

    # -- the scheduler thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.running and not (self.inbox or self.stops or self.live):
                    self.cond.wait()
                if not self.running:
                    return
                new, self.inbox = self.inbox, []
                stops, self.stops = self.stops, []
            try:
                self._round(new, set(stops))
            except Exception as err:  # a runtime bug must not take the server down: fail this batch, start afresh
                self._reset(err)

    def _round(self, new: list[_Entry], stops: set[str]) -> None:
        for entry in new:
            self._admit(entry)
        self._cancel(stops)
        if any(not e.seq.done for e in self.live):
            self._step()
        done = [e for e in self.live if e.seq.done]
        self.live = [e for e in self.live if not e.seq.done]
        with self.cond:
            queued = len(self.inbox)
        self.metrics.gauges(active=self.batcher.active, waiting=self.batcher.waiting + queued)
        for entry in done:
            self._finish(entry)

    def _admit(self, entry: _Entry) -> None:
        from specdeploy.errors import SpecDeployError
        from specdeploy.runtime.batch import BatchRequest

        try:
            on_tokens = entry.stream.on_tokens if entry.stream else None
            proposer = None if entry.draft is None else _ClientDraft(len(entry.prompt), entry.draft)
            entry.seq = self.batcher.add(BatchRequest(entry.prompt, entry.params, on_tokens, proposer))
        except SpecDeployError as err:
            self._answer(entry, "bad_request", error=_error_text(err))
            return
        except Exception as err:
            pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
            self._answer(entry, "error", error=f"internal error in the specdeploy runtime: {type(err).__name__}: {err}")
            return
        self.live.append(entry)

    def _cancel(self, stops: set[str]) -> None:
        """Between rounds: a cancelled request leaves the batch at the next step (its KV cache freed),
        whether it is running or still waiting."""
        for entry in self.live:
            if entry.seq.done:
                continue
            named = bool(entry.request_id) and entry.request_id in stops  # ends like a finished one
            entry.gone = not named and _client_gone(entry)
            if named or entry.gone:
                self.batcher.cancel(entry.seq)

    def _step(self) -> None:
        before = copy.deepcopy(self.batcher.stats)  # cumulative: the metrics take this round's share
        self.batcher.step()
        self.metrics.round(before, self.batcher.stats)

    def _reset(self, err: Exception) -> None:
        """The batch failed as a whole: every request in it gets the error, a fresh batcher goes on."""
        pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
        for entry in self.live:
            self._answer(entry, "error", error=f"internal error in the specdeploy runtime: {type(err).__name__}: {err}")
        self.live = []
        self.batcher = self.decoder.batcher(max_batch_size=self.max_batch_size)

    def _finish(self, entry: _Entry) -> None:
        try:
            outcome, outputs, error = self._outcome(entry)
        except Exception as err:  # e.g. the last streamed group could not be sent
            pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
            outcome, outputs, error = "error", None, f"internal error in the specdeploy runtime: {type(err).__name__}: {err}"
        self._answer(entry, outcome, outputs=outputs, error=error)

    def _outcome(self, entry: _Entry) -> tuple[str, list | None, str | None]:
        """(outcome for the metrics, final outputs, or the error message)."""
        from specdeploy.errors import SpecDeployError

        seq = entry.seq
        if entry.gone or (seq.error is not None and _client_gone(entry)):  # e.g. a send to a closed stream failed
            return "cancelled", None, "request cancelled"
        if isinstance(seq.error, SpecDeployError):
            return "error", None, _error_text(seq.error)
        if seq.error is not None:
            pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: a request failed: {seq.error!r}")
            return "error", None, f"internal error in the specdeploy runtime: {type(seq.error).__name__}: {seq.error}"
        # finished, or stopped by a `stop` request: the tokens so far (finish reason "cancelled")
        return seq.result.finish_reason, self._final_outputs(entry), None

    def _final_outputs(self, entry: _Entry) -> list:
        """Streaming: the tokens still held back, then an empty final response; else every token
        (after the prompt unless exclude_input_in_output)."""
        result = entry.seq.result
        if entry.stream:
            entry.stream.flush()
            return _outputs(entry, [], len(result.token_ids))
        tokens = result.token_ids if entry.exclude_input else entry.prompt + result.token_ids
        return _outputs(entry, tokens, len(result.token_ids))

    def _answer(self, entry: _Entry, outcome: str, *, outputs: list | None = None, error: str | None = None) -> None:
        """The request's last response. Counted (metrics, queue bound) first: a client that has its
        answer sees them up to date."""
        with self.cond:
            self.in_flight -= 1
        result = entry.seq.result if entry.seq is not None else None
        self.metrics.request(outcome, result.metrics.target_forwards if result else 0)
        try:
            if error is not None:
                entry.sink.error(error)
            else:
                entry.sink.send(outputs, final=True)
        except Exception:  # a closed sender: the client is gone, the others are still served
            pb_utils.Logger.log_warn(f"specdeploy tensorrt_llm: could not answer a request: {traceback.format_exc()}")

    # -- shutdown ------------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after its round; what is still queued or in the batch gets an error."""
        with self.cond:
            self.running = False
            self.cond.notify()
        self.thread.join(timeout_s)
        with self.cond:
            left, self.inbox = self.inbox, []
        if not self.thread.is_alive():  # else the thread still owns self.live
            left += self.live
            self.live = []
        for entry in left:
            self._answer(entry, "error", error="the model is being unloaded (server shutting down); retry later")
        self.metrics.close()


def _client_gone(entry: _Entry) -> bool:
    try:
        return entry.sink.cancelled()
    except Exception:  # not knowing is no reason to drop a request
        pb_utils.Logger.log_warn(f"specdeploy tensorrt_llm: is_cancelled failed: {traceback.format_exc()}")
        return False


class _Metrics:
    """Triton custom metrics (served on tritonserver's metrics port beside its own nv_* ones):
    speculative-decoding counters, requests by outcome, the batch's occupancy. Used from the
    execute() and scheduler threads."""

    def __init__(self, labels: dict[str, str]) -> None:
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self.labels = labels
        self.lock = threading.Lock()
        self.families = {name: pb_utils.MetricFamily(name=name, description=text, kind=kind) for name, text, kind in (
            ("specdeploy_draft_tokens_total", "draft tokens sent to verification", counter),
            ("specdeploy_accepted_draft_tokens_total", "draft tokens the target accepted", counter),
            ("specdeploy_target_forwards_total", "batched target forwards (rounds of the in-flight batch)", counter),
            ("specdeploy_sequence_forwards_total", "target forwards summed over requests, added as each ends "
             "(/ target_forwards_total = the mean batch size)", counter),
            ("specdeploy_drafted_at_position_total", "draft tokens verified at each draft position (1 = first)", counter),
            ("specdeploy_accepted_at_position_total", "draft tokens accepted at each draft position (1 = first)", counter),
            ("specdeploy_requests_total", "requests answered, by outcome (stop, length, cancelled, error, "
                                          "bad_request, rejected = server busy)", counter),
            ("specdeploy_requests_in_flight", "requests in the batch (active) or queued for it (waiting)", gauge),
        )}
        self.metrics: dict[tuple, object] = {}
        self.shown: dict[str, int] = {}  # gauge values last set: set only on change (each set is an IPC)

    def _metric(self, family: str, **labels: str):
        key = (family, *sorted(labels.items()))
        with self.lock:
            if key not in self.metrics:
                self.metrics[key] = self.families[family].Metric(labels={**self.labels, **labels})
            return self.metrics[key]

    def request(self, outcome: str, forwards: int = 0) -> None:
        """A request answered; `forwards`: the batched target forwards it took part in."""
        self._metric("specdeploy_requests_total", outcome=outcome).increment(1)
        self._add("specdeploy_sequence_forwards_total", forwards)

    def gauges(self, **states: int) -> None:
        for state, value in states.items():
            if self.shown.get(state) != value:
                self._metric("specdeploy_requests_in_flight", state=state).set(value)
                self.shown[state] = value

    def round(self, before, after) -> None:
        """One step(): the batcher's cumulative BatchStats before and after it."""
        for family, name in (("specdeploy_draft_tokens_total", "draft_tokens"),
                             ("specdeploy_accepted_draft_tokens_total", "accepted_draft_tokens"),
                             ("specdeploy_target_forwards_total", "rounds")):
            self._add(family, getattr(after, name) - getattr(before, name))
        for family, name in (("specdeploy_drafted_at_position_total", "drafted_at_position"),
                             ("specdeploy_accepted_at_position_total", "accepted_at_position")):
            old = getattr(before, name)
            for position, count in enumerate(getattr(after, name)):
                self._add(family, count - (old[position] if position < len(old) else 0), position=str(position + 1))

    def _add(self, family: str, amount: int, **labels: str) -> None:
        if amount:
            self._metric(family, **labels).increment(amount)

    def close(self) -> None:
        """Metrics before their families (the backend's rule)."""
        with self.lock:
            self.metrics.clear()
            self.families.clear()


class _Streamer:
    """Sends each accepted group at once; holds back tokens that end inside a UTF-8 character
    so the postprocessing model (which decodes each response without the next one's bytes)
    never emits a broken one."""

    def __init__(self, tokenizer, entry: _Entry) -> None:
        self.tokenizer = tokenizer
        self.entry = entry
        self.pending: list[int] = []
        self.generated = 0  # tokens accepted so far, sent or held back

    def on_tokens(self, group: list[int]) -> None:
        self.pending += group
        self.generated += len(group)
        if self.tokenizer.decode(self.pending).endswith("\ufffd"):
            return
        self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.entry.sink.send(_outputs(self.entry, self.pending, self.generated), final=False)
        self.pending = []


def _outputs(entry: _Entry, tokens: list[int], generated: int) -> list:
    """One response's tensors, in TRT-LLM's shapes: output_ids [1, beam 1, n], sequence_length
    [1, 1], batch_index [1, 1] for a row of a batched request, the perf outputs [1, 1] each (when
    asked for) as of `generated` new tokens."""
    ids = np.array(tokens, dtype=np.int32).reshape(1, 1, len(tokens))
    outputs = [
        pb_utils.Tensor("output_ids", ids),
        pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], dtype=np.int32)),
    ]
    if entry.batch_index is not None:
        outputs.append(pb_utils.Tensor("batch_index", np.array([[entry.batch_index]], dtype=np.int32)))
    return outputs + (_perf_tensors(entry, generated) if entry.perf else [])


def _perf_tensors(entry: _Entry, generated: int) -> list:
    """TRT-LLM's perf outputs from the runtime's own counters. The times are the request's own:
    arrival when execute() got it, scheduled when the batcher admitted it (the difference is its
    queue time). The runtime's KV cache is not paged: its positions count as blocks of one token,
    all newly allocated (no prefix reuse)."""
    seq = entry.seq
    metrics = seq.result.metrics if seq.result is not None else seq.metrics
    scheduled = seq.first_scheduled_ns or entry.arrival_ns
    first = seq.first_token_ns or scheduled
    last = seq.last_token_ns or first
    positions = len(entry.prompt) + generated

    def one(name: str, value, dtype) -> object:
        return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))

    return [
        one("kv_cache_alloc_new_blocks", positions, np.int32),
        one("kv_cache_reused_blocks", 0, np.int32),
        one("kv_cache_alloc_total_blocks", positions, np.int32),
        one("arrival_time_ns", entry.arrival_ns, np.int64),
        one("first_scheduled_time_ns", scheduled, np.int64),
        one("first_token_time_ns", first, np.int64),
        one("last_token_time_ns", last, np.int64),
        one("acceptance_rate", metrics.acceptance_rate, np.float32),
        one("total_accepted_draft_tokens", metrics.accepted_draft_tokens, np.int32),
        one("total_draft_tokens", metrics.draft_tokens, np.int32),
        # specdeploy's own, beside NVIDIA's: what the acceptance length is counted on (emitted tokens
        # and the target forwards after the prefill), so no client has to re-tokenize the text for it
        one("total_generated_tokens", generated, np.int32),
        one("total_target_forwards", metrics.target_forwards, np.int32),
    ]
