"""A module folder as its layouts see it: config.json, every tensor of its weight files, and the
sha256 of each input file (what the import stage records in the manifest).

Weights are read from the folder's checkpoint (model.safetensors, else the shards its index
names: fileio.checkpoint_files), else from every *.safetensors (a module's own file name, as
Medusa's medusa_lm_head.safetensors); pickles (*.bin, *.pt, ...) only where the folder has no
safetensors and the user passed --allow-pickle (models.refuse_pickles: the policy every reader of
user folders follows), with torch.load(weights_only=True): tensors only, never arbitrary objects.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import cached_sha256, checkpoint_files

CONFIG = "config.json"
ADAPTER = "adapter_model.safetensors"  # ModelOpt's export with eagle_base_lora: the base's LoRA, beside the draft


@dataclass
class Folder:
    path: Path
    config: dict[str, Any]
    tensors: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256 of every file read

    def keys_under(self, prefix: str) -> list[str]:
        return sorted(k for k in self.tensors if k.startswith(prefix))


def weight_files(path: Path, allow_pickle: bool) -> list[Path]:
    """The folder's weight files: its checkpoint's, else its safetensors, else (with allow_pickle)
    its pickles. A checkpoint's files come first as transformers reads them: beside ModelOpt's
    model.safetensors may sit adapter_model.safetensors (a LoRA of the base, eagle_base_lora), which
    is no part of the module."""
    from specdeploy.resolve.local import pickle_files, refuse_pickles

    found = checkpoint_files(path) or sorted(path.glob("*.safetensors"))
    if found:
        return found
    pickles = [p for p in pickle_files(path) if p.name != "training_args.bin"]
    if not pickles:
        raise SpecDeployError(f"{path} holds no module weights (*.safetensors)",
                              hint="pass the folder with the module's config.json and weights")
    refuse_pickles(path, pickles, allow_pickle)
    return pickles


def fingerprint(path: str | os.PathLike, *, allow_pickle: bool = False) -> dict[str, str]:
    """{file name: sha256} of every file a module is read from (weights and configs)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise SpecDeployError(f"{path}: no such module folder", hint="pass MODULE=<the folder holding the module's weights>")
    configs = [p for p in (path / CONFIG, path / "spec_config.json") if p.is_file()]
    return {p.name: cached_sha256(p) for p in sorted([*weight_files(path, allow_pickle), *configs])}


def read_folder(path: str | os.PathLike, *, allow_pickle: bool = False) -> Folder:
    path = Path(path).expanduser()
    files = fingerprint(path, allow_pickle=allow_pickle)
    tensors: dict[str, Any] = {}
    for file in weight_files(path, allow_pickle):
        tensors.update(_load(file))
    if (path / ADAPTER).is_file():
        print(f"modules: {path / ADAPTER} (a LoRA of the base the module was trained with, ModelOpt's eagle_base_lora) "
              "is not read: the module drafts for the base as it is, and may be accepted less often than in training")
    config = json.loads((path / CONFIG).read_text()) if (path / CONFIG).is_file() else {}
    return Folder(path, config, tensors, files)


def _load(file: Path) -> dict[str, Any]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    import torch

    state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(hasattr(v, "shape") for v in state.values()):
        raise SpecDeployError(f"{file} is not a flat state dict of tensors", hint="save the module's state_dict() as safetensors")
    return state
