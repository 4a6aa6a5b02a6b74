"""The client's request building against the configs the routes deploy, without a server: the
model's config is read with Triton's own protobuf schema (tritonclient's model_config_pb2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from specdeploy.client import Request, TritonLLMClient, _http_error
from specdeploy.errors import SpecDeployError

TEMPLATES = Path(__file__).resolve().parents[1] / "specdeploy" / "triton" / "templates"


def _config_as_served(path: Path) -> dict:
    """What tritonclient.grpc's get_model_config(as_json=True) returns for a template, its
    ${placeholders} filled with a value of the right kind."""
    text = re.sub(r"\$\{logits_datatype\}", "TYPE_FP32", path.read_text())
    text = re.sub(r"\$\{decoupled_mode\}", "true", text)
    text = re.sub(r"\$\{\w+\}", "4", text)
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    return {"config": json_format.MessageToDict(config, preserving_proto_field_name=True)}


def _client(config: dict, protocol: str = "grpc") -> TritonLLMClient:
    client = TritonLLMClient("127.0.0.1:1", protocol, model="tensorrt_llm_bls")  # never connects: the config is stubbed
    served = config if protocol == "grpc" else config["config"]  # tritonclient.http's answer has no wrapper
    client._client.get_model_config = lambda model, as_json=False: served
    return client


def test_every_input_type_the_engine_routes_bls_declares_is_built():
    config = _config_as_served(TEMPLATES / "inflight_batcher_llm" / "tensorrt_llm_bls" / "config.pbtxt")
    types = {spec["data_type"] for spec in config["config"]["input"]}
    assert "TYPE_UINT8" in types  # image_bytes_input: a type the client once had no numpy type for
    inputs = _client(config)._build_inputs(Request("hello", max_tokens=8, temperature=0.5, stop_words=["a"]), stream=True)
    assert {tensor.name(): tensor.datatype() for tensor in inputs} == {
        "text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL", "temperature": "FP32",
        "return_perf_metrics": "BOOL", "exclude_input_in_output": "BOOL", "stop_words": "BYTES"}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("field, value", [("max_tokens", 2**31), ("max_tokens", 2**32 + 3), ("max_tokens", -(2**31) - 1),
                                          ("top_k", 2**32 + 50), ("end_id", 2**32 + 7)])
def test_an_integer_the_input_cannot_hold_is_refused_before_sending(protocol, field, value):
    """Refused before anything is sent (the stubbed client's address answers nothing)."""
    config = _config_as_served(TEMPLATES / "inflight_batcher_llm" / "tensorrt_llm_bls" / "config.pbtxt")
    with pytest.raises(SpecDeployError, match=re.escape(f"{field}={value} does not fit the model's int32 input")):
        _client(config, protocol).generate(Request("hello", **{"max_tokens": 8, field: value}))


class _Response:
    def __init__(self, status_code: int, text: str) -> None:
        self.status_code, self.text = status_code, text


@pytest.mark.parametrize("body", ['{"error":"max_tokens must be at least 1"}',
                                  'data: {"error":"max_tokens must be at least 1"}\n\n'])
def test_an_http_error_reads_as_the_servers_message_streamed_or_not(body):
    assert _http_error(_Response(400, body)) == "max_tokens must be at least 1"


def test_an_http_error_without_a_message_keeps_the_status_and_body():
    assert _http_error(_Response(502, "Bad Gateway")) == "HTTP 502: Bad Gateway"


def test_a_ready_client_has_read_the_models_config_so_no_request_pays_for_it():
    config = _config_as_served(TEMPLATES / "inflight_batcher_llm" / "tensorrt_llm_bls" / "config.pbtxt")
    client, reads = _client(config), []
    client._client.get_model_config = lambda model, as_json=False: reads.append(model) or config
    client._client.is_server_live = client._client.is_model_ready = lambda *args: True
    client.wait_ready(timeout_s=1)
    assert reads == ["tensorrt_llm_bls"]
    client._build_inputs(Request("hello"), stream=True)
    assert reads == ["tensorrt_llm_bls"]


def test_an_answer_without_text_had_its_first_response_at_its_end():
    """One empty final response (the first token was the end token): its time to first chunk is
    the latency, not 0 (verify's TTFT median would take a 0 as measured)."""
    import time
    import types

    config = _config_as_served(TEMPLATES / "inflight_batcher_llm" / "tensorrt_llm_bls" / "config.pbtxt")
    final = types.SimpleNamespace(as_numpy=lambda name: None, get_response=lambda: types.SimpleNamespace(
        parameters={"triton_final_response": types.SimpleNamespace(bool_param=True)}))

    class Server:  # one empty final response, 50 ms after the request
        def get_model_config(self, model, as_json=False):
            return config

        def start_stream(self, callback):
            self.callback = callback

        def async_stream_infer(self, *args, **kwargs):
            time.sleep(0.05)
            self.callback(final, None)

        def stop_stream(self, **kwargs):
            pass

    client = TritonLLMClient("127.0.0.1:1", model="tensorrt_llm_bls")
    client._client = Server()
    done = client.generate(Request("hello", max_tokens=4), stream=True)
    assert done.text == "" and done.time_to_first_chunk_s == done.latency_s > 0
