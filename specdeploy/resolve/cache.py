"""The model cache's write discipline: one builder per entry (a file lock), entries published
whole (a temp folder renamed into place), so concurrent callers never see a half-written folder."""

from __future__ import annotations

import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import cache_dir, checkpoint_files, share_written


@contextmanager
def locked(name: str) -> Iterator[None]:
    """An exclusive lock across processes, so two callers never build the same cache entry."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def publish_dir(tmp: Path, final: Path) -> Path:
    """Rename a finished temp folder into place. Called under the entry's lock: a folder already
    there is a damaged entry (the callers return a complete one before converting), replaced."""
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is shared
    share_written(tmp)  # and so are the weights transformers saved 0600
    if final.exists():
        damaged = final.with_name(f".{final.name}.damaged")
        shutil.rmtree(damaged, ignore_errors=True)
        os.rename(final, damaged)
        shutil.rmtree(damaged, ignore_errors=True)
    os.rename(tmp, final)
    return final


def is_complete_hf_dir(path: Path) -> bool:
    try:
        return (path / "config.json").is_file() and bool(checkpoint_files(path))
    except SpecDeployError:  # an index naming a shard that is not there
        return False
