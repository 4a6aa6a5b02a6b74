"""Helpers shared by the spec stage: base loading, prompts, cache paths, safetensors checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specdeploy.fileio import atomic_write_bytes, atomic_write_json


def load_base(path: str | os.PathLike, dtype: str = "float32") -> Any:
    from specdeploy.models import load_causal_lm

    return load_causal_lm(path, dtype=dtype)


def cache_root() -> Path:
    root = os.environ.get("SPECDEPLOY_CACHE") or Path.home() / ".cache" / "specdeploy"
    return Path(root).expanduser()


def chat_prompts(n: int, split: str = "train") -> list[str]:
    """Distinct first-turn ShareGPT prompts of a split (train / heldout), deterministic."""
    from specdeploy.data import sharegpt_prompts

    return list(sharegpt_prompts(n, split, max_chars=4000))


def code_prompts(n: int) -> list[str]:
    from specdeploy.data import humaneval_prompts

    return list(humaneval_prompts(n))


def save_tensors(path: Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> Path:
    """safetensors, written atomically (save to bytes, then rename into place)."""
    from safetensors.torch import save

    return atomic_write_bytes(path, save(tensors, metadata=metadata))


def save_checkpoint(folder: Path, module: dict[str, Any], optimizer: Any, state: dict[str, Any]) -> None:
    """A resumable training checkpoint without pickle: module + flattened optimizer tensors + JSON."""
    flat = {}
    opt_state = optimizer.state_dict()
    for pid, slots in opt_state["state"].items():
        for name, value in slots.items():
            flat[f"{pid}.{name}"] = value.detach().clone().contiguous() if hasattr(value, "detach") else value
    save_tensors(folder / "module.safetensors", module)
    save_tensors(folder / "optimizer.safetensors", {k: v for k, v in flat.items() if hasattr(v, "shape")})
    atomic_write_json(folder / "state.json", state)  # written last: marks the checkpoint complete


def load_checkpoint(folder: Path, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(module tensors, state) of a complete checkpoint, restoring the optimizer in place; or None."""
    import torch
    from safetensors.torch import load_file

    if not (folder / "state.json").is_file():
        return None
    state = json.loads((folder / "state.json").read_text())
    module = load_file(str(folder / "module.safetensors"))
    flat = load_file(str(folder / "optimizer.safetensors"))
    opt_state = optimizer.state_dict()
    restored: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        pid, name = key.split(".", 1)
        restored.setdefault(int(pid), {})[name] = value
    for slots in restored.values():
        if "step" in slots and slots["step"].dim() == 0:
            slots["step"] = slots["step"].to(torch.float32)
    opt_state["state"] = restored
    optimizer.load_state_dict(opt_state)
    return module, state
