"""The draft model folders the LLM-API route's speculative_config names (`speculative_model`),
written for TensorRT-LLM's PyTorch backend to load on the GPU host; `specdeploy export --format
trtllm` writes the same folders. The CPU deployment reads the module from spec/, not from here.

- eagle3_draft/: ModelOpt's EAGLE-3 export of the spec stage's module (spec/eagle3_export, exported
  here when absent), its single layer as `midlayer.*` (TRT-LLM's Eagle3DraftModel names it so), the
  RoPE it was trained with, and the first layer's norms named where they are not what TRT-LLM
  computes (first_layer_fields).
- dflash_draft/: the spec stage's ModelOpt export (spec/dflash_export), for TensorRT-LLM 1.3+.

Both hold the weights in the deployment's half dtype (ModelOpt exports float32, which TensorRT-LLM's
kernels mostly lack) and a config the GPU host's transformers reads as ours does (hfcompat).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_bytes, atomic_write_json

DRAFT_FOLDER = "eagle3_draft"
DFLASH_FOLDER = "dflash_draft"


# ------------------------------------------------------------------------------ DFlash draft


def dflash_draft(spec_dir: Path | None, out: Path, dtype: str = "bfloat16") -> Path:
    """out/dflash_draft: the spec stage's ModelOpt export (config.json with dflash_config + weights)
    in the deployment's dtype (ModelOpt exports the base's, float32 here, which TensorRT-LLM's
    kernels mostly lack), its config readable by the GPU host's transformers (hfcompat). The CPU
    deployment reads the module from spec/, not from here."""
    import torch
    from safetensors.torch import load_file, save

    from specdeploy.hfcompat import compatible_config, with_dtype

    ready = Path(spec_dir or ".") / "dflash_export"
    if spec_dir is None or not ((ready / "config.json").is_file() and list(ready.glob("*.safetensors"))):
        raise SpecDeployError(f"DFlash on the LLM-API route needs the spec stage's export ({ready})",
                              hint="re-run `specdeploy spec train --spec dflash`: it writes spec/dflash_export")
    config = with_dtype(json.loads((ready / "config.json").read_text()), dtype)
    final = out / DFLASH_FOLDER
    shutil.rmtree(final, ignore_errors=True)
    shutil.copytree(ready, final)
    for file in final.glob("*.safetensors"):
        tensors = load_file(str(file))
        cast = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in tensors.items()}
        atomic_write_bytes(file, save(cast, metadata={"format": "pt"}))
    atomic_write_json(final / "config.json", compatible_config(config))
    return final


# ------------------------------------------------------------------------------ EAGLE-3 draft


def is_eagle3(spec: Any) -> bool:
    """ModelOpt's EAGLE-3 layout: auxiliary hidden states of several base layers (fc + hidden_norm)."""
    arch = ((spec.config or {}).get("modelopt_config") or {}).get("eagle_architecture_config") or {}
    return bool(arch.get("use_aux_hidden_state")) or any(".hidden_norm." in k for k in (spec.module or {}))


def export_eagle3(base_dir: Path, spec_dir: Path, out: Path) -> Path:
    """ModelOpt's own EAGLE-3 draft export (a LlamaForCausalLMEagle3 folder) from the spec stage's module."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding

    spec_config = json.loads((spec_dir / "spec_config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    mtsp.convert(model, [("eagle", json.loads(json.dumps(spec_config["modelopt_config"])))])
    module = load_file(str(spec_dir / "module.safetensors"))
    missing = set(module) - set(model.state_dict())
    if missing:
        raise SpecDeployError(f"module tensors {sorted(missing)[:3]} do not fit the EAGLE module built from spec_config.json")
    model.load_state_dict(module, strict=False)
    with torch.inference_mode():
        export_speculative_decoding(model, export_dir=out)
    return out


def first_layer_fields(spec_config: dict[str, Any] | None) -> dict[str, Any]:
    """The first layer's norms where they are not what TensorRT-LLM computes (hidden_norm on the fc
    output, residual un-normed: checkpoints.modules.eagle.HIDDEN_NORM_INPUTS): the draft folder says so (engines
    ignore the keys; specdeploy's import reads them back). Empty for an engine-shaped module."""
    from specdeploy.checkpoints.modules.eagle import first_layer_norms

    arch = ((spec_config or {}).get("modelopt_config") or {}).get("eagle_architecture_config") or {}
    source, before_residual = first_layer_norms(arch)
    fields: dict[str, Any] = {} if source == "fc" else {"hidden_norm_input": source}
    return {**fields, "norm_before_residual": True} if before_residual else fields


def training_rope_scaling(spec: Any) -> dict[str, Any] | None:
    """The module's own rope_scaling (None: plain RoPE), as the spec stage trained it."""
    arch = ((spec.config or {}).get("modelopt_config") or {}).get("eagle_architecture_config") or {}
    scaling = arch.get("rope_scaling") or {}
    return None if (scaling.get("rope_type") or scaling.get("type") or "default") == "default" else scaling


def write_draft_folder(export: Path, out: Path, rope_scaling: dict[str, Any] | None, dtype: str = "bfloat16",
                       first_layer: dict[str, Any] | None = None) -> Path:
    """The draft folder the GPU host loads: ModelOpt's export with its single decoder layer as
    `midlayer.*`, the RoPE the module was trained with (ModelOpt's exporter injects a YaRN
    rope_scaling into a plain-RoPE module, which would make the GPU draft differ from the CPU one),
    the weights in the deployment's dtype (ModelOpt exports float32, which TensorRT-LLM's kernels
    mostly lack) and a config the GPU host's transformers reads as ours does (hfcompat). The CPU
    deployment reads the module from spec/, not from here."""
    import torch
    from safetensors.torch import load_file, save

    from specdeploy.hfcompat import compatible_config, with_dtype

    # ModelOpt writes the draft as model.safetensors, and with eagle_base_lora its LoRA of the base as
    # adapter_model.safetensors beside it (hf_spec_export.py, nvidia-modelopt 0.47.0): only the first is the draft
    tensors = load_file(str(export / "model.safetensors"))
    layers = {k.split(".")[1] for k in tensors if k.startswith("layers.")}
    if len(layers) == 1:
        tensors = {("midlayer." + k.split(".", 2)[2]) if k.startswith("layers.") else k: v for k, v in tensors.items()}
    config = with_dtype(json.loads((export / "config.json").read_text()), dtype)
    config["rope_scaling"] = rope_scaling
    config.update(first_layer or {})
    cast = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "model.safetensors", save(cast, metadata={"format": "pt"}))
    atomic_write_json(out / "config.json", compatible_config(config))
    return out


def eagle3_draft(spec: Any, spec_dir: Path | None, base_dir: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """out/eagle3_draft from the spec stage's export (spec/eagle3_export), exporting it if absent;
    weights in `dtype`, the deployment's (bfloat16 unless the target is deployed in another)."""
    if spec_dir is None:
        raise SpecDeployError("EAGLE-3 on the LLM-API route needs the spec stage output (spec/)")
    if not is_eagle3(spec):
        raise SpecDeployError("this EAGLE module is EAGLE-1/2 shaped; TensorRT-LLM's LLM API runs EAGLE-3 drafts only",
                              hint="train the module with `specdeploy spec train` (ModelOpt EAGLE-3)")
    ready = Path(spec_dir) / "eagle3_export"
    if not ((ready / "config.json").exists() and (ready / "model.safetensors").exists()):
        ready = export_eagle3(base_dir, Path(spec_dir), out / ".eagle3_export")
    folder = write_draft_folder(ready, out / DRAFT_FOLDER, training_rope_scaling(spec), dtype, first_layer_fields(spec.config))
    shutil.rmtree(out / ".eagle3_export", ignore_errors=True)
    return folder
