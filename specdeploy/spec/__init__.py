"""Stage `spec`: a Medusa, EAGLE or DFlash module trained with ModelOpt on the base model's own outputs.

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
        (spec.eagle.run_first_layer_as_engines).
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

Producers: the stage function `specdeploy.spec.commands.run(build, spec, preset="quick", device="auto",
**overrides)` (what `make engine` calls) and `specdeploy spec train` (also under torchrun: see
spec.parallel); for a module made elsewhere, `specdeploy.modules.stage.run` (`make engine MODULE=...`,
`specdeploy spec import`). Consumers: `load_spec_model` below, and
the runtime proposers (`build_proposer("medusa"|"eagle", target, spec_dir=...)`), which take the
module from `load_module_model` without loading a second copy of the base.

`load_spec_model(base_model, spec_dir)` rebuilds the mtsp-converted model with the module
weights loaded. No pickle anywhere in the deliverable: resumable training checkpoints under the
build's `.spec.ckpt/` are safetensors too (module + optimizer state + a JSON step counter).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError

SPEC_CONFIG = "spec_config.json"
MODULE_FILE = "module.safetensors"
EAGLE_EXPORT = "eagle3_export"
DFLASH_EXPORT = "dflash_export"
MODULE_PREFIXES = {"medusa": "medusa_heads.", "eagle": "eagle_module.", "dflash": "dflash_module."}

__all__ = ["load_spec_model", "load_module_model", "load_module_weights", "read_spec_config", "module_state_dict",
           "convert_model", "SPEC_CONFIG", "MODULE_FILE"]


def read_spec_config(spec_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(spec_dir) / SPEC_CONFIG
    if not path.is_file():
        raise SpecDeployError(f"{path} not found", hint="run `specdeploy spec train` (or `make engine`) first")
    config = json.loads(path.read_text())
    if config.get("kind") not in MODULE_PREFIXES:
        raise SpecDeployError(f"{path}: unknown kind {config.get('kind')!r}", hint=f"expected one of {', '.join(MODULE_PREFIXES)}")
    return config


def convert_model(model: Any, kind: str, modelopt_config: dict[str, Any]) -> Any:
    """mtsp.convert in place (imports ModelOpt lazily: ~10 s); an EAGLE-3 first layer computes the
    norms its config names (spec.eagle.run_first_layer_as_engines)."""
    import copy

    import modelopt.torch.speculative as mtsp

    mtsp.convert(model, [(kind, copy.deepcopy(modelopt_config))])
    if kind == "eagle" and (modelopt_config.get("eagle_architecture_config") or {}).get("use_aux_hidden_state"):
        from specdeploy.spec.eagle import run_first_layer_as_engines

        run_first_layer_as_engines(model.eagle_module)
    return model


def module_state_dict(model: Any, kind: str) -> dict[str, Any]:
    """The trained module's tensors only, keys as in the converted model's state_dict()."""
    prefix = MODULE_PREFIXES[kind]
    return {k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous()
            for k, v in model.state_dict().items() if k.startswith(prefix)}


def load_module_model(
    base_config: Any, kind: str, modelopt_config: dict[str, Any], spec_dir: str | os.PathLike | None = None,
    *, dtype: Any = None, seed: int = 0, device: Any = None,
) -> Any:
    """A converted *skeleton* (the base config with one decoder layer, random base weights) that
    carries the module: what the runtime proposers take the module from without a second copy of
    the base. Trained weights come from spec_dir; without one the module is freshly initialized
    (on the CPU, from `seed`: the same module on every device). `device`: where it goes then."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(base_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    torch.manual_seed(seed)
    skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    convert_model(skeleton, kind, modelopt_config)
    if spec_dir is not None:
        load_module_weights(skeleton, kind, spec_dir)
    skeleton.to(device=device, dtype=dtype)
    return skeleton.eval()


def load_module_weights(model: Any, kind: str, spec_dir: str | os.PathLike) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(Path(spec_dir) / MODULE_FILE))
    expected = set(module_state_dict(model, kind))
    if set(weights) != expected:
        raise SpecDeployError(
            f"{Path(spec_dir) / MODULE_FILE} does not match the module spec_config.json describes "
            f"(missing {sorted(expected - set(weights))[:3]}, unexpected {sorted(set(weights) - expected)[:3]})",
            hint="retrain the spec stage: the module was saved for another configuration",
        )
    target_dtype = next(model.parameters()).dtype
    weights = {k: v.to(target_dtype) if v.is_floating_point() else v for k, v in weights.items()}
    model.load_state_dict(weights, strict=False)


def load_spec_model(base_model: Any, spec_dir: str | os.PathLike, dtype: str = "float32", *, device: Any = "auto",
                    trust_remote_code: bool = False) -> Any:
    """The mtsp-converted base model with the trained module loaded (eval mode).

    base_model: an HF folder path (loaded in `dtype` on `device`), or an already loaded
    (unconverted) PreTrainedModel, converted where it is.
    """
    config = read_spec_config(spec_dir)
    if isinstance(base_model, (str, os.PathLike)):
        from specdeploy.spec.common import load_base

        base_model = load_base(base_model, dtype, device=device, trust_remote_code=trust_remote_code)
    model = convert_model(base_model, config["kind"], config["modelopt_config"])
    load_module_weights(model, config["kind"], spec_dir)
    return model.eval()
