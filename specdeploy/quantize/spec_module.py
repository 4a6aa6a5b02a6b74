"""--quantize-spec: FP8 post-training quantization of the Medusa heads / EAGLE module, written as
quantized/spec/, and the same numerics applied to a runtime proposer (for the quality report)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json
from specdeploy.quantize.calibrate import forward_loop
from specdeploy.quantize.export import load_base
from specdeploy.checkpoints.quantized import apply_quantized_tensors, read_quant_config
from specdeploy.quantize.placement import Placement

SPEC_PREFIXES = {"medusa": "medusa_heads", "eagle": "eagle_module"}


def _spec_quant_config(prefix: str, vocab_projections: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """FP8 weights + static FP8 inputs for the module's Linears only (the base is quantized and
    exported separately: this calibration only needs the base to produce the module's inputs),
    its vocabulary projections left out as ModelOpt's presets leave the base's LM head: EAGLE's
    lm_head, and Medusa's `vocab_projections` (_vocab_projections), which no lm_head pattern names."""
    fp8 = {"num_bits": (4, 3), "axis": None}
    return {"quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": f"*{prefix}*weight_quantizer", "cfg": fp8},
        {"quantizer_name": f"*{prefix}*input_quantizer", "cfg": fp8},
        {"quantizer_name": f"*{prefix}*lm_head*", "enable": False},
        *({"quantizer_name": f"*{name}.*", "enable": False} for name in vocab_projections),
    ], "algorithm": "max"}


def _vocab_projections(model: nn.Module, prefix: str) -> list[str]:
    """Medusa's per-head vocabulary projections, head[-1] (`medusa_heads.{h}.{layers}`): kept
    unquantized as TensorRT-LLM's Medusa quantization keeps the heads (quantize_by_modelopt.py
    excludes *medusa_heads* by default), so the report measures acceptance with the heads a
    deployment would have. EAGLE's is its lm_head, which the config's pattern already names."""
    if prefix != SPEC_PREFIXES["medusa"]:
        return []
    return [f"{prefix}.{h}.{len(head) - 1}" for h, head in enumerate(model.get_submodule(prefix))]


def _module_fp8_tensors(model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The module's tensors in the export's naming, on the CPU: quantized Linears as <m>.weight
    (fp8), <m>.weight_scale, <m>.input_scale (ModelOpt's own export helpers); the rest as float32."""
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
    return {k: v.contiguous().cpu() for k, v in tensors.items()}


def quantize_spec_module(base_dir: Path, spec_dir: Path, out: Path, batches: list[torch.Tensor], dtype: str,
                         placement: Placement, trust_remote_code: bool = False) -> Path:
    """FP8 PTQ of the Medusa heads / EAGLE module on a fresh base+module model; writes out/
    (spec_config.json with a "quantization" entry + module.safetensors, see the package docstring)."""
    import modelopt.torch.quantization as mtq
    from safetensors.torch import save_file

    from specdeploy.checkpoints.modules import read_spec_config
    from specdeploy.speculator import load_spec_model

    config = read_spec_config(spec_dir)
    prefix = SPEC_PREFIXES[config["kind"]]
    model = load_spec_model(load_base(base_dir, dtype, placement, trust_remote_code), spec_dir)
    # the module reads the states the LM head reads: it lives beside it (one device, or the last shard)
    model.get_submodule(prefix).to(model.get_output_embeddings().weight.device, getattr(torch, dtype))
    quant_config = _spec_quant_config(prefix, _vocab_projections(model, prefix))
    mtq.quantize(model, quant_config, forward_loop(batches, f"calibrating {prefix} (fp8)"))
    tensors = _module_fp8_tensors(model, prefix)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "module.safetensors"), metadata={"format": "pt", "quant_algo": "FP8"})
    atomic_write_json(out / "spec_config.json", {**config, "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": None, "producer": "modelopt (max calibration)",
        "base_quant_algo": read_quant_config(out.parent).get("quant_algo")}})
    return out


def apply_spec_quantization(proposer: Any, quant_spec_dir: Path) -> Any:
    """Swap the proposer's module Linears for QuantLinears from quantized/spec/ (FP8 weights and
    static FP8 inputs), on the module's device, so acceptance is measured with the numerics the
    engine would have."""
    from safetensors.torch import load_file

    from specdeploy.checkpoints.modules import read_spec_config

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
