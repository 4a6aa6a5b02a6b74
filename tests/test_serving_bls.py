"""The CPU repository's tensorrt_llm_bls in-process, with stand-ins for Triton's pb_utils and for the
tensorrt_llm it calls: a client's cancellation reaches the generation even when the watcher's
`stop` gets to tensorrt_llm before the request it names (which drops it, as TensorRT-LLM's
backend drops a stop for a request id it is not running)."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np

BLS_PY = Path(__file__).parents[1] / "specdeploy/triton/templates/cpu/tensorrt_llm_bls/1/model.py"
INPUTS = ("input_ids", "input_lengths", "request_output_len")
WHOLE = 200  # responses of a generation no stop reaches
WAIT_S = 10  # a deadline, never a check


class Tensor:
    def __init__(self, name: str, value) -> None:
        self._name, self.value = name, np.asarray(value)

    def name(self) -> str:
        return self._name

    def as_numpy(self):
        return self.value


class Response:
    def __init__(self, output_tensors=(), error=None) -> None:
        self.tensors, self.error_ = list(output_tensors), error

    def has_error(self) -> bool:
        return self.error_ is not None

    def error(self):
        return self.error_

    def output_tensors(self) -> list:
        return self.tensors


class Generator:
    """tensorrt_llm: a stop naming a request it runs ends it at the next response; one naming
    a request it does not run is dropped. The first generation request is held back until a stop
    has arrived: the race of a client that cancelled before the BLS submitted its request."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.stopped: set[str] = set()
        self.first_stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0  # responses of the generation

    def request(self, inputs: list, request_id: str):
        if any(tensor.name() == "stop" for tensor in inputs):
            with self.lock:
                if request_id in self.running:
                    self.stopped.add(request_id)
            self.first_stop.set()
            return iter([Response()])
        self.first_stop.wait(WAIT_S)
        with self.lock:
            self.running.add(request_id)
        return self._generate(request_id)

    def _generate(self, request_id: str):
        for _ in range(WHOLE):
            if request_id in self.stopped:
                break
            self.sent += 1
            yield Response([Tensor("output_ids", [[[7]]])])
            time.sleep(0.01)
        with self.lock:
            self.running.discard(request_id)


class Sender:
    """A client that cancelled as soon as it sent its request."""

    def __init__(self) -> None:
        self.final = threading.Event()

    def is_cancelled(self) -> bool:
        return True

    def send(self, response=None, flags: int = 0) -> None:
        if flags:
            self.final.set()


def _pb_utils(generator: Generator) -> types.SimpleNamespace:
    class InferenceRequest:
        def __init__(self, model_name: str, inputs: list, requested_output_names: list, request_id: str = "") -> None:
            self.inputs, self.request_id = inputs, request_id

        def exec(self, decoupled: bool = False):
            return generator.request(self.inputs, self.request_id)

    return types.SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1, Logger=types.SimpleNamespace(log_error=print, log_warn=print),
        Tensor=Tensor, InferenceRequest=InferenceRequest, InferenceResponse=Response, TritonError=str,
        using_decoupled_model_transaction_policy=lambda config: True,
        get_input_tensor_by_name=lambda request, name: request.tensors.get(name))


def _bls(tmp_path: Path, monkeypatch, generator: Generator):
    """model.py's TritonPythonModel, initialized on a one-step plan: tensorrt_llm generates."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb_utils(generator))
    spec = importlib.util.spec_from_file_location("specdeploy_bls_model", BLS_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "1").mkdir()
    step = {"model": "tensorrt_llm", "inputs": {name: name for name in INPUTS}, "outputs": {"output_ids": "output_ids"}}
    (tmp_path / "1" / "steps.json").write_text(json.dumps({"steps": [step], "generator": "tensorrt_llm",
                                                           "outputs": ["output_ids"]}))
    model = module.TritonPythonModel()
    model.initialize({"model_repository": str(tmp_path), "model_version": "1",
                      "model_config": json.dumps({"input": [{"name": name} for name in INPUTS]})})
    return model


def test_a_cancellation_whose_stop_overtakes_the_generation_request_still_ends_it(tmp_path, monkeypatch):
    generator = Generator()
    model = _bls(tmp_path, monkeypatch, generator)
    sender = Sender()
    tensors = {"input_ids": Tensor("input_ids", [[1, 2, 3]]), "input_lengths": Tensor("input_lengths", [[3]]),
               "request_output_len": Tensor("request_output_len", [[WHOLE]])}
    try:
        model.execute([types.SimpleNamespace(tensors=tensors, get_response_sender=lambda: sender)])
        assert sender.final.wait(WAIT_S), "no final response"
    finally:
        model.finalize()
    assert generator.first_stop.is_set() and generator.sent < WHOLE, "the generation ran to its end"
