"""DFlash with ModelOpt: the conversion config for a given base, and one training step on the
precomputed ("offline") base hidden states the EAGLE path already caches.

DFlash reads one target layer per draft layer. ModelOpt's default for a 1-layer draft is the
middle layer; the one taken here is the captured EAGLE-3 auxiliary layer closest to it, so DFlash
trains on the same cached self-distillation data (no second pass of the base). The module's
config is built by the runtime proposer's `modelopt_config`: what is trained is what it loads.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from specdeploy.runtime.proposers.dflash import DEFAULT_BLOCK_SIZE, modelopt_config as runtime_config
from specdeploy.speculator.shards import within_sample
from specdeploy.checkpoints.modules import eagle as eagle_spec

__all__ = ["DEFAULT_BLOCK_SIZE", "target_layer", "hidden_layers", "modelopt_config", "online_config", "mask_token_id",
           "converted", "trainable", "training_step"]


def target_layer(num_layers: int) -> int:
    """The captured auxiliary layer (0-based decoder layer) nearest ModelOpt's default (the middle)."""
    return min(eagle_spec.aux_layer_ids(num_layers), key=lambda layer: (abs(layer - num_layers // 2), layer))


def hidden_layers(num_layers: int) -> list[int]:
    """The same layer in output_hidden_states indexing (0 = embeddings): what the proposer reads."""
    return [target_layer(num_layers) + 1]


def mask_token_id(base_config: Any) -> int:
    """The id of the block's unknown positions: the vocabulary's last id (the runtime's default)."""
    return int(base_config.vocab_size) - 1


def modelopt_config(base_config: Any, *, block_size: int, anchors: int, num_layers: int = 1,
                    offline: bool = False) -> dict[str, Any]:
    """The dict for mtsp.convert(model, [("dflash", cfg)]), sized for this base (not for 8B).
    `anchors`: blocks trained per window (ModelOpt's 512 makes each step's draft logits
    anchors x block_size x vocab: on a CPU a few dozen per window keep a step EAGLE-sized)."""
    config = runtime_config(base_config, mask_token_id=mask_token_id(base_config), block_size=block_size,
                            num_layers=num_layers, target_layer_ids=[target_layer(base_config.num_hidden_layers)])
    config["dflash_num_anchors"] = anchors
    return {**config, "dflash_offline": True} if offline else config


def online_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config recorded in spec_config.json: the same module on a model with its base layers."""
    out = copy.deepcopy(config)
    out.pop("dflash_offline", None)
    return out


def converted(base_config: Any, config: dict[str, Any], seed: int = 0) -> Any:
    """A ModelOpt-converted skeleton of the base, its base layers on the meta device (no memory):
    ModelOpt checks target_layer_ids against the real layer count, so the skeleton keeps every layer.
    (The runtime builds the module without ModelOpt: specdeploy.checkpoints.modules.dflash.)"""
    import modelopt.torch.speculative as mtsp
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(copy.deepcopy(base_config))
    torch.manual_seed(seed)  # the module is built (and initialized) on the CPU, outside the meta context
    mtsp.convert(skeleton, [("dflash", copy.deepcopy(config))])
    return skeleton


def trainable(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.dflash_module.parameters() if p.requires_grad]


def crop(window: int, block_size: int) -> int:
    """ModelOpt needs the sequence length to be a multiple of the block size."""
    return window - window % block_size


def training_step(model: Any, batch: dict[str, torch.Tensor], last_layer: int) -> tuple[torch.Tensor, list[float]]:
    """ModelOpt's DFlash forward (random anchors, a non-causal block each, logit distillation from
    the base's logits at the captured last layer) on precomputed hidden states. The anchors come
    from torch's global generator: seeded from the batch, so a resumed run draws the same ones."""
    torch.manual_seed(int(batch["seed"]))
    hidden = batch["hidden"]
    layers = [layer + 1 for layer in model.target_layer_ids]
    last = hidden[last_layer]
    outputs = {
        "aux_hidden_states": torch.cat([hidden[i].float() for i in layers], dim=-1),
        "base_model_logits": last.to(model._base_model_lm_head.weight.dtype) @ model._base_model_lm_head.weight.T,
    }
    # ModelOpt draws anchors where loss_mask is set and scores label i (teacher: the base at i - 1)
    # where loss_mask[i]: the block_size positions before i in i's sample keep a block and the
    # anchor's context inside one sample, and a sample's last token (its end) is a label too
    loss_mask = within_sample(batch["valid"], model.dflash_block_size, itself=False)
    out = model(
        input_ids=batch["tokens"],
        attention_mask=batch["attention"],  # one sample per row, right-padded
        loss_mask=loss_mask.float(),
        base_model_outputs=outputs,
    )
    return out.loss, [float(a) for a in out.train_acc[0]]
