"""Serving a quantize-stage checkpoint with its own numerics, on any device: what
checkpoints.load_causal_lm does for a folder with hf_quant_config.json.

A leaf module: no ModelOpt, no stage code, no pickle. The runtime, the Triton Python-backend
model, verify and bench import only this, and every one of them gets the same numbers.

The exported checkpoint IS the reference. Each quantized Linear is rebuilt from its stored
quantized weight times its scales (what the TRT-LLM engine multiplies with), and its input is
fake-quantized with the stored static input_scale (after pre_quant_scale), exactly the
quantize-dequantize ModelOpt applied during calibration; K and V are fake-quantized with
k_scale / v_scale at the attention call (post-RoPE, like ModelOpt and TRT-LLM's KV cache), once
as they enter a DynamicCache (fake quantization is idempotent: the same numbers as re-quantizing
the whole cache at every step, which cost ~10% of a decode step here, more in long batches).
Checked against ModelOpt layer by layer (tests): given the exported weights, each Linear's output
is ModelOpt's own (SmoothQuant: the whole forward, bit for bit). ModelOpt's in-memory fake quant
itself differs slightly from its export (the export divides w / scale in bf16, so ~4% of FP8
weights land one FP8 step away at near-ties): we follow the export, because it is what
TensorRT-LLM computes with. NVFP4 (dynamic FP4 block quantization) is not implemented here:
load_quantized refuses it with a clear error.

Every operation is elementwise IEEE arithmetic in float32, so dequantized weights are the same
bits on the CPU and on a GPU; the skeleton is built on the meta device and each tensor goes
straight to the target device, so a large model is never materialized twice.
"""

from __future__ import annotations

import json
import os
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdeploy.attention import sdpa, use_attention
from specdeploy.device import resolve_device
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import load_safetensors_dir
from specdeploy.checkpoints.quant_algos import ACT_FORMAT, FP4_ALGOS

FP8_MAX = 448.0
KV_ATTENTION = "specdeploy_sdpa_kv_quant"
# A quantized Linear's tensors in the export, after its module name.
LINEAR_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "bias")


def read_quant_config(path: str | os.PathLike) -> dict[str, Any]:
    """hf_quant_config.json's "quantization" dict ({} when the folder is not quantized)."""
    file = Path(path) / "hf_quant_config.json"
    if not file.is_file():
        return {}
    return json.loads(file.read_text()).get("quantization", {})


def rounds_activations(quant: dict[str, Any]) -> bool:
    """Does the forward pass round activations or K/V with static scales? Then a k-token verify
    and a 1-token step (which differ by ~1e-7 in fp32) can land on opposite sides of a rounding
    boundary, and a whole FP8/INT8 step apart: exact parity needs float64 on both sides."""
    return bool(ACT_FORMAT.get(quant.get("quant_algo")) or quant.get("kv_cache_quant_algo"))


def parity_dtype(model_dir: str | os.PathLike) -> str:
    """The runtime dtype in which speculative output equals plain greedy output exactly."""
    return "float64" if rounds_activations(read_quant_config(model_dir)) else "float32"


def quant_factors(scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ModelOpt's `scale` = maxbound / amax, its inverse) in fp32, from a static scale (= amax /
    maxbound, as exported)."""
    maxbound = FP8_MAX if fmt == "fp8" else 127.0
    inv = maxbound / (scale.float() * maxbound)
    return inv, 1 / inv


def fake_quant(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize-dequantize with a static scale (= amax / maxbound, as exported)."""
    return apply_fake_quant(x, quant_factors(scale, fmt), fmt)


def apply_fake_quant(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor], fmt: str) -> torch.Tensor:
    """Quantize-dequantize with precomputed `quant_factors`, in fp32 and in the same operation
    order as ModelOpt's CPU kernels (x * (maxbound / amax)), so rounding ties fall the same way."""
    inv, step = (t.float() for t in factors)
    if fmt == "fp8":
        q = (x.float() * inv).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float().mul_(step)
    elif fmt == "int8":
        q = (x.float() * inv).round_().clamp_(-128, 127).div_(inv)
    else:
        raise ValueError(fmt)
    return q.to(x.dtype)


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
    """A Linear with dequantized weights and static fake-quantized inputs (see module docstring).
    Siblings that read one tensor with the same input quantizer (q/k/v, gate/up: the export gives
    fused Linears one input scale) share a `SharedInput`, so that tensor is quantized once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_format: str | None,
                 input_scale: torch.Tensor | None, pre_quant_scale: torch.Tensor | None) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.act_format = act_format if input_scale is not None else None
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float())
        self.register_buffer("pre_quant_scale", None if pre_quant_scale is None else pre_quant_scale.to(weight.dtype))
        inv, step = quant_factors(input_scale, act_format) if self.act_format else (None, None)
        self.register_buffer("input_inv", inv, persistent=False)  # computed once, not per call
        self.register_buffer("input_step", step, persistent=False)
        self.shared_input: SharedInput | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_format is not None:
            x = self.quantize_input(x)
        elif self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        return nn.functional.linear(x, self.weight, self.bias)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        quantized = self.shared_input.take(x) if self.shared_input is not None else None
        if quantized is None:
            smoothed = x * self.pre_quant_scale if self.pre_quant_scale is not None else x
            quantized = apply_fake_quant(smoothed, (self.input_inv, self.input_step), self.act_format)
            if self.shared_input is not None:
                self.shared_input.put(x, quantized)
        return quantized

    def same_input_quantizer(self, other: "QuantLinear") -> bool:
        return (self.act_format == other.act_format and _same(self.input_scale, other.input_scale)
                and _same(self.pre_quant_scale, other.pre_quant_scale))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, act={self.act_format}, smooth={self.pre_quant_scale is not None}"


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class SharedInput:
    """The quantized input of `readers` sibling QuantLinears, kept until each has taken it: the
    first reader computes it, the others find it by the identity of their input tensor (checked
    through a weak reference, so a freed tensor whose id is reused never matches)."""

    def __init__(self, readers: int) -> None:
        self.readers = readers
        self._entry: tuple[weakref.ref, torch.Tensor, int] | None = None  # (source, quantized, readers left)

    def take(self, x: torch.Tensor) -> torch.Tensor | None:
        entry = self._entry  # one read: another thread's put() cannot mix two entries
        if entry is None or entry[0]() is not x:
            return None
        source, quantized, left = entry
        self._entry = (source, quantized, left - 1) if left > 1 else None
        return quantized

    def put(self, x: torch.Tensor, quantized: torch.Tensor) -> None:
        self._entry = (weakref.ref(x), quantized, self.readers - 1)

    def clear(self) -> None:
        self._entry = None


def share_inputs(model: nn.Module) -> None:
    """Give QuantLinear siblings (children of one module) with the same input quantizer one
    SharedInput: in the transformer blocks these read the same tensor (q/k/v; gate/up). Whatever
    a sibling did not take is dropped when the parent's forward returns, so no activation is kept
    between forwards."""
    for parent in model.modules():
        groups: list[list[QuantLinear]] = []
        for child in parent.children():
            if isinstance(child, QuantLinear) and child.act_format is not None:
                group = next((g for g in groups if g[0].same_input_quantizer(child)), None)
                groups.append([child]) if group is None else group.append(child)
        shared = []
        for group in (g for g in groups if len(g) > 1):
            shared.append(SharedInput(len(group)))
            for layer in group:
                layer.shared_input = shared[-1]
        if shared:
            parent.register_forward_hook(partial(_clear_shared, shared))


def _clear_shared(shared: list[SharedInput], module: nn.Module, args: tuple, output: Any) -> None:
    for one in shared:
        one.clear()


def _register_kv_attention() -> None:
    """A named attention function: fake-quantize K/V, then attention.sdpa.

    It is selected per attention module (its own config copy), not by replacing "sdpa": ModelOpt
    swaps ALL_ATTENTION_FUNCTIONS["sdpa"] in and out around its own forwards, which would shadow
    a global replacement in any process that also calibrates (e.g. the quality report)."""
    from transformers.modeling_utils import AttentionInterface

    if KV_ATTENTION in AttentionInterface._global_mapping:
        return

    def sdpa_with_kv_quant(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any):
        fmt, k_scale, v_scale = module.specdeploy_kv_format, module.specdeploy_k_scale, module.specdeploy_v_scale
        if _appended_to_dynamic_cache(module, key, value):
            # Quantize on write: this call's columns are the last ones, the older ones were quantized
            # when written, and fake quantization is idempotent, so the numbers are those of
            # re-quantizing the whole cache at every step (what dominates a long batch's step here).
            new = query.shape[-2]
            key[..., -new:, :] = fake_quant(key[..., -new:, :], k_scale, fmt)
            value[..., -new:, :] = fake_quant(value[..., -new:, :], v_scale, fmt)
        else:
            key, value = fake_quant(key, k_scale, fmt), fake_quant(value, v_scale, fmt)
        return sdpa(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(KV_ATTENTION, sdpa_with_kv_quant)


def _remember_cache(attention: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: the cache this call appends its K/V to (weakly: it outlives no request)."""
    cache = kwargs.get("past_key_values")
    attention.specdeploy_kv_cache = None if cache is None else weakref.ref(cache)


def _appended_to_dynamic_cache(attention: nn.Module, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Are `key`/`value` a transformers DynamicLayer's own tensors, which its update() just
    extended by this call's columns? (Any other cache, or none: the whole K/V is quantized.)"""
    from transformers.cache_utils import DynamicLayer

    ref = getattr(attention, "specdeploy_kv_cache", None)
    cache, index = ref() if ref else None, getattr(attention, "layer_idx", None)
    if cache is None or index is None or index >= len(getattr(cache, "layers", ())) or key.requires_grad:
        return False
    layer = cache.layers[index]
    return type(layer) is DynamicLayer and layer.keys is key and layer.values is value


def attach_kv_quant(attention: nn.Module, fmt: str, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """K/V of this attention module are fake-quantized (post-RoPE, at the attention call, like
    ModelOpt's _QuantAttention; once, as they are written, into a DynamicCache); the model's own
    config keeps "sdpa" (masks, callers). The scales are buffers (not in the state dict), so they
    follow the module to its device."""
    _register_kv_attention()
    attention.specdeploy_kv_format = fmt
    attention.register_buffer("specdeploy_k_scale", k_scale, persistent=False)
    attention.register_buffer("specdeploy_v_scale", v_scale, persistent=False)
    use_attention(attention, KV_ATTENTION)
    attention.register_forward_pre_hook(_remember_cache, with_kwargs=True)


def _swap_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def apply_quantized_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], quant: dict[str, Any],
                            device: torch.device | None = None) -> list[str]:
    """Replace each quantized Linear of `model` with a QuantLinear built from `tensors` (consumed)
    on `device` (default: where the model's parameters are); attach KV scales. Returns the names
    of the swapped modules."""
    first = next(model.parameters())
    dtype, device = first.dtype, device or first.device
    act_format = ACT_FORMAT.get(quant.get("quant_algo"))
    swapped = []
    for key in sorted(k for k in tensors if k.endswith(".weight_scale")):
        prefix = key.removesuffix(".weight_scale")
        names = [f"{prefix}.{suffix}" for suffix in LINEAR_SUFFIXES if f"{prefix}.{suffix}" in tensors]
        own = {name: tensors.pop(name).to(device) for name in names}
        bias = own.get(f"{prefix}.bias")
        layer = QuantLinear(dequantize_weight(own, prefix).to(dtype), None if bias is None else bias.to(dtype), act_format,
                            own.get(f"{prefix}.input_scale"), own.get(f"{prefix}.pre_quant_scale"))
        _swap_module(model, prefix, layer)
        swapped.append(prefix)
    kv_format = {"FP8": "fp8", "INT8": "int8"}.get(quant.get("kv_cache_quant_algo") or "")
    for key in sorted(k for k in tensors if k.endswith(".k_proj.k_scale")):
        attn = key.removesuffix(".k_proj.k_scale")
        k_scale = tensors.pop(key).float().to(device)
        v_scale = tensors.pop(f"{attn}.v_proj.v_scale").float().to(device)
        if kv_format:
            attach_kv_quant(model.get_submodule(attn), kv_format, k_scale, v_scale)
    share_inputs(model)
    return swapped


def torch_dtype(dtype: str) -> torch.dtype:
    """'float32' -> torch.float32, refusing names that are not dtypes."""
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise SpecDeployError(f"unknown dtype '{dtype}'", hint="use float32, float64, bfloat16 or float16")
    return value


def _check_loadable(path: Path, quant: dict[str, Any]) -> None:
    algo = quant.get("quant_algo")
    if algo in FP4_ALGOS or (algo and algo not in ACT_FORMAT):
        raise SpecDeployError(
            f"{path} is quantized with {algo}, which specdeploy's fake-quant loader cannot run (dynamic FP4 "
            "block quantization is not implemented here; ModelOpt's own needs CUDA)",
            hint="serve it with TensorRT-LLM on a GPU (Blackwell for NVFP4), or quantize with --quant fp8 for the "
                 "specdeploy runtime",
        )


def _empty_model(path: Path, dtype: torch.dtype, trust_remote_code: bool) -> nn.Module:
    """The architecture with its parameters on the meta device (no memory, no init) and its
    buffers (rotary frequencies) real: the checkpoint's tensors are assigned afterwards."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we apply the numerics ourselves; no HF quantizer
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa",
                                                trust_remote_code=trust_remote_code)


def _dispatch(model: nn.Module, device_map: str | dict[str, Any]) -> nn.Module:
    """Spread a loaded model over the visible GPUs with accelerate (what from_pretrained does for
    device_map="auto"); a decoder layer is never split."""
    from accelerate import dispatch_model, infer_auto_device_map

    if device_map == "auto":
        device_map = infer_auto_device_map(model, no_split_module_classes=model._no_split_modules or [])
    return dispatch_model(model, device_map=device_map)


def load_quantized(path: str | os.PathLike, dtype: str = "float32", *, device: str | torch.device = "cpu",
                   device_map: str | dict[str, Any] | None = None, trust_remote_code: bool = False) -> nn.Module:
    """The quantize stage's checkpoint as a model with the checkpoint's own numerics, in eval
    mode on `device` (or spread by accelerate with device_map, e.g. "auto")."""
    path = Path(path)
    quant = read_quant_config(path)
    _check_loadable(path, quant)
    dtype_ = torch_dtype(dtype)
    target = torch.device("cpu") if device_map else resolve_device(device)
    model = _empty_model(path, dtype_, trust_remote_code)
    tensors = load_safetensors_dir(path, hint="rerun `specdeploy quantize`")
    apply_quantized_tensors(model, tensors, quant, target)
    unknown = sorted(set(tensors) - set(model.state_dict()))
    if unknown:
        raise SpecDeployError(f"{path}: tensors this loader does not understand: {unknown[:4]}",
                              hint="the checkpoint was exported with a format the specdeploy runtime does not support")
    model.load_state_dict({k: v.to(target, dtype_) for k, v in tensors.items()}, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise SpecDeployError(f"{path}: weights missing from the checkpoint: {missing[:4]}", hint="rerun `specdeploy quantize`")
    model.to(target)  # the buffers built with the skeleton (rotary frequencies)
    if device_map:
        model = _dispatch(model, device_map)
    model.specdeploy_quant = quant
    return model.eval()
