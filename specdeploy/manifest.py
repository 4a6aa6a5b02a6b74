"""The build directory and its manifest: the only record of which stages are complete.

A stage writes into a temporary folder beside its final one and renames it into place when it
is done; only then is it recorded in manifest.json (written atomically). An interrupted stage
leaves a temp folder that the next run deletes, so a rerun resumes at the first incomplete stage.

One run writes a build at a time: a stage holds an exclusive lock on <build>/.lock while it
writes, and a second run reaching a stage then stops with the first one's pid instead of
replacing its temp folder or its manifest record underneath it.

A stage is complete when the manifest holds it with the same settings, the same fingerprints of
the stages it consumed, and its output files still present with their recorded content (sha256,
remembered per file by size and mtime: fileio.cached_sha256). Each record also says which device
the stage computed on.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import IO, Any, Iterator

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, cached_sha256, share_written
from specdeploy.quantize.formats import QUANT_FORMATS

MANIFEST = "manifest.json"
LOCK = ".lock"
COMMANDS = {"spec": "spec train"}  # the command that runs a stage, where it is not the stage's name
_VERSIONED = ("specdeploy", "torch", "transformers", "nvidia-modelopt", "tensorrt_llm")


def _normalized(obj: Any) -> Any:
    """JSON round trip, so tuples/paths compare equal to what was read back from disk."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def _versions() -> dict[str, str]:
    found = {}
    for dist in _VERSIONED:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    found["python"] = platform.python_version()
    return found


def build_name(model: str, spec: str, quant: str, module: str | None = None) -> str:
    """build/<name>/ for a model/spec/quant combination, e.g. 'smollm2-135m-eagle-fp8'; an imported
    module's folder name joins the spec ('...-eagle-<folder>-fp8'), so importing never replaces a
    trained module's build."""
    stem = Path(model.rstrip("/")).name.removesuffix(".gguf")
    kind = f"{spec}-{Path(module.rstrip('/')).name}" if module else spec
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{stem}-{kind}-{quant}").strip("-").lower()


def add_build_args(parser: argparse.ArgumentParser) -> None:
    """The options every stage uses to find its build directory."""
    parser.add_argument("--build-dir", help="build directory (default: <build-root>/<model>-<spec>-<quant>)")
    parser.add_argument("--build-root", default="build", help="parent of build directories (default: build)")
    parser.add_argument("--model", default="smollm2-135m", help="HF folder, .gguf file or bundled name")
    parser.add_argument("--spec", default="eagle", choices=["eagle", "medusa", "dflash", "draft", "ngram", "none"])
    parser.add_argument("--quant", default="fp8", choices=QUANT_FORMATS, help="ModelOpt quantization format of the base")
    parser.add_argument("--module", help="a speculative module made elsewhere (a folder in a layout docs/formats.md lists): "
                                         "the spec stage imports it instead of training one; it names the build too")


def build_from_args(args: argparse.Namespace) -> "BuildDir":
    if args.build_dir:
        return BuildDir(args.build_dir)
    return BuildDir(Path(args.build_root) / build_name(args.model, args.spec, args.quant, getattr(args, "module", None)))


class BuildDir:
    """build/<name>/: one folder per stage output plus manifest.json."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.manifest_path = self.root / MANIFEST

    def __repr__(self) -> str:
        return f"BuildDir({str(self.root)!r})"

    def path(self, out_dir: str) -> Path:
        return self.root / out_dir

    def manifest(self) -> dict[str, Any]:
        if not self.manifest_path.exists():
            return {"stages": {}}
        try:
            return json.loads(self.manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise SpecDeployError(
                f"{self.manifest_path} is not valid JSON ({err})",
                hint="delete it to rebuild every stage of this build directory",
            ) from err

    def record(self, stage: str) -> dict[str, Any] | None:
        return self.manifest()["stages"].get(stage)

    def fingerprint(self, stage: str) -> str:
        """A short hash of what a stage produced, for the stages that consume it."""
        record = self.record(stage)
        if record is None:
            raise SpecDeployError(
                f"stage '{stage}' has not run in {self.root}",
                hint=f"run `specdeploy {COMMANDS.get(stage, stage)}` (or `make engine`) first",
            )
        blob = json.dumps(record["outputs"], sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def completed(self, stage: str, settings: dict[str, Any], consumes: tuple[str, ...] = ()) -> bool:
        record = self.record(stage)
        if record is None or record["settings"] != _normalized(settings):
            return False
        if record["inputs"] != {name: self.fingerprint(name) for name in consumes}:
            return False
        out = self.root / record["out_dir"]
        return all(
            (out / rel).is_file() and (out / rel).stat().st_size == info["bytes"]
            and cached_sha256(out / rel) == info["sha256"]
            for rel, info in record["outputs"].items()
        )

    @contextmanager
    def stage(
        self, stage: str, out_dir: str, settings: dict[str, Any], consumes: tuple[str, ...] = (),
        device: str | None = None, notes: dict[str, Any] | None = None,
    ) -> Iterator[Path]:
        """Yield a fresh temp folder; on success rename it to `out_dir` and record the stage.

        `device` (device.describe()) and `notes` (how the stage chose its settings) are recorded
        beside the settings, not in them: a stage completed on one device stays complete when the
        build is mounted on another host."""
        with self._locked(stage):
            inputs = {name: self.fingerprint(name) for name in consumes}
            tmp, final, stale = (self.root / name for name in (f".{out_dir}.partial", out_dir, f".{out_dir}.stale"))
            for leftover in (tmp, stale):  # an interrupted run's
                shutil.rmtree(leftover, ignore_errors=True)
            tmp.mkdir(parents=True)
            started = time.time()
            yield tmp
            share_written(tmp)  # weights saved by transformers / ModelOpt come out 0600
            if final.exists():
                os.rename(final, stale)
            os.rename(tmp, final)  # the new output in place before the old one's (slow) removal
            shutil.rmtree(stale, ignore_errors=True)
            self._write_record(stage, out_dir, settings, inputs, started, device, notes)

    @contextmanager
    def _locked(self, stage: str) -> Iterator[None]:
        """The build's lock for one stage, or a clear refusal naming the run that holds it."""
        with self._lock_file(stage) as handle:
            locked = self._acquire(handle, stage)
            try:
                yield
            finally:
                if locked:
                    fcntl.flock(handle, fcntl.LOCK_UN)

    def _acquire(self, handle: IO[str], stage: str) -> bool:
        """Take the lock and say who holds it (where the file is writable); False where the file
        system has no locks (ENOLCK: some NFS and FUSE mounts)."""
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise SpecDeployError(f"another specdeploy run is writing {self.root} ({holder}): stage '{stage}' "
                                  "was not started", hint="wait for that run to end, or give this one another "
                                  "--build-dir / --build-root") from None
        except OSError as err:
            print(f"specdeploy: {self.root} cannot be locked ({err.strerror}): one run at a time, please", file=sys.stderr)
            return False
        if handle.writable():
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()}, stage {stage}")
            handle.flush()
        return True

    def _lock_file(self, stage: str) -> IO[str]:
        """<build>/.lock, open to write who holds it; read-only where another user made it (a
        shared build: flock needs no write access)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return open(self.root / LOCK, "a+")
        except PermissionError:
            if (self.root / LOCK).is_file() and os.access(self.root, os.W_OK):
                return open(self.root / LOCK)
            raise self._unwritable(stage, "permission denied") from None
        except OSError as err:
            raise self._unwritable(stage, err.strerror) from err

    def _unwritable(self, stage: str, why: str) -> SpecDeployError:
        return SpecDeployError(f"cannot write {self.root} ({why}): stage '{stage}' was not started",
                               hint="run it on a writable copy of the build (serving a build needs no write access)")

    def _write_record(
        self, stage: str, out_dir: str, settings: dict, inputs: dict, started: float, device: str | None,
        notes: dict[str, Any] | None,
    ) -> None:
        out = self.root / out_dir
        outputs = {
            str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": cached_sha256(p)}
            for p in sorted(out.rglob("*"))
            if p.is_file() and not p.is_symlink()
        }
        manifest = self.manifest()
        manifest["stages"][stage] = {
            "out_dir": out_dir,
            "settings": _normalized(settings),
            "inputs": inputs,
            "outputs": outputs,
            "versions": _versions(),
            **({"device": device} if device else {}),
            **(notes or {}),
            "seconds": round(time.time() - started, 2),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        atomic_write_json(self.manifest_path, manifest)
