"""Tiny speculative modules in each layout, written from a config and random weights in that
layout's own names and shapes (read from each layout's source, cited in specdeploy/modules/), one
set of weights per kind, so every layout holds the same module.

The base they fit: tests.tiny's Llama with 8 layers (hidden 64, 4 heads, 2 KV heads, vocabulary
384). EAGLE-3 reads the outputs of layers [1, 3, 4] (the default for 8 layers: {1, n//2-1, n-4}).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 64, 4, 2, 16, 128, 384, 8
EAGLE_LAYERS = [1, 3, 4]  # 0-based layer outputs; vLLM / speculators count inputs: [2, 4, 5]
DRAFT_VOCAB = 96
DFLASH_LAYERS = [3]
BLOCK, MASK = 4, VOCAB - 1
MEDUSA_HEADS = 3


def _random(shape: tuple[int, ...], generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * scale


def _norm(generator: torch.Generator) -> torch.Tensor:
    return 1 + _random((HIDDEN,), generator, 0.2)  # not all ones: norm placement must matter


def eagle_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """One EAGLE-3 module in the authors' names (midlayer.*), with d2t and t2d over a draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[chosen] = True
    layer = {
        "self_attn.q_proj.weight": _random((HEADS * HEAD_DIM, 2 * HIDDEN), g),
        "self_attn.k_proj.weight": _random((KV_HEADS * HEAD_DIM, 2 * HIDDEN), g),
        "self_attn.v_proj.weight": _random((KV_HEADS * HEAD_DIM, 2 * HIDDEN), g),
        "self_attn.o_proj.weight": _random((HIDDEN, HEADS * HEAD_DIM), g),
        "mlp.gate_proj.weight": _random((INTER, HIDDEN), g),
        "mlp.up_proj.weight": _random((INTER, HIDDEN), g),
        "mlp.down_proj.weight": _random((HIDDEN, INTER), g),
        "input_layernorm.weight": _norm(g), "hidden_norm.weight": _norm(g), "post_attention_layernorm.weight": _norm(g),
    }
    return {**{f"midlayer.{k}": v for k, v in layer.items()}, "fc.weight": _random((HIDDEN, 3 * HIDDEN), g, 0.15),
            "norm.weight": _norm(g), "lm_head.weight": _random((DRAFT_VOCAB, HIDDEN), g, 1.0),
            "d2t": chosen - torch.arange(DRAFT_VOCAB), "t2d": t2d}


def _layer_config() -> dict:
    return {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "hidden_act": "silu",
            "max_position_embeddings": 256, "tie_word_embeddings": False}


def _write(out: Path, config: dict, tensors: dict[str, torch.Tensor], file: str = "model.safetensors") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / file))
    return out


def _renamed(tensors: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    return {(new + k[len(old):]) if k.startswith(old) else k: v for k, v in tensors.items()}


def eagle_authors(out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """SafeAILab/EAGLE: LlamaForCausalLM + draft_vocab_size; no layer ids (the default)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_layer_config(), "draft_vocab_size": DRAFT_VOCAB,
              "rope_theta": 10000.0, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 0}
    return _write(out, config, weights)


def eagle_modelopt(out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """ModelOpt's export: LlamaForCausalLMEagle3, layers.0.*, eagle_config with the layer ids, no t2d."""
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **_layer_config(),
              "draft_vocab_size": DRAFT_VOCAB, "rope_theta": 10000.0, "rope_scaling": None,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": EAGLE_LAYERS, "use_aux_hidden_state": True,
                               "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True}}
    tensors = {k: v for k, v in _renamed(weights, "midlayer.", "layers.0.").items() if k != "t2d"}
    return _write(out, config, tensors)


def eagle_specforge(out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """SpecForge: LlamaForCausalLMEagle3 without eagle_config (default layers), midlayer.*, t2d, and RoPE
    in transformers 5's rope_parameters."""
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **_layer_config(),
              "draft_vocab_size": DRAFT_VOCAB, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    return _write(out, config, {**weights, "embed_tokens.weight": torch.zeros(VOCAB, HIDDEN)})


def eagle_speculators(out: Path, weights: dict[str, torch.Tensor], verifier: str, **overrides) -> Path:
    """vLLM speculators 0.9.0 Eagle3Speculator: layer ids count inputs; norm_before_residual explicit."""
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
              "transformer_layer_config": {"model_type": "llama", **_layer_config(), "rope_theta": 10000.0},
              "draft_vocab_size": DRAFT_VOCAB, "norm_before_residual": False, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": [i + 1 for i in EAGLE_LAYERS], "norm_before_fc": False,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}},
              **overrides}
    return _write(out, config, _renamed(weights, "midlayer.", "layers.0."))


EAGLE_LAYOUTS = {"eagle3": eagle_authors, "eagle3-modelopt": eagle_modelopt, "specforge": eagle_specforge,
                 "speculators": eagle_speculators}


def dflash_weights(seed: int = 1) -> dict[str, torch.Tensor]:
    """One DFlash module in z-lab's names (Qwen3 layers with q_norm / k_norm)."""
    g = torch.Generator().manual_seed(seed)
    layer = {
        "self_attn.q_proj.weight": _random((HEADS * HEAD_DIM, HIDDEN), g),
        "self_attn.k_proj.weight": _random((KV_HEADS * HEAD_DIM, HIDDEN), g),
        "self_attn.v_proj.weight": _random((KV_HEADS * HEAD_DIM, HIDDEN), g),
        "self_attn.o_proj.weight": _random((HIDDEN, HEADS * HEAD_DIM), g),
        "self_attn.q_norm.weight": 1 + _random((HEAD_DIM,), g, 0.2), "self_attn.k_norm.weight": 1 + _random((HEAD_DIM,), g, 0.2),
        "mlp.gate_proj.weight": _random((INTER, HIDDEN), g), "mlp.up_proj.weight": _random((INTER, HIDDEN), g),
        "mlp.down_proj.weight": _random((HIDDEN, INTER), g),
        "input_layernorm.weight": _norm(g), "post_attention_layernorm.weight": _norm(g),
    }
    return {**{f"layers.0.{k}": v for k, v in layer.items()}, "fc.weight": _random((HIDDEN, HIDDEN), g, 0.2),
            "hidden_norm.weight": _norm(g), "norm.weight": _norm(g)}


def dflash_zlab(out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """z-lab/dflash: DFlashDraftModel (Qwen3 config), block_size at the top, dflash_config."""
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **_layer_config(), "block_size": BLOCK,
              "dflash_config": {"mask_token_id": MASK, "target_layer_ids": DFLASH_LAYERS}, "num_target_layers": LAYERS,
              "rope_theta": 10000.0, "layer_types": ["full_attention"], "attention_bias": False}
    return _write(out, config, weights)


def dflash_speculators(out: Path, weights: dict[str, torch.Tensor], verifier: str) -> Path:
    """vLLM speculators 0.9.0 DFlashSpeculator: aux layer ids count inputs; full-vocabulary head omitted."""
    config = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.9.0",
              "transformer_layer_config": {"model_type": "qwen3", **_layer_config(), "rope_theta": 10000.0},
              "draft_vocab_size": VOCAB, "block_size": BLOCK, "mask_token_id": MASK,
              "aux_hidden_state_layer_ids": [i + 1 for i in DFLASH_LAYERS],
              "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": BLOCK - 1}],
                                     "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
    return _write(out, config, weights)


DFLASH_LAYOUTS = {"dflash": dflash_zlab, "speculators": dflash_speculators}


def medusa_weights(seed: int = 2) -> dict[str, torch.Tensor]:
    """Medusa heads in FasterDecoding's names: {head}.0.linear.{weight,bias}, {head}.1.weight."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for head in range(MEDUSA_HEADS):
        tensors.update({f"{head}.0.linear.weight": _random((HIDDEN, HIDDEN), g), f"{head}.0.linear.bias": _random((HIDDEN,), g),
                        f"{head}.1.weight": _random((VOCAB, HIDDEN), g, 1.0)})
    return tensors


def medusa_fasterdecoding(out: Path, weights: dict[str, torch.Tensor], verifier: str) -> Path:
    config = {"medusa_num_heads": MEDUSA_HEADS, "medusa_num_layers": 1, "base_model_name_or_path": verifier, "version": "2"}
    return _write(out, config, weights, "medusa_lm_head.safetensors")


def medusa_modelopt(out: Path, weights: dict[str, torch.Tensor], verifier: str) -> Path:
    """ModelOpt: the converted model's weights, heads under medusa_heads.*, beside base tensors."""
    base = {"model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": torch.zeros(VOCAB, HIDDEN)}
    return _write(out, {"architectures": ["LlamaForCausalLM"], "_name_or_path": verifier, **_layer_config()},
                  {**base, **{f"medusa_heads.{k}": v for k, v in weights.items()}})


MEDUSA_LAYOUTS = {"medusa": medusa_fasterdecoding, "medusa-modelopt": medusa_modelopt}
