"""EAGLE-3's module without ModelOpt: ModelOpt 0.47's EagleModule (llama decoder) rebuilt from
transformers' Llama blocks, with the first layer the spec stage trains.

What mtsp.convert builds (plugins/hf_eagle.py HFEagleModel.modify, plugins/modeling_eagle.py):
the architecture dict merged over ModelOpt's EAGLE-3 defaults, read as the base's own config
class; LlamaDecoderLayers whose first attention takes cat(input_layernorm(embeddings),
hidden_norm(hidden)) (q/k/v twice as wide); `fc` over the concatenated auxiliary target states;
a final norm; an lm_head over the draft vocabulary and its `d2t` map (target = draft + d2t[draft])
when that vocabulary is smaller. ModelOpt joins the two first-layer inputs in an attention
pre-hook; here the first layer says it directly, for both placements of hidden_norm the spec
config can name (HIDDEN_NORM_INPUTS). The config helpers below are what the spec stage writes
into spec_config.json and what the runtime reads back (one definition for both).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import Cache, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from specdeploy.errors import SpecDeployError
from specdeploy.checkpoints.modules import base_rope_theta, text_config

DEFAULT_DRAFT_VOCAB = 8192
# What the first layer's hidden_norm reads (eagle_architecture_config "hidden_norm_input"): the fc
# output, as the EAGLE authors' layer and every engine compute it (SafeAILab/EAGLE cb7e084
# eagle/model/cnets.py LlamaDecoderLayeremb; TensorRT-LLM's Eagle3DecoderLayer; vLLM and SGLang
# llama_eagle3), or its input_layernorm, as ModelOpt 0.47's HF EagleModule computes it (the decoder
# layer normalizes its input before the attention pre-hook applies hidden_norm). Absent: ModelOpt's
# (modules trained before the spec stage named it); the spec stage trains the engines' ("fc").
HIDDEN_NORM_INPUTS = ("fc", "input_layernorm")


def aux_layer_ids(num_layers: int) -> list[int]:
    """ModelOpt's default EAGLE-3 auxiliary layers (0-based decoder layers): early, middle, late."""
    return sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)})


def hidden_layers(num_layers: int) -> list[int]:
    """The same layers in output_hidden_states indexing (0 = embeddings): what the proposer reads."""
    return [i + 1 for i in aux_layer_ids(num_layers)]


def modelopt_config(
    base_config: Any, *, draft_vocab_size: int, num_layers: int = 1, ttt_steps: int = 3,
    intermediate_size: int | None = None, offline: bool = False,
) -> dict[str, Any]:
    """The dict for mtsp.convert(model, [("eagle", cfg)]), sized for this base (not for 8B)."""
    heads = base_config.num_attention_heads
    head_dim = getattr(base_config, "head_dim", None) or base_config.hidden_size // heads
    theta = base_rope_theta(base_config)
    arch = {
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(base_config, "num_key_value_heads", heads),
        "head_dim": head_dim,
        "intermediate_size": intermediate_size or base_config.intermediate_size,
        "draft_vocab_size": min(draft_vocab_size, base_config.vocab_size),
        "use_aux_hidden_state": True,
        "use_last_layernorm": True,
        "eagle_aux_hidden_state_layer_ids": aux_layer_ids(base_config.num_hidden_layers),
        # the first layer as TensorRT-LLM, vLLM and SGLang compute it (HIDDEN_NORM_INPUTS): trained,
        # served here and served on a GPU alike
        "hidden_norm_input": "fc",
        "rms_norm_eps": getattr(base_config, "rms_norm_eps", 1e-5),
        "rope_theta": theta,
        "rope_scaling": {"rope_type": "default", "rope_theta": theta},
        "torch_dtype": "float32",
    }
    return {
        "eagle_offline": offline,
        "eagle_use_torch_compile": False,  # ~100x slower steps on CPU (docs/environment.md)
        "eagle_ttt_steps": ttt_steps,
        # ModelOpt's export would otherwise write YaRN (its default) into a module trained with plain RoPE
        "eagle_export_rope_scaling": {},
        "eagle_architecture_config": arch,
    }


def first_layer_norms(arch: Any) -> tuple[str, bool]:
    """(hidden_norm_input, norm_before_residual) of an EAGLE-3 architecture config (dict or config)."""
    read = arch.get if isinstance(arch, dict) else lambda key, default=None: getattr(arch, key, default)
    return read("hidden_norm_input", "input_layernorm") or "input_layernorm", bool(read("norm_before_residual", False))


def checked_first_layer_norms(arch: Any) -> tuple[str, bool]:
    """first_layer_norms, refused unless the first layer can compute them (ModelOpt's module here,
    and the runtime's torch-only one, specdeploy.checkpoints.modules.eagle)."""
    source, before_residual = first_layer_norms(arch)
    if source not in HIDDEN_NORM_INPUTS or (source == "input_layernorm" and before_residual):
        raise SpecDeployError(f"unsupported EAGLE-3 first layer: hidden_norm_input {source!r}, norm_before_residual "
                              f"{before_residual}", hint=f"hidden_norm_input is one of {', '.join(HIDDEN_NORM_INPUTS)}; "
                                                        "norm_before_residual needs 'fc'")
    return source, before_residual

# ModelOpt 0.47's EAGLE-3 architecture defaults (eagle/default_config.py default_eagle_config with
# config.py's EAGLE-3 update: aux hidden states and a last layernorm), which mtsp.convert merges
# spec_config.json's eagle_architecture_config over.
EAGLE3_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "torch_dtype": "bfloat16", "position_embedding_type": "rope",
    "rope_scaling": {"rope_type": "default", "rope_theta": 10000}, "rope_theta": 10000,
    "num_hidden_layers": 1, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "initializer_range": 0.01, "rms_norm_eps": 1e-05, "mlp_bias": False, "attention_bias": False,
    "attention_dropout": 0.0, "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
    "use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [], "use_mtp_layernorm": False,
    "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1, "has_lm_head": False, "head_dim": 128,
}


def eagle_config(base_config: Any, modelopt_config: dict[str, Any]) -> PretrainedConfig:
    """The module's config as HFEagleModel.modify makes it: the base's config class, its hidden
    size, vocabulary and context; refused where the runtime cannot run it."""
    decoder = modelopt_config.get("eagle_decoder_type", "llama")
    if decoder != "llama":
        raise SpecDeployError(f"the runtime's EAGLE proposer does not implement eagle_decoder_type {decoder!r}",
                              hint="train the module with the llama decoder (the spec stage's)")
    base = text_config(base_config)
    arch = {**copy.deepcopy(EAGLE3_DEFAULTS), **copy.deepcopy(modelopt_config.get("eagle_architecture_config") or {})}
    arch.update(hidden_size=base.hidden_size, vocab_size=base.vocab_size,
                max_position_embeddings=base.max_position_embeddings)
    rope = arch.get("rope_scaling")
    if rope and "rope_theta" not in rope and "rope_theta" in arch:
        rope["rope_theta"] = arch["rope_theta"]
    config = type(base).from_dict(arch)
    config.eagle_decoder_type = decoder
    config.draft_vocab_size = getattr(config, "draft_vocab_size", config.vocab_size)
    if config._attn_implementation is None:
        config._attn_implementation = "sdpa"
    if not config.use_aux_hidden_state:
        raise SpecDeployError("the runtime's EAGLE proposer drafts from auxiliary target states (EAGLE-3) only",
                              hint="train the module with use_aux_hidden_state (the spec stage's default)")
    if config.draft_vocab_size > config.vocab_size:
        raise SpecDeployError(f"EAGLE draft vocabulary {config.draft_vocab_size} exceeds the base's {config.vocab_size}",
                              hint="draft_vocab_size must be at most the base vocabulary")
    if not config.eagle_aux_hidden_state_layer_ids:  # ModelOpt's default for the base's depth
        config.eagle_aux_hidden_state_layer_ids = aux_layer_ids(base.num_hidden_layers)
    checked_first_layer_norms(config)
    return config


class EagleModule(nn.Module):
    """ModelOpt's EagleModule, parameter for parameter (the same state_dict keys and shapes)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, index) for index in range(config.num_hidden_layers))
        if config.use_last_layernorm:
            self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.draft_vocab_size != config.vocab_size or config.has_lm_head:
            if config.draft_vocab_size < config.vocab_size:
                self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.fc = nn.Linear(len(config.eagle_aux_hidden_state_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        first = self.layers[0]
        for name in ("q_proj", "k_proj", "v_proj"):  # they read cat(embeddings, hidden): twice as wide
            narrow = getattr(first.self_attn, name)
            setattr(first.self_attn, name, nn.Linear(2 * narrow.in_features, narrow.out_features, bias=config.attention_bias))
        first.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm_input, self.norm_before_residual = checked_first_layer_norms(config)

    def _maybe_init_rope(self, device: torch.device | str | None = None) -> None:
        """The rotary embedding, made once the module sits in its dtype (inv_freq stays float32),
        as ModelOpt's module does; the proposer calls it."""
        if not hasattr(self, "rotary_emb"):
            self.rotary_emb = LlamaRotaryEmbedding(config=self.config, device=device)

    def forward(
        self, hidden_states: torch.Tensor, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None, past_key_values: Cache | None = None, use_cache: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Cache | None]:
        """hidden_states (rows, q, hidden): fc(aux target states) or the module's own earlier output;
        inputs_embeds: the embeddings of the tokens that follow them; attention_mask: additive,
        (rows, 1, q, past + q). The final-normed output (its drafts' logits come from lm_head), the
        output before that norm (the next depth's input) and the cache."""
        rows, q, _ = hidden_states.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + q, dtype=torch.long, device=hidden_states.device)[None]
        position_ids = position_ids.view(-1, q).long()
        embeds = inputs_embeds.to(device=hidden_states.device, dtype=hidden_states.dtype)
        self._maybe_init_rope(hidden_states.device)
        attend = dict(attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                      use_cache=use_cache, position_embeddings=self.rotary_emb(hidden_states, position_ids))
        hidden = self._first_layer(hidden_states, embeds, attend)
        for layer in self.layers[1:]:
            hidden = layer(hidden, **attend)
        return (self.norm(hidden) if hasattr(self, "norm") else hidden), hidden, past_key_values

    def _first_layer(self, hidden: torch.Tensor, embeds: torch.Tensor, attend: dict[str, Any]) -> torch.Tensor:
        """hidden_norm reads the fc output ("fc": the engines' layer, what the spec stage trains) or
        the layer's input_layernorm of it (ModelOpt's own); with norm_before_residual the normed
        state is the attention's residual. The attention reads cat(input_layernorm(embeddings),
        that normed state)."""
        layer = self.layers[0]
        if self.hidden_norm_input == "fc":
            normed = layer.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
        else:
            normed, residual = layer.hidden_norm(layer.input_layernorm(hidden)), hidden
        attention, _ = layer.self_attn(hidden_states=torch.cat((layer.input_layernorm(embeds), normed), dim=-1), **attend)
        hidden = residual + attention
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
