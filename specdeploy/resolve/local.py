"""A model folder on disk: safetensors as they are; pickle weights only when the user vouches for
them (converted once to safetensors, cached by content); remote code only when trusted."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import cache_dir, checkpoint_files, content_fingerprint
from specdeploy.resolve.bundled import ACCEPTED_FORMS
from specdeploy.resolve.cache import is_complete_hf_dir, locked, publish_dir

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _check_remote_code(folder: Path, trust_remote_code: bool) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise SpecDeployError(f"{folder} has no config.json, so it is not a Hugging Face model folder",
                              hint=f"accepted forms: {ACCEPTED_FORMS}")
    # the model's config or the tokenizer's can each name code of the folder's own to run
    for path in (config_path, folder / "tokenizer_config.json"):
        if not path.is_file():
            continue
        try:
            auto_map = json.loads(path.read_text()).get("auto_map")
        except json.JSONDecodeError as err:
            raise SpecDeployError(f"{path} is not valid JSON ({err})") from err
        if auto_map and not trust_remote_code:
            raise SpecDeployError(
                f"{folder} needs remote code ({path.name} auto_map: {sorted(auto_map)})",
                hint="read the folder's *.py files; pass --trust-remote-code only if you trust them",
            )


def _check_safetensors(folder: Path) -> None:
    """The checkpoint's weight files (fileio.checkpoint_files; a shard its index names that is
    missing fails here) and each one's header, read now (it is small): a truncated or unfinished
    download fails here with its name, not as a struct error stages later. Other *.safetensors
    alone (Mistral's consolidated.safetensors) are no checkpoint transformers loads."""
    from safetensors import safe_open

    files = checkpoint_files(folder)
    if not files:
        raise SpecDeployError(f"{folder} has *.safetensors but no model.safetensors or model.safetensors.index.json",
                              hint="pass the model's Hugging Face folder (consolidated.safetensors is another layout)")
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as weights:
                weights.keys()
        except Exception as err:  # SafetensorError, or an OSError for an unreadable file
            raise SpecDeployError(f"{path} is not a readable safetensors file ({err})",
                                  hint="it may be truncated or still downloading: fetch it again") from err


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


def _check_unquantized(folder: Path) -> None:
    """A folder quantized elsewhere (FP8 with block scales, AWQ, GPTQ, bitsandbytes ...) holds
    weights the stages would read as plain ones (FP8 bytes cast without their scales) or not at
    all; specdeploy quantizes the base itself. A ModelOpt checkpoint (its own export) is read with
    its numerics."""
    method = (json.loads((folder / "config.json").read_text()).get("quantization_config") or {}).get("quant_method")
    if method not in (None, "modelopt"):
        raise SpecDeployError(f"{folder} is already quantized (quantization_config quant_method {method!r})",
                              hint="pass the unquantized model (bf16 / fp16 / fp32 weights): the quantize stage "
                                   "quantizes it (make engine QUANT=fp8|int4_awq|...)")


def resolve_local_dir(folder: Path, *, allow_pickle: bool = False, trust_remote_code: bool = False) -> Path:
    _check_remote_code(folder, trust_remote_code)
    _check_unquantized(folder)
    if any(folder.glob("*.safetensors")):
        _check_safetensors(folder)
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
    if is_complete_hf_dir(final):
        return final
    with locked(key):
        if is_complete_hf_dir(final):
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
            return publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
