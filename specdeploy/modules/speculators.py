"""vLLM's speculators format (vllm-project/speculators 0.9.0, the PyPI wheel: models/eagle3/config.py
Eagle3SpeculatorConfig, models/dflash/config.py DFlashSpeculatorConfig, config.py SpeculatorsConfig):
config.json with speculators_model_type, speculators_config {algorithm, proposal_methods,
default_proposal_method, verifier {name_or_path, architectures}} and transformer_layer_config (the
draft decoder's HF config); the weights in the module's own names:

    eagle3: layers.0.* (q/k/v read 2H), fc.weight, norm.weight, lm_head.weight (draft vocab), d2t
            (draft -> target offsets) and t2d (a bool mask over the target vocabulary, draft_vocab_size
            of them set); draft_vocab_size, norm_before_residual, eagle_aux_hidden_state_layer_ids
    dflash: layers.*, fc.weight, hidden_norm.weight, norm.weight (+ lm_head, d2t, t2d only for a reduced
            vocabulary); block_size, mask_token_id, aux_hidden_state_layer_ids

Layer ids count the input of a layer (our id + 1, module.py). Both mappings are written: speculators
loads d2t and t2d together or neither, and its EAGLE-3 converter keeps a d2t only when the source
has a t2d (convert/eagle/eagle3_converter.py reduce_vocab_size), so a folder without t2d loses its
vocabulary map there while keeping draft_vocab_size ("Unexpected keys in checkpoint: ['d2t']"), and
vLLM then reads every drafted id as the wrong token. norm_before_residual is written explicitly:
vLLM reads a missing one as True (vllm/transformers_utils/configs/speculators/algos.py
update_eagle3), the speculators library as False; a missing one is read here as vLLM serves it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.modules.files import Folder
from specdeploy.modules.module import (Module, decoder_arch, refuse_flags, refuse_unknown, rope_of,
                                       without_target_tensors)

NAME = "speculators"
VERSION = "0.9.0"  # the speculators release whose format is written (speculators_version)
EAGLE_TENSORS = r"(fc|norm|lm_head)\.weight|d2t|t2d|layers\.\d+\.[\w.]+\.weight"
DFLASH_TENSORS = r"(fc|hidden_norm|norm)\.weight|layers\.\d+\.[\w.]+\.weight"
ARCHITECTURES = {"eagle": "Eagle3Speculator", "dflash": "DFlashSpeculator"}
TYPES = {"eagle3": "eagle", "dflash": "dflash"}


def matches(folder: Folder) -> bool:
    return "speculators_model_type" in folder.config


def read(folder: Folder) -> Module:
    config = folder.config
    kind = TYPES.get(config["speculators_model_type"])
    if kind is None:
        raise SpecDeployError(f"a speculators {config['speculators_model_type']!r} module is not imported",
                              hint=f"speculators types imported: {', '.join(TYPES)}")
    layer = config.get("transformer_layer_config") or {}
    hidden = int(layer["hidden_size"])
    if config.get("target_hidden_size") not in (None, hidden):
        raise SpecDeployError(f"the module reads a target of hidden size {config['target_hidden_size']} (its own: {hidden})",
                              hint="only modules as wide as their base are imported")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {})
    theta, scaling = rope_of(layer)
    common = dict(layout=NAME, hidden_size=hidden, vocab_size=layer.get("vocab_size"), arch=decoder_arch(layer, hidden),
                  rope_theta=theta, rope_scaling=scaling, verifier=verifier.get("name_or_path"),
                  verifier_architectures=list(verifier.get("architectures") or []))
    return _eagle(config, layer, common, folder) if kind == "eagle" else _dflash(config, layer, common, folder)


def _layers(ids: list[int] | None) -> list[int] | None:
    return None if ids is None else [int(i) - 1 for i in ids]


def _eagle(config: dict[str, Any], layer: dict[str, Any], common: dict[str, Any], folder: Folder) -> Module:
    if layer.get("model_type", "llama") != "llama":
        raise SpecDeployError(f"the module's draft layer is {layer['model_type']!r}: the runtime's EAGLE-3 layer is Llama's",
                              hint="only Llama-style EAGLE-3 layers are imported")
    refuse_flags(config, ("norm_before_fc", "fc_norm", "norm_output"), "speculators EAGLE-3")
    tensors = without_target_tensors(folder.tensors)
    refuse_unknown(tensors, EAGLE_TENSORS, "speculators EAGLE-3")
    return Module(kind="eagle", tensors=tensors, layers=_layers(config.get("eagle_aux_hidden_state_layer_ids")),
                  draft_vocab_size=config.get("draft_vocab_size"), norm_before_residual=bool(config.get("norm_before_residual", True)),
                  hidden_norm_input=config.get("hidden_norm_input", "fc"), **common)


def _dflash(config: dict[str, Any], layer: dict[str, Any], common: dict[str, Any], folder: Folder) -> Module:
    refuse_flags(config, ("sample_from_anchor", "sliding_window_non_causal"), "speculators DFlash")
    refuse_flags(layer, ("use_sliding_window",), "speculators DFlash")
    draft = config.get("draft_vocab_size")
    if draft not in (None, layer.get("vocab_size")):
        raise SpecDeployError(f"the DFlash module drafts over a reduced vocabulary ({draft} of {layer.get('vocab_size')})",
                              hint="the runtime's DFlash drafts through the target's own head: a full-vocabulary module only")
    tensors = {k: v for k, v in without_target_tensors(folder.tensors).items() if k not in ("lm_head.weight", "d2t", "t2d")}
    refuse_unknown(tensors, DFLASH_TENSORS, "speculators DFlash")
    return Module(kind="dflash", tensors=tensors, layers=_layers(config.get("aux_hidden_state_layer_ids")),
                  block_size=config.get("block_size"), mask_token_id=config.get("mask_token_id"), **common)


# ---------------------------------------------------------------------------------- writing


def write(module: Module, out: Path, *, verifier: str, verifier_architectures: list[str], max_positions: int,
          dtype: str) -> Path:
    """out/config.json + out/model.safetensors in the speculators layout of an EAGLE-3 or DFlash
    `module` (normalised: layers and vocabulary map resolved against its base, spec.normalise)."""
    import torch

    from specdeploy.fileio import atomic_write_json
    from specdeploy.speculator.common import save_tensors

    tensors = dict(module.tensors)
    if module.kind == "eagle":
        tensors.update(_vocab_map(module))
    cast = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(out / "model.safetensors", cast, metadata={"format": "pt"})
    atomic_write_json(out / "config.json", _config(module, verifier, verifier_architectures, max_positions, dtype))
    return out


def _vocab_map(module: Module) -> dict[str, Any]:
    import torch

    d2t = module.tensors.get("d2t")
    if d2t is None:
        return {}
    t2d = torch.zeros(module.vocab_size, dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t] = True
    return {"d2t": d2t, "t2d": t2d}


def _config(module: Module, verifier: str, verifier_architectures: list[str], max_positions: int, dtype: str) -> dict:
    arch = module.arch
    layer = {"model_type": "llama" if module.kind == "eagle" else "qwen3", "vocab_size": module.vocab_size,
             "hidden_size": module.hidden_size, "max_position_embeddings": max_positions, "hidden_act": "silu",
             "attention_bias": False, "tie_word_embeddings": False, "dtype": dtype, **arch,
             "rope_parameters": {"rope_type": "default", "rope_theta": module.rope_theta, **(module.rope_scaling or {})}}
    ids = [i + 1 for i in module.layers]
    # the default proposal's length (vLLM's --speculative-config num_speculative_tokens decides when serving):
    # DFlash's block, EAGLE-3's chain of 3 as speculators' own converter writes it
    tokens = module.block_size - 1 if module.kind == "dflash" else 3
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[module.kind]], "speculators_model_type": "eagle3" if module.kind == "eagle" else "dflash",
        "speculators_version": VERSION, "transformer_layer_config": layer, "dtype": dtype,
        "speculators_config": {"algorithm": "eagle3" if module.kind == "eagle" else "dflash",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
                               "default_proposal_method": "greedy",
                               "verifier": {"name_or_path": verifier, "architectures": verifier_architectures}},
    }
    if module.kind == "eagle":
        config.update(draft_vocab_size=module.draft_vocab_size, norm_before_residual=module.norm_before_residual,
                      eagle_aux_hidden_state_layer_ids=ids, target_hidden_size=None, norm_before_fc=False, fc_norm=False,
                      norm_output=False)
        if module.hidden_norm_input != "fc":  # a module ModelOpt trained: engines ignore it, our import reads it back
            config["hidden_norm_input"] = module.hidden_norm_input
    else:
        config.update(draft_vocab_size=module.vocab_size, block_size=module.block_size, mask_token_id=module.mask_token_id,
                      aux_hidden_state_layer_ids=ids)
    return config
