"""In-flight batching for the CPU `tensorrt_llm` model, as TensorRT-LLM's own Python-executor
model.py does it: execute() only validates a request and queues it (Scheduler.submit), then
returns; one scheduler thread owns the runtime's InflightBatcher, admits queued requests between
rounds, stops cancelled ones and steps the batch while there is work, and answers each request
through its response sender, in decoupled and non-decoupled mode alike (so a non-decoupled model
batches in flight too). Beyond `max_queue` requests in flight a request is refused at once (Busy:
"server busy"). Client errors come back as the request's Triton error; the model keeps serving.
"""

from __future__ import annotations

import copy
import threading
import traceback

from specdeploy.triton.serving.metrics import Metrics
from specdeploy.triton.serving.requests import ClientDraft, Entry
from specdeploy.triton.serving.responses import error_text, outputs
from specdeploy.triton.serving.stub import pb_utils


class Busy(Exception):
    """Back-pressure: too many requests in flight; the client should retry later."""


class Scheduler:
    """Owns the runtime's InflightBatcher: its thread admits queued requests between rounds,
    cancels the ones whose client went away (or that a `stop` request named), steps the batch
    while there is work and answers each request as its sequence finishes.

    The thread also loads the model: all of torch's work happens on it. A thread that has run
    parallel torch ops keeps its OpenMP team alive; with two teams (the stub's main thread's and
    this one's) there are more OpenMP threads than cores, and libgomp then spins only briefly
    before sleeping (GOMP_SPINCOUNT's throttled mode), so every parallel op pays a wake-up: measured
    on 2 cores, decoding from a second thread took 1.5x as long."""

    def __init__(self, load, max_batch_size: int, max_queue: int, metrics: Metrics) -> None:
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.metrics = metrics
        self.cond = threading.Condition()
        self.inbox: list[Entry] = []  # queued by execute(), not yet given to the batcher
        self.stops: list[str] = []  # request ids a `stop` request named
        self.in_flight = 0  # inbox + live: what back-pressure bounds
        self.live: list[Entry] = []  # in the batcher (waiting or active); the scheduler thread's own
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
    def submit(self, entries: list[Entry]) -> None:
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

    def _round(self, new: list[Entry], stops: set[str]) -> None:
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

    def _admit(self, entry: Entry) -> None:
        from specdeploy.errors import SpecDeployError
        from specdeploy.runtime.batch_requests import BatchRequest

        try:
            on_tokens = entry.stream.on_tokens if entry.stream else None
            proposer = None if entry.draft is None else ClientDraft(len(entry.prompt), entry.draft)
            entry.seq = self.batcher.add(BatchRequest(entry.prompt, entry.params, on_tokens, proposer))
        except SpecDeployError as err:
            self._answer(entry, "bad_request", error=error_text(err))
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
            entry.gone = not named and client_gone(entry)
            if named or entry.gone:
                self.batcher.cancel(entry.seq)

    def _step(self) -> None:
        before = copy.deepcopy(self.batcher.stats)  # cumulative: the metrics take this round's share
        self.batcher.step()
        self.metrics.round(before, self.batcher.stats)

    def _reset(self, err: Exception) -> None:
        """The batch failed as a whole: every request in it gets the error, a fresh batcher goes on.
        Where no fresh one can be made, the old one does, its failed sequences cancelled: this thread
        must outlive any failure, or every later request would wait for an answer forever."""
        pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
        failed, self.live = self.live, []
        for entry in failed:
            self._answer(entry, "error", error=f"internal error in the specdeploy runtime: {type(err).__name__}: {err}")
        try:
            self.batcher = self.decoder.batcher(max_batch_size=self.max_batch_size)
        except Exception:
            pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: no fresh batch, the old one goes on: {traceback.format_exc()}")
            for entry in failed:
                if entry.seq is not None:
                    self.batcher.cancel(entry.seq)

    def _finish(self, entry: Entry) -> None:
        try:
            outcome, tensors, error = self._outcome(entry)
        except Exception as err:  # e.g. the last streamed group could not be sent
            pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
            outcome, tensors, error = "error", None, f"internal error in the specdeploy runtime: {type(err).__name__}: {err}"
        self._answer(entry, outcome, outputs=tensors, error=error)

    def _outcome(self, entry: Entry) -> tuple[str, list | None, str | None]:
        """(outcome for the metrics, final outputs, or the error message)."""
        from specdeploy.errors import SpecDeployError

        seq = entry.seq
        if entry.gone or (seq.error is not None and client_gone(entry)):  # e.g. a send to a closed stream failed
            return "cancelled", None, "request cancelled"
        if isinstance(seq.error, SpecDeployError):
            return "error", None, error_text(seq.error)
        if seq.error is not None:
            pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: a request failed: {seq.error!r}")
            return "error", None, f"internal error in the specdeploy runtime: {type(seq.error).__name__}: {seq.error}"
        # finished, or stopped by a `stop` request: the tokens so far (finish reason "cancelled")
        return seq.result.finish_reason, self._final_outputs(entry), None

    def _final_outputs(self, entry: Entry) -> list:
        """Streaming: the tokens still held back, then an empty final response; else every token
        (after the prompt unless exclude_input_in_output)."""
        result = entry.seq.result
        if entry.stream:
            entry.stream.flush()
            return outputs(entry, [], len(result.token_ids))
        tokens = result.token_ids if entry.exclude_input else entry.prompt + result.token_ids
        return outputs(entry, tokens, len(result.token_ids))

    def _answer(self, entry: Entry, outcome: str, *, outputs: list | None = None, error: str | None = None) -> None:
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


def client_gone(entry: Entry) -> bool:
    try:
        return entry.sink.cancelled()
    except Exception:  # not knowing is no reason to drop a request
        pb_utils.Logger.log_warn(f"specdeploy tensorrt_llm: is_cancelled failed: {traceback.format_exc()}")
        return False
