"""Stage `quantize`: ModelOpt post-training quantization of the base model (and optionally of the
Medusa/EAGLE module), exported as a unified HF checkpoint the CPU runtime serves and the
TensorRT-LLM convert stage reads.

Layout of build/<name>/quantized/ (read by specdeploy.trtllm.convert and by load_causal_lm):

    config.json              HF config with `quantization_config` (quant_method "modelopt")
    hf_quant_config.json     {"producer": {"name": "modelopt", "version"},
                              "quantization": {"quant_algo": FP8 | W8A8_SQ_PER_CHANNEL | W4A16_AWQ |
                                               W4A8_AWQ | NVFP4 | null,
                                               "kv_cache_quant_algo": FP8 | INT8 | null,
                                               "group_size", "has_zero_point", "pre_quant_scale",
                                               "exclude_modules": ["lm_head", "model.embed_tokens",
                                                                   + what --exclude kept]}}
    model.safetensors        ModelOpt's export: per quantized Linear `<m>.weight` (float8_e4m3fn,
                             int8, or uint8 = two int4 packed along the output dim), `<m>.weight_scale`
                             (per tensor / per row / per (row, block)), `<m>.weight_scale_2` (W4A8),
                             `<m>.input_scale` (static activation scale), `<m>.pre_quant_scale`
                             (SmoothQuant / AWQ smoothing not fused into a norm), and
                             `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale` (KV cache).
                             Other weights in the export dtype (bf16 by default).
    generation_config.json, tokenizer files, chat template (copied from base/)
    specdeploy_quant.json    the settings, ModelOpt config and calibration summary of this run
    quantize.json, quantize.md   the quality report (see quality_report)
    spec/                    only with --quantize-spec: spec_config.json (+ "quantization") and
                             module.safetensors with the module's quantized linears in the same
                             naming as above (<m>.weight fp8, <m>.weight_scale, <m>.input_scale)

The CPU runtime's numerics (load_quantized, also what load_causal_lm does for this folder):
the exported checkpoint IS the reference. Each quantized Linear is rebuilt from its stored
quantized weight times its scales (what the TRT-LLM engine multiplies with), and its input is
fake-quantized with the stored static input_scale (after pre_quant_scale), exactly the
quantize-dequantize ModelOpt applied during calibration; K and V are fake-quantized with
k_scale / v_scale at the attention call (post-RoPE, like ModelOpt and TRT-LLM's KV cache).
No ModelOpt import, no pickle: every process that serves this folder (runtime, Triton model,
verify, bench) gets the same numbers. Checked against ModelOpt layer by layer (tests): given the
exported weights, each Linear's output is ModelOpt's own (SmoothQuant: the whole forward, bit for
bit). ModelOpt's in-memory fake quant itself differs slightly from its export (the export divides
w / scale in bf16, so ~4% of FP8 weights land one FP8 step away at near-ties): we follow the
export, because it is what TensorRT-LLM computes with. NVFP4 exports but cannot run on CPU (ModelOpt's dynamic
block quantization needs CUDA): load_quantized refuses it with a clear error.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, atomic_write_text, load_safetensors_dir
from specdeploy.manifest import BuildDir, add_build_args, build_from_args

STAGE = "quantize"
OUT = "quantized"
QFORMATS = {
    "fp8": "FP8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int4_awq": "INT4_AWQ_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG",
    "none": None,
}
KV_CACHE = ("fp8", "int8", "none")
BLOCK_QFORMATS = ("int4_awq", "w4a8_awq")
AWQ_BLOCK_SIZES = (32, 64, 128)  # TRT-LLM's W4A16 AWQ kernels take 64 and 128; ModelOpt any divisor
CPU_UNRUNNABLE = {"nvfp4": "NVFP4", "NVFP4": "NVFP4", "W4A8_NVFP4_FP8": "NVFP4", "NVFP4_AWQ": "NVFP4"}
# What the activations of a quantized Linear are fake-quantized to, per exported quant_algo.
ACT_FORMAT = {"FP8": "fp8", "W8A8_SQ_PER_CHANNEL": "int8", "W4A16_AWQ": None, "W4A8_AWQ": "fp8"}
FP8_MAX = 448.0
EXCLUDED_NAMES = ("lm_head", "output_layer", "embed")  # never quantized by the ModelOpt presets
# TensorRT-LLM runs these Linears as one GEMM (attention.qkv; the fused gate/up MLP), so a layer
# keeps or quantizes each group as a whole.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# TRT-LLM honours exclude_modules for FP8 and weight-only AWQ (quantize_layers); its INT8
# SmoothQuant plugin path quantizes every layer, so mixed precision is refused there.
EXCLUDABLE_QFORMATS = ("fp8", "int4_awq")


# ============================================================================ configuration


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


def quant_config(qformat: str, kv_cache: str = "fp8", awq_block_size: int = 128,
                 keep: Iterable[str] = ()) -> dict[str, Any] | None:
    """The ModelOpt 0.47 config (list-style quant_cfg) for a format + KV cache; None = nothing.
    `keep`: Linear names left unquantized (see excluded_linears)."""
    if qformat not in QFORMATS:
        raise SpecDeployError(f"unknown --qformat '{qformat}'", hint=f"use one of {', '.join(QFORMATS)}")
    if kv_cache not in KV_CACHE:
        raise SpecDeployError(f"unknown --kv-cache '{kv_cache}'", hint=f"use one of {', '.join(KV_CACHE)}")
    if qformat in BLOCK_QFORMATS and awq_block_size not in AWQ_BLOCK_SIZES:
        raise SpecDeployError(f"AWQ block size {awq_block_size} is not supported",
                              hint=f"use one of {', '.join(map(str, AWQ_BLOCK_SIZES))}")
    if kv_cache == "int8":
        raise SpecDeployError(
            "--kv-cache int8 cannot be exported: ModelOpt 0.47's unified HF checkpoint stores only FP8 "
            "(or NVFP4) KV-cache scales",
            hint="use --kv-cache fp8 (what TRT-LLM ships with FP8/INT8/INT4 weights) or --kv-cache none",
        )
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


def _quantized_linears(model: nn.Module) -> Iterable[tuple[str, nn.Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not any(part in name for part in EXCLUDED_NAMES):
            yield name, module


def check_exclude_format(qformat: str, patterns: list[str]) -> None:
    if patterns and qformat not in EXCLUDABLE_QFORMATS:
        raise SpecDeployError(f"--exclude is not supported with --qformat {qformat}",
                              hint=f"mixed precision needs --qformat {' or '.join(EXCLUDABLE_QFORMATS)} (TRT-LLM "
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
    names = [name for name, _ in _quantized_linears(model)]
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


def check_block_size(model: nn.Module, qformat: str, block_size: int) -> None:
    """INT4 AWQ packs weights in blocks along the input dimension: each quantized Linear's input
    size must be a multiple of the block size (else the export fails deep inside ModelOpt)."""
    if qformat not in BLOCK_QFORMATS:
        return
    for name, linear in _quantized_linears(model):
        if linear.in_features % block_size:
            smaller = [b for b in AWQ_BLOCK_SIZES if b < block_size and all(
                m.in_features % b == 0 for _, m in _quantized_linears(model))]
            hint = (f"pass --awq-block-size {smaller[-1]}" if smaller
                    else "use --qformat fp8 or int8_sq for this model")
            raise SpecDeployError(
                f"{qformat}: layer {name} has input size {linear.in_features}, which is not a multiple of "
                f"the INT4 block size {block_size} (partial blocks are not supported)",
                hint=hint,
            )


# ============================================================================ calibration


def calibration_batches(tokenizer: Any, calib_size: int, seq_len: int, seed: int = 0) -> list[torch.Tensor]:
    """`calib_size` token sequences (<= seq_len) of ShareGPT *train* conversations (user turn +
    answer, in the chat template when there is one): the activations the model will serve."""
    from specdeploy.data import sharegpt_conversations

    if calib_size <= 0 or seq_len < 8:
        raise SpecDeployError(f"calibration needs calib_size > 0 and calib_seq_len >= 8 (got {calib_size}, {seq_len})")
    batches = []
    for messages in sharegpt_conversations(calib_size, split="train", seed=seed):
        ids = _encode_chat(tokenizer, messages[:2])[:seq_len]
        batches.append(torch.tensor([ids], dtype=torch.long))
    return batches


def _encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    else:
        text = "\n\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _forward_loop(batches: list[torch.Tensor], desc: str) -> Callable[[nn.Module], None]:
    from tqdm import tqdm

    def loop(model: nn.Module) -> None:
        with torch.no_grad():
            for ids in tqdm(batches, desc=desc, unit="seq", leave=False):
                model(input_ids=ids, use_cache=False)

    return loop


def quantize_model(model: nn.Module, qformat: str, kv_cache: str, batches: list[torch.Tensor],
                   awq_block_size: int = 128, keep: Iterable[str] = ()) -> nn.Module:
    """ModelOpt PTQ in place (the model should already be bf16/fp16: export casts nothing);
    `keep`: Linear names left unquantized (excluded_linears resolves --exclude patterns)."""
    config = quant_config(qformat, kv_cache, awq_block_size, keep)
    if config is None:
        return model
    check_block_size(model, qformat, awq_block_size)
    import modelopt.torch.quantization as mtq

    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        model.config._attn_implementation = "sdpa"  # KV-cache quantizers hook the attention call
    mtq.quantize(model, config, _forward_loop(batches, f"calibrating {qformat}/kv {kv_cache}"))
    return model


# ============================================================================ export


def _load_base(base_dir: Path, dtype: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]  # export_hf_checkpoint needs it
    return model.eval()


def export_checkpoint(model: nn.Module, out_dir: Path) -> None:
    """export_hf_checkpoint mutates the model: never export the same instance twice."""
    if getattr(model, "_specdeploy_exported", False):
        raise SpecDeployError("this model instance was already exported (ModelOpt's export mutates it)",
                              hint="quantize a fresh instance for each export")
    from modelopt.torch.export import export_hf_checkpoint

    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
    model._specdeploy_exported = True
    export_hf_checkpoint(model, export_dir=str(out_dir))


def _copy_tokenizer_files(base_dir: Path, out_dir: Path) -> None:
    for src in base_dir.iterdir():
        if src.is_file() and not (out_dir / src.name).exists() and src.suffix in (".json", ".jinja", ".txt", ".model"):
            if src.name not in ("config.json", "model.safetensors.index.json", "specdeploy_source.json"):
                shutil.copy2(src, out_dir / src.name)


# ============================================================================ CPU loader


def read_quant_config(path: str | os.PathLike) -> dict[str, Any]:
    """hf_quant_config.json's "quantization" dict ({} when the folder is not quantized)."""
    file = Path(path) / "hf_quant_config.json"
    if not file.is_file():
        return {}
    return json.loads(file.read_text()).get("quantization", {})


def fake_quant(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize-dequantize with a static scale (= amax / maxbound, as exported), in fp32 and in
    the same operation order as ModelOpt's CPU kernels (x * (maxbound / amax)), so rounding
    ties fall the same way."""
    maxbound = FP8_MAX if fmt == "fp8" else 127.0
    inv = maxbound / (scale.float() * maxbound)  # ModelOpt's `scale`: maxbound / amax
    if fmt == "fp8":
        q = (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * (1 / inv)
    elif fmt == "int8":
        q = (x.float() * inv).round().clamp(-128, 127) / inv
    else:
        raise ValueError(fmt)
    return q.to(x.dtype)


def rounds_activations(quant: dict[str, Any]) -> bool:
    """Does the forward pass round activations or K/V with static scales? Then a k-token verify
    and a 1-token step (which differ by ~1e-7 in fp32) can land on opposite sides of a rounding
    boundary, and a whole FP8/INT8 step apart: exact parity needs float64 on both sides."""
    return bool(ACT_FORMAT.get(quant.get("quant_algo")) or quant.get("kv_cache_quant_algo"))


def parity_dtype(model_dir: str | os.PathLike) -> str:
    """The CPU runtime dtype in which speculative output equals plain greedy output exactly."""
    return "float64" if rounds_activations(read_quant_config(model_dir)) else "float32"


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt's pack_int4_in_uint8, inverted: (out/2, in) uint8 -> (out, in) int8 in [-8, 7];
    byte [r, c] holds row 2r in its low nibble and row 2r+1 in its high nibble."""
    low = (packed & 0x0F).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    low = torch.where(low > 7, low - 16, low)
    high = torch.where(high > 7, high - 16, high)
    return torch.stack([low, high], dim=1).reshape(-1, packed.shape[-1])


def dequantize_weight(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The float32 weight a quantized Linear computes with: stored values times their scales."""
    weight = tensors[f"{prefix}.weight"]
    scale = tensors[f"{prefix}.weight_scale"].float()
    if weight.dtype == torch.uint8:  # int4, per (row, block)
        q = unpack_int4(weight).float()
        block = q.shape[1] // scale.shape[-1]
        w = q * scale.repeat_interleave(block, dim=-1)
        scale_2 = tensors.get(f"{prefix}.weight_scale_2")
        if scale_2 is not None:  # W4A8: the int4-dequantized weight is then FP8 quantized
            w = fake_quant(w, scale_2.float(), "fp8")
        return w
    if scale.ndim == 1 and scale.numel() > 1:
        scale = scale[:, None]  # per output row
    return weight.float() * scale


class QuantLinear(nn.Linear):
    """A Linear with dequantized weights and static fake-quantized inputs (see module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_format: str | None,
                 input_scale: torch.Tensor | None, pre_quant_scale: torch.Tensor | None) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.act_format = act_format if input_scale is not None else None
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float())
        self.register_buffer("pre_quant_scale", None if pre_quant_scale is None else pre_quant_scale.to(weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        if self.act_format is not None:
            x = fake_quant(x, self.input_scale, self.act_format)
        return nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, act={self.act_format}, smooth={self.pre_quant_scale is not None}"


KV_ATTENTION = "specdeploy_sdpa_kv_quant"


def _register_kv_attention() -> None:
    """A named attention function: fake-quantize K/V, then run whatever "sdpa" currently is.

    It is selected per attention module (its own config copy), not by replacing "sdpa": ModelOpt
    swaps ALL_ATTENTION_FUNCTIONS["sdpa"] in and out around its own forwards, which would shadow
    a global replacement in any process that also calibrates (e.g. the quality report)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if KV_ATTENTION in AttentionInterface._global_mapping:
        return

    def sdpa_with_kv_quant(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any):
        fmt, k_scale, v_scale = module._specdeploy_kv
        key, value = fake_quant(key, k_scale, fmt), fake_quant(value, v_scale, fmt)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, *args, **kwargs)

    AttentionInterface.register(KV_ATTENTION, sdpa_with_kv_quant)


def attach_kv_quant(attention: nn.Module, fmt: str, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """K/V of this attention module are fake-quantized (post-RoPE, at the attention call, like
    ModelOpt's _QuantAttention); the model's own config keeps "sdpa" (masks, callers)."""
    _register_kv_attention()
    attention._specdeploy_kv = (fmt, k_scale, v_scale)
    attention.config = copy.copy(attention.config)
    attention.config._attn_implementation = KV_ATTENTION


def _empty_model(path: Path, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we apply the numerics ourselves; no HF quantizer
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: pay for a random init
        from contextlib import nullcontext as no_init_weights
    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")


def _swap_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def apply_quantized_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], quant: dict[str, Any]) -> list[str]:
    """Replace each quantized Linear of `model` with a QuantLinear built from `tensors` (consumed);
    attach KV scales. Returns the names of the swapped modules."""
    dtype = next(model.parameters()).dtype
    act_format = ACT_FORMAT.get(quant.get("quant_algo"))
    swapped = []
    for key in sorted(k for k in tensors if k.endswith(".weight_scale")):
        prefix = key.removesuffix(".weight_scale")
        weight = dequantize_weight(tensors, prefix).to(dtype)
        bias = tensors.pop(f"{prefix}.bias", None)
        layer = QuantLinear(weight, None if bias is None else bias.to(dtype), act_format,
                            tensors.pop(f"{prefix}.input_scale", None), tensors.pop(f"{prefix}.pre_quant_scale", None))
        for suffix in ("weight", "weight_scale", "weight_scale_2"):
            tensors.pop(f"{prefix}.{suffix}", None)
        _swap_module(model, prefix, layer)
        swapped.append(prefix)
    kv_format = {"FP8": "fp8", "INT8": "int8"}.get(quant.get("kv_cache_quant_algo") or "")
    for key in sorted(k for k in tensors if k.endswith(".k_proj.k_scale")):
        attn = key.removesuffix(".k_proj.k_scale")
        k_scale = tensors.pop(key).float()
        v_scale = tensors.pop(f"{attn}.v_proj.v_scale").float()
        if kv_format:
            attach_kv_quant(model.get_submodule(attn), kv_format, k_scale, v_scale)
    return swapped


def load_quantized(path: str | os.PathLike, dtype: str = "float32") -> nn.Module:
    """The quantize stage's checkpoint as a CPU model with the checkpoint's own numerics."""
    path = Path(path)
    quant = read_quant_config(path)
    algo = quant.get("quant_algo")
    if algo in CPU_UNRUNNABLE or (algo and algo not in ACT_FORMAT):
        raise SpecDeployError(
            f"{path} is quantized with {algo}, which a CPU forward pass cannot run "
            "(ModelOpt's dynamic FP4 block quantization needs a CUDA device)",
            hint="serve it with TensorRT-LLM on a GPU (Blackwell for NVFP4), or quantize with --qformat fp8 for the CPU runtime",
        )
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise SpecDeployError(f"unknown dtype '{dtype}'", hint="use float32, float64, bfloat16 or float16")
    model = _empty_model(path, torch_dtype)
    tensors = load_safetensors_dir(path, hint="rerun `specdeploy quantize`")
    apply_quantized_tensors(model, tensors, quant)
    expected = model.state_dict()
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise SpecDeployError(f"{path}: tensors this loader does not understand: {unknown[:4]}",
                              hint="the checkpoint was exported with a format the CPU runtime does not support")
    model.load_state_dict({k: v.to(torch_dtype) for k, v in tensors.items()}, strict=False, assign=True)
    missing = [k for k in expected if k not in tensors and not isinstance(model.get_submodule(k.rpartition(".")[0]), QuantLinear)]
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing:
        raise SpecDeployError(f"{path}: weights missing from the checkpoint: {missing[:4]}", hint="rerun `specdeploy quantize`")
    model.specdeploy_quant = quant
    return model.eval()


# ============================================================================ quality report


def _chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return _encode_chat_prompt(tokenizer, prompt)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def _encode_chat_prompt(tokenizer: Any, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def greedy_tokens(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, proposer: Any = None) -> tuple[list[int], Any]:
    """Greedy continuation with the project's runtime; a proposer drafts every step (not
    adaptive), so the acceptance measured is the module's own."""
    from specdeploy.runtime.decoding import generate
    from specdeploy.runtime.types import SamplingParams

    result = generate(model, prompt_ids, SamplingParams(max_new_tokens=max_new_tokens), proposer, adaptive=False)
    return list(result.token_ids), result.metrics


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def perplexity(model: nn.Module, token_lists: list[list[int]]) -> float:
    """exp(mean next-token NLL) over all predicted tokens of the texts."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in token_lists:
            x = torch.tensor([ids])
            logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
            total += nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            count += len(ids) - 1
    return math.exp(total / max(count, 1))


def token_agreement(base: nn.Module, quant: nn.Module, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    from tqdm import tqdm

    rows = []
    for ids in tqdm(prompts, desc="greedy agreement", unit="prompt", leave=False):
        a, _ = greedy_tokens(base, ids, max_new_tokens)
        b, _ = greedy_tokens(quant, ids, max_new_tokens)
        same = sum(x == y for x, y in zip(a, b))
        rows.append({"first_divergence": first_divergence(a, b), "length": min(len(a), len(b)),
                     "identical": a == b, "positional_match": same / max(min(len(a), len(b)), 1)})
    n = max(len(rows), 1)
    return {
        "prompts": len(rows),
        "max_new_tokens": max_new_tokens,
        "mean_first_divergence": sum(r["first_divergence"] for r in rows) / n,
        "identical_fraction": sum(r["identical"] for r in rows) / n,
        "mean_positional_match": sum(r["positional_match"] for r in rows) / n,
        "per_prompt": rows,
    }


def acceptance_length(target: nn.Module, spec_dir: Path | None, prompts: list[list[int]], max_new_tokens: int,
                      quant_spec_dir: Path | None = None) -> float:
    """Mean tokens per target forward with the module in spec_dir proposing for `target` (with
    the FP8 numerics of quant_spec_dir's module when given); n-gram lookup without a module."""
    from specdeploy.runtime.proposers import build_proposer
    from specdeploy.spec import read_spec_config

    if spec_dir is None:
        proposer = build_proposer("ngram", target)
    else:
        proposer = build_proposer(read_spec_config(spec_dir)["kind"], target, spec_dir=spec_dir)
    if quant_spec_dir is not None:
        apply_spec_quantization(proposer, quant_spec_dir)
    tokens = forwards = 0
    for ids in prompts:
        _, metrics = greedy_tokens(target, ids, max_new_tokens, proposer)
        tokens += metrics.new_tokens
        forwards += metrics.target_forwards
    return tokens / max(forwards, 1)


def quality_report(base_dir: Path, quant_dir: Path, *, dtype: str = "bfloat16", prompts: int = 8,
                   max_new_tokens: int = 32, ppl_texts: int = 16, ppl_seq_len: int = 256,
                   spec_dir: Path | None = None, quant_spec_dir: Path | None = None, seed: int = 0) -> dict[str, Any]:
    """Quantized vs unquantized on held-out ShareGPT (never seen in calibration)."""
    from specdeploy.data import heldout_texts, sharegpt_prompts
    from specdeploy.models import load_tokenizer

    quant = read_quant_config(quant_dir)
    report: dict[str, Any] = {"quant_algo": quant.get("quant_algo"), "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
                              "dtype": dtype, "data": "sharegpt heldout split"}
    if quant.get("quant_algo") in CPU_UNRUNNABLE:
        report["skipped"] = f"{quant['quant_algo']} cannot run a CPU forward pass (needs CUDA); no quality figures"
        return report
    tokenizer = load_tokenizer(base_dir)
    prompt_ids = [_chat_ids(tokenizer, p) for p in sharegpt_prompts(prompts, split="heldout", seed=seed, max_chars=400)]
    texts = [tokenizer(t, add_special_tokens=False)["input_ids"][:ppl_seq_len] for t in heldout_texts(ppl_texts, seed=seed)]
    base = _load_base(base_dir, dtype)
    quantized = load_quantized(quant_dir, dtype)
    started = time.time()
    ppl_base, ppl_quant = perplexity(base, texts), perplexity(quantized, texts)
    report["perplexity"] = {"base": ppl_base, "quantized": ppl_quant, "relative_change": ppl_quant / ppl_base - 1,
                            "texts": len(texts), "tokens": sum(len(t) - 1 for t in texts)}
    report["greedy_agreement"] = token_agreement(base, quantized, prompt_ids, max_new_tokens)
    if spec_dir is not None and not (spec_dir / "spec_config.json").is_file():
        spec_dir = None  # a draft-model or n-gram build: measure with n-gram lookup
    report["acceptance_length"] = _acceptance_report(base, quantized, spec_dir, quant_spec_dir, prompt_ids, max_new_tokens)
    report["seconds"] = round(time.time() - started, 1)
    return report


def _acceptance_report(base: nn.Module, quantized: nn.Module, spec_dir: Path | None, quant_spec_dir: Path | None,
                       prompt_ids: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    try:
        unquantized = acceptance_length(base, spec_dir, prompt_ids, max_new_tokens)
        on_quantized = acceptance_length(quantized, spec_dir, prompt_ids, max_new_tokens, quant_spec_dir)
    except ImportError as err:  # the runtime or its proposers are not installed
        return {"skipped": f"speculative runtime unavailable: {err}"}
    if spec_dir is None:
        proposer = "ngram (no Medusa/EAGLE module in this build)"
    else:
        proposer = f"{_spec_kind(spec_dir)} module ({'FP8' if quant_spec_dir else 'unquantized'} on the quantized base)"
    return {"unquantized_pair": unquantized, "quantized_base": on_quantized, "proposer": proposer,
            "module": "quantized" if quant_spec_dir else "unquantized",
            "relative_change": on_quantized / unquantized - 1}


def _spec_kind(spec_dir: Path) -> str:
    from specdeploy.spec import read_spec_config

    return read_spec_config(spec_dir)["kind"]


def report_markdown(report: dict[str, Any], settings: dict[str, Any]) -> str:
    lines = [f"# Quantization report: {settings.get('qformat')} (KV cache {settings.get('kv_cache')})", ""]
    if "skipped" in report:
        return "\n".join(lines + [f"Quality not measured: {report['skipped']}", ""])
    ppl, agree = report["perplexity"], report["greedy_agreement"]
    lines += [
        f"Calibration: {settings.get('calib_size')} ShareGPT train conversations x {settings.get('calib_seq_len')} tokens; "
        f"evaluation on the held-out split in {report['dtype']}.",
        *([f"Mixed precision: Linears matching {', '.join(settings['exclude'])} stay in {settings.get('dtype')} (--exclude)."]
          if settings.get("exclude") else []),
        "",
        "| metric | unquantized | quantized | change |",
        "|---|---|---|---|",
        f"| perplexity ({ppl['texts']} texts, {ppl['tokens']} tokens) | {ppl['base']:.3f} | {ppl['quantized']:.3f} | {100 * ppl['relative_change']:+.2f}% |",
        f"| greedy: mean first divergence ({agree['prompts']} prompts x {agree['max_new_tokens']} tokens) | - | {agree['mean_first_divergence']:.1f} | identical {100 * agree['identical_fraction']:.0f}% |",
    ]
    acc = report.get("acceptance_length")
    if acc and "skipped" not in acc:
        lines.append(f"| acceptance length ({acc['proposer']}) | {acc['unquantized_pair']:.3f} | {acc['quantized_base']:.3f} | {100 * acc['relative_change']:+.2f}% |")
    elif acc:
        lines.append(f"\nAcceptance length not measured: {acc['skipped']}")
    return "\n".join(lines) + "\n"


# ============================================================================ the stage


def run(build: BuildDir, qformat: str = "fp8", kv_cache: str = "fp8", *, calib_size: int = 64,
        calib_seq_len: int = 256, quantize_spec: bool = False, dtype: str = "bfloat16", awq_block_size: int = 128,
        report: bool = True, report_prompts: int = 8, report_tokens: int = 32, report_texts: int = 16,
        seed: int = 0, exclude: list[str] | None = None) -> Path:
    """Stage `quantize`: build/<name>/quantized/ (see the module docstring for the layout)."""
    if dtype not in ("bfloat16", "float16"):
        raise SpecDeployError(f"quantize in bfloat16 or float16, not {dtype}",
                              hint="ModelOpt's export does not cast unquantized weights: fp32 would ship fp32")
    quant_config(qformat, kv_cache, awq_block_size)  # validate before loading anything
    check_exclude_format(qformat, exclude or [])
    base_dir = build.path("base")
    if build.record("resolve") is None:
        raise SpecDeployError(f"stage 'resolve' has not run in {build.root}", hint="run `specdeploy resolve` first")
    spec_dir = build.path("spec") if build.record("spec") else None
    if quantize_spec and spec_dir is None:
        raise SpecDeployError("--quantize-spec needs a trained module in spec/", hint="run `specdeploy spec` first")
    consumes = ("resolve", "spec") if spec_dir is not None else ("resolve",)
    settings = {"qformat": qformat, "kv_cache": kv_cache, "calib_size": calib_size, "calib_seq_len": calib_seq_len,
                "quantize_spec": quantize_spec, "dtype": dtype, "awq_block_size": awq_block_size,
                "report": report, "report_prompts": report_prompts, "report_tokens": report_tokens,
                "report_texts": report_texts, "seed": seed}
    if exclude:  # only when used: builds made before --exclude existed stay complete
        settings["exclude"] = list(exclude)
    if build.completed(STAGE, settings, consumes=consumes):
        return build.path(OUT)
    with build.stage(STAGE, OUT, settings, consumes=consumes) as tmp:
        _quantize_into(tmp, base_dir, spec_dir, settings)
    return build.path(OUT)


def _quantize_into(out: Path, base_dir: Path, spec_dir: Path | None, settings: dict[str, Any]) -> None:
    from specdeploy.models import load_tokenizer

    batches = calibration_batches(load_tokenizer(base_dir), settings["calib_size"], settings["calib_seq_len"], settings["seed"])
    calib_seconds, kept = _quantize_and_export(out, base_dir, batches, settings)
    _copy_tokenizer_files(base_dir, out)
    quant_spec_dir = None
    if settings["quantize_spec"]:
        quant_spec_dir = quantize_spec_module(base_dir, spec_dir, out / "spec", batches, settings)
    atomic_write_json(out / "specdeploy_quant.json", {
        "settings": settings,
        "modelopt_config": _jsonable(quant_config(settings["qformat"], settings["kv_cache"], settings["awq_block_size"], kept)),
        "unquantized_linears": kept,
        "calibration": {"sequences": len(batches), "tokens": sum(b.shape[1] for b in batches), "seconds": round(calib_seconds, 1)},
        "cpu_runnable": settings["qformat"] not in CPU_UNRUNNABLE,
        "note": "load with specdeploy.models.load_causal_lm (dequantized weights + static fake-quantized inputs/KV)",
    })
    if settings["report"]:
        _write_report(out, base_dir, spec_dir, quant_spec_dir, settings)


def _quantize_and_export(out: Path, base_dir: Path, batches: list[torch.Tensor], settings: dict[str, Any]) -> tuple[float, list[str]]:
    """Calibrate a fresh bf16/fp16 instance and export it into `out`: (calibration seconds,
    the Linears --exclude kept unquantized)."""
    qformat, kv_cache = settings["qformat"], settings["kv_cache"]
    model = _load_base(base_dir, settings["dtype"])  # a fresh instance: export mutates it
    check_block_size(model, qformat, settings["awq_block_size"])
    kept = excluded_linears(model, qformat, settings.get("exclude", []))
    started = time.time()
    quantize_model(model, qformat, kv_cache, batches, settings["awq_block_size"], kept)
    seconds = time.time() - started
    if qformat == "none" and kv_cache == "none":
        model.save_pretrained(out)
    else:
        print(f"exporting the {qformat} checkpoint (ModelOpt unified HF format)")
        export_checkpoint(model, out)
    return seconds, kept


def _write_report(out: Path, base_dir: Path, spec_dir: Path | None, quant_spec_dir: Path | None, settings: dict[str, Any]) -> None:
    report = quality_report(base_dir, out, dtype=settings["dtype"], prompts=settings["report_prompts"],
                            max_new_tokens=settings["report_tokens"], ppl_texts=settings["report_texts"],
                            spec_dir=spec_dir, quant_spec_dir=quant_spec_dir, seed=settings["seed"])
    atomic_write_json(out / "quantize.json", report)
    atomic_write_text(out / "quantize.md", report_markdown(report, settings))
    print(report_markdown(report, settings))


SPEC_PREFIXES = {"medusa": "medusa_heads", "eagle": "eagle_module"}


def _spec_quant_config(prefix: str) -> dict[str, Any]:
    """FP8 weights + static FP8 inputs for the module's Linears only (the base is quantized and
    exported separately: this calibration only needs the base to produce the module's inputs)."""
    fp8 = {"num_bits": (4, 3), "axis": None}
    return {"quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": f"*{prefix}*weight_quantizer", "cfg": fp8},
        {"quantizer_name": f"*{prefix}*input_quantizer", "cfg": fp8},
    ], "algorithm": "max"}


def _module_fp8_tensors(model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The module's tensors in the export's naming: quantized Linears as <m>.weight (fp8),
    <m>.weight_scale, <m>.input_scale (ModelOpt's own export helpers); the rest as float32."""
    from modelopt.torch.export.quant_utils import (
        QUANTIZATION_FP8, get_activation_scaling_factor, get_weight_scaling_factor, to_quantized_weight)

    tensors: dict[str, torch.Tensor] = {}
    quantized = set()
    for name, module in model.named_modules():
        if not name.startswith(prefix) or not hasattr(module, "weight_quantizer") or not module.weight_quantizer.is_enabled:
            continue
        weight_scale = get_weight_scaling_factor(module)
        input_scale = get_activation_scaling_factor(module)
        if weight_scale is None or input_scale is None:
            raise SpecDeployError(f"{name} was not calibrated: the module never ran during calibration",
                                  hint="--quantize-spec supports modules whose forward runs with the base (Medusa)")
        tensors[f"{name}.weight"] = to_quantized_weight(module.weight.detach(), weight_scale, QUANTIZATION_FP8)
        tensors[f"{name}.weight_scale"] = weight_scale.float().squeeze()
        tensors[f"{name}.input_scale"] = input_scale.float().squeeze()
        if module.bias is not None:
            tensors[f"{name}.bias"] = module.bias.detach().float()
        quantized.add(f"{name}.weight")
    for key, value in model.state_dict().items():
        if key.startswith(prefix) and key not in tensors and "_quantizer" not in key and key not in quantized:
            tensors[key] = value.detach().float() if value.is_floating_point() else value
    if not quantized:
        raise SpecDeployError(f"no quantizable Linear found under {prefix}", hint="check spec/spec_config.json")
    return {k: v.contiguous() for k, v in tensors.items()}


def quantize_spec_module(base_dir: Path, spec_dir: Path, out: Path, batches: list[torch.Tensor],
                         settings: dict[str, Any]) -> Path:
    """FP8 PTQ of the Medusa heads / EAGLE module on a fresh base+module model; writes out/
    (spec_config.json with a "quantization" entry + module.safetensors, see module docstring)."""
    import modelopt.torch.quantization as mtq
    from safetensors.torch import save_file

    from specdeploy.spec import load_spec_model, read_spec_config

    config = read_spec_config(spec_dir)
    prefix = SPEC_PREFIXES[config["kind"]]
    model = load_spec_model(_load_base(base_dir, settings["dtype"]), spec_dir)
    model.to(getattr(torch, settings["dtype"]))
    mtq.quantize(model, _spec_quant_config(prefix), _forward_loop(batches, f"calibrating {prefix} (fp8)"))
    tensors = _module_fp8_tensors(model, prefix)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "module.safetensors"), metadata={"format": "pt", "quant_algo": "FP8"})
    atomic_write_json(out / "spec_config.json", {**config, "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": None, "producer": "modelopt (max calibration)",
        "base_quant_algo": read_quant_config(out.parent).get("quant_algo")}})
    return out


def apply_spec_quantization(proposer: Any, quant_spec_dir: Path) -> Any:
    """Swap the proposer's module Linears for QuantLinears from quantized/spec/ (FP8 weights and
    static FP8 inputs), so acceptance is measured with the numerics the engine would have."""
    from safetensors.torch import load_file

    from specdeploy.spec import read_spec_config

    prefix = SPEC_PREFIXES[read_spec_config(quant_spec_dir)["kind"]] + "."
    root = getattr(proposer, "heads", None) if prefix.startswith("medusa") else getattr(proposer, "module", None)
    if root is None:
        raise SpecDeployError("this proposer does not expose its module", hint="measure with the unquantized module")
    tensors = {k.removeprefix(prefix): v for k, v in load_file(str(quant_spec_dir / "module.safetensors")).items()
               if k.removeprefix(prefix) != k and k.endswith(("weight_scale", "input_scale", ".weight", ".bias"))}
    quantized = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")}
    tensors = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] in quantized}
    apply_quantized_tensors(root, tensors, {"quant_algo": "FP8"})
    return proposer


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    parser.add_argument("--qformat", choices=list(QFORMATS), default=None, help="weight/activation format (default: --quant)")
    parser.add_argument("--kv-cache", choices=list(KV_CACHE), default="fp8", help="KV cache quantization (default fp8)")
    parser.add_argument("--calib-size", type=int, default=64, help="calibration sequences (ShareGPT train split)")
    parser.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration sequence")
    parser.add_argument("--quantize-spec", action="store_true", help="also quantize the Medusa/EAGLE module (FP8)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="cast before quantizing")
    parser.add_argument("--awq-block-size", type=int, default=128, help="INT4 AWQ block size (32, 64, 128)")
    parser.add_argument("--exclude", nargs="+", metavar="PATTERN",
                        help="keep these Linears in the model dtype (fnmatch on HF names, e.g. '*mlp.down_proj' "
                             "'model.layers.0.*'); fp8 and int4_awq; TRT-LLM's fused q/k/v and gate/up go together")
    parser.add_argument("--no-report", action="store_true", help="skip the quality report")
    parser.add_argument("--report-prompts", type=int, default=8, help="held-out prompts for the greedy agreement")
    parser.add_argument("--report-tokens", type=int, default=32, help="new tokens per prompt in the report")
    parser.add_argument("--report-texts", type=int, default=16, help="held-out texts (256 tokens each) for perplexity")


def main(args: argparse.Namespace) -> int:
    qformat = args.qformat or args.quant
    if args.qformat and args.quant != args.qformat and args.build_dir is None:
        args.quant = args.qformat  # the build name follows the format actually produced
    out = run(build_from_args(args), qformat, args.kv_cache, calib_size=args.calib_size,
              calib_seq_len=args.calib_seq_len, quantize_spec=args.quantize_spec, dtype=args.dtype,
              awq_block_size=args.awq_block_size, report=not args.no_report,
              report_prompts=args.report_prompts, report_tokens=args.report_tokens, report_texts=args.report_texts,
              exclude=args.exclude)
    print(out)
    return 0
