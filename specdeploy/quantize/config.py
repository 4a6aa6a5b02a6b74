"""What to quantize: the ModelOpt config for a format + KV cache, the Linears --exclude keeps, and
the checks that catch a format the model cannot take before calibration starts."""

from __future__ import annotations

import copy
from typing import Any, Iterable

from torch import nn

from specdeploy.errors import SpecDeployError
from specdeploy.quantize.formats import (
    AWQ_BLOCK_SIZES, BLOCK_QFORMATS, EXCLUDABLE_QFORMATS, EXCLUDED_NAMES, FUSED_GROUPS, KV_CACHE, QFORMATS)


def _kv_entries(kv_cache: str) -> list[dict[str, Any]]:
    if kv_cache == "none":
        return []
    bits = (4, 3) if kv_cache == "fp8" else 8
    return [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": bits, "axis": None}}]


def _set_block_size(entries: list[dict[str, Any]], block_size: int) -> None:
    """Rewrite the int4 weight quantizer's block size (W4A8 has a list: int4 then fp8)."""
    for entry in entries:
        cfgs = entry.get("cfg")
        for cfg in cfgs if isinstance(cfgs, list) else [cfgs]:
            if isinstance(cfg, dict) and cfg.get("block_sizes") and cfg.get("num_bits") == 4:
                cfg["block_sizes"] = {**cfg["block_sizes"], -1: block_size}
                cfg["block_sizes"].pop("-1", None)


def check_format(qformat: str, kv_cache: str, awq_block_size: int = 128) -> None:
    """Refuse a combination the stage cannot produce, before anything is loaded."""
    if qformat not in QFORMATS:
        raise SpecDeployError(f"unknown --quant '{qformat}'", hint=f"use one of {', '.join(QFORMATS)}")
    if kv_cache not in KV_CACHE:
        raise SpecDeployError(f"unknown --kv-cache '{kv_cache}'", hint=f"use one of {', '.join(KV_CACHE)}")
    if qformat in BLOCK_QFORMATS and awq_block_size not in AWQ_BLOCK_SIZES[qformat]:
        raise SpecDeployError(f"{qformat}: block size {awq_block_size} is not one TensorRT-LLM's INT4 kernels run",
                              hint=f"--awq-block-size {' or '.join(map(str, AWQ_BLOCK_SIZES[qformat]))}")
    if kv_cache == "int8":
        raise SpecDeployError(
            "--kv-cache int8 cannot be exported: ModelOpt 0.47's unified HF checkpoint stores only FP8 "
            "(or NVFP4) KV-cache scales",
            hint="use --kv-cache fp8 (what TRT-LLM ships with FP8/INT8/INT4 weights) or --kv-cache none",
        )


def quant_config(qformat: str, kv_cache: str = "fp8", awq_block_size: int = 128,
                 keep: Iterable[str] = ()) -> dict[str, Any] | None:
    """The ModelOpt 0.47 config (list-style quant_cfg) for a format + KV cache; None = nothing.
    `keep`: Linear names left unquantized (see excluded_linears)."""
    check_format(qformat, kv_cache, awq_block_size)
    if qformat == "none" and kv_cache == "none":
        return None
    import modelopt.torch.quantization as mtq

    if qformat == "none":
        config: dict[str, Any] = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        config = copy.deepcopy(getattr(mtq, QFORMATS[qformat]))
    if qformat in BLOCK_QFORMATS:
        _set_block_size(config["quant_cfg"], awq_block_size)
    keep_entries = [{"quantizer_name": f"{name}.*", "enable": False} for name in keep]
    config["quant_cfg"] = list(config["quant_cfg"]) + _kv_entries(kv_cache) + keep_entries
    return config


def quantized_linears(model: nn.Module) -> Iterable[tuple[str, nn.Linear]]:
    """The Linears the ModelOpt presets quantize (all but the embeddings and the LM head)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not any(part in name for part in EXCLUDED_NAMES):
            yield name, module


def check_exclude_format(qformat: str, patterns: list[str]) -> None:
    if patterns and qformat not in EXCLUDABLE_QFORMATS:
        raise SpecDeployError(f"--exclude is not supported with --quant {qformat}",
                              hint=f"mixed precision needs --quant {' or '.join(EXCLUDABLE_QFORMATS)} (TRT-LLM "
                                   "ignores exclude_modules on its INT8 SmoothQuant path)")


def excluded_linears(model: nn.Module, qformat: str, patterns: Iterable[str]) -> list[str]:
    """The quantizable Linears that --exclude keeps in the model dtype (fnmatch on HF module
    names, e.g. '*mlp.down_proj' or 'model.layers.0.*'); a pattern must match something, and
    TRT-LLM's fused GEMMs (FUSED_GROUPS) are kept or quantized as a whole."""
    from fnmatch import fnmatchcase

    patterns = list(patterns)
    check_exclude_format(qformat, patterns)
    if not patterns:
        return []
    names = [name for name, _ in quantized_linears(model)]
    kept = []
    for pattern in patterns:
        matched = [n for n in names if fnmatchcase(n, pattern)]
        if not matched:
            raise SpecDeployError(f"--exclude '{pattern}' matches no quantized Linear",
                                  hint=f"patterns match module names such as {names[0]} (e.g. '*mlp.down_proj', 'model.layers.0.*')")
        kept += [n for n in matched if n not in kept]
    for name in kept:
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED_GROUPS if leaf in g), ())
        missing = [f"{parent}.{m}" for m in group if f"{parent}.{m}" in names and f"{parent}.{m}" not in kept]
        if missing:
            raise SpecDeployError(
                f"--exclude keeps {name} unquantized but not {', '.join(missing)}: TensorRT-LLM runs "
                f"{'/'.join(group)} as one GEMM",
                hint="exclude the group together: --exclude " + " ".join(f"'{parent}.{m}'" for m in group),
            )
    return sorted(kept)


def check_block_size(model: nn.Module, qformat: str, block_size: int, keep: Iterable[str] = ()) -> None:
    """INT4 AWQ packs weights in blocks along the input dimension: each quantized Linear's input
    size must be a multiple of the block size (else the export fails deep inside ModelOpt); the
    Linears in `keep` (--exclude) stay unquantized and are not packed."""
    if qformat not in BLOCK_QFORMATS:
        return
    kept = set(keep)
    packed = [(name, linear) for name, linear in quantized_linears(model) if name not in kept]
    for name, linear in packed:
        if linear.in_features % block_size:
            smaller = [b for b in AWQ_BLOCK_SIZES[qformat] if b < block_size and all(m.in_features % b == 0 for _, m in packed)]
            unquantized = f"leave such layers unquantized (--exclude '{name}', ...) or " if qformat in EXCLUDABLE_QFORMATS else ""
            hint = f"pass --awq-block-size {smaller[-1]}" if smaller else f"{unquantized}use --quant fp8 for this model"
            raise SpecDeployError(
                f"{qformat}: layer {name} has input size {linear.in_features}, which is not a multiple of "
                f"the INT4 block size {block_size} (partial blocks are not supported)",
                hint=hint,
            )
