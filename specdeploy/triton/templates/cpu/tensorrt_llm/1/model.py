"""specdeploy CPU-repo `tensorrt_llm`: TensorRT-LLM's tensorrt_llm model contract (input_ids ->
output_ids, perf metrics) served by specdeploy's speculative-decoding runtime (Python backend), on
the deployment's device, or on the GPU of a KIND_GPU instance.

This file is what Triton loads: it wires the Python backend's initialize / execute / finalize to
specdeploy.triton.serving, where the work is done (in the installed package, as the runtime is):

    requests.py    requests read and checked with TensorRT-LLM's semantics (anything the runtime
                   does not implement is refused with a clear error, never ignored)
    scheduler.py   in-flight batching: execute() only validates a request and queues it, then
                   returns; one scheduler thread owns the runtime's InflightBatcher and answers each
                   request through its response sender, decoupled or not; beyond
                   `specdeploy_max_queue` requests in flight a request is refused ("server busy")
    responses.py   streaming (decoupled only, as in TensorRT-LLM): each accepted group of tokens as
                   soon as the verifier accepts it, then a final response without tokens
    metrics.py     TensorRT-LLM's perf outputs (return_perf_metrics) plus total_generated_tokens and
                   total_target_forwards; speculative-decoding counters on Triton's metrics endpoint

Client errors come back as the request's Triton error; the model keeps serving.
"""

from __future__ import annotations

import json
import locale
import time
import traceback
from pathlib import Path

import triton_python_backend_utils as pb_utils

# The stub's embedded Python starts in the C locale and ignores PYTHONUTF8, so open() decodes as
# ASCII; torch._inductor (imported with the EAGLE module) then fails on a non-ASCII template.
locale.setlocale(locale.LC_CTYPE, "C.UTF-8")

import torch  # noqa: E402  (after the locale fix)
from specdeploy.triton.serving.metrics import Metrics  # noqa: E402
from specdeploy.triton.serving.requests import BATCH_NEEDS_DECOUPLED, BadRequest, Inputs, RequestReader, rows  # noqa: E402
from specdeploy.triton.serving.responses import Sink, error_text  # noqa: E402
from specdeploy.triton.serving.scheduler import Busy, Scheduler  # noqa: E402

DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_QUEUE = 64


def _param(config: dict, key: str, default: str = "") -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", default)
    return default if value.startswith("${") else value


def _positive_param(config: dict, key: str, default: int) -> int:
    value = _param(config, key, str(default))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"config.pbtxt parameter {key} must be a positive integer, got {value!r}")
    return int(value)


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
        exclude_input = _param(config, "exclude_input_in_output", "false").lower() in ("true", "1")
        max_batch = _positive_param(config, "specdeploy_max_batch_size", DEFAULT_MAX_BATCH_SIZE)
        max_queue = _positive_param(config, "specdeploy_max_queue", DEFAULT_MAX_QUEUE)
        folder = Path(args["model_repository"]) / args["model_version"]
        path = folder / _param(config, "specdeploy_deployment", "deployment.json")
        metrics = Metrics({"model": args["model_name"], "version": args["model_version"]})
        device = instance_device(args)
        self.scheduler = Scheduler(lambda: load_decoder(path, device=device), max_batch, max_queue, metrics)
        self.decoder = self.scheduler.decoder
        self.requests = RequestReader(
            self.decoder.tokenizer, int(self.decoder.target.config.vocab_size),
            int(getattr(self.decoder.target.config, "max_position_embeddings", 0) or 1 << 30),
            decoupled=self.decoupled, exclude_input=exclude_input)
        pb_utils.Logger.log_info(f"specdeploy tensorrt_llm: {path}, computing on {describe(self.decoder.device)}, "
                                 f"instance {args.get('model_instance_name')} ({args.get('model_instance_kind')}), "
                                 f"torch threads {torch.get_num_threads()}, in-flight batch {max_batch}, "
                                 f"max queue {max_queue}, {'decoupled' if self.decoupled else 'not decoupled'}")

    def execute(self, requests):
        """Validate and queue; the scheduler thread answers through each request's sender."""
        for request in requests:
            try:
                self._accept(request, Sink(request))
            except Exception:  # even the error path failed (a closed sender...): serve the others
                pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
        return None

    def _accept(self, request, sink: Sink) -> None:
        from specdeploy.errors import SpecDeployError

        arrival = time.time_ns()
        try:
            if Inputs(request).scalar("stop", False):
                self._stop(request, sink)
                return
            count = rows(request)
            if count > 1 and not self.decoupled:
                raise BadRequest(BATCH_NEEDS_DECOUPLED)
            entries = [self.requests.entry(Inputs(request, row), sink, arrival, row if count > 1 else None)
                       for row in range(count)]
            sink.expect(count)
            self.scheduler.submit(entries)
        except (BadRequest, Busy, SpecDeployError) as err:
            self.scheduler.metrics.request("rejected" if isinstance(err, Busy) else "bad_request")
            sink.refuse(error_text(err))
        except Exception as err:  # the server must survive whatever one request does
            pb_utils.Logger.log_error(f"specdeploy tensorrt_llm: {traceback.format_exc()}")
            self.scheduler.metrics.request("error")
            sink.refuse(f"internal error in the specdeploy runtime: {type(err).__name__}: {err}")

    def _stop(self, request, sink: Sink) -> None:
        """TRT-LLM's `stop` input: cancel the requests carrying this request's id (the C++
        backend's handleStopRequest, the Python one's handle_stop_request); they end with what
        they generated so far. The stop request itself gets an empty final response."""
        request_id = request.request_id()
        if not request_id:
            raise BadRequest("a request id must be provided for request cancellation (stop=true)")
        self.scheduler.stop(request_id)
        sink.send([], final=True)

    def finalize(self) -> None:
        """Stop the scheduler and drop the model. Triton unloads a model only once its requests have
        their final responses (on SIGTERM it lets them run for --exit-timeout-secs, then exits without
        finalize), so normally nothing is left here; whatever is gets an error."""
        self.scheduler.close()
        self.scheduler = None
        self.decoder = None
