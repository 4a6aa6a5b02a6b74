"""A GGUF file dequantized once into a Hugging Face safetensors folder, cached by its sha256."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, cache_dir, cached_sha256
from specdeploy.resolve.cache import is_complete_hf_dir, locked, publish_dir

CONVERSION_VERSION = 3  # bump when the GGUF -> safetensors conversion changes its output (3: BOS as the GGUF adds it)


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
    add_bos = _check_readable(gguf)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, OSError) as err:  # not GGUF, truncated, or an architecture transformers cannot map
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        raise SpecDeployError(f"{gguf} cannot be read as a GGUF model: {err}",
                              hint=f"transformers reads GGUF files of {', '.join(_architectures(GGUF_CONFIG_MAPPING))}; check that the "
                                   "file is complete (its size and sha256), or convert the model to a safetensors HF folder") from err
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
    tokenizer.add_bos_token = add_bos  # transformers' GGUF tokenizer ignores tokenizer.ggml.add_bos_token
    tokenizer.save_pretrained(out)
    return out


def _check_readable(gguf: Path) -> bool:
    """Refuse what transformers' GGUF loader would drop without a word; whether the tokenizer adds
    BOS (llama.cpp does where the file says so: Llama 3's). transformers 5.14 reads no RoPE scaling
    for llama / qwen2 (only rope.freq_base) and loads non-strictly, so a `{arch}.rope.scaling.*`
    setting or Llama 3.1's `rope_freqs` tensor would vanish and the model compute differently."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf)
    except Exception:  # not GGUF or truncated: transformers' own error below says which
        return False
    field = lambda name: reader.fields[name].contents() if name in reader.fields else None  # noqa: E731
    arch = field("general.architecture")
    scaling = field(f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise SpecDeployError(f"{gguf.name} scales its RoPE ({scaling or 'rope_freqs'}), which transformers' GGUF loader "
                              "drops: the converted model would compute differently",
                              hint="pass the model's Hugging Face folder (safetensors) instead of the GGUF file")
    return bool(field("tokenizer.ggml.add_bos_token"))


def _architectures(mapping: dict[str, Any]) -> list[str]:
    return sorted(name for name in mapping if name not in ("general", "tokenizer"))  # sections, not architectures


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
    digest = sha256 or cached_sha256(gguf)  # a multi-GB file is hashed once, not on every run
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", label or gguf.stem).lower()
    key = f"{stem}-{digest[:12]}-v{CONVERSION_VERSION}"
    final = cache_dir() / "models" / key
    if is_complete_hf_dir(final):
        return final
    with locked(key):
        if is_complete_hf_dir(final):  # another process converted it while we waited
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{key}.", suffix=".partial"))
        try:
            convert_gguf(gguf, tmp, dtype=dtype)
            atomic_write_json(tmp / "specdeploy_source.json", {"gguf": gguf.name, "sha256": digest})
            return publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
