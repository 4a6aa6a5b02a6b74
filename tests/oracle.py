"""Oracle environments: a venv per pin set, made once and cached under the specdeploy cache dir, so a
test can ask another library (or another version of one) what it reads, in its own process.

    python -m tests.oracle NAME PIN [PIN ...] [--uninstall PKG ...]   # build one ahead of a test run
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdeploy.fileio import cache_dir


def oracle_venv(name: str, pins: tuple[str, ...], uninstall: tuple[str, ...] = ()) -> Path:
    """The python of a venv with `pins` installed and then `uninstall` removed, made once per pin set
    (under a file lock: concurrent test runs build it once)."""
    recipe = list(pins) + [f"-{package}" for package in uninstall]
    key = hashlib.sha256("\n".join(recipe).encode()).hexdigest()[:12]
    venv = cache_dir() / "oracle-venvs" / f"{name}-{key}"
    python, stamp = venv / "bin" / "python", venv / ".installed"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
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
        pytest.fail(f"could not make the oracle venv {venv} ({', '.join(pins)}): pip {args[0]}:\n{done.stderr[-3000:]}")


if __name__ == "__main__":
    arguments = sys.argv[2:]
    split = arguments.index("--uninstall") if "--uninstall" in arguments else len(arguments)
    print(oracle_venv(sys.argv[1], tuple(arguments[:split]), tuple(arguments[split + 1:])))
