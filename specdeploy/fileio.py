"""Atomic file writes: a reader never sees a half-written file, an interrupted writer leaves
only a temp file that the next run overwrites."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    """The process umask. os.umask can only read it by setting it, which races with files other
    threads create meanwhile, so Linux's /proc is asked first."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _open_mode() -> int:
    """The mode a plain open() gives a new file under the umask (0644 under the usual 022)."""
    return 0o666 & ~_umask()


def shared_mode(path: str | os.PathLike) -> None:
    """Give a file the read (and write) bits a plain open() would, under the umask: libraries that
    write through mkstemp (transformers' save_pretrained writes model.safetensors 0600) otherwise
    leave weights a server running as another user (a pod) cannot read. Execute bits are kept."""
    mode = os.stat(path).st_mode & 0o7777
    wanted = mode | _open_mode()
    if wanted != mode:
        os.chmod(path, wanted)


def share_written(folder: str | os.PathLike) -> None:
    """shared_mode on every file `folder` holds that was written there, not hard-linked from
    elsewhere (a user's model folder keeps the modes its owner gave it)."""
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_nlink == 1:
            shared_mode(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp creates 0600; the file gets the mode a plain open() would give it (0644
            # under the usual umask), so a server running as another user (a pod) can read it
            os.fchmod(f.fileno(), _open_mode())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def carry_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A model's file into a build. Weights are hard-linked (free, the same bytes; a copy across
    file systems): a writer replaces a linked file (atomic_write_*), so the source is never written
    through, but a weights file overwritten in place in the user's folder changes the build's too.
    Every other file (config, tokenizer, chat template: small) is copied, so editing one in the
    user's folder leaves a finished build as it was."""
    if Path(src).suffix == ".safetensors":
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def link_folder(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A copy of a folder's files (an HF model folder), its weights hard-linked (carry_file)."""
    Path(dst).mkdir(parents=True, exist_ok=True)
    for item in Path(src).iterdir():
        if item.is_file():
            carry_file(item, Path(dst) / item.name)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of an HF checkpoint folder, in transformers' order: model.safetensors, else
    the shards its model.safetensors.index.json names; none where it has neither. A folder may hold
    other weights beside the checkpoint (Mistral's repositories ship consolidated.safetensors, the
    same model in another layout; a re-save in the other layout leaves the old index or file behind):
    transformers reads only these, and so does every reader here."""
    from specdeploy.errors import SpecDeployError

    folder = Path(path)
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        missing = [file.name for file in files if not file.exists()]
        if missing:
            raise SpecDeployError(f"{index} names shards that are not there: {', '.join(missing)}",
                                  hint="copy the whole checkpoint folder")
        return files
    return []


def load_safetensors_dir(path: str | os.PathLike, hint: str) -> dict[str, Any]:
    """Every tensor of an HF checkpoint folder (`checkpoint_files`)."""
    from safetensors.torch import load_file

    from specdeploy.errors import SpecDeployError

    files = checkpoint_files(path)
    if not files:
        raise SpecDeployError(f"no model.safetensors (or model.safetensors.index.json) in {path}", hint=hint)
    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def cache_dir() -> Path:
    """$SPECDEPLOY_CACHE, default ~/.cache/specdeploy: conversions, self-distillation data, hashes."""
    root = os.environ.get("SPECDEPLOY_CACHE") or Path.home() / ".cache" / "specdeploy"
    return Path(root).expanduser()


def cached_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's content, computed once and remembered by (path, size, mtime_ns, inode).

    Caches and completion checks are keyed on content, never on sizes: two fine-tunes of one
    architecture have identical sizes. Rehashing a 16 GB checkpoint on every run would cost
    minutes, so the digest is kept in $SPECDEPLOY_CACHE/hashes/ and recomputed when any of those
    change. Not the change time, which would catch a same-size file restored with its old mtime on a
    reused inode number (`cp -p`, `tar x`): every hard link the stages make (carry_file) changes it,
    and a 16 GB checkpoint would be hashed again on every run.
    """
    path = Path(path).resolve()
    stat = path.stat()
    stamp = (path, stat.st_size, stat.st_mtime_ns, stat.st_ino)
    key = hashlib.sha256("\0".join(map(str, stamp)).encode()).hexdigest()
    memo = cache_dir() / "hashes" / key[:2] / key
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    digest = sha256_file(path)
    try:
        atomic_write_text(memo, digest)
    except OSError:
        pass  # a read-only cache only costs the rehash next time
    return digest


def content_fingerprint(folder: str | os.PathLike, suffixes: tuple[str, ...] | None = None) -> dict[str, str]:
    """{file name: sha256} of a folder's files (optionally only those ending in `suffixes`)."""
    folder = Path(folder)
    return {
        p.name: cached_sha256(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and not p.name.startswith(".") and (suffixes is None or p.name.endswith(suffixes))
    }
