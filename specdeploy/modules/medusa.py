"""Medusa heads as FasterDecoding/Medusa (e2a5d20 medusa/model/medusa_model.py, train_legacy.py) and
ModelOpt (0.47 modelopt/torch/speculative/plugins/hf_medusa.py) save them. Head h is
nn.Sequential(ResBlock x L, Linear(H, vocab, bias=False)), ResBlock(x) = x + SiLU(linear(x)), on the
base's last (normed) hidden state:

    FasterDecoding: medusa_lm_head.safetensors (or .pt) with {h}.{l}.linear.{weight,bias} and
                    {h}.{L}.weight, beside a config.json with medusa_num_heads, medusa_num_layers,
                    base_model_name_or_path (its own loader notes uploaded configs whose head count
                    is wrong: the tensors decide here)
    ModelOpt:       the converted model's weights, the heads under medusa_heads.{h}.…, often beside
                    the base's own tensors (ignored)
"""

from __future__ import annotations

import re

from specdeploy.errors import SpecDeployError
from specdeploy.modules.files import Folder
from specdeploy.modules.module import Module

NAME = "medusa"
KIND = "medusa"
HEAD = re.compile(r"(medusa_heads\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


def matches(folder: Folder) -> bool:
    return "medusa_num_heads" in folder.config or bool(folder.keys_under("medusa_heads."))


def read(folder: Folder) -> Module:
    modelopt = bool(folder.keys_under("medusa_heads."))
    tensors = {}
    for key, value in folder.tensors.items():
        found = HEAD.fullmatch(key)
        if found and bool(found.group(1)) == modelopt:
            tensors[key.removeprefix("medusa_heads.")] = value
        elif not modelopt:
            raise SpecDeployError(f"{folder.path}: {key!r} is not a Medusa head tensor",
                                  hint="import the heads' own file (medusa_lm_head.safetensors)")
    if not tensors:
        raise SpecDeployError(f"{folder.path} holds no Medusa head tensors", hint="expected {head}.{block}.linear.weight")
    module = Module(kind=KIND, layout=NAME, tensors=tensors, hidden_size=0,
                    verifier=folder.config.get("base_model_name_or_path"))
    heads, blocks = module.medusa_shape
    head = tensors[f"0.{blocks}.weight"]
    module.vocab_size, module.hidden_size = int(head.shape[0]), int(head.shape[1])
    module.arch = {"medusa_num_heads": heads, "medusa_num_layers": blocks}
    return module
