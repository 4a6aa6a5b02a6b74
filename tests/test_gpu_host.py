"""build_scripts/gpu_host.sh offline, against stubs of what a GPU host has (docker, NVIDIA's
container: tritonserver, tensorrt_llm, trtllm-serve; the user's Python running verify): the
version check, a server that dies or never gets ready, the order served -> server stopped ->
reference, nothing installed into the image, the trtllm-serve command as printed, modes a
non-root server can read, the refusals, and a build directory that still works after it moved."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdeploy.cli import main as cli_main
from specdeploy.client import Completion
from specdeploy.fileio import atomic_write_text
from specdeploy.manifest import BuildDir
from specdeploy.triton import stage
from specdeploy.triton.serve import free_ports
from specdeploy.trtllm import build as trt_build
from tests.test_triton_package import eagle3_module, new_build

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "build_scripts" / "gpu_host.sh"
IMAGE = "registry.example/tritonserver:trtllm-1.2.1"  # the release's image, as a test names it
INSTALLS = re.compile(r"\bpip3?\b|\binstall\b")
RELEASE = {"version": "1.2.1", "line": "1.2", "triton_image": IMAGE, "triton_image_note": f"NGC: {IMAGE}",
           "serve_image": "nvcr.io/nvidia/tensorrt-llm/release:1.2.1", "serve_flag": "--config",
           "transformers": "4.56.0", "torch": "2.9.0a0"}


def gpu_host(*args: str, env: dict | None = None, umask: str | None = None) -> subprocess.CompletedProcess:
    command = ["bash", str(SCRIPT), *args]
    if umask:
        command = ["bash", "-c", f'umask {umask} && exec "$@"', "bash", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def packaged(root: Path, model: Path, kind: str, eagle: dict | None = None, **options) -> BuildDir:
    build = new_build(root, model, kind, eagle, **options)
    trt_build.run(build)
    stage.run(build, spec=kind, max_draft_len=options.get("max_draft_len"))
    return build


def with_release(root: Path, **release) -> Path:
    """gpu_routes.json with the release each test names, over the one the package stage recorded."""
    path = root / "triton_repo" / "gpu_routes.json"
    routes = json.loads(path.read_text())
    routes["release"] = {**routes["release"], **RELEASE, **release}
    path.write_text(json.dumps(routes))
    return root


def fake_container(tmp_path: Path) -> Path:
    """What NVIDIA's container holds in /app/all_models for the two routes (owner-only modes, as
    a copy out of an image can have)."""
    models = tmp_path / "all_models"
    for folder, files in (("llmapi/tensorrt_llm", ("config.pbtxt", "1/model.py", "1/helpers.py", "1/model.yaml")),
                          ("inflight_batcher_llm/tensorrt_llm_bls/1", ("model.py", "lib/decode.py"))):
        for name in files:
            (models / folder / name).parent.mkdir(parents=True, exist_ok=True)
            (models / folder / name).write_text(f"# upstream {name}\n")
            (models / folder / name).chmod(0o600)
    return models


@pytest.fixture(scope="module")
def base_build(tmp_path_factory, tiny_llama_dir) -> Path:
    """A packaged build with both GPU routes (no speculation): copied by each test that runs on it."""
    return packaged(tmp_path_factory.mktemp("base") / "b", tiny_llama_dir, "none").root.resolve()


@pytest.fixture(scope="module")
def eagle_build(tmp_path_factory, tiny_llama_dir) -> Path:
    """A packaged EAGLE-3 build: its trtllm-serve YAML names the draft module by path."""
    return packaged(tmp_path_factory.mktemp("eagle") / "b", tiny_llama_dir, "eagle", eagle3_module(tiny_llama_dir)).root.resolve()


@pytest.fixture
def build(tmp_path, base_build) -> Path:
    root = tmp_path / "build"
    shutil.copytree(base_build, root, symlinks=True)
    return with_release(root)


# ---------------------------------------------------------------------------------------------
# stubs: docker, NVIDIA's container, the user's Python

FAKES = r'''
import json, os, shutil, signal, subprocess, sys, tempfile, time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

STUBS = Path(os.environ["STUB_DIR"])


def record(name, entry):
    with open(STUBS / f"{name}.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def tritonserver(args):
    """STUB_SERVER: serve (ready at once), hang (never ready), exit (dies while loading)."""
    mode = os.environ.get("STUB_SERVER", "serve")
    print("I0101 tritonserver stub: loading", flush=True)
    if mode == "exit":
        print("E0101 failed to load 'tensorrt_llm': CUDA out of memory", flush=True)
        sys.exit(1)
    (STUBS / "server.pid").write_text(str(os.getpid()))

    class Ready(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if mode == "serve" and self.path.endswith("/ready") else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    http = HTTPServer(("127.0.0.1", int(args[args.index("--http-port") + 1])), Ready)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    http.serve_forever()


def in_container(path):
    return path.replace("/app/all_models", os.environ["STUB_ALL_MODELS"])


def docker(args):
    record("docker", args)
    if args[0] == "run" and "python3" in args:  # the version probe: run as the image would
        with tempfile.TemporaryDirectory() as packages:
            (Path(packages) / "tensorrt_llm").mkdir()
            (Path(packages) / "tensorrt_llm" / "__init__.py").write_text(f"__version__ = {os.environ.get('STUB_TRTLLM', '1.2.1')!r}\n")
            print("== NVIDIA Release 25.12 (banner) ==", flush=True)
            command = [sys.executable, *[in_container(a) for a in args[args.index("python3") + 1:]]]
            image_path = f"{STUBS / 'image_bin'}{os.pathsep}{os.environ['PATH']}"  # the image's tritonserver
            return subprocess.run(command, env={**os.environ, "PYTHONPATH": packages, "PATH": image_path}).returncode
    if args[0] == "run" and "tritonserver" in args:
        return tritonserver(args[args.index("tritonserver") + 1:])
    if args[0] == "cp":
        shutil.copytree(in_container(args[1].split(":", 1)[1]), args[2], dirs_exist_ok=True)
    if args[0] == "stop":
        pid = int((STUBS / "server.pid").read_text())
        os.kill(pid, signal.SIGTERM)
        while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text():
            time.sleep(0.05)
    return 0


def server_alive():
    pid = STUBS / "server.pid"
    if not pid.exists():
        return False
    try:
        os.kill(int(pid.read_text()), 0)
        return True
    except ProcessLookupError:
        return False


def python(args):
    """The user's Python running `specdeploy verify`: records each phase and whether a server ran."""
    if args[0] == "-c":  # gpu_host's check that verify can run here
        return 0
    phase = args[args.index("--phase") + 1]
    record("verify", {"phase": phase, "server_alive": server_alive(), "args": args,
                      "pythonpath": os.environ.get("PYTHONPATH"), "offline": os.environ.get("HF_HUB_OFFLINE")})
    served = Path(args[args.index("--served-file") + 1])
    if phase == "served":
        served.write_text("{}")
    return 0 if served.exists() else 1


def trtllm_serve(args):
    """trtllm-serve MODEL <the release's flag> YAML: the flag, the model, the YAML and its paths."""
    model, flag, config = args[:3]
    assert flag == os.environ["STUB_SERVE_FLAG"], flag
    assert (Path(model) / "config.json").exists(), model
    text = Path(config).read_text()
    assert "$BUILD_DIR" not in text, text
    paths = [v for v in json.dumps(__import__("yaml").safe_load(text)).split('"') if v.startswith("/")]
    assert paths and all(Path(p).exists() for p in paths), paths
    print("trtllm-serve stub: ok", paths)
    return 0
'''


def stubs(tmp_path: Path, *, local: bool = False, **env: str) -> dict:
    """PATH with docker / tritonserver / trtllm-serve stubs and the environment they read. `local`:
    NVIDIA's stack is here (tritonserver on PATH, tensorrt_llm importable): no docker."""
    bin_dir, state = tmp_path / "stub_bin", tmp_path / "stub_state"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "fakes.py").write_text(FAKES)
    names = {"docker": "docker", "trtllm-serve": "trtllm_serve", "specdeploy-python": "python"}
    if local:
        names["tritonserver"] = "tritonserver"
    (state / "image_bin").mkdir()
    for name, function in [*names.items(), ("image_bin/tritonserver", "tritonserver")]:
        stub = (state if "/" in name else bin_dir) / name
        stub.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(bin_dir)!r})\nimport fakes\n"
                        f"sys.exit(fakes.{function}(sys.argv[1:]))\n")
        stub.chmod(0o755)
    if local:
        shutil.move(bin_dir / "docker", state / "docker")  # inside the container: no docker
        packages = tmp_path / "container_packages" / "tensorrt_llm"
        packages.mkdir(parents=True)
        (packages / "__init__.py").write_text(f"__version__ = {env.pop('STUB_TRTLLM', '1.2.1')!r}\n")
        env["PYTHONPATH"] = str(packages.parent)
    http, grpc, metrics = free_ports(3)
    all_models = fake_container(tmp_path)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STUB_DIR": str(state), "STUB_ALL_MODELS": str(all_models),
            "SPECDEPLOY_PYTHON": str(bin_dir / "specdeploy-python"), "HTTP_PORT": str(http), "GRPC_PORT": str(grpc),
            "METRICS_PORT": str(metrics), **({"SPECDEPLOY_ALL_MODELS": str(all_models)} if local else {}), **env}


def recorded(env: dict, name: str) -> list:
    path = Path(env["STUB_DIR"]) / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------------------------------
# the flow


@pytest.mark.parametrize("script", ["gpu_host.sh", "build_engines.sh"])
def test_scripts_are_valid_bash(script):
    assert subprocess.run(["bash", "-n", str(ROOT / "build_scripts" / script)], capture_output=True).returncode == 0


def test_the_planner_parses_as_the_oldest_python_it_supports():
    assert "sys.version_info < (3, 8)" in SCRIPT.read_text()
    ast.parse((ROOT / "build_scripts" / "gpu_host.py").read_text(), feature_version=(3, 8))


@pytest.mark.parametrize("local", [False, True], ids=["docker", "in-container"])
def test_verify_answers_while_serving_and_the_reference_loads_after_the_server_is_gone(tmp_path, build, local):
    env = stubs(tmp_path, local=local)
    done = gpu_host(str(build), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    phases = recorded(env, "verify")
    assert [(p["phase"], p["server_alive"]) for p in phases] == [("served", True), ("reference", False)]
    served, reference = phases
    assert served["args"][served["args"].index("--url") + 1] == f"127.0.0.1:{env['GRPC_PORT']}"
    assert reference["args"][-2:] == ["--device", "cuda"]
    assert all(p["pythonpath"].split(os.pathsep)[0] == str(ROOT) and p["offline"] == "1" for p in phases)
    assert "TensorRT-LLM 1.2.1" in done.stdout.splitlines()[0]  # the versions come first
    assert os.access(build / "gpu_host" / "llmapi" / "tensorrt_llm" / "1" / "helpers.py", os.R_OK)
    if local:
        return
    calls = recorded(env, "docker")
    assert calls[0][:3] == ["run", "--rm", IMAGE] and "python3" in calls[0]  # the probe, the build's release's image
    assert {call[0] for call in calls} <= {"run", "create", "cp", "rm", "stop"}  # no exec into a container
    assert not any(INSTALLS.search(" ".join(call)) for call in calls)  # nothing installed into the image
    server = next(call for call in calls if "tritonserver" in call)
    for port in (env["HTTP_PORT"], env["GRPC_PORT"], env["METRICS_PORT"]):
        assert f"127.0.0.1:{port}:{port}" in server  # published on loopback only
    assert f"{build}:/build:ro" in server and "HF_HUB_OFFLINE=1" in server and "TRANSFORMERS_OFFLINE=1" in server
    assert server[server.index("tritonserver") + 1:server.index("tritonserver") + 3] == ["--model-repository", "/build/gpu_host/llmapi"]
    assert calls[-1][:1] == ["stop"]


@pytest.mark.parametrize("local", [False, True], ids=["docker", "in-container"])
def test_a_server_that_exits_stops_the_wait_at_once_with_its_log(tmp_path, build, local):
    env = stubs(tmp_path, local=local, STUB_SERVER="exit")
    started = time.monotonic()
    done = gpu_host("--ready-timeout", "600", str(build), env=env)
    assert done.returncode == 11, done.stdout + done.stderr
    assert time.monotonic() - started < 30
    assert "tritonserver exited (code 1)" in done.stderr and "CUDA out of memory" in done.stderr  # the log's tail
    assert recorded(env, "verify") == []


def test_a_server_never_ready_is_given_up_after_the_timeout_and_stopped(tmp_path, build):
    env = stubs(tmp_path, STUB_SERVER="hang")
    started = time.monotonic()
    done = gpu_host("--ready-timeout", "2", str(build), env=env)
    assert done.returncode == 11 and "not ready after 2 s" in done.stderr and "I0101 tritonserver stub" in done.stderr
    assert time.monotonic() - started < 30
    assert recorded(env, "docker")[-1][0] == "stop" and recorded(env, "verify") == []


@pytest.mark.parametrize("local", [False, True], ids=["docker", "in-container"])
def test_another_tensorrt_llm_release_in_the_image_is_refused_before_anything_runs(tmp_path, build, local):
    env = stubs(tmp_path, local=local, STUB_TRTLLM="1.1.0")
    done = gpu_host(str(build), env=env)
    assert done.returncode == 8, done.stdout + done.stderr
    assert "carries TensorRT-LLM 1.1.0" in done.stderr and "converted for TensorRT-LLM 1.2.1 (line 1.2)" in done.stderr
    assert f"use {IMAGE}" in done.stderr  # names the image for this build
    assert "TensorRT-LLM 1.1.0, torch" in done.stdout  # the versions it found, printed first
    assert len(recorded(env, "docker")) == (0 if local else 1) and not (build / "gpu_host").exists()


def test_in_a_container_that_cannot_run_verify_it_says_what_to_run_from_outside(tmp_path, build):
    env = stubs(tmp_path, local=True)
    env.pop("SPECDEPLOY_PYTHON")
    tritonclient = Path(env["PYTHONPATH"]) / "tritonclient"
    tritonclient.mkdir()
    (tritonclient / "__init__.py").write_text("raise ImportError('not in this image')\n")
    done = gpu_host(str(build), env=env)
    assert done.returncode == 10, done.stdout + done.stderr
    assert "nothing is installed into NVIDIA's image" in done.stderr and f"--serve-only {build}" in done.stderr
    assert "--phase served" in done.stderr and "--phase reference" in done.stderr
    assert not (Path(env["STUB_DIR"]) / "server.pid").exists()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])  # a kill; a closed terminal or dropped SSH
def test_serve_only_serves_until_stopped_and_then_stops_the_server(tmp_path, build, stop):
    env = stubs(tmp_path)
    serving = subprocess.Popen(["bash", str(SCRIPT), "--serve-only", str(build)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, **env})
    try:
        lines = iter(serving.stdout.readline, "")
        assert any("serving on 127.0.0.1" in line for line in lines)
        assert "--phase served" in next(lines)
    finally:
        serving.send_signal(stop)
    assert serving.wait(60) == 128 + stop
    assert recorded(env, "docker")[-1][0] == "stop" and recorded(env, "verify") == []


def test_the_image_is_the_builds_release_and_a_release_without_one_needs_an_image(tmp_path, build):
    env = stubs(tmp_path)
    with_release(build, triton_image="example/tritonserver:custom")
    assert "--rm example/tritonserver:custom python3" in gpu_host("--dry-run", str(build), env=env).stdout
    with_release(build, triton_image=None, triton_image_note="build it with NVIDIA's tensorrtllm_backend recipe")
    done = gpu_host("--dry-run", str(build), env=env)
    assert done.returncode == 9 and "build it with NVIDIA's tensorrtllm_backend recipe" in done.stderr
    assert "--rm my/image:1 python3" in gpu_host("--dry-run", str(build), "my/image:1", env=env).stdout


def test_dry_run_prints_the_plan_in_order_without_installing_anything(tmp_path, build):
    env = stubs(tmp_path)
    done = gpu_host("--dry-run", str(build), env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    steps = [f"docker run --rm {IMAGE} python3 -c",
             f"gpu_host.sh --assemble --route llmapi --mount /build {build} {IMAGE}",
             f"docker run --rm --gpus all --ipc=host --shm-size=2g --ulimit memlock=-1 -p 127.0.0.1:{env['HTTP_PORT']}:",
             f"--phase served --served-file {build}/gpu_host/llmapi.served.json --url 127.0.0.1:{env['GRPC_PORT']}",
             "docker stop -t 60 specdeploy-llmapi-",
             "--phase reference",
             "# or trtllm-serve: docker run"]
    assert all(step in out for step in steps), out
    assert [out.index(step) for step in steps] == sorted(out.index(step) for step in steps)
    assert not INSTALLS.search(out)
    assert not recorded(env, "docker")  # a dry run runs nothing


def test_dry_run_engine_route_builds_engines_and_takes_the_bls_code(tmp_path, tiny_llama_dir, tiny_draft_dir):
    build = with_release(packaged(tmp_path / "b", tiny_llama_dir, "draft", draft_model=str(tiny_draft_dir), max_draft_len=3).root.resolve())
    env = stubs(tmp_path)
    # NVIDIA's BLS reads the other models' configs over gRPC at localhost:8001: another port is refused
    done = gpu_host("--dry-run", "--route", "engine", str(build), env={**env, "GRPC_PORT": "18001"})
    assert done.returncode == 2 and "GRPC_PORT=18001" in done.stderr and "localhost:8001" in done.stderr
    done = gpu_host("--dry-run", "--route", "engine", str(build), env={**env, "GRPC_PORT": "8001"})
    assert done.returncode == 0, done.stderr
    out = done.stdout
    engines = (f"-v {build}:/build -e HF_HUB_OFFLINE=1 -e TRANSFORMERS_OFFLINE=1 -e CKPT_DIR=/build/trtllm_ckpt "
               f"-e ENGINE_DIR=/build/engines {IMAGE} bash -c 'bash /build/engines/build_engines.sh && chown -R ")
    bls = "/app/all_models/inflight_batcher_llm/tensorrt_llm_bls/1 -> "  # the code the assembly takes from the image
    assemble = f"gpu_host.sh --assemble --route engine --mount /build {build} {IMAGE}"
    assert engines in out and bls in out and assemble in out
    assert out.index(engines) < out.index(bls) < out.index(assemble) < out.index("tritonserver --model-repository /build/gpu_host/engine")
    # the server is ready when the route's entry model is: the BLS model for draft-target
    assert "/v2/models/tensorrt_llm_bls/ready" in out and "trtllm-serve" not in out


# ---------------------------------------------------------------------------------------------
# what assembly writes


@pytest.mark.parametrize("version, line, flag", [("1.2.1", "1.2", "--config"), ("1.1.0", "1.1", "--extra_llm_api_options")])
def test_the_printed_trtllm_serve_command_runs_as_printed(tmp_path, eagle_build, version, line, flag):
    build = tmp_path / "build"
    shutil.copytree(eagle_build, build, symlinks=True)
    serve_image = f"nvcr.io/nvidia/tensorrt-llm/release:{version}"
    with_release(build, version=version, line=line, serve_flag=flag, serve_image=serve_image)
    env = stubs(tmp_path, local=True, STUB_SERVE_FLAG=flag)
    done = gpu_host("--assemble", str(build), env=env)
    assert done.returncode == 0, done.stderr
    lines = [line.strip() for line in done.stdout.splitlines()]
    bare = next(line for line in lines if line.startswith("trtllm-serve "))
    assert bare.split()[2] == flag
    ran = subprocess.run(shlex.split(bare), capture_output=True, text=True, env={**os.environ, **env})
    assert ran.returncode == 0, ran.stderr
    assert str(build / "trtllm_ckpt" / "llmapi") in ran.stdout  # the EAGLE-3 draft, by the path the build has now
    in_docker = next(line for line in lines if line.startswith("docker run"))
    assert f"{serve_image} {bare} --host 0.0.0.0 --port" in in_docker and f"-v {build}:{build}:ro" in in_docker


def test_assembly_is_readable_by_another_user(tmp_path, build):
    env = stubs(tmp_path, local=True)
    done = gpu_host("--assemble", str(build), env=env, umask="077")  # even under the tightest umask
    assert done.returncode == 0, done.stderr
    repo = build / "gpu_host" / "llmapi"
    for path in [repo.parent, repo, *repo.rglob("*")]:
        assert stat.S_IMODE(path.stat().st_mode) == (0o755 if path.is_dir() else 0o644), path


# A stand-in for NVIDIA's llmapi model as its container ships it (tensorrtllm_backend v0.19.0,
# all_models/llmapi/tensorrt_llm): config.pbtxt declares no transaction policy; model.py's
# auto_complete_config sets it from model.yaml's triton_config, and a decoupled model.yaml streams
# every answer in several responses through the response sender.
LLMAPI_CONFIG = """
name: "tensorrt_llm"
backend: "python"

# As NVIDIA's config.pbtxt comments it out (TensorRT-LLM triton_backend/all_models/llmapi):
# model_transaction_policy {
#  decoupled: False
# }
instance_group [ { count: 1 kind: KIND_CPU } ]
input [ { name: "text_input" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
LLMAPI_MODEL = """
from pathlib import Path
import numpy as np
import yaml
import triton_python_backend_utils as pb_utils

TRITON_CONFIG = yaml.safe_load(Path(__file__).with_name("model.yaml").read_text())["triton_config"]


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, config):
        config.set_model_transaction_policy(dict(decoupled=bool(TRITON_CONFIG["decoupled"])))
        config.set_max_batch_size(int(TRITON_CONFIG["max_batch_size"]))
        return config

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            for piece in ("first", "second"):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([piece.encode()], dtype=object))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def _streamed(url: str, model: str, timeout_s: float = 30.0) -> list:
    """Every response of one streamed request (text, or the error), up to the empty final one."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    answers: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello"], dtype=object))
    client.async_stream_infer(model, [text], enable_empty_final_response=True)
    seen = []
    try:
        while True:
            answer = answers.get(timeout=timeout_s)
            if not hasattr(answer, "get_response"):
                return [*seen, str(answer)]
            if answer.get_response().parameters["triton_final_response"].bool_param:
                return seen
            seen.append(answer.as_numpy("text_output")[0].decode())
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


@pytest.mark.parametrize("auto_complete", [False, True], ids=["launch_triton_server", "tritonserver"])
def test_the_llmapi_model_streams_under_any_launcher(tmp_path, build, auto_complete):
    """The assembled llmapi repository on the bundled tritonserver, started as NVIDIA's
    launch_triton_server.py starts it (--disable-auto-complete-config) and plainly: the model is
    decoupled either way and a streamed request gets every response."""
    from specdeploy.triton.serve import TritonServer

    class AutoCompleting(TritonServer):
        def command(self, backends):
            return [arg for arg in super().command(backends) if arg != "--disable-auto-complete-config"]

    container = fake_container(tmp_path)
    llmapi = container / "llmapi" / "tensorrt_llm"
    (llmapi / "config.pbtxt").write_text(LLMAPI_CONFIG)
    (llmapi / "1" / "model.py").write_text(LLMAPI_MODEL)
    done = gpu_host("--assemble", "--route", "llmapi", str(build), env={"SPECDEPLOY_ALL_MODELS": str(container)})
    assert done.returncode == 0, done.stderr
    repo = build / "gpu_host" / "llmapi"
    (repo / "trtllm_serve.yaml").unlink()  # trtllm-serve's file, not a Triton model
    server_type = TritonServer if not auto_complete else AutoCompleting  # TritonServer disables auto-complete
    with server_type(repo, log_path=tmp_path / "server.log") as server:
        import tritonclient.grpc as grpcclient

        config = grpcclient.InferenceServerClient(server.grpc_url).get_model_config("tensorrt_llm", as_json=True)
        assert config["config"]["model_transaction_policy"].get("decoupled") is True
        assert _streamed(server.grpc_url, "tensorrt_llm") == ["first", "second"]


def test_the_llmapi_config_keeps_a_policy_the_release_declares(tmp_path, build):
    container = fake_container(tmp_path)
    config = container / "llmapi" / "tensorrt_llm" / "config.pbtxt"
    env = {"SPECDEPLOY_ALL_MODELS": str(container)}
    config.write_text(LLMAPI_CONFIG + "model_transaction_policy { decoupled: True }\n")
    assert gpu_host("--assemble", "--route", "llmapi", str(build), env=env).returncode == 0
    assert (build / "gpu_host" / "llmapi" / "tensorrt_llm" / "config.pbtxt").read_text() == config.read_text()
    config.write_text(LLMAPI_CONFIG + "model_transaction_policy { decoupled: false }\n")
    done = gpu_host("--assemble", "--route", "llmapi", str(build), env=env)
    assert done.returncode == 7 and "declares decoupled: false" in done.stderr


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask022", "umask027"])
def test_atomic_writes_get_the_mode_a_plain_open_gives(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        written = atomic_write_text(tmp_path / "config.json", "{}")
        (tmp_path / "plain").write_text("{}")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(written.stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == mode


# ---------------------------------------------------------------------------------------------
# verify --server trtllm in two phases


def test_verify_trtllm_phases_split_the_server_from_the_reference(tmp_path, build, monkeypatch):
    from specdeploy.verify import trtllm_server
    from specdeploy.verify.reference import Prompt, load_reference

    prompts = [Prompt("chat", "hi", "Hello there"), Prompt("code", "def f():", "def f():")]
    monkeypatch.setattr(trtllm_server, "load_prompts", lambda per_category, tokenizer: prompts)
    reference = load_reference(build / "base", "float32", "cpu")
    greedy = {p.text_input: reference.check(p.text_input, "", 8)[0].text for p in prompts}

    class Server:
        def __init__(self, url: str, model: str) -> None:
            assert (url, model) == ("127.0.0.1:9", "tensorrt_llm")

        def wait_ready(self, timeout_s: float) -> None:
            pass

        def generate(self, request, stream: bool) -> Completion:
            text = greedy[request.text_input]
            return Completion(text, [text], {"total_accepted_draft_tokens": 2.0}, 0.5, 0.1)

    def no_model(*args, **kwargs):
        raise AssertionError("the served phase loads no model")

    served = ["verify", "--build-dir", str(build), "--server", "trtllm", "--url", "127.0.0.1:9", "--max-new-tokens", "8"]
    monkeypatch.setattr(trtllm_server, "TritonLLMClient", Server)
    monkeypatch.setattr(trtllm_server, "load_reference", no_model)
    assert cli_main([*served, "--phase", "served", "--served-file", str(tmp_path / "served.json")]) == 0
    answers = json.loads((tmp_path / "served.json").read_text())
    assert [a["served"] for a in answers["prompts"]] == list(greedy.values()) and not (build / "reports_gpu").exists()

    def no_server(*args, **kwargs):
        raise AssertionError("the reference phase asks no server")

    monkeypatch.setattr(trtllm_server, "TritonLLMClient", no_server)
    monkeypatch.setattr(trtllm_server, "load_reference", lambda model_dir, dtype, device: reference)
    judged = ["verify", "--build-dir", str(build), "--server", "trtllm", "--device", "cpu"]
    assert cli_main([*judged, "--phase", "reference", "--served-file", str(tmp_path / "served.json")]) == 0
    report = json.loads((build / "reports_gpu" / "verify.json").read_text())
    assert report["summary"]["parity_ok"] and report["summary"]["prompts"] == 2
    assert json.loads((build / "reports_gpu" / "served.json").read_text()) == answers
    # in one go (the server still up), as a user may choose
    monkeypatch.setattr(trtllm_server, "TritonLLMClient", Server)
    assert cli_main([*served, "--device", "cpu"]) == 0
    assert (build / trtllm_server.GPU_SERVED).exists() and json.loads((build / "reports_gpu" / "verify.json").read_text())["summary"]["parity_ok"]
    # a release whose llmapi model returns no draft counts: no acceptance length, rather than a measured-looking 1.00
    for answer in answers["prompts"]:
        answer["perf"] = {}
    (tmp_path / "served.json").write_text(json.dumps(answers))
    assert cli_main([*judged, "--phase", "reference", "--served-file", str(tmp_path / "served.json"),
                     "--ar-lower-bound", "1.0"]) == 1
    report = json.loads((build / "reports_gpu" / "verify.json").read_text())
    assert report["summary"]["parity_ok"] and report["summary"]["acceptance_length"] is None
    assert "acceptance length not reported by the server" in (build / "reports_gpu" / "verify.md").read_text()


# ---------------------------------------------------------------------------------------------
# refusals, and a build that moved


def test_refusals(tmp_path, tiny_llama_dir, eagle_build, build):
    eagle = tmp_path / "eagle"
    shutil.copytree(eagle_build, eagle, symlinks=True)
    done = gpu_host("--dry-run", "--route", "engine", str(eagle))
    assert done.returncode == 5 and "no TensorRT-LLM route engine" in done.stderr and "EAGLE-3" in done.stderr
    wide = packaged(tmp_path / "n", tiny_llama_dir, "ngram", tp=2).root
    done = gpu_host("--dry-run", str(wide))
    assert done.returncode == 6 and "launch_triton_server.py --model_repo" in done.stderr  # the llmapi route
    assert "--world_size" not in done.stderr and "tp x pp = 2 is in tensorrt_llm/1/model.yaml" in done.stderr
    done = gpu_host("--dry-run", str(tmp_path))
    assert done.returncode == 2 and "gpu_routes.json" in done.stderr
    routes_file = build / "triton_repo" / "gpu_routes.json"
    routes = routes_file.read_text()
    routes_file.write_text(json.dumps({k: v for k, v in json.loads(routes).items() if k != "release"}))
    done = gpu_host("--dry-run", str(build))
    assert done.returncode == 2 and "run `specdeploy package` again" in done.stderr
    routes_file.write_text(routes)
    env = stubs(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(env["GRPC_PORT"])))
        taken.listen()
        done = gpu_host(str(build), env=env)
    assert done.returncode == 2 and f"port {env['GRPC_PORT']} is in use" in done.stderr
    done = gpu_host(str(build), env={**env, "SPECDEPLOY_PYTHON": sys.executable + "-missing"})
    assert done.returncode == 10 and "make venv" in done.stderr


def _resolved_paths(text: str, root: Path) -> list[Path]:
    return [Path(m) for m in re.findall(re.escape(str(root)) + r"[^\s\"',}\]]*", text)]


@pytest.mark.parametrize("kind", ["none", "draft"])
def test_a_moved_build_keeps_every_generated_path_valid(tmp_path, tiny_llama_dir, tiny_draft_dir, kind):
    options = {"draft_model": str(tiny_draft_dir), "max_draft_len": 3} if kind == "draft" else {}
    old = packaged(tmp_path / "old" / "b", tiny_llama_dir, kind, **options).root.resolve()
    new = tmp_path / "elsewhere" / "b"
    new.parent.mkdir()
    shutil.move(old, new)
    shutil.rmtree(tmp_path / "old")
    for path in [*(new / "triton_repo").rglob("*"), *(new / "trtllm_ckpt" / "llmapi").rglob("*.yaml"), new / "trtllm_ckpt" / "convert_summary.json"]:
        if path.is_file() and path.suffix in (".pbtxt", ".json", ".yaml", ".txt", ".md"):
            assert str(old) not in path.read_text(), path  # nothing names where the build was written
    # the CPU repository: relative to each model's folder / deployment.json's folder
    cpu = new / "triton_repo" / "cpu"
    config = json.loads((cpu / "tensorrt_llm" / "1" / "deployment.json").read_text())
    base = cpu / "tensorrt_llm" / "1"
    assert (base / config["model_dir"] / "config.json").exists()
    if kind == "draft":
        assert (base / config["spec"]["draft_model_dir"] / "config.json").exists()
    for model in ("preprocessing", "postprocessing"):
        text = (cpu / model / "config.pbtxt").read_text()
        rel = re.search(r'key: "tokenizer_dir" value: \{ string_value: "([^"]+)"', text).group(1)
        assert (cpu / model / rel / "tokenizer_config.json").exists(), model
    # the GPU repositories, assembled where the build now is
    env = {"SPECDEPLOY_ALL_MODELS": str(fake_container(tmp_path))}
    for route in ("engine", "llmapi"):
        done = gpu_host("--assemble", "--route", route, str(new), env=env)
        assert done.returncode == 0, done.stderr
        repo = new / "gpu_host" / route
        texts = [p.read_text() for p in repo.rglob("*") if p.is_file() and p.suffix in (".pbtxt", ".yaml", ".txt")]
        assert texts and not any("$BUILD_DIR" in t for t in texts)
        paths = [p for t in texts for p in _resolved_paths(t, new.resolve())]
        assert paths, route
        for path in paths:  # engines are built on the GPU host, into the build's engines/ folder
            assert path.exists() or path.parent == new.resolve() / "engines", path
    assert (new / "gpu_host" / "llmapi" / "tensorrt_llm" / "1" / "helpers.py").exists()
    assert (new / "gpu_host" / "engine" / "tensorrt_llm_bls" / "1" / "lib" / "decode.py").exists()
    assert (new / "gpu_host" / "llmapi" / "tensorrt_llm" / "1" / "model.yaml").read_text().startswith("model: ")  # ours, not upstream's
    # the model's config.pbtxt is the release's own, as the container ships it beside its model.py
    config = (new / "gpu_host" / "llmapi" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert config.startswith("# upstream config.pbtxt\n") and "model_transaction_policy {\n  decoupled: true\n}" in config
