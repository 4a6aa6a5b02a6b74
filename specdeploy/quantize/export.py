"""The base model going into ModelOpt, and ModelOpt's unified HF checkpoint coming out."""

from __future__ import annotations

import shutil
from pathlib import Path

from torch import nn

from specdeploy.errors import SpecDeployError
from specdeploy.hfcompat import write_compatible
from specdeploy.quantize.placement import Placement

# Files of base/ the quantized folder carries over (tokenizer, chat template, generation config).
CARRIED_SUFFIXES = (".json", ".jinja", ".txt", ".model")
NOT_CARRIED = ("config.json", "model.safetensors.index.json", "specdeploy_source.json")


def load_base(base_dir: Path, dtype: str, placement: Placement, trust_remote_code: bool = False) -> nn.Module:
    """A fresh instance of the base in `dtype` where `placement` says, ready to quantize and
    export: ModelOpt's export mutates it, so every export needs its own."""
    from specdeploy.checkpoints import load_causal_lm

    model = load_causal_lm(base_dir, dtype, device=placement.device, device_map=placement.device_map,
                           trust_remote_code=trust_remote_code)
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]  # export_hf_checkpoint needs it
    return model


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


def copy_tokenizer_files(base_dir: Path, out_dir: Path) -> None:
    """Carry base/'s tokenizer files over, then make the finished folder (config.json as either
    export path wrote it, the tokenizer) readable by the GPU host's older transformers."""
    for src in base_dir.iterdir():
        if src.is_file() and not (out_dir / src.name).exists() and src.suffix in CARRIED_SUFFIXES:
            if src.name not in NOT_CARRIED:
                shutil.copy2(src, out_dir / src.name)
    write_compatible(out_dir)
