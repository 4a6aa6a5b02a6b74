"""Calibration: the data (ShareGPT train conversations, the activations the model will serve) and
ModelOpt's post-training quantization, with the forward loop on the model's own device."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from specdeploy.errors import SpecDeployError
from specdeploy.prompts import conversation_ids
from specdeploy.quantize.config import check_block_size, quant_config
from specdeploy.runtime.types import model_device


def calibration_batches(tokenizer: Any, calib_size: int, seq_len: int, seed: int = 0) -> list[torch.Tensor]:
    """`calib_size` token sequences (<= seq_len) of ShareGPT *train* conversations (user turn +
    answer, in the chat template when there is one), on the CPU: the loop moves each in turn."""
    from specdeploy.data import sharegpt_conversations

    if calib_size <= 0 or seq_len < 8:
        raise SpecDeployError(f"calibration needs calib_size > 0 and calib_seq_len >= 8 (got {calib_size}, {seq_len})")
    batches = []
    for messages in sharegpt_conversations(calib_size, split="train", seed=seed):
        ids = conversation_ids(tokenizer, messages[:2])[:seq_len]
        batches.append(torch.tensor([ids], dtype=torch.long))
    return batches


def forward_loop(batches: list[torch.Tensor], desc: str) -> Callable[[nn.Module], None]:
    """ModelOpt's forward_loop: every calibration sequence through the model, on its device."""
    from tqdm import tqdm

    def loop(model: nn.Module) -> None:
        device = model_device(model)
        with torch.no_grad():
            for ids in tqdm(batches, desc=desc, unit="seq", leave=False):
                model(input_ids=ids.to(device), use_cache=False)

    return loop


def quantize_model(model: nn.Module, qformat: str, kv_cache: str, batches: list[torch.Tensor],
                   awq_block_size: int = 128, keep: Iterable[str] = ()) -> nn.Module:
    """ModelOpt PTQ in place (the model should already be bf16/fp16: export casts nothing);
    `keep`: Linear names left unquantized (config.excluded_linears resolves --exclude patterns)."""
    config = quant_config(qformat, kv_cache, awq_block_size, keep)
    if config is None:
        return model
    check_block_size(model, qformat, awq_block_size, keep)
    import modelopt.torch.quantization as mtq

    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        model.config._attn_implementation = "sdpa"  # KV-cache quantizers hook the attention call
    mtq.quantize(model, config, forward_loop(batches, f"calibrating {qformat}/kv {kv_cache}"))
    return model
