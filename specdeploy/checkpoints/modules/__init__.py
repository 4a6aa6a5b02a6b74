"""The trained speculative modules the runtime serves, built with torch and transformers only.

The spec stage trains with ModelOpt (`mtsp.convert` grows the module on the base); serving only
runs the small module's forward, and must not need ModelOpt: Triton's Python-backend stub on the
GPU host had no ModelOpt ("No module named 'modelopt'" at model load), and importing it costs
~10 s per load. Each kind rebuilds the module ModelOpt 0.47 builds from spec_config.json's
"modelopt_config" (the same transformers blocks, parameter names and shapes, so
spec/module.safetensors loads as it is) with the forward the runtime proposers call:

    eagle   eagle.EagleModule    (modelopt/torch/speculative/plugins/modeling_eagle.py, hf_eagle.py)
    dflash  dflash.DFlashModule  (plugins/modeling_dflash.py, hf_dflash.py)
    medusa  medusa.medusa_heads  (plugins/hf_medusa.py, utils.ResBlock)

tests/test_runtime_modules.py checks each against ModelOpt's own module on the same weights.

Contract of `build/<name>/spec/` (read by the quantize and TRT-LLM convert stages, and by the
runtime proposers):

    spec/spec_config.json
        {"kind": "medusa" | "eagle" | "dflash",
         "modelopt_config": {...},   # exactly the dict passed to mtsp.convert(model, [(kind, cfg)])
                                     # for an *online* model (base layers present; EAGLE training
                                     # may have used eagle_offline=True, this dict never does)
         "choices": [[0], [0, 0], ...],   # default medusa_choices / eagle_choices (validated)
         "base_model": "<path of the base HF folder the module was trained on>",
         "hidden_layers": [...],     # target hidden states the runtime proposer reads
                                     # (output_hidden_states indexing: 0 = embeddings)
         "draft_vocab_size": int,    # EAGLE: size of the reduced draft vocabulary (d2t in the module)
         "draft_vocab_ids": [...],   # Medusa: the frequent tokens the runtime ranks (not a weight:
                                     # the heads keep their full-vocabulary projection)
         "draft_vocab_coverage": float,  # share of training next-tokens inside that vocabulary
         "block_size": int,          # DFlash: the pending token + block_size - 1 drafts per forward
         "training": {"steps", "seconds", "tokens", "first_loss", "final_loss", "final_acc", "lr",
                      "distill": {...}, "settings": {...}},
         "imported": {"layout", "source", "files", "verifier", "gate"},   # instead of "training" for a
                                     # module made elsewhere (specdeploy.modules)
         "format_version": 1}
        EAGLE-3's eagle_architecture_config names its first layer's norms: "hidden_norm_input"
        "fc" (the engines' layer: what the spec stage trains) or "input_layernorm" (ModelOpt's HF
        module; absent means this, in modules trained before), and "norm_before_residual"
        (speculator.eagle.run_first_layer_as_engines).
    spec/module.safetensors
        only the trained module's tensors, keys exactly as in the converted model's state_dict():
        medusa_heads.{h}.{l}.linear.{weight,bias}, medusa_heads.{h}.{num_layers}.weight  (Medusa)
        eagle_module.*  (EAGLE-3 layer, fc, norms, lm_head over the draft vocab, d2t buffer)
        dflash_module.*  (DFlash layers, fc, norms; drafts through the base's embeddings and lm_head)
        Stored in float32 (the base dtype is chosen when loading).
    spec/eagle3_export/      (EAGLE only) ModelOpt's export_speculative_decoding output
                             (config.json + model.safetensors of a LlamaForCausalLMEagle3 draft)
    spec/dflash_export/      (DFlash only) the same export of the DFlash draft (config.json with
                             dflash_config, model.safetensors): what TensorRT-LLM and vLLM load
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdeploy.errors import SpecDeployError

SPEC_CONFIG = "spec_config.json"
MODULE_FILE = "module.safetensors"
EAGLE_EXPORT = "eagle3_export"
DFLASH_EXPORT = "dflash_export"
MODULE_PREFIXES = {"medusa": "medusa_heads.", "eagle": "eagle_module.", "dflash": "dflash_module."}

__all__ = ["base_rope_theta", "build_module", "load_module", "load_weights", "read_spec_config", "text_config", "SPEC_CONFIG", "MODULE_FILE",
           "MODULE_PREFIXES", "EAGLE_EXPORT", "DFLASH_EXPORT"]


def read_spec_config(spec_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(spec_dir) / SPEC_CONFIG
    if not path.is_file():
        raise SpecDeployError(f"{path} not found", hint="run `specdeploy spec train` (or `make engine`) first")
    config = json.loads(path.read_text())
    if config.get("kind") not in MODULE_PREFIXES:
        raise SpecDeployError(f"{path}: unknown kind {config.get('kind')!r}", hint=f"expected one of {', '.join(MODULE_PREFIXES)}")
    return config



def base_rope_theta(config: Any) -> float:
    """The base's RoPE theta: transformers 5 keeps it in rope_parameters, 4.x as an attribute."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def text_config(config: Any) -> Any:
    """The language model's config of a base (a VLM's text part), as ModelOpt's _base_llm_config."""
    return getattr(config, "text_config", None) or getattr(config, "llm_config", None) or config


def build_module(kind: str, base_config: Any, modelopt_config: dict[str, Any]) -> nn.Module:
    """A fresh module of `kind` for this base (float32, on the CPU, initialized from torch's
    global generator), refused with the reason where the runtime cannot run what the config asks."""
    if kind == "eagle":
        from specdeploy.checkpoints.modules.eagle import EagleModule, eagle_config

        return EagleModule(eagle_config(base_config, modelopt_config))
    if kind == "dflash":
        from specdeploy.checkpoints.modules.dflash import DFlashModule, dflash_config

        return DFlashModule(dflash_config(base_config, modelopt_config))
    if kind == "medusa":
        from specdeploy.checkpoints.modules.medusa import medusa_heads

        heads, layers = modelopt_config.get("medusa_num_heads", 0), modelopt_config.get("medusa_num_layers", 0)
        if heads < 1:
            raise SpecDeployError(f"a Medusa module with {heads} heads drafts nothing", hint="set medusa_num_heads >= 1")
        text = text_config(base_config)
        return medusa_heads(heads, layers, text.hidden_size, text.vocab_size)
    raise SpecDeployError(f"unknown module kind {kind!r}", hint="expected one of eagle, dflash, medusa")


def load_module(
    kind: str, base_config: Any, modelopt_config: dict[str, Any], spec_dir: str | os.PathLike | None = None,
    *, dtype: torch.dtype | None = None, device: Any = None, seed: int = 0,
) -> nn.Module:
    """The module with spec_dir's trained weights (module.safetensors), or freshly initialized from
    `seed` on the CPU (the same module on every device; torch's global generator is left as it
    was), then moved to `device` in `dtype`. In eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build_module(kind, base_config, modelopt_config)
    if spec_dir is not None:
        load_weights(module, kind, spec_dir)
    return module.to(device=device, dtype=dtype).eval()


def load_weights(module: nn.Module, kind: str, spec_dir: str | os.PathLike) -> None:
    """spec_dir's module.safetensors into `module`: its keys must be exactly the module's own under
    the kind's prefix (MODULE_PREFIXES, as the spec stage writes them)."""
    from safetensors.torch import load_file

    path = Path(spec_dir) / MODULE_FILE
    prefix = MODULE_PREFIXES[kind]
    weights = load_file(str(path))
    expected = {prefix + key for key in module.state_dict()}
    if set(weights) != expected:
        raise SpecDeployError(
            f"{path} does not match the module spec_config.json describes "
            f"(missing {sorted(expected - set(weights))[:3]}, unexpected {sorted(set(weights) - expected)[:3]})",
            hint="retrain the spec stage: the module was saved for another configuration",
        )
    try:
        module.load_state_dict({key.removeprefix(prefix): value for key, value in weights.items()})
    except RuntimeError as err:  # a tensor of another shape
        raise SpecDeployError(f"{path} does not match the module spec_config.json describes: {err}",
                              hint="retrain the spec stage: the module was saved for another configuration") from err
