"""DFlash as z-lab publishes it (z-lab/dflash 44947fb dflash/model.py DFlashDraftModel): a Qwen3
config with architectures ["DFlashDraftModel"], block_size (top level; inside dflash_config in
newer ones), dflash_config {mask_token_id, target_layer_ids}, num_target_layers, and

    layers.{i}.self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.*, input_layernorm,
    post_attention_layernorm; fc.weight (H x len(target_layer_ids) H), hidden_norm.weight, norm.weight

drafting through the target's embeddings and lm_head. target_layer_ids are 0-based decoder layers
(z-lab reads hidden_states[id + 1]); missing, z-lab derives them from num_target_layers
(build_target_layer_ids: the middle layer for one draft layer, else evenly from 1 to n-3).
ModelOpt's DFlash export writes the same layout (hf_spec_export.py DFlashExporter), and so do
spec/dflash_export and the dflash_draft folder convert writes for TensorRT-LLM 1.3+.
"""

from __future__ import annotations

from specdeploy.errors import SpecDeployError
from specdeploy.modules.files import Folder
from specdeploy.modules.module import Module, decoder_arch, refuse_flags, refuse_unknown, rope_of, without_target_tensors

NAME = "dflash"
KIND = "dflash"
TENSORS = r"(fc|hidden_norm|norm)\.weight|layers\.\d+\.[\w.]+\.weight"


def matches(folder: Folder) -> bool:
    return "dflash_config" in folder.config or "DFlashDraftModel" in (folder.config.get("architectures") or [])


def default_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's build_target_layer_ids."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# dflash_config fields that change what the draft computes (ModelOpt 0.47's exporter writes `causal`;
# SGLang 0.5.23's parse_dflash_draft_config reads the others), with the value the runtime implements
PLAIN_DFLASH = {"causal": False, "output_multiplier": 1.0, "final_logit_softcapping": None, "attention_value_scale": None,
                "projector_type": "dflash"}


def refuse_variants(dflash: dict) -> None:
    """A variant the runtime's DFlash does not compute (bidirectional blocks, plain logits) is refused,
    not imported as the plain one."""
    refuse_flags(dflash, ("use_swa",), "z-lab DFlash")
    unsupported = [f"{name}={dflash[name]!r}" for name, plain in PLAIN_DFLASH.items()
                   if dflash.get(name) not in (None, plain) and not (plain is None and not dflash.get(name))]
    if unsupported:
        raise SpecDeployError(f"the DFlash module sets {', '.join(unsupported)}: a variant the runtime's DFlash does not "
                              "compute (bidirectional blocks, plain logits)", hint="import a module without it")


def read(folder: Folder) -> Module:
    config = folder.config
    dflash = config.get("dflash_config") or {}
    refuse_variants(dflash)
    if any(t != "full_attention" for t in config.get("layer_types") or []):
        raise SpecDeployError("the DFlash module has sliding-window layers: the runtime's DFlash attends to the whole context",
                              hint="import a module with full attention")
    hidden = int(config["hidden_size"])
    tensors = without_target_tensors(folder.tensors)
    refuse_unknown(tensors, TENSORS, "z-lab DFlash")
    theta, scaling = rope_of(config)
    layers = dflash.get("target_layer_ids")
    return Module(kind=KIND, layout=NAME, tensors=tensors, hidden_size=hidden, vocab_size=config.get("vocab_size"),
                  layers=None if layers is None else [int(i) for i in layers], arch=decoder_arch(config, hidden),
                  rope_theta=theta, rope_scaling=scaling, block_size=config.get("block_size") or dflash.get("block_size"),
                  mask_token_id=dflash.get("mask_token_id"), num_target_layers=config.get("num_target_layers"))
