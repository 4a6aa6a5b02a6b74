"""Where the stage's models go: a memory preflight before any load, and device_map="auto" when a
model fits all visible GPUs but not one (as ModelOpt's own hf_ptq.py loads large models)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdeploy import preflight


@dataclass(frozen=True)
class Placement:
    """One device, or device_map "auto": accelerate spreads the layers over every visible GPU."""

    device: torch.device
    device_map: str | None = None


def activation_bytes(model_dir: Path, seq_len: int, dtype: str) -> int:
    """Peak working set of one no-grad forward over `seq_len` tokens (batch 1, no KV cache):
    the residual stream and attention projections, the MLP, fp32 attention scores (the math
    fallback of sdpa) and fp32 logits (perplexity upcasts them)."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    intermediate = config.get("intermediate_size", 4 * hidden)
    heads = config.get("num_attention_heads", 1)
    size = preflight.dtype_bytes(dtype)
    return seq_len * (6 * hidden + 3 * intermediate) * size + 4 * heads * seq_len * seq_len + 4 * seq_len * vocab


def place(what: str, model_dir: Path, dtype: str, device: torch.device, seq_len: int, *, copies: int = 1,
          options: list[str]) -> Placement:
    """Check that `copies` of the model in `dtype` plus one forward's activations fit `device`;
    on a GPU that is too small, fall back to all visible GPUs (device_map "auto"); else refuse
    with `options`, before anything is loaded."""
    plan = preflight.MemoryPlan(what, {
        "weights" if copies == 1 else f"weights x{copies}": copies * preflight.weights_bytes(model_dir, dtype),
        "activations": activation_bytes(model_dir, seq_len, dtype),
    })
    return Placement(device, preflight.fit(plan, device, options=options))
