"""DFlash's module without ModelOpt: ModelOpt 0.47's DFlashModule rebuilt from transformers' Qwen3
blocks (MLP, RMSNorm, rotary embedding), as ModelOpt builds it.

What mtsp.convert builds (plugins/hf_dflash.py HFDFlashModel.modify, plugins/modeling_dflash.py):
`fc` + `hidden_norm` fuse the target's states at `target_layer_ids`; each layer's attention takes
its queries from the block ([pending token, mask, ...]) and its keys/values from the fused target
states followed by the block (QK-norm, RoPE; non-causal), then a Qwen3 MLP; a final norm. The
drafts go through the target's own embeddings and lm_head. The runtime proposer
(runtime/proposers/dflash.py) runs these parts itself with a cache of the injected keys/values;
`forward` here is the whole-context reference it is tested against.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from specdeploy.errors import SpecDeployError
from specdeploy.checkpoints.modules import text_config

# ModelOpt 0.47's DFlash defaults: dflash/default_config.py (merged under the spec's
# dflash_architecture_config) and config.py DFlashConfig (the top-level options read here)
DFLASH_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 5, "hidden_act": "silu", "rms_norm_eps": 1e-06, "initializer_range": 0.02,
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "_attn_implementation": "sdpa",
}
DEFAULT_BLOCK_SIZE = 8
# options that change what the module computes, with the values this module (and the proposer) implement
IMPLEMENTED = (("dflash_swa_window_size", None), ("dflash_draft_attention", "bidirectional"),
               ("dflash_attention_sink", False))


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """ModelOpt's build_target_layer_ids: target layers spread uniformly (the middle one for one)."""
    if num_target_layers < num_draft_layers:
        raise SpecDeployError(f"a {num_draft_layers}-layer DFlash module needs as many target layers, the base has "
                              f"{num_target_layers}", hint="use fewer DFlash layers")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start = min(1, num_target_layers - 1)
    span = max(start, num_target_layers - 3) - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def dflash_config(base_config: Any, modelopt_config: dict[str, Any]) -> Qwen3Config:
    """The module's config as HFDFlashModel.modify makes it; refused where the runtime cannot run it."""
    arch = {**DFLASH_DEFAULTS, **copy.deepcopy(modelopt_config.get("dflash_architecture_config") or {})}
    unsupported = [f"{name}={modelopt_config.get(name, default)!r}" for name, default in IMPLEMENTED
                   if modelopt_config.get(name, default) != default]
    if arch.get("projector_type") not in (None, "dflash"):
        unsupported.append(f"projector_type={arch['projector_type']!r}")
    if unsupported:
        raise SpecDeployError(f"the runtime's DFlash proposer does not implement {', '.join(unsupported)}",
                              hint="train the module with full context attention and bidirectional blocks")
    base = text_config(base_config)
    config = Qwen3Config(**arch)
    config.hidden_size, config.vocab_size = base.hidden_size, base.vocab_size
    for name in ("max_position_embeddings", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "rms_norm_eps"):
        if getattr(config, name, None) is None and hasattr(base, name):
            setattr(config, name, getattr(base, name))
    # ModelOpt copies these from the base where the base config has them as attributes (transformers
    # 4.x). transformers 5 keeps rope_theta in rope_parameters, so the spec stage names it in the
    # architecture config itself; a module trained without it has Qwen3Config's 10000: served as trained.
    for name in ("rope_theta", "rope_type", "rope_interleaved"):
        if hasattr(base, name):
            setattr(config, name, getattr(base, name))
    config.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    config.block_size = modelopt_config.get("dflash_block_size", DEFAULT_BLOCK_SIZE)
    config.attention_sink_bias = False
    layers = arch.get("target_layer_ids") or default_target_layers(base.num_hidden_layers, config.num_hidden_layers)
    distinct = len(set(layers)) == len(layers) == config.num_hidden_layers
    if not distinct or not 0 <= min(layers) <= max(layers) < base.num_hidden_layers:
        raise SpecDeployError(f"DFlash target_layer_ids {layers} do not fit a {config.num_hidden_layers}-layer module on a "
                              f"{base.num_hidden_layers}-layer base", hint="one distinct base layer per DFlash layer")
    config.target_layer_ids = list(layers)
    if any(kind == "sliding_attention" for kind in (getattr(config, "layer_types", None) or [])):
        raise SpecDeployError("the runtime's DFlash proposer does not implement sliding-window draft layers",
                              hint="train the module with full context attention and bidirectional blocks")
    return config


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from the target context followed by the block."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, target_hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        rows, q_len, _ = hidden_states.shape
        columns = target_hidden.shape[1] + q_len  # keys/values: the context, then the block
        q = self.q_norm(self.q_proj(hidden_states).view(rows, q_len, -1, self.head_dim)).transpose(1, 2)
        # context and block projected apart, as ModelOpt does (one matmul over both can round differently)
        k = torch.cat([self.k_proj(target_hidden), self.k_proj(hidden_states)], dim=1).view(rows, columns, -1, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        v = torch.cat([self.v_proj(target_hidden), self.v_proj(hidden_states)], dim=1)
        v = v.view(rows, columns, -1, self.head_dim).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)  # positions of context + block
        q, k = _rope(q, cos[:, :, -q_len:], sin[:, :, -q_len:]), _rope(k, cos, sin)
        attention = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, ALL_ATTENTION_FUNCTIONS["sdpa"])
        out, _ = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, sliding_window=None)
        return self.o_proj(out.reshape(rows, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, target_hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = hidden_states + self.self_attn(self.input_layernorm(hidden_states), target_hidden, position_embeddings,
                                                attention_mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashModule(nn.Module):
    """ModelOpt's DFlashModule, parameter for parameter (the same state_dict keys and shapes)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.block_size = config.block_size
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        for module in self.modules():  # ModelOpt's _init_weights (a fresh module's only)
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=config.initializer_range)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def _maybe_init_rotary_emb(self, device: torch.device | str | None = None) -> None:
        """Made once the module sits in its dtype (inv_freq stays float32); the proposer calls it."""
        if not hasattr(self, "rotary_emb"):
            self.rotary_emb = Qwen3RotaryEmbedding(config=self.config, device=device)

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """noise_embedding (rows, B, hidden): the block's embeddings; target_hidden (rows, n, len(target
        layers) * hidden): the context's target states; position_ids (rows, n + B). The final-normed
        block states (the target's lm_head makes them drafts)."""
        context = self.hidden_norm(self.fc(target_hidden))
        self._maybe_init_rotary_emb(noise_embedding.device)
        position_embeddings = self.rotary_emb(noise_embedding, position_ids)
        hidden = noise_embedding
        for layer in self.layers:
            hidden = layer(hidden, context, position_embeddings, attention_mask)
        return self.norm(hidden)
