#!/usr/bin/env python3
"""Serve a specdeploy build on NVIDIA's TensorRT-LLM Triton container and verify it (gpu_host.sh).

Standard library only, any python3 >= 3.8: it runs on the GPU host before anything else is there,
and the whole plan is plain data (argv lists) that --dry-run prints and tests read.

The container only serves: nothing is installed into NVIDIA's image (its torch, transformers and
TensorRT-LLM pins stay as NVIDIA tested them), the build is mounted read-only, the ports are
published on 127.0.0.1 only, and HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE keep it off any model hub.
`specdeploy verify` runs from the user's own environment (SPECDEPLOY_PYTHON, default
<project>/.venv/bin/python) in two phases: the served answers while the server runs, the
Hugging Face reference after it stopped (TensorRT-LLM takes most of the GPU's free memory).
Inside NVIDIA's container (tritonserver and tensorrt_llm here) everything runs in place, and
verify runs from this checkout (PYTHONPATH, no installation) when its imports work there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

# exit codes (build_scripts/README.md); a failed verify passes its own (1) through
EXIT_USAGE = 2  # bad arguments, no gpu_routes.json or one without "release", a port in use, BLS_GRPC_PORT
EXIT_NO_RUNTIME = 3  # neither NVIDIA's stack here nor docker
EXIT_NO_ROUTE = 5  # the build has no TensorRT-LLM route (of that name)
EXIT_MULTI_GPU = 6  # tp x pp > 1: assemble only
EXIT_IMAGE = 7  # the image lacks tritonserver or the files the route takes from it
EXIT_VERSION = 8  # the image's TensorRT-LLM is another release line than the build's
EXIT_NO_IMAGE = 9  # the build names no image for its release and none was given
EXIT_PYTHON = 10  # no Python that can run `specdeploy verify`
EXIT_SERVER = 11  # the server exited, or was not ready in time

BLS_GRPC_PORT = 8001  # where NVIDIA's BLS model reads the other models' configs (check_bls_port)

EPILOG = f"""exit codes: 0 verified; 1 verify failed (parity, acceptance); {EXIT_USAGE} usage, no gpu_routes.json (or one
without "release"), a port in use; {EXIT_NO_RUNTIME} neither NVIDIA's stack nor docker; {EXIT_NO_ROUTE} no such route;
{EXIT_MULTI_GPU} more than one GPU; {EXIT_IMAGE} the image lacks tritonserver or the route's code; {EXIT_VERSION} the image's
TensorRT-LLM is another release line; {EXIT_NO_IMAGE} no image known for the build's release; {EXIT_PYTHON} no Python
that can run verify; {EXIT_SERVER} the server exited or was not ready in time.
environment: TRTLLM_IMAGE, SPECDEPLOY_PYTHON, HTTP_PORT / GRPC_PORT / METRICS_PORT (8000 / 8001 / 8002),
SPECDEPLOY_ALL_MODELS (a copy of the container's /app/all_models)."""

ENTRY = Path(__file__).with_suffix(".sh")
MARKER = "$BUILD_DIR"
MOUNT = "/build"  # where the container sees the build
ALL_MODELS = "/app/all_models"  # where NVIDIA's container keeps the Triton models' code
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
DOCKER_GPU = ["--gpus", "all", "--ipc=host", "--shm-size=2g", "--ulimit", "memlock=-1"]
STOP_S = 60  # a stopping server's grace before it is killed
LOG_TAIL = 40
PROBE_TAG = "specdeploy-probe:"
# Versions from package metadata: no GPU needed, none of TensorRT-LLM's import-time start-up;
# the import is the fallback for a source checkout without metadata.
PROBE = f"""
import json, os, shutil, sys
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except Exception:
        pass
    try:
        return __import__(name).__version__
    except Exception:
        return None
print({PROBE_TAG!r}, json.dumps({{"tensorrt_llm": version("tensorrt_llm"), "torch": version("torch"),
      "transformers": version("transformers"), "python": sys.version.split()[0],
      "tritonserver": shutil.which("tritonserver"), "container_files": os.path.isdir(sys.argv[1])}}))
"""


class Refusal(Exception):
    """A clear stop: the message for the user and the exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Ports:
    http: int
    grpc: int
    metrics: int

    def all(self) -> List[int]:
        return [self.http, self.grpc, self.metrics]


@dataclass
class Host:
    """One plan: the build, the route, and where things run."""

    build: Path  # the build on this machine
    project: Path  # this checkout
    routes: dict
    route: str
    image: Optional[str]  # the Triton image; None: NVIDIA's stack is here (no docker)
    mount: str  # the build's path as the server sees it
    ports: Ports
    ready_timeout: float
    device: str

    @property
    def entry(self) -> dict:
        return self.routes["routes"][self.route]

    @property
    def release(self) -> dict:
        return self.routes["release"]

    @property
    def repo(self) -> Path:
        """The assembled repository on this machine."""
        return self.build / "gpu_host" / self.route

    @property
    def served_repo(self) -> str:
        return f"{self.mount}/gpu_host/{self.route}"

    @property
    def log(self) -> Path:
        return self.build / "gpu_host" / f"{self.route}.tritonserver.log"

    @property
    def served_file(self) -> Path:
        return self.build / "gpu_host" / f"{self.route}.served.json"

    @property
    def container_name(self) -> str:
        return f"specdeploy-{self.route}-{os.getpid()}"


# ---------------------------------------------------------------------------------------------
# the plan


def read_routes(build: Path) -> dict:
    path = build / "triton_repo" / "gpu_routes.json"
    if not path.is_file():
        raise Refusal(EXIT_USAGE, f"no {path}: run `specdeploy package` (or `make engine`) first")
    routes = json.loads(path.read_text())
    if not routes.get("release"):
        raise Refusal(EXIT_USAGE, f"{path} names no TensorRT-LLM release (packaged by an older specdeploy): "
                                  "run `specdeploy package` again")
    return routes


def choose_route(routes: dict, route: Optional[str]) -> str:
    route = route or routes.get("recommended")
    if not route or route not in routes.get("routes", {}):
        why = (routes.get("refused") or {}).get(route or "", "")
        raise Refusal(EXIT_NO_ROUTE, f"this build has no TensorRT-LLM route {route or ''}: {why}".rstrip(": "))
    world = routes["routes"][route].get("world_size", 1)
    if world != 1:
        raise Refusal(EXIT_MULTI_GPU, f"route {route} needs {world} GPUs (tp x pp): serve the repository --assemble "
                                      f"writes with {multi_gpu_launch(route, world)}; this script serves single-GPU "
                                      "deployments")
    return route


def multi_gpu_launch(route: str, world: int) -> str:
    """NVIDIA's launcher as its docs run it: the C++ backend takes an MPI rank per GPU; the LLM API
    takes tp and pp from model.yaml and starts its own workers (tensorrtllm_backend v1.1.0,
    docs/llmapi.md: launch_triton_server.py --model_repo, no --world_size)."""
    launcher = "/app/scripts/launch_triton_server.py --model_repo <repository>"
    if route == "llmapi":
        return f"{launcher} (tp x pp = {world} is in tensorrt_llm/1/model.yaml; the LLM API starts its own workers)"
    return f"{launcher} --world_size {world}"


def nvidia_stack_here() -> bool:
    """Inside NVIDIA's container (or a host with its stack): tritonserver and tensorrt_llm here."""
    import importlib.util

    return shutil.which("tritonserver") is not None and importlib.util.find_spec("tensorrt_llm") is not None


def choose_image(given: Optional[str], release: dict) -> str:
    """The given image, else the build's release's (never a constant: it must carry that release)."""
    image = given or os.environ.get("TRTLLM_IMAGE") or release.get("triton_image")
    if not image:
        raise Refusal(EXIT_NO_IMAGE, f"no Triton image is published for TensorRT-LLM {release['version']}: "
                                     f"{release.get('triton_image_note') or 'build one'}; then pass it: "
                                     "gpu_host.sh build/<name> <image>")
    return image


def container_dir(host: Host) -> str:
    """Where the route's code sits in NVIDIA's container (SPECDEPLOY_ALL_MODELS: a copy of /app/all_models)."""
    path = host.entry["container_files"]["from"]
    local = os.environ.get("SPECDEPLOY_ALL_MODELS")
    return local + path[len(ALL_MODELS):] if local and path.startswith(ALL_MODELS) else path


def docker_run(host: Host, *args: str, rw: bool = False, ports: bool = False) -> List[str]:
    """`docker run` of the host's image with the build mounted (read-only unless `rw`)."""
    publish = [f for port in host.ports.all() for f in ("-p", f"127.0.0.1:{port}:{port}")] if ports else []
    env = [f for key, value in OFFLINE.items() for f in ("-e", f"{key}={value}")]
    mount = ["-v", f"{host.build}:{host.mount}" + ("" if rw else ":ro")]
    return ["docker", "run", "--rm", *DOCKER_GPU, *publish, *mount, *env, *args]


def probe_command(host: Host) -> List[str]:
    """One tiny python in the image (or here): its versions, tritonserver, the route's files."""
    python = ["python3", "-c", PROBE, container_dir(host)]
    return python if host.image is None else ["docker", "run", "--rm", host.image, *python]


def engines_command(host: Host) -> List[str]:
    """The engine route's trtllm-build run (engines/build_engines.sh), the engines left readable
    by the user and by a server running as another user."""
    script = f"bash {host.mount}/engines/build_engines.sh"
    if host.image is None:
        return ["env", f"CKPT_DIR={host.mount}/trtllm_ckpt", f"ENGINE_DIR={host.mount}/engines", *[f"{k}={v}" for k, v in OFFLINE.items()],
                "bash", "-c", f"{script} && chmod -R a+rX {host.mount}/engines"]
    # the container writes as root: the engines go back to the user who owns the build
    owner = f"{os.getuid()}:{os.getgid()}"
    return docker_run(host, "-e", f"CKPT_DIR={host.mount}/trtllm_ckpt", "-e", f"ENGINE_DIR={host.mount}/engines",
                      host.image, "bash", "-c", f"{script} && chown -R {owner} {host.mount}/engines && chmod -R a+rX {host.mount}/engines",
                      rw=True)


def copy_out_commands(host: Host, image: str, into: str) -> List[List[str]]:
    """The route's code copied out of the image (docker cp writes as the user running it)."""
    name = f"{host.container_name}-files"
    return [["docker", "create", "--name", name, image, "true"],
            ["docker", "cp", f"{name}:{container_dir(host)}/.", into],
            ["docker", "rm", name]]


def server_command(host: Host) -> List[str]:
    serve = ["tritonserver", "--model-repository", host.served_repo, "--grpc-port", str(host.ports.grpc),
             "--http-port", str(host.ports.http), "--metrics-port", str(host.ports.metrics)]
    if host.image is None:
        return serve
    return docker_run(host, "--name", host.container_name, host.image, *serve, ports=True)


def assemble_command(host: Host) -> List[str]:
    """This script's --assemble for the host's route, mount and image: the dry run's assembly step."""
    return [str(ENTRY), "--assemble", "--route", host.route, "--mount", host.mount, str(host.build),
            *([host.image] if host.image else [])]


def stop_command(host: Host) -> List[str]:
    return ["docker", "stop", "-t", str(STOP_S), host.container_name]


def python_for_verify(host: Host) -> str:
    """SPECDEPLOY_PYTHON, else the container's python3 (in place) or the project's venv."""
    default = "python3" if host.image is None else str(host.project / ".venv" / "bin" / "python")
    return os.environ.get("SPECDEPLOY_PYTHON") or default


def verify_env(host: Host) -> Dict[str, str]:
    """This checkout's specdeploy, found without installing it; no model hub."""
    path = os.pathsep.join(filter(None, [str(host.project), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, **OFFLINE}


def verify_command(host: Host, phase: str) -> List[str]:
    command = [python_for_verify(host), "-m", "specdeploy", "verify", "--build-dir", str(host.build), "--server", "trtllm",
               "--route", host.route, "--phase", phase, "--served-file", str(host.served_file)]
    if phase == "served":
        return [*command, "--url", f"127.0.0.1:{host.ports.grpc}"]
    return [*command, "--device", host.device]


def trtllm_serve(host: Host) -> Optional[List[str]]:
    """The llmapi route as trtllm-serve runs it: the release's flag, the resolved YAML assembly
    writes into the repository."""
    serve = host.entry.get("trtllm_serve")
    if not serve:
        return None
    config = Path(serve["config"]).relative_to(host.entry["repo"]).as_posix()
    return ["trtllm-serve", serve["model"].replace(MARKER, host.mount), host.release["serve_flag"],
            f"{host.served_repo}/{config}"]


def trtllm_serve_docker(host: Host, bare: List[str]) -> List[str]:
    mount = ["-v", f"{host.build}:{host.mount}:ro"]
    env = [f for key, value in OFFLINE.items() for f in ("-e", f"{key}={value}")]
    return ["docker", "run", "--rm", *DOCKER_GPU, "-p", f"127.0.0.1:{host.ports.http}:{host.ports.http}", *mount, *env,
            host.release["serve_image"], *bare, "--host", "0.0.0.0", "--port", str(host.ports.http)]


def shell(command: List[str], env: Optional[Dict[str, str]] = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(command)


# ---------------------------------------------------------------------------------------------
# steps


def say(text: str) -> None:
    print(f"gpu_host: {text}", flush=True)


def probe(host: Host) -> dict:
    done = subprocess.run(probe_command(host), capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(PROBE_TAG):
            return json.loads(line[len(PROBE_TAG):])
    where = f"image {host.image}" if host.image else "this container"
    raise Refusal(EXIT_IMAGE, f"could not read the versions in {where} (exit {done.returncode}):\n"
                              f"{(done.stdout + done.stderr)[-2000:]}")


def release_line(version: str) -> Optional[str]:
    found = re.match(r"(\d+)\.(\d+)", version or "")
    return f"{found.group(1)}.{found.group(2)}" if found else None


def check_versions(host: Host, found: dict) -> None:
    """Print what the container carries; refuse another TensorRT-LLM release line than the build's."""
    release, where = host.release, host.image or "this container"
    say(f"{where}: TensorRT-LLM {found['tensorrt_llm']}, torch {found['torch']}, transformers {found['transformers']}, "
        f"Python {found['python']} (the build: TensorRT-LLM {release['version']}, torch {release.get('torch')}, "
        f"transformers {release.get('transformers')})")
    if release_line(found["tensorrt_llm"]) != release["line"]:
        carried = f"TensorRT-LLM {found['tensorrt_llm']}" if found["tensorrt_llm"] else "no TensorRT-LLM"
        raise Refusal(EXIT_VERSION, f"{where} carries {carried}, but this build was converted for TensorRT-LLM "
                                    f"{release['version']} (line {release['line']}): use {use_image(release)}, or convert "
                                    "and package again with `specdeploy convert --trtllm-version <the image's version>`")
    if not found["tritonserver"]:
        raise Refusal(EXIT_IMAGE, f"{where} has no tritonserver: use a Triton image with TensorRT-LLM ({use_image(release)})")
    if not os.environ.get("SPECDEPLOY_ALL_MODELS") and not found["container_files"]:
        raise Refusal(EXIT_IMAGE, f"{where} has no {container_dir(host)} (the route's Triton model code): use "
                                  f"{use_image(release)}, or set SPECDEPLOY_ALL_MODELS to a copy of its /app/all_models")


def use_image(release: dict) -> str:
    return release.get("triton_image") or release.get("triton_image_note") or "see the build's gpu_routes.json"


def check_python(host: Host) -> None:
    """The Python that runs verify can import it (and sees a GPU when the reference needs one);
    checked before the server starts, as the server takes minutes."""
    python = python_for_verify(host)
    code = ("import specdeploy.verify.command, tritonclient.grpc, torch, sys; "
            f"sys.exit(3 if {host.device!r}.startswith('cuda') and not torch.cuda.is_available() else 0)")
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, env={**os.environ, **verify_env(host)})
    except OSError as err:
        done = subprocess.CompletedProcess([python], 127, "", str(err))
    if done.returncode == 0:
        return
    why = "its torch sees no GPU (a CPU wheel?)" if done.returncode == 3 else (done.stderr.strip().splitlines() or ["?"])[-1]
    if host.image is None and not os.environ.get("SPECDEPLOY_PYTHON"):
        raise Refusal(EXIT_PYTHON, f"specdeploy verify cannot run in this container ({why}); nothing is installed into "
                                   f"NVIDIA's image. Serve here with `{ENTRY} --serve-only {host.build}` and run from an "
                                   f"environment with specdeploy (`make venv`), while it serves:\n  "
                                   f"{shell(verify_command(host, 'served'))}\nthen, after stopping it:\n  "
                                   f"{shell(verify_command(host, 'reference'))}\n(or set SPECDEPLOY_PYTHON)")
    raise Refusal(EXIT_PYTHON, f"{python} cannot run specdeploy verify ({why}): prepare the project's environment on this "
                               "host beforehand (`make venv`; air-gapped: `pip install --no-index --find-links <wheelhouse> "
                               "-e .[cpu]`), or point SPECDEPLOY_PYTHON at a Python that has it")


def check_bls_port(entry: dict, ports: Ports) -> None:
    """Draft-target on the engine route runs in NVIDIA's BLS model, which reads the target's and the
    draft's configs over gRPC at localhost:8001, hard-coded (NVIDIA/TensorRT-LLM PR #9453, in the
    container's tensorrt_llm_bls/1/model.py from early 2026): another gRPC port fails every request."""
    if entry["model"] == "tensorrt_llm_bls" and ports.grpc != BLS_GRPC_PORT:
        raise Refusal(EXIT_USAGE, f"GRPC_PORT={ports.grpc}: the engine route's draft-target runs in NVIDIA's BLS "
                                  f"model, which reads the models' configs over gRPC at localhost:{BLS_GRPC_PORT}; "
                                  f"leave GRPC_PORT at {BLS_GRPC_PORT} (or free that port)")


def check_ports(ports: Ports) -> None:
    """A server already on these ports would answer the readiness poll in place of ours."""
    for port in ports.all():
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                raise Refusal(EXIT_USAGE, f"port {port} is in use: stop what listens there, or set "
                                          "HTTP_PORT / GRPC_PORT / METRICS_PORT") from None


def run_step(command: List[str], env: Optional[Dict[str, str]] = None) -> int:
    say(shell(command, env))
    return subprocess.run(command, env={**os.environ, **(env or {})}).returncode


def copy_container_files(host: Host, into: Path) -> None:
    """The code NVIDIA's container ships for the route (everything but what the build replaces)."""
    with tempfile.TemporaryDirectory(prefix="specdeploy-files-") as scratch:
        source = Path(container_dir(host))
        if host.image is not None and not os.environ.get("SPECDEPLOY_ALL_MODELS"):
            source = Path(scratch)
            for command in copy_out_commands(host, host.image, scratch):
                if run_step(command) != 0:
                    raise Refusal(EXIT_IMAGE, f"could not copy {container_dir(host)} out of {host.image}")
        if not source.is_dir():
            raise Refusal(EXIT_IMAGE, f"{source} not found: run inside the TensorRT-LLM Triton container "
                                      "(or set SPECDEPLOY_ALL_MODELS to a copy of its /app/all_models)")
        keep = {Path(p) for p in host.entry["container_files"].get("except", [])}  # the build's, relative to `into`
        for item in sorted(source.rglob("*")):
            relative = item.relative_to(source)
            if item.is_file() and relative not in keep:
                (into / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(item, into / relative)


def resolve_paths(folder: Path, mount: str) -> None:
    """Every `$BUILD_DIR` becomes where the server sees the build (TensorRT-LLM takes absolute paths)."""
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            if MARKER.encode() in data:
                path.write_bytes(data.replace(MARKER.encode(), mount.encode()))


def make_readable(folder: Path) -> None:
    """0644 files (0755 if executable), 0755 folders: a server running as another user (a
    non-root pod) reads the repository; copies from the container or a 0600 file keep their modes."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            executable = path.is_dir() or path.stat().st_mode & 0o111
            path.chmod(0o755 if executable else 0o644)


def unreadable_references(host: Host) -> List[Path]:
    """Files of the build the assembled repository names that another user could not read."""
    pattern = re.compile(re.escape(host.mount) + r"/[^\s\"',}\]]+")
    texts = [p.read_text(errors="replace") for p in host.repo.rglob("*")
             if p.is_file() and p.suffix in (".pbtxt", ".yaml", ".json", ".txt")]
    named = {host.build / found[len(host.mount) + 1:] for text in texts for found in pattern.findall(text)}
    closed = []
    for path in sorted(p for p in named if p.exists()):
        for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
            need = 0o005 if item.is_dir() else 0o004
            if item.stat().st_mode & need != need:
                closed.append(item)
    return closed


def pin_decoupled(config: Path, decoupled: bool) -> None:
    """State the llmapi model's transaction policy in its config.pbtxt. NVIDIA's config leaves it
    to model.py's auto_complete_config (from model.yaml), which tritonserver skips under
    --disable-auto-complete-config, as launch_triton_server.py always passes: the model would then
    load non-decoupled while model.py streams, and a streamed request never completes. Stated
    here, it holds either way (auto-complete accepts an equal value)."""
    text = config.read_text()
    # NVIDIA's config carries the block commented out ("# model_transaction_policy {" ...): not a declaration
    declared = re.search(r"model_transaction_policy\s*\{[^}]*decoupled\s*:\s*(\w+)", re.sub(r"(?m)#.*$", "", text))
    if declared:
        if (declared.group(1).lower() == "true") != decoupled:
            raise Refusal(EXIT_IMAGE, f"{config} declares decoupled: {declared.group(1)}, the build's model.yaml "
                                      f"{str(decoupled).lower()}: run `specdeploy package` again "
                                      f"{'with' if decoupled else 'without'} --no-stream")
        return
    config.write_text(text.rstrip("\n") + "\n\n# model.yaml's triton_config.decoupled (specdeploy: stated for "
                      "launchers that disable auto-complete)\nmodel_transaction_policy {\n  decoupled: "
                      f"{str(decoupled).lower()}\n}}\n")


def assemble(host: Host) -> Path:
    """build/<name>/gpu_host/<route>/: the route's repository, the container's code for it, paths
    resolved, readable by any user."""
    repo = host.repo
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(host.build / host.entry["repo"], repo, symlinks=True)
    into = repo / host.entry["container_files"]["to"]
    copy_container_files(host, into)
    if "decoupled" in host.entry:  # the llmapi route: the engine route's configs state it themselves
        pin_decoupled(into / "config.pbtxt", host.entry["decoupled"])
    resolve_paths(repo, host.mount)
    repo.parent.chmod(0o755)
    make_readable(repo)
    say(f"assembled {repo} (route {host.route}, paths under {host.mount})")
    closed = unreadable_references(host)
    if closed:
        say(f"{len(closed)} file(s) it names are not readable by other users (a non-root pod), e.g. {closed[0]}: "
            f"chmod -R a+rX {host.build}")
    command = trtllm_serve(host)
    if command:
        say("the same deployment on trtllm-serve (OpenAI API), in place of Triton:\n"
            f"  {shell(command)}\n  {shell(trtllm_serve_docker(host, command))}")
    return repo


# ---------------------------------------------------------------------------------------------
# the server


class Server:
    """tritonserver (or its container) as a child process; its exit is seen at once."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.log = open(host.log, "wb")
        say(f"{shell(server_command(host))} > {host.log}")
        # its own session: everything tritonserver starts (backend stubs, TensorRT-LLM workers) is stopped with it
        self.process = subprocess.Popen(server_command(host), stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def tail(self) -> str:
        self.log.flush()
        lines = self.host.log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
        return "\n".join(f"  | {line}" for line in lines) or "  (empty)"

    def wait_ready(self) -> None:
        url = f"http://127.0.0.1:{self.host.ports.http}/v2/models/{self.host.entry['model']}/ready"
        say(f"waiting for {url} (at most {self.host.ready_timeout:g} s)")
        deadline = time.monotonic() + self.host.ready_timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise Refusal(EXIT_SERVER, f"tritonserver exited (code {code}) before {self.host.entry['model']} was ready; "
                                           f"the end of {self.host.log}:\n{self.tail()}")
            if ready(url):
                say("ready")
                return
            if time.monotonic() > deadline:
                raise Refusal(EXIT_SERVER, f"{self.host.entry['model']} not ready after {self.host.ready_timeout:g} s "
                                           f"(--ready-timeout); the end of {self.host.log}:\n{self.tail()}")
            time.sleep(1.0)

    def stop(self) -> None:
        """Stop it and wait until it is gone: the reference loads on the GPU it held."""
        if self.process.poll() is None:
            if self.host.image is None:
                self.process.terminate()
            else:
                subprocess.run(stop_command(self.host), capture_output=True)
            try:
                self.process.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.host.image is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # what it left behind in its session
            except ProcessLookupError:
                pass
        self.log.close()
        say("server stopped")


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# modes


def dry_run(host: Host) -> None:
    """Every command, in order, as it would run."""
    print(f"# route {host.route} of {host.build} (TensorRT-LLM {host.release['version']}); "
          f"{'image ' + host.image if host.image else 'NVIDIA stack here'}")
    print(shell(probe_command(host)))
    if host.route == "engine":
        print(shell(engines_command(host)))
    # the assembly (the route's code copied out of the image, $BUILD_DIR resolved, modes) is this
    # script's own step, so the plan stays a list of commands that can be pasted as they are
    print(f"# {host.repo}: {host.entry['repo']} + {container_dir(host)} -> {host.entry['container_files']['to']}, "
          f"{MARKER} -> {host.mount}, files 0644 / folders 0755")
    print(shell(assemble_command(host)))
    print(shell(server_command(host)) + f" > {host.log} 2>&1 &")
    url = f"http://127.0.0.1:{host.ports.http}/v2/models/{host.entry['model']}/ready"
    print(f"timeout {host.ready_timeout:g} sh -c {shlex.quote(f'until curl -sf {url} > /dev/null; do sleep 5; done')}")
    print(shell(verify_command(host, "served"), verify_env(host)))
    print(shell(stop_command(host)) if host.image else "# stop tritonserver")
    print(shell(verify_command(host, "reference"), verify_env(host)))
    command = trtllm_serve(host)
    if command:
        print("# or trtllm-serve: " + shell(trtllm_serve_docker(host, command) if host.image else command))


def serve_and_verify(host: Host, serve_only: bool) -> int:
    check_versions(host, probe(host))
    if not serve_only:
        check_python(host)
    check_ports(host.ports)
    if host.route == "engine" and run_step(engines_command(host)) != 0:
        raise Refusal(EXIT_IMAGE, "building the engines failed (see above)")
    assemble(host)
    server = Server(host)
    try:
        server.wait_ready()
        if serve_only:
            say(f"serving on 127.0.0.1:{host.ports.grpc} (gRPC), :{host.ports.http} (HTTP) until stopped (Ctrl-C). "
                f"From an environment with specdeploy:\n  {shell(verify_command(host, 'served'))}\n"
                f"then, after stopping this server:\n  {shell(verify_command(host, 'reference'))}")
            return server.process.wait()
        code = run_step(verify_command(host, "served"), verify_env(host))
        if code != 0:
            say(f"the served phase failed; the end of {host.log}:\n{server.tail()}")
            return code
    finally:
        server.stop()
    return run_step(verify_command(host, "reference"), verify_env(host))


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_host.sh", description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", dest="mode", action="store_const", const="dry-run", help="print the commands, run nothing")
    mode.add_argument("--assemble", dest="mode", action="store_const", const="assemble",
                      help="only assemble the repository here (no GPU, no server; paths resolved to --mount)")
    mode.add_argument("--serve-only", dest="mode", action="store_const", const="serve-only",
                      help="serve until stopped and print the verify commands to run from elsewhere")
    parser.add_argument("--route", choices=["engine", "llmapi"], help="default: the route gpu_routes.json recommends")
    parser.add_argument("--mount", help=f"where the server sees the build (default: {MOUNT} under docker, else where it is)")
    parser.add_argument("--ready-timeout", type=float, default=1800.0,
                        help="seconds to wait for the model to be ready (default 1800); a server that exits stops the wait at once")
    parser.add_argument("--device", default="cuda", help="where verify's reference computes, after the server stopped (default cuda)")
    parser.add_argument("build", help="build/<name>")
    parser.add_argument("image", nargs="?", help="the Triton image (default: TRTLLM_IMAGE, else the build's release's)")
    args = parser.parse_args(argv)
    args.mode = args.mode or "run"
    return args


def make_host(args: argparse.Namespace) -> Host:
    build = Path(args.build)
    if not build.is_dir():
        raise Refusal(EXIT_USAGE, f"no build directory {build}")
    build = build.resolve()
    routes = read_routes(build)
    route = choose_route(routes, args.route)
    here = nvidia_stack_here()
    # --assemble needs the image only to copy the route's code out of it
    needs_image = not here and (args.mode != "assemble" or not os.environ.get("SPECDEPLOY_ALL_MODELS"))
    image = choose_image(args.image, routes["release"]) if needs_image else None
    if image is not None and args.mode != "dry-run" and shutil.which("docker") is None:
        raise Refusal(EXIT_NO_RUNTIME, "neither NVIDIA's container stack (tritonserver, tensorrt_llm) nor docker here: "
                                       "run this on a GPU host (--assemble: or set SPECDEPLOY_ALL_MODELS to a copy "
                                       "of the container's /app/all_models)")
    mount = args.mount or (str(build) if here or args.mode == "assemble" else MOUNT)
    ports = Ports(*(int(os.environ.get(name, default)) for name, default in
                    (("HTTP_PORT", 8000), ("GRPC_PORT", 8001), ("METRICS_PORT", 8002))))
    if args.mode != "assemble":  # assembling serves nothing
        check_bls_port(routes["routes"][route], ports)
    return Host(build, Path(__file__).resolve().parents[1], routes, route, image, mount, ports, args.ready_timeout, args.device)


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    # a `kill`, a closed terminal or a dropped SSH session run the same clean-up as Ctrl-C: the
    # server is stopped, not orphaned on the GPU
    for stop in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, lambda number, _: sys.exit(128 + number))
    try:
        host = make_host(args)
        if args.mode == "dry-run":
            dry_run(host)
            return 0
        if args.mode == "assemble":
            assemble(host)
            return 0
        return serve_and_verify(host, args.mode == "serve-only")
    except Refusal as refusal:
        print(f"gpu_host: {refusal}", file=sys.stderr)
        return refusal.code
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
