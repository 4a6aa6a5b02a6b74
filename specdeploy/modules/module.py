"""One speculative module, whatever layout it came in: the facts every layout records in its own
names, and its tensors in ModelOpt's names (the spec/ contract's module.safetensors without the
kind's prefix: specdeploy/speculator/__init__.py).

Layer numbering: `layers` are the base's decoder layers whose outputs the module reads, 0-based
(ModelOpt's eagle_aux_hidden_state_layer_ids and TensorRT-LLM's eagle3_layers_to_capture, z-lab's
target_layer_ids). vLLM and speculators count the input of layer i instead (i = our id + 1: vLLM's
LlamaModel appends `hidden_states + residual` before running layer i; SGLang adds 1 to the ids it
reads for the same reason); each layout converts at its border.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from specdeploy.errors import SpecDeployError

KINDS = ("eagle", "dflash", "medusa")
# the draft decoder's shape, as an HF config names it
ARCH_KEYS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
             "rms_norm_eps")
# tensors of the target a layout may carry beside the module (engines take the target's own)
TARGET_TENSORS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


@dataclass
class Module:
    kind: str  # eagle (EAGLE-3) | dflash | medusa
    layout: str  # the layout it was read from (modules.LAYOUTS)
    tensors: dict[str, Any]  # ModelOpt's names without the kind's prefix (d2t / t2d as the layout has them)
    hidden_size: int
    vocab_size: int | None = None  # the target vocabulary the module was made for (None: unstated)
    layers: list[int] | None = None  # captured base layers, 0-based (above); None: the engines' default
    arch: dict[str, Any] = field(default_factory=dict)  # ARCH_KEYS of the draft decoder
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None  # None: plain RoPE
    draft_vocab_size: int | None = None  # EAGLE-3: None = the target's
    hidden_norm_input: str = "fc"  # EAGLE-3 first layer (checkpoints.modules.eagle.HIDDEN_NORM_INPUTS)
    norm_before_residual: bool = False  # EAGLE-3 first layer: the residual is the normed hidden state
    block_size: int | None = None  # DFlash
    mask_token_id: int | None = None  # DFlash
    verifier: str | None = None  # the base the layout says the module was made for
    verifier_architectures: list[str] = field(default_factory=list)
    num_target_layers: int | None = None  # the base depth the layout records (DFlash's default layers)

    @property
    def medusa_shape(self) -> tuple[int, int]:
        """(heads, ResBlocks per head) of Medusa tensors named `{head}.{block}.…`."""
        blocks = {tuple(int(x) for x in k.split(".")[:2]) for k in self.tensors}
        heads = 1 + max(h for h, _ in blocks)
        return heads, max(b for _, b in blocks)


def rope_of(config: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """RoPE from either place a config keeps it: rope_theta + rope_scaling (transformers 4.x, the
    engines' configs) or rope_parameters (5.x); scaling None when plain."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or params)
    theta = config.get("rope_theta", scaling.get("rope_theta", params.get("rope_theta")))
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling.pop("rope_theta", None)
    return (None if theta is None else float(theta)), (None if kind == "default" else {"rope_type": kind, **scaling})


def decoder_arch(config: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """The draft decoder's shape from an HF-style config (head_dim derived where it is not stated)."""
    heads = int(config["num_attention_heads"])
    arch = {
        "num_hidden_layers": int(config.get("num_hidden_layers", 1)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or hidden_size // heads),
        "intermediate_size": int(config["intermediate_size"]),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
    }
    act = config.get("hidden_act", "silu")
    if act != "silu" or config.get("attention_bias") or config.get("mlp_bias"):
        raise SpecDeployError(f"the module's decoder uses hidden_act {act!r}, attention_bias {config.get('attention_bias')}, "
                              f"mlp_bias {config.get('mlp_bias')}: the runtime's draft layers are SiLU without biases",
                              hint="only Llama-style draft layers are imported")
    return arch


def renamed(tensors: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    return {(new + k[len(old):]) if k.startswith(old) else k: v for k, v in tensors.items()}


def later_layer_norms(tensors: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """The pre-attention norm of EAGLE-3 layers after the first, renamed: ModelOpt's (and ours)
    `layers.{i}.input_layernorm`, SGLang 0.5.23's `layers.{i}.hidden_norm` (llama_eagle3.py: a layer
    i > 0 normalises with hidden_norm and leaves input_layernorm unused: a checkpoint SGLang saved
    may hold that unused one too, dropped). Layer 0 keeps both names."""
    pattern = re.compile(rf"^layers\.([1-9]\d*)\.{re.escape(old)}\.weight$")
    layers = {match.group(1) for key in tensors if (match := pattern.match(key))}
    replaced = {f"layers.{i}.{new}.weight" for i in layers}

    def name(key: str) -> str:
        match = pattern.match(key)
        return f"layers.{match.group(1)}.{new}.weight" if match else key

    return {name(k): v for k, v in tensors.items() if k not in replaced}


def without_target_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """The module's own tensors: a copy of the target's embeddings or head is the target's to give."""
    return {k: v for k, v in tensors.items() if k not in TARGET_TENSORS}


def refuse_unknown(tensors: dict[str, Any], allowed: str, layout: str) -> None:
    """Tensors outside `allowed` (a regex) belong to a variant of the layout the runtime does not run."""
    unknown = sorted(k for k in tensors if not re.fullmatch(allowed, k))
    if unknown:
        raise SpecDeployError(f"the {layout} module carries tensors this import does not know: {unknown[:5]}",
                              hint="that variant (e.g. fc_norm, norm_before_fc, fused qkv, biases) is not imported")


def refuse_flags(config: dict[str, Any], names: tuple[str, ...], layout: str) -> None:
    on = [name for name in names if config.get(name)]
    if on:
        raise SpecDeployError(f"the {layout} module sets {', '.join(on)}: a variant the runtime does not run",
                              hint="import a module without it")
