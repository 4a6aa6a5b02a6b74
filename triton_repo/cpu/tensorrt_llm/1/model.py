"""specdeploy CPU-repo `tensorrt_llm`: TensorRT-LLM's tensorrt_llm model contract (input_ids ->
output_ids, perf metrics) served by specdeploy's speculative-decoding runtime (Python backend), on
the deployment's device, or on the GPU of a KIND_GPU instance.

In-flight batching, as TensorRT-LLM's own Python-executor model.py does it: execute() only
validates a request and queues it; one scheduler thread owns the runtime's InflightBatcher,
admits queued requests between rounds, stops cancelled ones and steps the batch while there is
work. Decoupled: each accepted group of tokens is sent as soon as the verifier accepts it
(several tokens in one response when several drafts were accepted), then a final response
carrying the perf metrics (draft counts, acceptance rate, the request's arrival / scheduled /
first-token / last-token times) and the FINAL flag. Client errors come back as the request's
Triton error; the model keeps serving. Beyond `specdeploy_max_queue` requests in flight a
request is refused at once ("server busy"). Speculative-decoding counters go to Triton's
metrics endpoint (pb_utils.MetricFamily).
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


def _error_text(err: Exception) -> str:
    """A SpecDeployError's message and hint on one line (what the client sees)."""
    return str(err).replace("\n  hint:", "; hint:")


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
        self.request = None if decoupled else request  # decoupled: only the sender outlives execute()
        self.collected = None
        self.answered = threading.Event()  # the final response is out (a non-decoupled execute waits for it)

    def send(self, tensors: list, final: bool) -> None:
        response = pb_utils.InferenceResponse(output_tensors=tensors)
        if self.sender is None:
            self.collected = response
        else:
            self.sender.send(response, flags=FINAL if final else 0)
        if final:
            self.answered.set()

    def error(self, message: str) -> None:
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        if self.sender is None:
            self.collected = response
        else:
            self.sender.send(response, flags=FINAL)
        self.answered.set()

    def cancelled(self) -> bool:
        """The client went away or cancelled."""
        return (self.request if self.sender is None else self.sender).is_cancelled()


@dataclass
class _Entry:
    """One request from execute() to its final response."""

    sink: _Sink
    prompt: list[int]
    params: object  # SamplingParams
    request_id: str
    exclude_input: bool
    perf: bool
    stream: "_Streamer | None"
    arrival_ns: int
    seq: object = None  # the batcher's Sequence once admitted
    gone: bool = False  # the client cancelled: no one reads an answer


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
        max_batch = _positive_param(config, "specdeploy_max_batch_size", DEFAULT_MAX_BATCH_SIZE)
        max_queue = _positive_param(config, "specdeploy_max_queue", DEFAULT_MAX_QUEUE)
        folder = Path(args["model_repository"]) / args["model_version"]
        path = folder / _param(config, "specdeploy_deployment", "deployment.json")
        metrics = _Metrics({"model": args["model_name"], "version": args["model_version"]})
        device = instance_device(args)
        self.scheduler = _Scheduler(lambda: load_decoder(path, device=device), max_batch, max_queue, metrics)
        self.decoder = self.scheduler.decoder
        self.tokenizer = self.decoder.tokenizer
        self.context = int(getattr(self.decoder.target.config, "max_position_embeddings", 0) or 1 << 30)
        import torch

        pb_utils.Logger.log_info(f"specdeploy tensorrt_llm: {path}, computing on {describe(self.decoder.device)}, "
                                 f"instance {args.get('model_instance_name')} ({args.get('model_instance_kind')}), "
                                 f"torch threads {torch.get_num_threads()}, in-flight batch {max_batch}, "
                                 f"max queue {max_queue}")

    # -- requests ----------------------------------------------------------------------------
    def execute(self, requests):
        """Validate and queue; the scheduler thread answers. Not decoupled: wait for the answers."""
        sinks = []
        for request in requests:
            try:
                sink = _Sink(request, self.decoupled)
                sinks.append(sink)
                self._accept(request, sink)
            except Exception:  # even the error path failed (a closed sender...): serve the others
                pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
        if self.decoupled:
            return None
        for sink in sinks:
            sink.answered.wait()
        return [s.collected for s in sinks]

    def _accept(self, request, sink: _Sink) -> None:
        from specdeploy.errors import SpecDeployError

        arrival = time.time_ns()
        try:
            if _scalar(request, "stop", False):
                self._stop(request, sink)
                return
            self.scheduler.submit(self._entry(request, sink, arrival))
        except (BadRequest, Busy, SpecDeployError) as err:
            self.scheduler.metrics.request("rejected" if isinstance(err, Busy) else "bad_request")
            sink.error(_error_text(err))
        except Exception as err:  # the server must survive whatever one request does
            pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
            self.scheduler.metrics.request("error")
            sink.error(f"internal error in the specdeploy runtime: {type(err).__name__}: {err}")

    def _stop(self, request, sink: _Sink) -> None:
        """TRT-LLM's `stop` input: cancel the requests carrying this request's id (the C++
        backend's handleStopRequest, the Python one's handle_stop_request); they end with what
        they generated so far. The stop request itself gets an empty final response."""
        request_id = request.request_id()
        if not request_id:
            raise BadRequest("a request id must be provided for request cancellation (stop=true)")
        self.scheduler.stop(request_id)
        sink.send([], final=True)

    def _entry(self, request, sink: _Sink, arrival_ns: int) -> _Entry:
        prompt = self._prompt(request)
        streaming = bool(_scalar(request, "streaming", False)) and self.decoupled
        return _Entry(
            sink=sink, prompt=prompt, params=self._params(request, len(prompt)), request_id=request.request_id(),
            exclude_input=bool(_scalar(request, "exclude_input_in_output", self.exclude_input)),
            perf=bool(_scalar(request, "return_perf_metrics", False)),
            stream=_Streamer(self.tokenizer, sink) if streaming else None, arrival_ns=arrival_ns,
        )

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

    def finalize(self) -> None:
        """Stop the scheduler and drop the model. Triton unloads a model only once its requests have
        their final responses (on SIGTERM it lets them run for --exit-timeout-secs, then exits without
        finalize), so normally nothing is left here; whatever is gets an error."""
        self.scheduler.close()
        self.scheduler = None
        self.decoder = None


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
    def submit(self, entry: _Entry) -> None:
        with self.cond:
            if self.in_flight >= self.max_queue:
                raise Busy(f"server busy: {self.in_flight} requests queued (max_queue {self.max_queue}); retry later")
            self.in_flight += 1
            self.inbox.append(entry)
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
            entry.seq = self.batcher.add(BatchRequest(entry.prompt, entry.params, on_tokens))
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
        result = entry.seq.result
        if entry.stream:
            entry.stream.flush()
            tokens = []
        else:
            tokens = result.token_ids if entry.exclude_input else entry.prompt + result.token_ids
        outputs = _token_tensors(tokens)
        if entry.perf:
            outputs += _perf_tensors(result.metrics, entry)
        return outputs

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

    def __init__(self, tokenizer, sink: _Sink) -> None:
        self.tokenizer = tokenizer
        self.sink = sink
        self.pending: list[int] = []

    def on_tokens(self, group: list[int]) -> None:
        self.pending += group
        if self.tokenizer.decode(self.pending).endswith("\ufffd"):
            return
        self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.sink.send(_token_tensors(self.pending), final=False)
        self.pending = []


def _token_tensors(tokens: list[int]) -> list:
    ids = np.array(tokens, dtype=np.int32).reshape(1, 1, len(tokens))
    return [
        pb_utils.Tensor("output_ids", ids),
        pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], dtype=np.int32)),
    ]


def _perf_tensors(metrics, entry: _Entry) -> list:
    """TRT-LLM's perf outputs; the times are the request's own: arrival when execute() got it,
    scheduled when the batcher admitted it (the difference is its queue time)."""
    seq = entry.seq
    scheduled = seq.first_scheduled_ns or entry.arrival_ns
    first = seq.first_token_ns or scheduled
    last = seq.last_token_ns or first

    def one(name: str, value, dtype) -> object:
        return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))

    return [
        one("total_draft_tokens", metrics.draft_tokens, np.int32),
        one("total_accepted_draft_tokens", metrics.accepted_draft_tokens, np.int32),
        one("acceptance_rate", metrics.acceptance_rate, np.float32),
        one("arrival_time_ns", entry.arrival_ns, np.int64),
        one("first_scheduled_time_ns", scheduled, np.int64),
        one("first_token_time_ns", first, np.int64),
        one("last_token_time_ns", last, np.int64),
    ]
