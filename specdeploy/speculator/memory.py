"""Memory preflight of the spec stage: before the base is loaded, size what self-distillation,
training and validation will hold (from config.json and the safetensors headers, no weights
read) and refuse, naming the options, when the device, the RAM or the cache's disk is too small.

The estimates are deliberately simple upper-bound-ish sums (preflight.MemoryPlan); they exist to
turn an out-of-memory crash an hour into a run into a message before anything is loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdeploy.errors import SpecDeployError
from specdeploy.preflight import GiB, MemoryPlan, check, dtype_bytes, fit, weights_bytes

if TYPE_CHECKING:
    import torch

BF16 = 2
FP32 = 4
SHARD_BYTES = 1 * GiB  # hidden states of one cached shard: what the distillation holds in RAM at once


@dataclass(frozen=True)
class Arch:
    """The base's sizes, read from config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def read(cls, model_dir: str | os.PathLike) -> "Arch":
        config = json.loads((Path(model_dir) / "config.json").read_text())
        config = {**config, **(config.get("text_config") or {})}
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"], layers=config["num_hidden_layers"], heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config.get("intermediate_size") or 4 * config["hidden_size"],
            vocab=config["vocab_size"], tied=bool(config.get("tie_word_embeddings", False)),
        )


def hidden_bytes_per_token(arch: Arch, num_layers_kept: int) -> int:
    """Cached hidden states of one position (bfloat16, every captured layer)."""
    return num_layers_kept * arch.hidden * BF16


def forward_bytes(arch: Arch, batch: int, seq: int) -> int:
    """A frozen bf16 forward with output_hidden_states: KV cache, every layer's hidden states
    (generate keeps them all), one layer's MLP working set and the last position's fp32 logits."""
    kv = 2 * arch.layers * arch.kv_heads * arch.head_dim * batch * seq * BF16
    states = (arch.layers + 1) * batch * seq * arch.hidden * BF16
    work = 3 * batch * seq * arch.intermediate * BF16
    return kv + states + work + batch * arch.vocab * FP32


DISTILL_OPTIONS = [
    "a smaller distillation batch (--distill-batch)",
    "fewer samples (--num-prompts, --teacher-forced)",
    "more GPUs: with several visible, a base too large for one is spread over all of them "
    "(device_map auto; run the distillation without torchrun)",
    "a GPU with more memory, or --device cpu (slow)",
]
TRAIN_OPTIONS = [
    "smaller batches (--batch-size, --window)",
    "a smaller draft vocabulary (--draft-vocab)",
    "more GPUs: torchrun --nproc_per_node N -m specdeploy spec train ... splits every batch over them",
    "a GPU with more memory",
]


def plan_distillation(
    model_dir: str | os.PathLike, device: "torch.device", *, batch: int, seq: int, tf_batch: int, tf_seq: int,
    num_layers_kept: int, shard_samples: int, world: int = 1,
) -> str | None:
    """Check the distillation fits; return the device_map to load the base with: None (one
    device) or "auto" (more than one GPU visible, the base too large for one, not under torchrun)."""
    import torch

    arch = Arch.read(model_dir)
    plan = MemoryPlan("self-distillation", {
        "base weights (bfloat16)": weights_bytes(model_dir, torch.bfloat16),
        "a batch's KV cache and hidden states": max(forward_bytes(arch, batch, seq), forward_bytes(arch, tf_batch, tf_seq)),
    })
    # one shard's hidden states in RAM, about three times over (per-sample pieces, concatenation, write)
    shard = MemoryPlan("self-distillation (RAM)", {
        "hidden states of one cached shard": 3 * shard_samples * max(seq, tf_seq) * hidden_bytes_per_token(arch, num_layers_kept),
    })
    if device.type == "cpu":
        plan.items.update(shard.items)
        check(plan, device, options=DISTILL_OPTIONS)
        return None
    device_map = fit(plan, device, options=DISTILL_OPTIONS, may_spread=world == 1)
    check(shard, torch.device("cpu"), options=DISTILL_OPTIONS)
    return device_map


def check_disk(folder: Path, needed: int) -> None:
    """The cached hidden states of the shards still to make must fit the cache's disk."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if needed > 0.95 * free:
        raise SpecDeployError(
            f"self-distillation would write ~{needed / GiB:.1f} GiB of hidden states under {folder}, "
            f"which has {free / GiB:.1f} GiB free",
            hint="options: fewer samples (`spec train --num-prompts / --teacher-forced`, `engine --spec-prompts`); "
                 "point SPECDEPLOY_CACHE at a larger disk",
        )


def module_parameters(kind: str, arch: Arch, settings: Any) -> tuple[int, int]:
    """(trainable, frozen) parameter counts of the module ModelOpt adds."""
    h = arch.hidden
    if kind == "medusa":
        blocks = settings.medusa_heads * settings.medusa_layers * (h * h + h)
        heads = settings.medusa_heads * arch.vocab * h
        return (blocks + heads, 0) if settings.medusa_train_lm_head else (blocks, heads)
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    if kind == "dflash":  # one layer reading the hidden size, fc over one target layer; the base's head
        return h * (q + 2 * kv) + q * h + 3 * h * arch.intermediate + h * h, 0
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * arch.intermediate  # EAGLE-3: q/k/v read [embeds, hidden]
    draft_vocab = min(settings.draft_vocab, arch.vocab)
    return settings.eagle_layers * layer + 3 * h * h + draft_vocab * h, 0


def plan_training(model_dir: str | os.PathLike, settings: Any, device: "torch.device", *, num_layers_kept: int,
                  frozen_bytes: int, world: int = 1) -> MemoryPlan:
    """What one rank holds while training the module on precomputed hidden states."""
    arch = Arch.read(model_dir)
    trainable, frozen = module_parameters(settings.kind, arch, settings)
    tokens = settings.batch_size * settings.window // max(world, 1)
    draft_vocab = min(settings.draft_vocab, arch.vocab)
    if settings.kind == "dflash":  # draft logits (+ softmax, grad, teacher) per block row; base logits
        rows = settings.batch_size * settings.anchors * settings.block_size // max(world, 1)
        work = rows * arch.vocab * FP32 * 4 + tokens * arch.vocab * FP32
    elif settings.kind == "medusa":
        work = settings.medusa_heads * tokens * (draft_vocab * FP32 * 3 + 4 * arch.hidden * FP32)
    else:
        q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
        per_step = tokens * (draft_vocab * FP32 * 4 + (8 * arch.hidden + q + 2 * kv + 3 * arch.intermediate) * FP32)
        work = settings.ttt_steps * per_step
    return MemoryPlan(f"{settings.kind} training", {
        "base embeddings and lm_head": (1 if arch.tied else 2) * arch.vocab * arch.hidden * frozen_bytes,
        "module, gradients and AdamW state (fp32)": 16 * trainable + FP32 * frozen,
        "a batch of hidden states": tokens * num_layers_kept * arch.hidden * (BF16 + FP32),
        "activations": work,
    })


def check_split(batch_size: int, world: int) -> None:
    """Every rank trains on batch-size / world of each step's batch."""
    if batch_size % world:
        raise SpecDeployError(
            f"--batch-size {batch_size} does not split over {world} processes",
            hint=f"use a multiple of {world} (every rank trains on batch-size / world of each step's batch)",
        )


def check_training(model_dir: str | os.PathLike, settings: Any, device: "torch.device", *, num_layers_kept: int,
                   frozen_bytes: int, world: int = 1) -> None:
    check_split(settings.batch_size, world)
    plan = plan_training(model_dir, settings, device, num_layers_kept=num_layers_kept, frozen_bytes=frozen_bytes, world=world)
    check(plan, device, options=TRAIN_OPTIONS)


def check_validation(model_dir: str | os.PathLike, dtype: str, device: "torch.device") -> None:
    """The target in `dtype` (plus the module skeleton's embeddings and head, in the same dtype)."""
    arch = Arch.read(model_dir)
    plan = MemoryPlan("spec validate", {
        f"base weights ({dtype})": weights_bytes(model_dir, dtype),
        "module skeleton": 2 * arch.vocab * arch.hidden * dtype_bytes(dtype),
    })
    check(plan, device, options=["--dtype bfloat16", "a GPU with more memory", "--device cpu (slow)"])
