"""`specdeploy serve`: a real tritonserver on a packaged model repository, loopback by default.

Without a Triton container the binary is the one bundled in nvidia-pytriton (docs/environment.md,
"The bundled tritonserver": a backend directory of symlinks, the interpreter's libpython first
on LD_LIBRARY_PATH, the venv's bin/ first on PATH so the Python-backend stub runs in this
environment). On a GPU host
`--tritonserver` points at the container's own binary.

`TritonServer` is the reusable piece: tests, `specdeploy verify` and the load test start it
with `with TritonServer(repo) as server: server.http_url ...`.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import BinaryIO

from specdeploy.errors import SpecDeployError

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "triton_python_backend_shm_region_"
_PY_TAG = f"{sys.version_info.major}.{sys.version_info.minor}"


_HANDED_OUT: set[tuple[str, int]] = set()


def free_ports(count: int, host: str = "127.0.0.1", exclude: tuple[int, ...] = ()) -> list[int]:
    """`count` distinct ports nothing listens on right now (the OS picks them), none handed out before
    by this process nor in `exclude`. Every socket stays bound until all are picked: the OS hands a
    port it just freed out again, and a server given one port twice (HTTP and metrics) will not start."""
    held, ports = [], []
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            if (host, port) not in _HANDED_OUT and port not in exclude and port not in ports:
                ports.append(port)
    finally:
        for sock in held:
            sock.close()
    _HANDED_OUT.update((host, port) for port in ports)
    return ports


def bundled_tritonserver() -> Path:
    """The tritonserver binary shipped inside the nvidia-pytriton wheel."""
    # found, not imported: pytriton's __init__ imports its own client (gevent), which serving never uses
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SpecDeployError("nvidia-pytriton is not installed", hint="run `make venv`")
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.exists():
        raise SpecDeployError(f"no tritonserver in {root}", hint="reinstall nvidia-pytriton==0.7.0")
    return binary


def check_stub_numpy(version: str | None = None) -> None:
    """The bundled stub is built against numpy 1 and runs in this Python's environment: under numpy 2
    it dies on the first text input ("unpack_from requires a buffer of at least ... bytes"), and
    the server only reports the stub as unhealthy. Refuse before starting it."""
    version = version or importlib.metadata.version("numpy")
    if int(version.split(".")[0]) >= 2:
        raise SpecDeployError(
            f"this Python has numpy {version}; the Python-backend stub bundled with nvidia-pytriton is built "
            "against numpy 1 and crashes on text inputs under numpy 2",
            hint="serve from the project's environment (`make venv` pins numpy 1.26.4), or pass --tritonserver "
                 "(a Triton image's own binary and stub)",
        )


def make_backend_dir(work: Path, tritonserver: Path) -> Path:
    """<work>/backends/python/ with symlinks to the Python backend and this Python's stub."""
    root = tritonserver.parent.parent
    python = work / "backends" / "python"
    python.mkdir(parents=True, exist_ok=True)
    links = {
        "libtriton_python.so": root / "backends" / "python" / "libtriton_python.so",
        "triton_python_backend_utils.py": root / "backends" / "python" / "triton_python_backend_utils.py",
        # a symlink (not a copy) keeps the stub's RPATH pointing at the wheel's libraries
        "triton_python_backend_stub": root / "python_backend_stubs" / _PY_TAG / "triton_python_backend_stub",
    }
    for name, target in links.items():
        if not target.exists():
            raise SpecDeployError(f"missing {target}", hint=f"nvidia-pytriton has no Python {_PY_TAG} stub")
        link = python / name
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to(target)
    return work / "backends"


def server_env(base: dict[str, str] | None = None, threads: int | None = None) -> dict[str, str]:
    """The environment the stub needs: this interpreter's libpython and venv first."""
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    # the runtime's torch threads share the machine's cores with the server's own threads
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_NUM_THREADS", str(min(2, os.cpu_count() or 1)))
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started the server dies, so a
    killed test or client never leaves an orphan tritonserver (Linux prctl PR_SET_PDEATHSIG). The
    "parent" is the starting *thread*: start servers from the main thread (or one that outlives
    them); one started from a pool worker is SIGTERMed when that worker exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass


def shm_regions(prefix: str = SHM_PREFIX) -> set[str]:
    return set(glob.glob(str(SHM_DIR / f"{prefix}*")))


class TritonServer:
    """One tritonserver process: start() waits until ready, stop() ends it and cleans its shm."""

    def __init__(
        self,
        repo: str | os.PathLike,
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        host: str = "127.0.0.1",
        log_path: str | os.PathLike | None = None,
        tritonserver: str | os.PathLike | None = None,
        ready_timeout: float = 180.0,
        threads: int | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.repo = Path(repo).resolve()
        self.host = host
        given = (http_port, grpc_port, metrics_port)
        picked = iter(free_ports(sum(not port for port in given), host, exclude=tuple(p for p in given if p)))
        self.http_port, self.grpc_port, self.metrics_port = (port or next(picked) for port in given)
        self.log_path = Path(log_path) if log_path else None
        self.tritonserver = Path(tritonserver) if tritonserver else None
        self.ready_timeout = ready_timeout
        self.threads = threads  # torch/OpenMP threads of the models (OMP_NUM_THREADS)
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None
        self._work: Path | None = None
        self._log_file = None
        # a prefix of its own: stop() removes exactly this server's regions, never those of
        # another server running beside it
        self.shm_prefix = f"{SHM_PREFIX}specdeploy_{os.getpid()}_{id(self):x}_"

    # -- addresses ---------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """host:port, the form tritonclient.http.InferenceServerClient takes."""
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def urls(self) -> dict[str, str]:
        return {"http": self.http_url, "grpc": self.grpc_url, "metrics": self.metrics_url}

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    # -- lifecycle ---------------------------------------------------------------------------
    def command(self, backends: Path | None) -> list[str]:
        """backends None: the binary's own backend directory (a GPU container's tritonserver)."""
        binary = self.tritonserver or bundled_tritonserver()
        return [
            str(binary),
            "--model-repository", str(self.repo),
            *(["--backend-directory", str(backends)] if backends else []),
            "--http-address", self.host, "--http-port", str(self.http_port),
            "--grpc-address", self.host, "--grpc-port", str(self.grpc_port),
            "--metrics-address", self.host, "--metrics-port", str(self.metrics_port),
            "--exit-timeout-secs", "5",
            # our configs are complete: auto-completing starts one more Python stub per model
            # (measured: 17.5 s to ready instead of 21.4 s, one CPU server on 2 cores)
            "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *self.extra_args,
        ]

    def start(self) -> "TritonServer":
        self.launch()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _open_log(self) -> BinaryIO:
        """The log where asked; where that cannot be written (a build mounted read-only: serving
        needs no write access to it) a temp file that outlives the server, said on stderr; none
        asked, in the server's temp folder."""
        if self.log_path:
            try:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                return open(self.log_path, "ab")
            except OSError as err:
                handle, path = tempfile.mkstemp(prefix="specdeploy-tritonserver-", suffix=".log")
                print(f"specdeploy: cannot write {self.log_path} ({err.strerror}): the server's log is {path}",
                      file=sys.stderr)
                self.log_path = Path(path)
                return os.fdopen(handle, "ab")
        self.log_path = self._work / "tritonserver.log"
        return open(self.log_path, "ab")

    def launch(self) -> "TritonServer":
        """Start the process without waiting for it to be ready (see `start_together`)."""
        if not any(self.repo.glob("*/config.pbtxt")):
            raise SpecDeployError(f"{self.repo} is not a model repository", hint="run `specdeploy package` first")
        if not self.tritonserver:
            check_stub_numpy()
        self._work = Path(tempfile.mkdtemp(prefix="specdeploy-triton-"))
        backends = None if self.tritonserver else make_backend_dir(self._work, bundled_tritonserver())
        self._log_file = self._open_log()
        self.process = subprocess.Popen(
            self.command(backends), stdout=self._log_file, stderr=subprocess.STDOUT,
            env=server_env(threads=self.threads), start_new_session=True,  # its own group: stop() reaches the stubs
            preexec_fn=_die_with_parent,
        )
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        relaunched = False
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                if not relaunched and self._aborted_in_grpc_poller():
                    relaunched = True
                    self._relaunch()
                    continue
                raise SpecDeployError(
                    f"tritonserver exited with code {self.process.returncode} while loading {self.repo}",
                    hint=f"see its log: {self.log_path}\n{self.log_tail()}",
                )
            if self.ready():
                return
            time.sleep(0.25)
        raise SpecDeployError(
            f"tritonserver not ready after {self.ready_timeout:.0f} s", hint=f"see its log: {self.log_path}"
        )

    def _aborted_in_grpc_poller(self) -> bool:
        """The bundled tritonserver's gRPC poller aborted it while it started ("epoll_wait error: Bad
        file descriptor", SIGABRT): seen once in five runs of the test suite, two servers starting
        side by side (2026-11-27); started again, it comes up. Any other exit is the server's answer."""
        return self.process is not None and self.process.returncode == -signal.SIGABRT and \
            "epoll_wait error" in self.log_tail()

    def _relaunch(self) -> None:
        print(f"tritonserver aborted in gRPC's poller while starting ({self.repo}); starting it once more:\n"
              f"{self.log_tail(3)}", file=sys.stderr)
        own_log = self._work is not None and self.log_path is not None and self._work in self.log_path.parents
        self.stop()
        if own_log:  # it went with the work folder: the next launch writes one in its own
            self.log_path = None
        self.launch()

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (Triton drains and unloads), SIGKILL the group if it hangs; clean shm."""
        code = None
        if self.process is not None:
            code = self._terminate(timeout)
            self.process = None
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        self.clean_shm()
        if self._work:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None
        return code

    def _terminate(self, timeout: float) -> int | None:
        proc = self.process
        assert proc is not None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        try:  # stubs left behind by a crash live in the server's process group
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return proc.returncode

    def clean_shm(self) -> list[str]:
        """Remove the Python backend's shared-memory files this server created."""
        removed = []
        for path in shm_regions(self.shm_prefix):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
        return removed

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_together(stack: ExitStack, servers: dict[str, TritonServer]) -> dict[str, TritonServer]:
    """Launch every server, then wait for each: their model loads overlap. Each stops when `stack`
    closes, or at once if one fails to come up. Call from the thread that keeps the servers: a
    server dies with the thread that started it (PR_SET_PDEATHSIG)."""
    for server in servers.values():
        stack.callback(server.stop)
        server.launch()
    for server in servers.values():
        server.wait_ready()
    return servers


# ---------------------------------------------------------------------------------------------
# CLI


def repository(build_root: Path) -> Path:
    """build/<name>/triton_repo/cpu: what the bundled tritonserver can run. The GPU routes
    (triton_repo/engine, triton_repo/llmapi) need NVIDIA's TensorRT-LLM container:
    build_scripts/gpu_host.sh assembles and serves them there."""
    return build_root / "triton_repo" / "cpu"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdeploy.manifest import add_build_args

    add_build_args(parser)
    parser.add_argument("--repo", help="model repository (default: <build>/triton_repo/cpu; the GPU routes are "
                        "served by build_scripts/gpu_host.sh in NVIDIA's container)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--tritonserver", help="tritonserver binary (default: the one bundled in nvidia-pytriton)")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--threads", type=int, help="torch threads per model (default: $OMP_NUM_THREADS or 2); "
                        "1 is steadier on a busy shared machine")


class _Interrupted(BaseException):
    """SIGINT/SIGTERM while the server loads (a BaseException: nothing on the way swallows it)."""


def main(args: argparse.Namespace) -> int:
    from specdeploy.manifest import build_from_args

    build = build_from_args(args)
    repo = Path(args.repo) if args.repo else repository(build.root)
    server = TritonServer(
        repo, http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        host=args.host, log_path=build.root / "logs" / "tritonserver.log",
        tritonserver=args.tritonserver, ready_timeout=args.ready_timeout, threads=args.threads,
    )
    stopping: list[int] = []
    starting = [True]

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)
        if starting:  # loading can take minutes: interrupt start(), which stops the server and cleans shm
            starting.clear()  # once: a second signal must not interrupt that cleanup
            raise _Interrupted(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.start()
        starting.clear()
    except _Interrupted as stop:
        server.stop()  # start() stopped it already, unless the signal came just after it returned
        print(f"tritonserver stopped before it was ready ({signal.Signals(stop.args[0]).name})", flush=True)
        return 0
    print(f"tritonserver ready (pid {server.pid}): HTTP {server.http_url}, gRPC {server.grpc_url}, "
          f"metrics {server.metrics_url}; log {server.log_path}. Ctrl-C stops it.", flush=True)
    return _wait(server, stopping)


def _wait(server: TritonServer, stopping: list[int]) -> int:
    try:
        while not stopping:
            if server.process is None or server.process.poll() is not None:
                print(f"tritonserver exited unexpectedly; log tail:\n{server.log_tail()}", file=sys.stderr)
                server.stop()
                return 1
            time.sleep(0.5)
    finally:
        server.stop()
    print("tritonserver stopped", flush=True)
    return 0
