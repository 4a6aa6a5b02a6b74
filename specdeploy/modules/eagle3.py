"""EAGLE-3 as its authors publish it (SafeAILab/EAGLE cb7e084: eagle/model/cnets.py `Model`,
eagle/traineagle3/config.json): a LlamaForCausalLM config with draft_vocab_size, and

    midlayer.{self_attn.{q,k,v}_proj (2H in), self_attn.o_proj, mlp.*, input_layernorm, hidden_norm,
              post_attention_layernorm}.weight
    fc.weight (H x 3H), norm.weight, lm_head.weight (draft vocab x H),
    d2t (draft -> target offsets: target = draft + d2t[draft]), t2d (bool over the target vocabulary)

No captured layers are recorded: the authors' base models capture the input of layers
{2, n//2, n-3} (eagle/model/modeling_llama_kv.py), i.e. the outputs of {1, n//2-1, n-4}, the
default every engine derives. The first layer's hidden_norm reads the fc output (LlamaDecoderLayeremb).
"""

from __future__ import annotations

from specdeploy.errors import SpecDeployError
from specdeploy.modules.files import Folder
from specdeploy.modules.module import (Module, decoder_arch, later_layer_norms, refuse_unknown, renamed, rope_of,
                                       without_target_tensors)

NAME = "eagle3"
KIND = "eagle"
TENSORS = r"(fc|norm|lm_head)\.weight|d2t|t2d|layers\.\d+\.[\w.]+\.weight"


def matches(folder: Folder) -> bool:
    architectures = folder.config.get("architectures") or []
    return bool(folder.keys_under("midlayer.")) and "draft_vocab_size" in folder.config and \
        "LlamaForCausalLMEagle3" not in architectures


def read(folder: Folder) -> Module:
    config = folder.config
    hidden = int(config["hidden_size"])
    if config.get("target_hidden_size", hidden) != hidden:
        raise SpecDeployError(f"the module reads a target of hidden size {config['target_hidden_size']} through its own "
                              f"embeddings ({hidden} wide)", hint="only modules as wide as their base are imported")
    return eagle_module(folder, NAME, prefix="midlayer.", layers=None)


def eagle_module(folder: Folder, layout: str, *, prefix: str, layers: list[int] | None) -> Module:
    """An EAGLE-3 module from an HF-style config (the authors' and ModelOpt's layouts share it)."""
    config = folder.config
    hidden = int(config["hidden_size"])
    tensors = later_layer_norms(without_target_tensors(renamed(folder.tensors, prefix, "layers.0.")), "hidden_norm", "input_layernorm")
    refuse_unknown(tensors, TENSORS, layout)
    theta, scaling = rope_of(config)
    return Module(kind=KIND, layout=layout, tensors=tensors, hidden_size=hidden, vocab_size=config.get("vocab_size"),
                  layers=layers, arch=decoder_arch(config, hidden), rope_theta=theta, rope_scaling=scaling,
                  draft_vocab_size=config.get("draft_vocab_size"),
                  hidden_norm_input=config.get("hidden_norm_input", "fc"),
                  norm_before_residual=bool(config.get("norm_before_residual", False)))
