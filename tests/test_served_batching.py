"""The served side of in-flight batching (issue 15 items 1-4): concurrent requests share the
CPU model's batch and get the tokens each gets alone; cancellation (gRPC cancel, TRT-LLM's
`stop` input) ends a request early: recorded cancelled, fewer tokens generated than it asked
for; back-pressure answers "server busy"; the perf outputs carry true arrival / scheduled /
first / last token times; speculative-decoding counters reach tritonserver's metrics port.
Nothing here asserts on elapsed time: waits have deadlines, the checks are the server's own
counters and the tokens received.

Two servers, started once each: the packaged repository as `specdeploy package` writes it
(in-flight batch of 4), and a copy of its tensorrt_llm model alone with a batch of 1 and a
queue bound of 2. The model never emits an end token (its EOS is unset), so every request runs
to max_tokens, and it drafts with itself, so every draft is accepted; float64 keeps batched
and alone answers bit-for-bit comparable."""

from __future__ import annotations

import queue
import re
import shutil
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer

from specdeploy import resolve
from specdeploy.client import Request, TritonLLMClient
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from specdeploy.triton import cpu_repo, stage
from specdeploy.triton.serve import TritonServer
from tests.overlap import until_overlapping
from tests.test_served_dropin import tensors
from tests.tiny import make_llama

pytestmark = pytest.mark.server

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over", "for i in range(10):\n    print(i * i)", "Hello"]
LONG = 900  # tokens: a request that runs for seconds, to be cancelled
DEADLINE_S = 300  # the longest a test waits for the server to get somewhere (a deadline, never a check)


# ---------------------------------------------------------------------------------------------
# a raw client for the tensorrt_llm model itself (token ids in and out, perf outputs, request ids)


@dataclass
class Answer:
    tokens: list[int] = field(default_factory=list)
    final: dict[str, int | float] = field(default_factory=dict)
    error: str | None = None


class Direct:
    """One gRPC stream to `tensorrt_llm`, one request at a time."""

    def __init__(self, server: TritonServer) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.responses: queue.Queue = queue.Queue()
        self.early: list = []  # responses first_response() already took
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, ids: list[int], max_tokens: int, *, request_id: str = "", **extra) -> None:
        arrays = {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": np.array([[len(ids)]], dtype=np.int32),
                  "request_output_len": np.array([[max_tokens]], dtype=np.int32),
                  "return_perf_metrics": np.array([[True]]), "exclude_input_in_output": np.array([[True]])}
        arrays.update({name: np.array([[value]]) for name, value in extra.items()})
        inputs = []
        for name, array in arrays.items():
            tensor = grpcclient.InferInput(name, list(array.shape), "BOOL" if array.dtype == bool else "INT32")
            tensor.set_data_from_numpy(array if array.dtype == bool else array.astype(np.int32))
            inputs.append(tensor)
        self.client.async_stream_infer("tensorrt_llm", inputs, request_id=request_id, enable_empty_final_response=True)

    def first_response(self, timeout: float = 120) -> None:
        """Wait for the first streamed group (the request is then in the batch)."""
        self.early.append(self.responses.get(timeout=timeout))

    def collect(self, timeout: float = 300) -> Answer:
        answer = Answer()
        while True:
            result, error = self.early.pop(0) if self.early else self.responses.get(timeout=timeout)
            if error is not None:
                answer.error = error.message()
                return answer
            ids = result.as_numpy("output_ids")
            answer.tokens += [] if ids is None else ids.reshape(-1).tolist()
            if _is_final(result):
                answer.final = {o.name: result.as_numpy(o.name).reshape(-1)[0].item()
                                for o in result.get_response().outputs if o.name not in ("output_ids", "sequence_length")}
                return answer

    def ask(self, ids: list[int], max_tokens: int, **extra) -> Answer:
        self.send(ids, max_tokens, **extra)
        return self.collect()

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def ask_alone(server: TritonServer, ids: list[int], max_tokens: int, **extra) -> Answer:
    client = Direct(server)
    try:
        return client.ask(ids, max_tokens, **extra)
    finally:
        client.close()


def ask_together(server: TritonServer, requests: list[tuple[list[int], int]]) -> list[Answer]:
    answers: list[Answer | None] = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def one(i: int) -> None:
        start.wait()
        answers[i] = ask_alone(server, *requests[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return answers


# ---------------------------------------------------------------------------------------------
# the metrics endpoint


def scrape(server: TritonServer) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = re.fullmatch(r"(specdeploy_\w+)(?:\{(.*)\})? (\S+)", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def metric(samples, name: str, **labels: str) -> float:
    return sum(v for n, got, v in samples if n == name and all(got.get(k) == want for k, want in labels.items()))


def wait_for(condition, timeout: float, what: str) -> None:
    """Poll until `condition()` holds; `timeout` is a deadline for waiting, not a check of speed."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.1f} s: {what}"
        time.sleep(0.02)


def in_flight(server: TritonServer, state: str = "active") -> float:
    return metric(scrape(server), "specdeploy_requests_in_flight", state=state)


def wait_idle(server: TritonServer) -> None:
    """Until nothing is in the batch or queued (a request given up over HTTP runs to its end)."""
    wait_for(lambda: in_flight(server, "active") == in_flight(server, "waiting") == 0, DEADLINE_S,
             "the server finishes earlier tests' requests")


def finished(samples) -> float:
    """Requests the server generated to their end (a stop token or max_tokens)."""
    return sum(metric(samples, "specdeploy_requests_total", outcome=outcome) for outcome in ("stop", "length"))


def generated(before, after, sequences: int = 1) -> float:
    """New tokens the server generated between two scrapes, for the sequences that ended between
    them with nothing else running: each prefill's token, then each round its accepted draft
    tokens plus one (a sequence's forwards are counted as it ends, cancelled or not)."""
    forwards = metric(after, "specdeploy_sequence_forwards_total") - metric(before, "specdeploy_sequence_forwards_total")
    accepted = (metric(after, "specdeploy_accepted_draft_tokens_total")
                - metric(before, "specdeploy_accepted_draft_tokens_total"))
    return sequences + forwards + accepted


# ---------------------------------------------------------------------------------------------
# fixtures: one model, two servers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """Big enough that a long request runs for seconds; no EOS, so every request runs to max_tokens."""
    out = tmp_path_factory.mktemp("batching_llama")
    model = make_llama(out, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), hidden=128, layers=4, context=1024, seed=1)
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def build_root(tmp_path_factory, model_dir) -> Path:
    root = tmp_path_factory.mktemp("batching") / "build"
    build = BuildDir(root)
    resolve.run(build, str(model_dir))
    stage.run(build, spec="draft", draft_model_dir=model_dir, max_draft_len=4, dtype="float64")
    return root


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def server(build_root):
    """The packaged CPU repository as is (in-flight batch of 4)."""
    with TritonServer(build_root / "triton_repo" / "cpu", log_path=build_root / "logs" / "batching.log", threads=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def small_server(build_root):
    """Its tensorrt_llm alone, one sequence at a time, at most two requests in flight."""
    repo = build_root / "triton_repo" / "cpu_small"  # beside cpu/: deployment.json's relative paths hold
    shutil.copytree(build_root / "triton_repo" / "cpu" / "tensorrt_llm", repo / "tensorrt_llm")
    config = repo / "tensorrt_llm" / "config.pbtxt"
    text = config.read_text()
    for key, value in (("specdeploy_max_batch_size", 1), ("specdeploy_max_queue", 2)):
        line = re.compile(rf'(key: "{key}" value: {{ string_value: ")\d+(" }})')
        assert line.search(text), f"package wrote no {key} parameter"
        text = line.sub(rf"\g<1>{value}\g<2>", text)
    config.write_text(text)
    with TritonServer(repo, log_path=build_root / "logs" / "batching-small.log", threads=1) as srv:
        yield srv


@dataclass
class LongRun:
    tokens: list[int]  # a LONG request's answer, alone on the batching server
    seconds: float  # its wall time: sizes the client timeouts below, never asserted on


@pytest.fixture(scope="module")
def long_run(server, prompt_ids) -> LongRun:
    wait_idle(server)
    before = scrape(server)
    started = time.perf_counter()
    answer = ask_alone(server, prompt_ids[0], LONG)
    seconds = time.perf_counter() - started
    assert len(answer.tokens) == LONG, answer.error
    assert generated(before, scrape(server)) == LONG, "the counters add up to the tokens sent"
    return LongRun(answer.tokens, seconds)


@pytest.fixture(scope="module")
def long_request_s(long_run) -> float:
    return long_run.seconds


# ---------------------------------------------------------------------------------------------
# batching


def test_package_writes_the_batching_parameters(build_root):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text = (build_root / "triton_repo" / "cpu" / "tensorrt_llm" / "config.pbtxt").read_text()
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert config.parameters["specdeploy_max_batch_size"].string_value == str(cpu_repo.CPU_MAX_BATCH_SIZE)
    assert config.parameters["specdeploy_max_queue"].string_value == str(cpu_repo.CPU_MAX_QUEUE)
    assert config.HasField("dynamic_batching") and config.dynamic_batching.max_queue_delay_microseconds == 0


def test_concurrent_requests_are_batched_and_answer_as_alone(server, prompt_ids):
    requests = [(ids, n) for ids, n in zip(prompt_ids, (60, 90, 45, 120))]
    alone = [ask_alone(server, ids, n) for ids, n in requests]
    before, together, after = until_overlapping(
        lambda: (scrape(server), ask_together(server, requests), scrape(server)),
        lambda tried: [answer.final for answer in tried[1]])
    assert [a.tokens for a in together] == [a.tokens for a in alone]
    assert all(len(a.tokens) == n for a, (_, n) in zip(together, requests))
    # batched: the requests' target forwards add up to more than the batched forwards run
    forwards = metric(after, "specdeploy_target_forwards_total") - metric(before, "specdeploy_target_forwards_total")
    shares = metric(after, "specdeploy_sequence_forwards_total") - metric(before, "specdeploy_sequence_forwards_total")
    assert 0 < forwards < shares, (forwards, shares)
    # and their lifetimes overlap
    spans = sorted((a.final["first_scheduled_time_ns"], a.final["last_token_time_ns"]) for a in together)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), spans


def test_timestamps_are_ordered(server, prompt_ids):
    final = ask_alone(server, prompt_ids[1], 20).final
    assert final["arrival_time_ns"] <= final["first_scheduled_time_ns"] <= final["first_token_time_ns"] \
        <= final["last_token_time_ns"], final
    assert final["total_draft_tokens"] >= final["total_accepted_draft_tokens"] > 0


def test_metrics_endpoint_counts_speculative_decoding(server, prompt_ids):
    before = scrape(server)
    answer = ask_alone(server, prompt_ids[2], 30)
    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("specdeploy_draft_tokens_total") == answer.final["total_draft_tokens"] > 0
    assert moved("specdeploy_accepted_draft_tokens_total") == answer.final["total_accepted_draft_tokens"] > 0
    assert moved("specdeploy_target_forwards_total") > 0
    assert moved("specdeploy_drafted_at_position_total", position="1") >= moved("specdeploy_accepted_at_position_total",
                                                                                 position="1") > 0
    assert moved("specdeploy_requests_total", outcome="length", model="tensorrt_llm") == 1
    assert metric(after, "specdeploy_requests_in_flight", state="active") == 0


# ---------------------------------------------------------------------------------------------
# cancellation


def assert_cancelled_early(server, before, whole: int = LONG, rows: int = 1) -> None:
    """The one request sent since `before` (the server idle then; `rows` sequences) is recorded
    cancelled, and only that, has left the batch, and generated fewer tokens than `whole` a row,
    what each generates uncancelled."""
    answered = metric(before, "specdeploy_requests_total")
    wait_for(lambda: metric(scrape(server), "specdeploy_requests_total") >= answered + rows, DEADLINE_S,
             "the server answers the request")
    after = scrape(server)
    assert metric(after, "specdeploy_requests_total") == answered + rows
    assert metric(after, "specdeploy_requests_total", outcome="cancelled") == \
        metric(before, "specdeploy_requests_total", outcome="cancelled") + rows, "not recorded cancelled"
    assert metric(after, "specdeploy_requests_in_flight", state="active") == 0
    assert generated(before, after, rows) < rows * whole, (generated(before, after, rows), whole)


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "non-stream"])
def test_grpc_cancel_ends_the_request_early(server, prompt_ids, streaming):
    wait_idle(server)
    before = scrape(server)
    client = Direct(server)
    client.send(prompt_ids[0], LONG, streaming=streaming)
    if streaming:
        client.first_response()
    else:  # cancelled while it runs: in the batch, its first round done
        wait_for(lambda: in_flight(server) == 1, DEADLINE_S, "the request is in the batch")
    client.cancel()
    client.close()
    assert_cancelled_early(server, before)
    assert len(ask_alone(server, prompt_ids[1], 8).tokens) == 8  # and it serves the next one


def test_stop_input_ends_the_request_with_that_id(server, prompt_ids, long_run):
    """TRT-LLM's `stop`: a request with stop=true and request id X cancels the request X; X
    ends with what it generated so far, the stop request gets an empty final response."""
    wait_idle(server)
    long = Direct(server)
    long.send(prompt_ids[0], LONG, request_id="long-1")
    wait_for(lambda: in_flight(server) == 1, DEADLINE_S, "the request is in the batch")  # prefilled: a token or more
    stop = ask_alone(server, prompt_ids[0], 1, request_id="long-1", stop=True)
    stopped = long.collect()
    long.close()
    assert stop.error is None and stop.tokens == []
    assert stopped.error is None and 0 < len(stopped.tokens) < LONG
    assert stopped.tokens == long_run.tokens[:len(stopped.tokens)], "what it generated so far, the real tokens"
    assert in_flight(server) == 0
    nameless = ask_alone(server, prompt_ids[0], 1, stop=True)
    assert "a request id must be provided" in nameless.error


def test_a_prompt_without_tokens_or_with_a_wrong_length_is_refused_by_name(server, prompt_ids):
    ids = prompt_ids[0]
    assert ask_alone(server, [], 4).error.endswith("input_ids is empty: send at least one prompt token")
    wrong = ask_alone(server, ids, 4, input_lengths=len(ids) + 5).error
    assert f"input_lengths {len(ids) + 5} does not match {len(ids)} input_ids: it counts the prompt's tokens, " \
           f"1 to {len(ids)}" in wrong
    assert len(ask_alone(server, ids, 4).tokens) == 4


# ---------------------------------------------------------------------------------------------
# one sequence at a time: queue time and back-pressure


def _second_while_first_runs(server: TritonServer, prompt_ids) -> tuple[dict, dict]:
    """The perf outputs of a 200-token request and of one sent once the first has its first token."""
    first, second = Direct(server), Direct(server)
    first.send(prompt_ids[0], 200, streaming=True)
    first.first_response()
    second.send(prompt_ids[1], 10)
    a, b = first.collect().final, second.collect().final
    first.close()
    second.close()
    return a, b


def test_queue_time_is_visible(small_server, prompt_ids):
    a, b = until_overlapping(lambda: _second_while_first_runs(small_server, prompt_ids))
    assert b["first_scheduled_time_ns"] >= a["last_token_time_ns"], "batch of 1: admitted once the first ended"
    assert b["first_scheduled_time_ns"] - b["arrival_time_ns"] > 0  # its queue time
    assert b["arrival_time_ns"] <= b["first_scheduled_time_ns"] <= b["first_token_time_ns"] <= b["last_token_time_ns"]


def test_a_full_queue_answers_busy_and_the_server_stays_up(small_server, prompt_ids):
    running, waiting = Direct(small_server), Direct(small_server)
    before = scrape(small_server)
    running.send(prompt_ids[0], LONG, streaming=True)
    running.first_response()
    waiting.send(prompt_ids[1], LONG)
    wait_for(lambda: metric(scrape(small_server), "specdeploy_requests_in_flight", state="waiting") == 1, 30,
             "the second request waits")
    refused = ask_alone(small_server, prompt_ids[2], 4)
    assert refused.error == "server busy: 2 requests queued (max_queue 2); retry later"
    rejected = metric(scrape(small_server), "specdeploy_requests_total", outcome="rejected")
    assert rejected == metric(before, "specdeploy_requests_total", outcome="rejected") + 1
    for client in (running, waiting):
        client.cancel()
        client.close()
    cancelled = metric(before, "specdeploy_requests_total", outcome="cancelled")
    wait_for(lambda: metric(scrape(small_server), "specdeploy_requests_total", outcome="cancelled") == cancelled + 2,
             60, "both cancelled")
    assert len(ask_alone(small_server, prompt_ids[2], 4).tokens) == 4


# ---------------------------------------------------------------------------------------------
# HTTP (tritonserver 2.51): a disconnect cancels a generate_stream request sent to tensorrt_llm
# itself; a non-streaming generate request, or either through the ensemble, runs to its end on the
# server (see specdeploy.client.HTTP_CANCEL_HINT). The client gives up promptly either way.


def test_http_disconnect_cancels_a_generate_stream_request(server, prompt_ids):
    wait_idle(server)
    before = scrape(server)
    ids = prompt_ids[0]
    body = {"input_ids": ids, "input_lengths": len(ids), "request_output_len": LONG, "streaming": True}
    _disconnect_after_the_first_event(server, "tensorrt_llm", body)
    assert_cancelled_early(server, before)


def _disconnect_after_the_first_event(server, model: str, body: dict) -> None:
    url = f"http://{server.http_url}/v2/models/{model}/generate_stream"
    with requests.post(url, json=body, stream=True, timeout=60) as response:
        next(line for line in response.iter_lines() if line.startswith(b"data:"))


@pytest.mark.parametrize("stream", [True, False], ids=["generate_stream", "generate"])
def test_http_client_timeout_gives_up_promptly(server, model_dir, long_request_s, stream):
    client = TritonLLMClient(server.http_url, "http", timeout_s=0.2 * long_request_s)
    # through the ensemble the preprocessing sets end_id; this one the greedy model does not emit early
    end_id = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|im_end|>")
    wait_idle(server)
    before = finished(scrape(server))
    with pytest.raises(SpecDeployError, match=r"no complete answer within .* \(connection closed\)"):
        client.generate(Request(PROMPTS[0], max_tokens=LONG, end_id=end_id), stream=stream)
    # promptly: it gave up while the server was still generating the answer, not once it was done
    assert finished(scrape(server)) == before
    assert client.generate(Request(PROMPTS[0], max_tokens=4), stream=stream).text  # a short one still comes


# ---------------------------------------------------------------------------------------------
# tensorrt_llm_bls: the ensemble's steps as BLS, through which a client's cancellation reaches
# the running generation (through the ensemble, tritonserver 2.51 does not pass it on)


def _bls_request(model_dir: Path, max_tokens: int) -> Request:
    end_id = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|im_end|>")  # never generated early
    return Request(PROMPTS[0], max_tokens=max_tokens, end_id=end_id)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_bls_answers_as_the_ensemble(server, model_dir, stream):
    answers = {model: TritonLLMClient(server.grpc_url, "grpc", model=model).generate(_bls_request(model_dir, 40), stream=stream)
               for model in ("ensemble", "tensorrt_llm_bls")}
    assert answers["tensorrt_llm_bls"].text == answers["ensemble"].text != ""
    assert len(answers["tensorrt_llm_bls"].chunks) == len(answers["ensemble"].chunks)
    assert answers["tensorrt_llm_bls"].perf.keys() == answers["ensemble"].perf.keys()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_client_timeout_through_the_bls_ends_the_generation_early(server, model_dir, long_request_s, stream):
    wait_idle(server)  # requests given up over HTTP /generate by the tests above still run to their end on the server
    before = scrape(server)
    client = TritonLLMClient(server.grpc_url, "grpc", model="tensorrt_llm_bls", timeout_s=0.2 * long_request_s)
    with pytest.raises(SpecDeployError, match="request cancelled"):
        client.generate(_bls_request(model_dir, LONG), stream=stream)
    assert_cancelled_early(server, before)
    assert client.generate(_bls_request(model_dir, 4), stream=stream).text  # and it serves the next one


def test_a_cancelled_batched_request_through_the_bls_ends_every_row_early(server, model_dir):
    """Two prompts in one streamed request, cancelled once the first piece arrived: the BLS's stop
    request carries a flag per row (Triton refuses a request whose inputs differ in batch size)."""
    end_id = _bls_request(model_dir, 1).end_id
    rows = {"text_input": np.array([[PROMPTS[0]], [PROMPTS[1]]], dtype=object),
            "max_tokens": np.full((2, 1), LONG, np.int32), "end_id": np.full((2, 1), end_id, np.int32),
            "stream": np.full((2, 1), True)}
    wait_idle(server)
    before = scrape(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put(error or result))
    client.async_stream_infer("tensorrt_llm_bls", tensors(**rows))
    assert not isinstance(got.get(timeout=DEADLINE_S), Exception)
    client.stop_stream(cancel_requests=True)
    client.close()
    assert_cancelled_early(server, before, rows=2)


def test_a_bad_request_through_the_bls_gets_the_preprocessing_error(server):
    client = TritonLLMClient(server.grpc_url, "grpc", model="tensorrt_llm_bls")
    with pytest.raises(SpecDeployError, match="rejected the request: max_tokens must be at least 1"):
        client.generate(Request(PROMPTS[0], max_tokens=-3))
    assert client.generate(Request(PROMPTS[0], max_tokens=4)).text


def test_http_disconnect_through_the_bls_cancels_a_generate_stream_request(server, model_dir):
    wait_idle(server)
    before = scrape(server)
    body = {"text_input": PROMPTS[0], "max_tokens": LONG, "stream": True, "end_id": _bls_request(model_dir, 1).end_id}
    _disconnect_after_the_first_event(server, "tensorrt_llm_bls", body)
    assert_cancelled_early(server, before)
