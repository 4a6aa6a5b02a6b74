"""Oracle environments: a venv per pin set, made once and cached under the specdeploy cache dir, so a
test can ask another library (or another version of one) what it reads, in its own process. Every
one the suite uses is named in ORACLES, so that `make test` can make them ahead of the tests that
need them (on the core the project's own pip install leaves idle); those tests wait on its lock.

    python -m tests.oracle [NAME ...]   # make these (default: all of them), print their pythons

Runs without the project's venv too: it needs only the standard library and specdeploy's release table.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from specdeploy.fileio import cache_dir
from specdeploy.trtllm import releases

# the transformers that TensorRT-LLM releases pin (the 4.x pins: releases whose transformers predates ours)
TRANSFORMERS = sorted({r.transformers for r in releases.RELEASES.values() if r.transformers.startswith("4.")})
# everything else tests/release_probe.py imports, pinned as resolved beside those (torch: the CPU wheel on disk)
TRANSFORMERS_PINS = ("torch==2.13.0", "numpy==1.26.4", "tokenizers==0.22.2", "safetensors==0.8.0",
                     "huggingface-hub==0.36.2", "jinja2==3.1.6")
# name -> (pins, packages uninstalled afterwards)
ORACLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    **{f"transformers-{version}": ((f"transformers=={version}", *TRANSFORMERS_PINS), ()) for version in TRANSFORMERS},
    # speculators needs numpy >= 2 (the project pins 1.26); torchvision and torchaudio come with it from
    # PyPI and are removed: their builds break transformers' imports beside the CPU torch
    "speculators-0.9.0": (("torch==2.13.0", "speculators==0.9.0"), ("torchvision", "torchaudio")),
    # the wheel's files only: read with `ast`, never imported
    "sglang-0.5.23": (("--no-deps", "sglang==0.5.23"), ()),
}


class OracleError(RuntimeError):
    pass


def oracle_venv(name: str) -> Path:
    """The python of the oracle environment `name` (a key of ORACLES), made on first use."""
    pins, uninstall = ORACLES[name]
    recipe = list(pins) + [f"-{package}" for package in uninstall]
    key = hashlib.sha256("\n".join(recipe).encode()).hexdigest()[:12]
    venv = cache_dir() / "oracle-venvs" / f"{name}-{key}"
    python, stamp = venv / "bin" / "python", venv / ".installed"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent makers (test workers, `make test`'s head start) build it once
        if not stamp.is_file():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            _pip(python, venv, ["install", "--no-compile", *pins], pins)  # compiled on first use (Makefile)
            if uninstall:
                _pip(python, venv, ["uninstall", "-y", *uninstall], pins)
            stamp.write_text("\n".join(recipe) + "\n")
    return python


def _pip(python: Path, venv: Path, args: list[str], pins: tuple[str, ...]) -> None:
    done = subprocess.run([str(python), "-m", "pip", *args[:1], "-q", "--disable-pip-version-check", *args[1:]],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise OracleError(f"could not make the oracle venv {venv} ({', '.join(pins)}): pip {args[0]}:\n{done.stderr[-3000:]}")


def main(names: list[str]) -> int:
    unknown = [name for name in names if name not in ORACLES]
    if unknown:
        print(f"unknown oracle environment(s) {', '.join(unknown)}; known: {', '.join(ORACLES)}", file=sys.stderr)
        return 2
    failed = 0
    for name in names or list(ORACLES):
        try:
            print(oracle_venv(name), flush=True)
        except (OracleError, subprocess.CalledProcessError) as err:  # the test that needs it tries again and reports
            print(err, file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
