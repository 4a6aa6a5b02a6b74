"""A real tritonserver (the binary bundled in nvidia-pytriton) on the packaged CPU repository of
the tiny model: HTTP and gRPC, streaming and not, bad requests, clean stop.

The deployment drafts with the target itself (spec "draft", draft = tiny model): at greedy every
draft token is accepted, so accepted groups of several tokens are guaranteed."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from specdeploy import resolve
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from specdeploy.runtime.deployment import deployment_device, load_decoder
from specdeploy.runtime.types import SamplingParams
from specdeploy.triton import stage
from specdeploy.triton.measure import inprocess_speed, served_speed
from specdeploy.triton import serve
from specdeploy.triton.serve import SHM_PREFIX, TritonServer, free_ports, shm_regions, start_together
from tests.triton_raw import StreamClient

pytestmark = pytest.mark.server

PROMPT = "def add(a, b):"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def build_root(tmp_path_factory, tiny_llama_dir) -> Path:
    root = tmp_path_factory.mktemp("served") / "build"
    build = BuildDir(root)
    resolve.run(build, str(tiny_llama_dir))
    stage.run(build, spec="draft", draft_model_dir=tiny_llama_dir, max_draft_len=4)
    return root


@pytest.fixture(scope="module")
def server(build_root):
    srv = TritonServer(build_root / "triton_repo" / "cpu", log_path=build_root / "logs" / "test-server.log", threads=1)
    srv.start()
    assert shm_regions(srv.shm_prefix), "the Python backend should use the server's own shm prefix"
    yield srv
    pid = srv.pid
    srv.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not shm_regions(srv.shm_prefix), "the server left Python-backend shared memory behind"


@pytest.fixture(scope="module")
def decoder(build_root):
    """The same deployment in-process: the reference the served answers must equal."""
    return load_decoder(build_root / "triton_repo" / "cpu" / "tensorrt_llm" / "1" / "deployment.json")


@pytest.fixture()
def stream(server):
    with StreamClient(server.grpc_url) as client:
        yield client


def http_post(server, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


def reference(decoder, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS):
    return decoder.generate(prompt, SamplingParams(max_new_tokens=max_tokens))


# ---------------------------------------------------------------------------------------------
# gRPC


def test_grpc_stream_sends_groups_then_a_final_response_with_perf_metrics(stream, decoder):
    text, result = reference(decoder)
    got = stream.generate(PROMPT, MAX_TOKENS, return_perf_metrics=True)
    assert got.text == text
    assert len(got.pieces) >= 2, "expected the text in several streamed responses"
    # the full draft every round (not adaptive): the served counts are the runtime's own for this request
    drafted, accepted = got.final["total_draft_tokens"], got.final["total_accepted_draft_tokens"]
    assert (drafted, accepted) == (result.metrics.draft_tokens, result.metrics.accepted_draft_tokens) and accepted > 0
    assert got.final["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert got.final["first_token_time_ns"] <= got.final["last_token_time_ns"]


def test_grpc_non_streaming_is_one_response(stream, decoder):
    text, _ = reference(decoder)
    got = stream.generate(PROMPT, MAX_TOKENS, stream=False)
    assert got.pieces == [text]
    assert "total_draft_tokens" not in got.final  # only with return_perf_metrics


def _direct_inputs(ids: list[int], max_tokens: int, streaming: bool) -> list:
    def one(name, array, dtype):
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        return tensor

    return [
        one("input_ids", np.array([ids], dtype=np.int32), "INT32"),
        one("input_lengths", np.array([[len(ids)]], dtype=np.int32), "INT32"),
        one("request_output_len", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        one("streaming", np.array([[streaming]], dtype=bool), "BOOL"),
    ]


def test_each_accepted_group_is_one_response_of_several_tokens(server, decoder):
    """tensorrt_llm itself (what the ensemble calls): output_ids per response are the groups."""
    ids = decoder.encode(PROMPT)
    _, result = reference(decoder)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    groups = []
    try:
        client.async_stream_infer("tensorrt_llm", _direct_inputs(ids, MAX_TOKENS, True),
                                  enable_empty_final_response=True)
        while True:
            got, error = responses.get(timeout=120)
            assert error is None, error
            groups.append(got.as_numpy("output_ids").reshape(-1).tolist())
            if got.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
    assert groups[-1] == [], "the final response carries no tokens, only the end of the stream"
    assert sum(groups, []) == result.token_ids
    assert max(len(g) for g in groups) > 1, f"no response held several accepted tokens: {groups}"


# ---------------------------------------------------------------------------------------------
# HTTP


def test_http_generate_stream_sse(server, decoder):
    text, _ = reference(decoder)
    status, body = http_post(server, "/v2/models/ensemble/generate_stream",
                             {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "stream": True})
    assert status == 200, body
    events = sse_events(body)
    assert len(events) >= 3
    assert "".join(e["text_output"] for e in events) == text


def test_http_generate_non_streaming(server, decoder):
    text, result = reference(decoder, max_tokens=5)
    status, body = http_post(server, "/v2/models/ensemble/generate",
                             {"text_input": PROMPT, "max_tokens": 5, "return_perf_metrics": True,
                              "exclude_input_in_output": True})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["text_output"] == text
    # the package speculates every round with the full draft (not adaptive), so a greedy request's
    # counts are deterministic: the served perf outputs are the runtime's own for the same request
    assert result.metrics.draft_tokens > 0
    assert (answer["total_draft_tokens"], answer["total_accepted_draft_tokens"]) == \
        (result.metrics.draft_tokens, result.metrics.accepted_draft_tokens)
    # TensorRT-LLM's default: the answer repeats the prompt
    status, body = http_post(server, "/v2/models/ensemble/generate", {"text_input": PROMPT, "max_tokens": 5})
    assert status == 200 and json.loads(body)["text_output"] == PROMPT + text, body


def test_stop_words_and_sampling_inputs(server, decoder):
    text, _ = reference(decoder, max_tokens=20)
    stop = text[3:6] if len(text) > 6 else text
    status, body = http_post(server, "/v2/models/ensemble/generate",
                             {"text_input": PROMPT, "max_tokens": 20, "stop_words": [stop], "exclude_input_in_output": True})
    assert status == 200, body
    assert len(json.loads(body)["text_output"]) < len(text)  # the answer alone: generate keeps the prompt by default
    sampled = {"text_input": PROMPT, "max_tokens": 8, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7}
    first, second = http_post(server, "/v2/models/ensemble/generate", sampled), \
        http_post(server, "/v2/models/ensemble/generate", sampled)
    assert first[0] == 200 and first == second, "same seed, same sample"


def test_concurrent_streams_get_their_own_answers(server, decoder):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [PROMPT, "The quick brown fox", "for i in range(10):"]
    expected = [reference(decoder, p, 8)[0] for p in prompts]

    def ask(prompt: str) -> str:
        with StreamClient(server.grpc_url) as client:
            return client.generate(prompt, 8).text

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(ask, prompts)) == expected


# ---------------------------------------------------------------------------------------------
# bad requests: a clear Triton error, and the server keeps answering


BAD_HTTP = [
    ({"max_tokens": 4}, 400, "missing required input(s) ['text_input']"),
    ({"text_input": PROMPT, "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0"),
    ({"text_input": PROMPT, "max_tokens": 10**9}, 400, "exceed the model's context of 256 tokens"),
    # a JSON string for an INT32 input: Triton's HTTP frontend itself rejects it (500, its wording)
    ({"text_input": PROMPT, "max_tokens": "many"}, 500, "Unable to parse 'data'"),
    ({"text_input": PROMPT, "max_tokens": 4, "temperature": -1.0}, 400, "temperature must be >= 0"),
    ({"text_input": PROMPT, "max_tokens": 4, "top_p": 1.5}, 400, "top_p must be <= 1"),
    ({"text_input": PROMPT, "max_tokens": 4, "beam_width": 2}, 400, "beam_width=2 is not supported"),
    ({"text_input": PROMPT, "max_tokens": 4, "bad_words": ["add"]}, 400, "bad_words is not supported"),
    ({"text_input": PROMPT, "max_tokens": 4, "guided_decoding_guide_type": "json"}, 400, "not supported"),
    ({"text_input": "add " * 400, "max_tokens": 4}, 400, "beyond the model's context of 256 tokens"),
    ({"text_input": "", "max_tokens": 4}, 400, "text_input is empty"),
]


@pytest.mark.parametrize("body,status,message", BAD_HTTP, ids=[m[:28] for _, _, m in BAD_HTTP])
def test_bad_http_request_gets_a_clear_error(server, body, status, message):
    got_status, got_body = http_post(server, "/v2/models/ensemble/generate", body)
    assert got_status == status, got_body
    assert message in json.loads(got_body)["error"], got_body


def test_bad_grpc_requests_then_a_good_one(stream, decoder):
    text, _ = reference(decoder, max_tokens=6)
    with pytest.raises(InferenceServerException, match="text_input is not valid UTF-8"):
        stream.generate("", 6, text_input=np.array([[b"\xff\xfeabc"]], dtype=object))
    with pytest.raises(InferenceServerException, match="(?i)unexpected datatype.*max_tokens|max_tokens.*FP32"):
        stream.generate(PROMPT, np.array([[6.0]], dtype=np.float32))
    with pytest.raises(InferenceServerException, match="max_tokens must be at least 1"):
        stream.generate(PROMPT, -3)
    assert stream.generate(PROMPT, 6).text == text


def test_server_still_healthy_after_bad_requests(server, decoder):
    for body, _, _ in BAD_HTTP:
        http_post(server, "/v2/models/ensemble/generate", body)
    assert server.ready() and server.process.poll() is None
    text, _ = reference(decoder, max_tokens=5)
    status, body = http_post(server, "/v2/models/ensemble/generate",
                             {"text_input": PROMPT, "max_tokens": 5, "exclude_input_in_output": True})
    assert status == 200 and json.loads(body)["text_output"] == text


# ---------------------------------------------------------------------------------------------
# where the model computes


def test_model_logs_the_device_it_computes_on(server, build_root):
    """A KIND_CPU instance computes where deployment.json says (the CPU here) and says so on load."""
    path = build_root / "triton_repo" / "cpu" / "tensorrt_llm" / "1" / "deployment.json"
    where = deployment_device(json.loads(path.read_text()), path)
    log = Path(server.log_path).read_text(errors="replace")
    said = re.search(r"specdeploy tensorrt_llm: .*deployment\.json, computing on (\S+) \(.*\), instance .*\((\w+)\)", log)
    assert said, log[-2000:]
    assert said.groups() == (str(where), "CPU")


@pytest.mark.gpu
def test_kind_gpu_instance_serves_on_its_gpu(build_root):
    """The CPU repository's tensorrt_llm as a KIND_GPU instance: Triton's device id picks the
    GPU (over deployment.json's cpu), and the served text equals the runtime on CUDA."""
    repo = build_root / "triton_repo" / "cpu_kind_gpu"  # beside cpu/: deployment.json's relative paths hold
    shutil.copytree(build_root / "triton_repo" / "cpu", repo, dirs_exist_ok=True)
    config = repo / "tensorrt_llm" / "config.pbtxt"
    text = config.read_text()
    assert "kind: KIND_CPU" in text
    config.write_text(re.sub(r"kind: KIND_CPU", "kind: KIND_GPU gpus: [ 0 ]", text))
    deployment = repo / "tensorrt_llm" / "1" / "deployment.json"
    deployment.write_text(json.dumps({**json.loads(deployment.read_text()), "device": "cpu"}))
    on_cuda = load_decoder(deployment, device="cuda:0")
    expected, _ = reference(on_cuda)
    with TritonServer(repo, log_path=build_root / "logs" / "kind-gpu.log", threads=1) as srv:
        with StreamClient(srv.grpc_url) as client:
            assert client.generate(PROMPT, MAX_TOKENS).text == expected
        log = Path(srv.log_path).read_text(errors="replace")
    assert "computing on cuda:0" in log and "(GPU)" in log, log[-2000:]


# ---------------------------------------------------------------------------------------------
# measurement helper (make bench's served rows)


def test_served_speed_measures_tokens_per_s_and_ttft(server, decoder):
    prompts = [PROMPT, "The quick brown fox"]
    params = SamplingParams(max_new_tokens=MAX_TOKENS)
    local = inprocess_speed(decoder, prompts, params)
    counts = local["tokens_by_prompt"]
    served = served_speed(server.grpc_url, prompts, MAX_TOKENS, count_tokens=lambda p, _: counts[p])
    assert served["new_tokens"] == local["new_tokens"] > 0
    assert served["tokens_per_s"] > 0 and 0 < served["ttft_median_s"] <= served["latency_median_s"]


# ---------------------------------------------------------------------------------------------
# `specdeploy serve`: the CLI process, stopped by a signal


ECHO_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
                for r in requests]
"""
ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_command_stops_cleanly_on_signal(tmp_path, signum):
    """The CLI on free ports, stopped by its PID with SIGINT/SIGTERM: exit 0, log written, shm cleaned.
    (A one-model repository: the packaged one is served by the module's server above.)"""
    repo = _echo_repo(tmp_path / "repo")
    ports = [str(port) for port in free_ports(3)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdeploy", "serve", "--build-dir", str(tmp_path / "build"), "--repo", str(repo),
         "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "tritonserver ready" in line, line + proc.stdout.read()
        assert f"127.0.0.1:{ports[0]}" in line
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
        tensor = grpcclient.InferInput("IN", [3], "INT32")
        tensor.set_data_from_numpy(np.array([1, 2, 3], dtype=np.int32))
        assert client.infer("echo", [tensor]).as_numpy("OUT").tolist() == [1, 2, 3]
        assert shm_regions(f"{SHM_PREFIX}specdeploy_{proc.pid}_")
        proc.send_signal(signum)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "tritonserver stopped" in proc.stdout.read()
    assert "Started GRPCInferenceService" in (tmp_path / "build" / "logs" / "tritonserver.log").read_text()
    assert not shm_regions(f"{SHM_PREFIX}specdeploy_{proc.pid}_")


def test_serve_from_a_build_it_cannot_write_logs_elsewhere_and_says_where(tmp_path):
    """A build mounted read-only: <build>/logs cannot be made (here a file holds its name), so the
    log goes to a temp file, named on stderr and in the ready line, kept after the server stopped."""
    repo = _echo_repo(tmp_path / "repo")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "logs").write_text("not a folder")
    ports = [str(port) for port in free_ports(3)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdeploy", "serve", "--build-dir", str(tmp_path / "build"), "--repo", str(repo),
         "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "tritonserver ready" in line, line + proc.stderr.read()
        log = Path(re.search(r"log (\S+)\. Ctrl-C", line).group(1))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"cannot write {tmp_path / 'build' / 'logs' / 'tritonserver.log'} (File exists): the server's log is " \
           f"{log}" in proc.stderr.read()
    assert "Started GRPCInferenceService" in log.read_text()
    log.unlink()


def _echo_repo(root: Path, model_py: str = ECHO_MODEL) -> Path:
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (root / "echo" / "1" / "model.py").write_text(model_py)
    return root


def test_start_together_serves_both_and_stops_both_when_one_fails(tmp_path):
    """Launched side by side, both answer; when one cannot load, the error names it and the other
    is stopped too (no orphan tritonserver, no shm left behind)."""
    good = _echo_repo(tmp_path / "good")
    broken = _echo_repo(tmp_path / "broken", ECHO_MODEL + "\nraise RuntimeError('this model cannot load')\n")
    with ExitStack() as stack:
        servers = start_together(stack, {"a": TritonServer(good), "b": TritonServer(good)})
        assert all(server.ready() for server in servers.values())
        pids = [server.pid for server in servers.values()]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    servers = {"good": TritonServer(good), "broken": TritonServer(broken)}
    with pytest.raises(SpecDeployError, match="tritonserver exited") as err, ExitStack() as stack:
        start_together(stack, servers)
    assert "broken" in str(err.value)
    assert all(server.process is None for server in servers.values())
    assert not any(shm_regions(server.shm_prefix) for server in servers.values())


# A stand-in for the binary: its first start prints `message` and aborts (as the bundled one's gRPC
# poller once did), later starts answer the health check on --http-port.
FLAKY_BINARY = """#!{python}
import http.server, os, pathlib, sys
starts = pathlib.Path(__file__).with_suffix(".starts")
starts.write_text(starts.read_text() + "x" if starts.exists() else "x")
if len(starts.read_text()) == 1:
    print({message!r}, flush=True)
    os.abort()

class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

port = int(sys.argv[sys.argv.index("--http-port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
"""
POLLER_ABORT = ("E1127 15:49:20.807247 18148 ev_epoll1_linux.cc:373] (event_engine) Epoll1Poller:0x55e45e365380 "
                "encountered epoll_wait error: Bad file descriptor")


@pytest.mark.parametrize("message, comes_up", [(POLLER_ABORT, True), ("terminate called after throwing", False)])
def test_a_start_aborted_in_grpcs_poller_is_made_once_more(tmp_path, capsys, message, comes_up):
    """That abort (seen once, two servers starting side by side) gets a second start; any other is final."""
    binary = tmp_path / "tritonserver"
    binary.write_text(FLAKY_BINARY.format(python=sys.executable, message=message))
    binary.chmod(0o755)
    server = TritonServer(_echo_repo(tmp_path / "repo"), tritonserver=binary, ready_timeout=30)
    starts = tmp_path / "tritonserver.starts"
    if comes_up:
        with server:
            assert server.ready() and starts.read_text() == "xx"
        assert "aborted in gRPC's poller" in capsys.readouterr().err
    else:
        with pytest.raises(SpecDeployError, match="exited with code -6"):
            server.start()
        assert starts.read_text() == "x"


def test_bundled_tritonserver_is_found_without_importing_pytriton():
    """pytriton's __init__ imports its own client, which needs gevent; an environment without it
    (NVIDIA's CUDA images, where the wheel is brought in with --no-deps) must still find the binary."""
    code = ("import sys; from specdeploy.triton.serve import bundled_tritonserver; "
            "print(bundled_tritonserver().is_file(), sorted(m for m in sys.modules if m.split('.')[0] == 'pytriton'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True []"


def test_bundled_stub_under_numpy_2_is_refused_before_the_server_starts(monkeypatch, build_root):
    """The stub crashes on text inputs under numpy 2 (seen on a CUDA image whose packages need it):
    the error names numpy and the fix, and no tritonserver is started."""
    serve.check_stub_numpy("1.26.4")
    real_version = serve.importlib.metadata.version
    monkeypatch.setattr(serve.importlib.metadata, "version",
                        lambda name: "2.5.2" if name == "numpy" else real_version(name))
    started = []
    monkeypatch.setattr(serve.subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(SpecDeployError, match=r"numpy 2\.5\.2.*numpy 1") as err:
        TritonServer(build_root / "triton_repo" / "cpu").start()
    assert "make venv" in str(err.value) and not started


def test_ports_are_never_handed_out_twice(monkeypatch, tmp_path):
    """The OS hands a port it just freed out again (CI once gave one server's HTTP and metrics the
    same port, and tritonserver refused to start): a port picked, given or handed out already is skipped."""
    offered = iter([41001, 41001, 41002, 41001, 41003, 41004, 41002, 41005, 41006, 41007])

    class OsSocket:  # what the OS offers to bind(port 0), in order
        def __init__(self, *args):
            self.port = None

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(serve.socket, "socket", OsSocket)
    monkeypatch.setattr(serve, "_HANDED_OUT", set())
    first = TritonServer(tmp_path)
    assert (first.http_port, first.grpc_port, first.metrics_port) == (41001, 41002, 41003)
    second = TritonServer(tmp_path, grpc_port=41006)
    assert (second.http_port, second.grpc_port, second.metrics_port) == (41004, 41006, 41005)
    assert serve.free_ports(1, exclude=(41006,)) == [41007]

