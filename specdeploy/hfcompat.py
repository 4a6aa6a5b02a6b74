"""Hugging Face folders that the GPU host's transformers reads as ours does.

TensorRT-LLM pins an older transformers than the pipeline's 5.x (1.2.1: 4.57.3; 1.1.0, in NGC's
25.12-26.02 Triton images: 4.56.0), and some fields 5.x saves mean something else, or nothing, to
4.56/4.57 (docs/formats.md lists them with the sources read):
- RoPE: 5.x keeps it only under `rope_parameters`; 4.x reads top-level `rope_theta` (10000
  when absent: silently wrong positions) and `rope_scaling`.
- dtype: 5.x writes `dtype`; readers of the raw file (and configs written by ModelOpt's
  exporters) use `torch_dtype`.
- tokenizer_config.json: 5.x's `tokenizer_class: TokenizersBackend` does not exist in 4.x
  (AutoTokenizer fails); `PreTrainedTokenizerFast` is that class in 4.x and an alias of it in
  5.x. 5.x's `extra_special_tokens` list is 4.x's `additional_special_tokens` (4.x takes
  `extra_special_tokens` for a dict of named tokens and fails on a list).

`write_compatible(folder)` adds the 4.x spellings beside the 5.x ones: 5.x reads the folder
exactly as before (tests/test_release_transformers.py checks both sides). JSON only, no heavy
imports; files are replaced atomically, so a hard-linked source folder (a cache) is never changed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_text
from specdeploy.quantize.formats import DEPLOY_DTYPES

# 5.x tokenizer class -> the 4.x class that loads the same tokenizer.json the same way
LEGACY_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def compatible_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with the 4.x RoPE and dtype fields beside 5.x's."""
    out = {**config, **_legacy_rope(config)}
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype:  # 5.x reads `dtype` first, 4.56+ too; raw readers of the file read `torch_dtype`
        out.update(dtype=dtype, torch_dtype=dtype)
    return out


def with_dtype(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """`config` declaring weights of `dtype` (a drafter cast to the deployment's dtype)."""
    if dtype not in DEPLOY_DTYPES:
        raise SpecDeployError(f"unknown deployment dtype {dtype!r} for a drafter", hint=f"use one of {', '.join(DEPLOY_DTYPES)}")
    return {**config, "dtype": dtype, "torch_dtype": dtype}


def _legacy_rope(config: dict[str, Any]) -> dict[str, Any]:
    """Top-level rope_theta / rope_scaling (/ partial_rotary_factor) from 5.x's rope_parameters.

    5.x reading them back: a non-null rope_scaling replaces rope_parameters and rope_theta fills
    its missing theta, so rope_scaling carries every other parameter; null keeps rope_parameters."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        return {}  # no RoPE, or written by an older transformers / by hand (already 4.x-shaped)
    if "rope_theta" not in rope:
        print(f"hfcompat: config.json has one RoPE per layer type ({sorted(rope)}); transformers 4.56/4.57 spell "
              "that per architecture, so a TensorRT-LLM pinning transformers 4.x may read other RoPE parameters",
              file=sys.stderr)
        return {}
    out: dict[str, Any] = {"rope_theta": rope["rope_theta"]}
    if "partial_rotary_factor" in rope:
        out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    # plain RoPE is null, not {"rope_type": "default"}: TensorRT-LLM's RopeParams.from_config passes a
    # non-null rope_scaling's type to RotaryScalingType.from_string, which refuses "default" in the
    # versions read (a later one maps it to none, for transformers 5)
    out["rope_scaling"] = None if rope_type == "default" else scaling
    return out


def compatible_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json with a tokenizer class and special-token fields 4.x reads as 5.x does."""
    out = dict(config)
    cls = out.get("tokenizer_class")
    if cls in LEGACY_TOKENIZER_CLASSES:
        out["tokenizer_class"] = LEGACY_TOKENIZER_CLASSES[cls]
    extra = out.get("extra_special_tokens")
    if isinstance(extra, list):  # 5.x reads additional_special_tokens into the same list
        del out["extra_special_tokens"]
        out["additional_special_tokens"] = extra
    return out


FIXES = {"config.json": compatible_config, "tokenizer_config.json": compatible_tokenizer_config}


def write_compatible(folder: str | Path) -> None:
    """Rewrite `folder`'s config.json and tokenizer_config.json (where present) in place."""
    for name, fix in FIXES.items():
        path = Path(folder) / name
        if not path.is_file():
            continue
        original = json.loads(path.read_text())
        fixed = fix(original)
        if fixed != original:
            atomic_write_text(path, json.dumps(fixed, indent=2, ensure_ascii=False) + "\n")
