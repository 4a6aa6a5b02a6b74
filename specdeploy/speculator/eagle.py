"""EAGLE-3 with ModelOpt: the conversion config for a given base, a reduced draft vocabulary,
and one training step on precomputed ("offline") base hidden states.

On a CPU the base forward and the 49k-vocabulary head dominate ModelOpt's online training
(docs/measurements.md, 2026-11-22). Offline mode drops the base decoder layers entirely, and a draft vocabulary
of the most frequent target tokens shrinks the draft's lm_head and every TTT softmax.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from specdeploy.checkpoints.modules.eagle import checked_first_layer_norms
from specdeploy.speculator.shards import within_sample


def online_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config recorded in spec_config.json: the same module on a model with its base layers."""
    out = copy.deepcopy(config)
    out["eagle_offline"] = False
    return out


def draft_vocab(tokens: torch.Tensor, valid: torch.Tensor, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """d2t (target = draft + d2t[draft]) for the `size` most frequent next tokens, and their coverage."""
    targets = tokens[1:][valid[:-1]]
    counts = torch.bincount(targets, minlength=vocab_size).float()
    counts += torch.linspace(1e-3, 0, vocab_size)  # ties: prefer low ids (special tokens, bytes)
    chosen = torch.sort(torch.topk(counts, size).indices).values
    coverage = float(counts[chosen].sum() / counts.sum())
    return chosen - torch.arange(size), coverage


@torch.no_grad()
def init_module(model: Any, d2t: torch.Tensor | None) -> None:
    """Draft vocabulary mapping, and the draft lm_head/norm started from the base's (faster start)."""
    module = model.eagle_module
    base_head = model._base_model_lm_head.weight
    if hasattr(module, "d2t") and d2t is not None:
        module.d2t.copy_(d2t)
    if hasattr(module, "lm_head"):
        rows = torch.arange(module.lm_head.weight.shape[0], device=base_head.device)
        if hasattr(module, "d2t"):
            rows = rows + module.d2t
        module.lm_head.weight.copy_(base_head[rows])
    norm = getattr(model._base_model, "norm", None)
    if hasattr(module, "norm") and norm is not None:
        module.norm.weight.copy_(norm.weight)


def trainable(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.eagle_module.parameters() if p.requires_grad]


def draft_rows(model: Any) -> torch.Tensor | None:
    module = model.eagle_module
    if not hasattr(module, "d2t"):
        return None
    return torch.arange(len(module.d2t), device=module.d2t.device) + module.d2t


@torch.no_grad()
def draft_logits(model: Any, last_hidden: torch.Tensor) -> torch.Tensor:
    """The base's logits over the draft vocabulary only: 6x less than the full 49k-row lm_head
    (ModelOpt would compute all of them and then keep these columns)."""
    weight = model._base_model_lm_head.weight
    rows = draft_rows(model)
    if rows is not None:
        weight = weight[rows]
    return last_hidden.to(weight.dtype) @ weight.T


def use_draft_vocab_logits(model: Any) -> None:
    """The logits we hand ModelOpt are already over the draft vocabulary: skip its column map."""
    if draft_rows(model) is not None:
        model._map_logits_to_draft_vocab = lambda logits: logits


def training_step(model: Any, batch: dict[str, torch.Tensor], last_layer: int, aux_layers: list[int]) -> tuple[torch.Tensor, list[float]]:
    """ModelOpt's EAGLE-3 forward (TTT steps, logit distillation) on precomputed hidden states."""
    model._cached_attn_blk_masks = {}  # ModelOpt caches the TTT mask by step index only
    hidden = batch["hidden"]
    outputs = {
        "base_model_hidden_states": hidden[last_layer].float(),
        "aux_hidden_states": torch.cat([hidden[i].float() for i in aux_layers], dim=-1),
        "base_model_logits": draft_logits(model, hidden[last_layer]),
    }
    # ModelOpt scores the draft at j (TTT step k: a chain from j - k) against the base at j + 1 where
    # loss_mask[j + 1]: every position of that chain must lie in the row's sample, not in its padding
    loss_mask = within_sample(batch["valid"], model.eagle_ttt_steps, itself=True)
    out = model(
        input_ids=batch["tokens"],
        attention_mask=batch["attention"],  # one sample per row, right-padded
        loss_mask=loss_mask.long(),
        base_model_outputs=outputs,
    )
    return out.loss, [float(a) for a in out.train_acc[0]]


def run_first_layer_as_engines(module: Any) -> None:
    """Make ModelOpt's EAGLE-3 first layer compute what its config names: hidden_norm on the fc output
    (not on its input_layernorm), and with norm_before_residual (vllm-project/speculators 0.9.0
    Eagle3FirstLayerMixin) the normed hidden state as the attention's residual. ModelOpt's attention
    pre-hook still concatenates input_layernorm(embeddings) with hidden_norm(what the layer passes)."""
    import types

    source, before_residual = checked_first_layer_norms(module.config)
    if source == "input_layernorm" and not before_residual:
        return

    def forward(layer: Any, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        residual = layer.hidden_norm(hidden_states) if before_residual else hidden_states
        attention, _ = layer.self_attn(hidden_states=hidden_states, **kwargs)
        hidden = residual + attention
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    first = module.layers[0]
    first.forward = types.MethodType(forward, first)
