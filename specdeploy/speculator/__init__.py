"""Stage `spec` (this package: the speculator, i.e. the draft module): a Medusa, EAGLE-3 or DFlash
module trained with ModelOpt on the base model's own outputs, written to build/<name>/spec/.

The folder's contract (spec_config.json, module.safetensors, the exports) and its reader live
with the module definitions the runtime serves: specdeploy.checkpoints.modules. Producers: the
stage function `specdeploy.speculator.commands.run(build, spec, preset="quick", device="auto",
**overrides)` (what `make engine` calls) and `specdeploy spec train` (also under torchrun: see
speculator.parallel); for a module made elsewhere, `specdeploy.modules.stage.run` (`make engine
MODULE=...`, `specdeploy spec import`). `load_spec_model(base_model, spec_dir)` below rebuilds the
mtsp-converted model (ModelOpt) with the module weights loaded, for training-side code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from specdeploy.checkpoints.modules import MODULE_FILE, MODULE_PREFIXES, SPEC_CONFIG, read_spec_config
from specdeploy.errors import SpecDeployError

__all__ = ["load_spec_model", "load_module_model", "load_module_weights", "read_spec_config", "module_state_dict",
           "convert_model", "SPEC_CONFIG", "MODULE_FILE"]


def convert_model(model: Any, kind: str, modelopt_config: dict[str, Any]) -> Any:
    """mtsp.convert in place (imports ModelOpt lazily: ~10 s); an EAGLE-3 first layer computes the
    norms its config names (speculator.eagle.run_first_layer_as_engines)."""
    import copy

    import modelopt.torch.speculative as mtsp

    mtsp.convert(model, [(kind, copy.deepcopy(modelopt_config))])
    if kind == "eagle" and (modelopt_config.get("eagle_architecture_config") or {}).get("use_aux_hidden_state"):
        from specdeploy.speculator.eagle import run_first_layer_as_engines

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
    """A ModelOpt-converted *skeleton* (the base config with one decoder layer, random base weights)
    that carries the module, without a second copy of the base (the runtime builds its module
    without ModelOpt: specdeploy.checkpoints.modules.load_module). Trained weights come from spec_dir;
    without one the module is freshly initialized (on the CPU, from `seed`: the same module on
    every device). `device`: where it goes then."""
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
        from specdeploy.speculator.common import load_base

        base_model = load_base(base_model, dtype, device=device, trust_remote_code=trust_remote_code)
    model = convert_model(base_model, config["kind"], config["modelopt_config"])
    load_module_weights(model, config["kind"], spec_dir)
    return model.eval()
