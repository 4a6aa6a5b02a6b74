"""EAGLE-3 as ModelOpt, SpecForge and AngelSlim export it: a LlamaForCausalLMEagle3 config with
draft_vocab_size and an eagle_config holding eagle_aux_hidden_state_layer_ids (0-based decoder
layers whose outputs fc reads), the layer as `layers.0.*` (ModelOpt's export_speculative_decoding,
NVIDIA/Model-Optimizer 0.47 modelopt/torch/export/plugins/hf_spec_export.py EagleExporter) or
`midlayer.*` (SpecForge a6b6b02 specforge/modeling/draft/llama3_eagle.py LlamaForCausalLMEagle3;
TensorRT-LLM's Eagle3DraftModel, and the eagle3_draft folder convert writes), beside fc, norm,
lm_head, d2t and t2d as the authors name them.

Missing or empty layer ids are derived by the reader (TensorRT-LLM: {1, n//2-1, n-4}; SGLang adds 1
to the ids it reads and derives [2, n//2, n-3] inputs, the same layers). The engines run the first
layer with hidden_norm on the fc output, whatever trained it; a folder specdeploy exported from a
module ModelOpt trained says so with "hidden_norm_input": "input_layernorm" (speculator.eagle).
"""

from __future__ import annotations

from specdeploy.modules.eagle3 import eagle_module
from specdeploy.modules.files import Folder
from specdeploy.modules.module import Module

NAME = "eagle3-modelopt"


def matches(folder: Folder) -> bool:
    return "LlamaForCausalLMEagle3" in (folder.config.get("architectures") or [])


def read(folder: Folder) -> Module:
    layers = (folder.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or None
    prefix = "midlayer." if folder.keys_under("midlayer.") else "layers.0."
    return eagle_module(folder, NAME, prefix=prefix, layers=None if layers is None else [int(i) for i in layers])
