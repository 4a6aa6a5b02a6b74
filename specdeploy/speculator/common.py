"""Helpers shared by the spec stage: base loading, prompts, safetensors checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specdeploy.fileio import atomic_write_bytes, atomic_write_json


def load_base(path: str | os.PathLike, dtype: str = "float32", *, device: Any = "cpu", device_map: str | None = None,
              trust_remote_code: bool = False) -> Any:
    from specdeploy.checkpoints import load_causal_lm

    return load_causal_lm(path, dtype=dtype, device=device, device_map=device_map, trust_remote_code=trust_remote_code)


def load_offline_base(path: str | os.PathLike, dtype: Any, *, device: Any = "cpu", trust_remote_code: bool = False) -> Any:
    """The base without its decoder layers (embeddings, final norm, lm_head): all that training
    on precomputed hidden states and the EAGLE-3 export touch, as ModelOpt's own offline
    loader does (num_hidden_layers=0); an 8B base then costs ~2 GB instead of 16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    layers = config.num_hidden_layers
    config.num_hidden_layers = 0
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = []
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the skipped decoder weights are reported as unexpected keys
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation="sdpa",
                                                     trust_remote_code=trust_remote_code)
    finally:
        logging.set_verbosity(verbosity)
    model.config.num_orig_hidden_layers = layers  # where ModelOpt looks for the real depth
    return model.to(device).eval()


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
