"""specdeploy tensorrt_llm_bls (CPU repository): the ensemble's steps as business-logic
scripting, so that a client's cancellation reaches the generation that is running.

Through the ensemble it does not: tritonserver 2.51 checks for a cancellation only between
ensemble steps, and the tensorrt_llm step lasts the whole generation. This model runs the same
steps (steps.json, which `specdeploy package` derives from the ensemble's config: the wiring has
one source) on a thread per request, and one watcher thread asks the clients of the running
requests whether they cancelled. For a request whose client did, it sends tensorrt_llm
TensorRT-LLM's `stop` input with the request's id (each poll until the generation ends), which
ends the sequence within a round and frees its KV cache. Inputs and outputs are the ensemble's
(plus TensorRT-LLM's BLS draft-target inputs, refused: there is no separate draft model); a
non-streaming request gets one response per batch row, a streaming one a response per accepted
group, then an empty final one. Decoupled or not as the repository was packaged (tensorrt_llm is
the same): either way each request is answered through its response sender, so execute() returns
at once.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
import uuid
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
POLL_S = 0.05  # how often the watcher asks each running request's client whether it cancelled
STOP_WITH = ("input_ids", "input_lengths", "request_output_len")  # required inputs a stop request repeats


class StepError(Exception):
    """A step answered with an error: its message goes to the client as it is."""


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        plan = json.loads((Path(args["model_repository"]) / args["model_version"] / "steps.json").read_text())
        self.steps, self.outputs, self.generator = plan["steps"], plan["outputs"], plan["generator"]
        config = json.loads(args["model_config"])
        self.inputs = [entry["name"] for entry in config["input"]]
        # tensorrt_llm shares the repository's transaction policy: its answers come the same way
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.running: dict[str, tuple] = {}  # inner request id -> (response sender, the stop request's inputs)
        self.lock = threading.Lock()
        self.alive = True
        self.watcher = threading.Thread(target=self._watch, name="specdeploy-bls-cancel", daemon=True)
        self.watcher.start()

    def execute(self, requests):
        """Read each request's inputs (they do not outlive execute) and serve it on its own thread."""
        for request in requests:
            tensors = {name: tensor.as_numpy() for name in self.inputs
                       if (tensor := pb_utils.get_input_tensor_by_name(request, name)) is not None}
            stream = bool(np.asarray(tensors.get("stream", False)).reshape(-1)[0])
            threading.Thread(target=self._serve, args=(tensors, request.get_response_sender(), stream),
                             daemon=True).start()
        return None

    def finalize(self) -> None:
        self.alive = False
        self.watcher.join(5)

    # -- one request ---------------------------------------------------------------------------
    def _serve(self, tensors: dict, sender, stream: bool) -> None:
        """Streaming: each response at once, then an empty final one. Otherwise one response per
        batch row, the last one held back to go with the FINAL flag (a non-decoupled model sends
        exactly one response, and with it the flag)."""
        held = None
        try:
            _check_no_draft_model(tensors)
            for outputs in self._run(tensors, sender):
                if stream:
                    sender.send(_response(outputs))
                    continue
                if held is not None:
                    sender.send(_response(held))
                held = outputs
            sender.send(_response(held) if held else None, flags=FINAL)
        except StepError as err:
            self._send_error(sender, str(err))
        except Exception as err:
            pb_utils.Logger.log_error(f"specdeploy tensorrt_llm_bls: {traceback.format_exc()}")
            self._send_error(sender, f"internal error in tensorrt_llm_bls: {type(err).__name__}: {err}")

    def _run(self, tensors: dict, sender):
        """The ensemble outputs of each response the generating step sends."""
        names = dict(tensors)  # the ensemble's tensors by name, as its steps fill them
        index = next(i for i, step in enumerate(self.steps) if step["model"] == self.generator)
        for step in self.steps[:index]:
            names.update(_call(step, names))
        step = self.steps[index]
        inner_id = f"specdeploy-bls-{uuid.uuid4().hex}"
        inputs = _inputs(step, names)
        repeated = [tensor for tensor in inputs if tensor.name() in STOP_WITH]
        # Triton refuses a request whose inputs differ in batch size: one stop flag per row
        rows = repeated[0].as_numpy().shape[0]
        stop = repeated + [pb_utils.Tensor("stop", np.full((rows, 1), True))]
        with self.lock:
            self.running[inner_id] = (sender, stop)
        try:
            request = pb_utils.InferenceRequest(model_name=step["model"], inputs=inputs, request_id=inner_id,
                                                requested_output_names=list(step["outputs"]))
            for response in self._exec(request):
                got = _outputs(step, response)
                if got:
                    yield self._finish(names, got, index)
        finally:
            with self.lock:
                self.running.pop(inner_id, None)

    def _finish(self, names: dict, got: dict, index: int) -> dict:
        """The steps after the generating one, on one of its responses."""
        names = {**names, **got}
        for step in self.steps[index + 1:]:
            if any(value in got for value in step["inputs"].values()):
                names.update(_call(step, names))
        return {name: names[name] for name in self.outputs if name in names}

    def _exec(self, request) -> Iterable:
        """The generating step's responses (one when not decoupled)."""
        return request.exec(decoupled=True) if self.decoupled else [request.exec()]

    @staticmethod
    def _send_error(sender, message: str) -> None:
        try:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)
        except Exception:  # the client is gone
            pass

    # -- cancellation --------------------------------------------------------------------------
    def _watch(self) -> None:
        while self.alive:
            time.sleep(POLL_S)
            with self.lock:
                running = list(self.running.items())
            for inner_id, (sender, stop) in running:
                try:
                    # sent again each poll until the generation ends: tensorrt_llm drops a stop that
                    # reaches it before the request it names (as TensorRT-LLM's backend does), and
                    # the request is registered before it is submitted
                    if sender.is_cancelled():
                        for response in self._exec(pb_utils.InferenceRequest(model_name=self.generator, inputs=stop,
                                                                             request_id=inner_id,
                                                                             requested_output_names=["output_ids"])):
                            if response.has_error():  # say why (the next poll sends it again)
                                pb_utils.Logger.log_error(f"specdeploy tensorrt_llm_bls: the stop request for a "
                                                          f"cancelled one failed: {response.error().message()}")
                except Exception:
                    pb_utils.Logger.log_error(f"specdeploy tensorrt_llm_bls: {traceback.format_exc()}")


def _check_no_draft_model(tensors: dict) -> None:
    """TensorRT-LLM's BLS runs draft-target speculation when asked for num_draft_tokens, with its
    tensorrt_llm_draft model; here tensorrt_llm drafts by itself and there is no draft model to call."""
    drafts = tensors.get("num_draft_tokens")
    if drafts is not None and int(np.max(drafts)) > 0:
        raise StepError("cannot perform speculative decoding without draft model: this repository has no "
                        "tensorrt_llm_draft (its tensorrt_llm speculates by itself); leave num_draft_tokens out or 0")


def _inputs(step: dict, names: dict) -> list:
    return [pb_utils.Tensor(key, names[value]) for key, value in step["inputs"].items() if value in names]


def _outputs(step: dict, response) -> dict:
    if response.has_error():
        raise StepError(response.error().message())
    return {step["outputs"][t.name()]: t.as_numpy() for t in response.output_tensors() if t.name() in step["outputs"]}


def _call(step: dict, names: dict) -> dict:
    request = pb_utils.InferenceRequest(model_name=step["model"], inputs=_inputs(step, names),
                                        requested_output_names=list(step["outputs"]))
    return _outputs(step, request.exec())


def _response(outputs: dict):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()])
