"""A Module and the spec/ contract (specdeploy/speculator/__init__.py), both ways, and the checks that
decide whether a module may run beside a base at all: what differs is said before anything is
written, with what to pass.

Defaults are filled as the engines fill them: captured layers derived from the base's depth when a
layout leaves them out and taken in layer order (vLLM, SGLang and TensorRT-LLM capture during the
forward, so fc reads them ascending whatever order a config lists), no vocabulary map when the
draft vocabulary is the target's (an identity d2t is dropped), a d2t derived from t2d when only the
mask is there, RoPE from either place (rope_theta + rope_scaling, or rope_parameters), and an
EAGLE-3 config without rope_theta runs LlamaConfig's 10000.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.modules.dflash import default_layers as dflash_default_layers
from specdeploy.modules.module import Module, rope_of
from specdeploy.checkpoints.modules import eagle as eagle_spec

PREFIXES = {"medusa": "medusa_heads.", "eagle": "eagle_module.", "dflash": "dflash_module."}
ACCEPTABLE = ("verifier", "rope")  # differences a user may vouch for (--module-accept)
FLOATS = ("float32", "float16", "bfloat16")
LLAMA_DEFAULT_THETA = 10000.0  # LlamaConfig's: what an EAGLE-3 config without rope_theta runs with


@dataclass(frozen=True)
class Base:
    """The base a module is checked against: its config.json and the names it goes by."""

    config: dict[str, Any]
    names: frozenset[str]

    @classmethod
    def of(cls, base_dir: Path, *aliases: str) -> "Base":
        config = json.loads((Path(base_dir) / "config.json").read_text())
        names = [*aliases, config.get("_name_or_path") or "", config.get("_model_name_or_path") or ""]
        return cls(config, frozenset(filter(None, (short_name(n) for n in names))))

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def rope_theta(self) -> float:
        theta, _ = rope_of(self.config)
        return LLAMA_DEFAULT_THETA if theta is None else theta


def short_name(name: str) -> str:
    """A model's name as a hub id, a path or a folder: its last component, lower case."""
    return str(name).rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf").lower()


# ---------------------------------------------------------------------------------- defaults


def normalise(module: Module, base: Base) -> Module:
    """The optional fields filled as the engines fill them (what a layout leaves out)."""
    module = replace(module, tensors=dict(module.tensors), vocab_size=module.vocab_size or base.vocab_size)
    if module.kind == "medusa":
        return module
    if module.layers is None:  # EAGLE-3: the outputs of {1, n//2-1, n-4}, TensorRT-LLM's default eagle3_layers_to_capture
        # and ModelOpt's, the inputs {2, n//2, n-3} the EAGLE authors, vLLM and SGLang capture
        module.layers = (eagle_spec.aux_layer_ids(base.num_layers) if module.kind == "eagle" else
                         dflash_default_layers(module.num_target_layers or base.num_layers, module.arch["num_hidden_layers"]))
    # the engines capture in layer order whatever order a config lists: fc reads them ascending
    module.layers = sorted(module.layers)
    if module.rope_theta is None:
        module.rope_theta = LLAMA_DEFAULT_THETA if module.kind == "eagle" else base.rope_theta
    if module.kind == "eagle":
        module.draft_vocab_size = module.draft_vocab_size or module.vocab_size
        _resolve_vocab_map(module)
    return module


def _resolve_vocab_map(module: Module) -> None:
    """d2t from t2d where only the mask is there; an identity map dropped (ModelOpt's module has none
    when the draft vocabulary is the target's); t2d checked against d2t, then dropped."""
    import torch

    d2t, t2d = module.tensors.pop("d2t", None), module.tensors.pop("t2d", None)
    if t2d is not None:
        chosen = torch.nonzero(t2d.bool()).squeeze(1)
        named = None if d2t is None else torch.sort(torch.arange(len(d2t)) + d2t).values
        if len(chosen) != module.draft_vocab_size or (named is not None and not torch.equal(chosen, named)):
            raise SpecDeployError(f"the module's t2d marks {len(chosen)} tokens, its draft vocabulary "
                                  f"({module.draft_vocab_size}{'' if d2t is None else ', d2t'}) names others",
                                  hint="the module folder is inconsistent: re-export it from its source")
        d2t = chosen - torch.arange(len(chosen)) if d2t is None else d2t
    if d2t is not None and (module.draft_vocab_size < module.vocab_size or bool(d2t.any())):
        module.tensors["d2t"] = d2t.long()


# ---------------------------------------------------------------------------------- checks


def differences(module: Module, base: Base) -> tuple[list[str], list[tuple[str, str]]]:
    """(what cannot run, [(acceptable name, what differs)]) for a normalised module beside `base`."""
    hard: list[str] = []
    soft: list[tuple[str, str]] = []
    if module.hidden_size != base.hidden_size:
        hard.append(f"hidden size: module {module.hidden_size}, base {base.hidden_size}")
    if module.vocab_size != base.vocab_size:
        hard.append(f"vocabulary: module {module.vocab_size} tokens, base {base.vocab_size}")
    hard += _dtypes(module)
    if module.kind == "eagle":
        hard += _vocab_map(module)
    if module.kind in ("eagle", "dflash"):
        hard += _layers(module, base)
        soft += _rope(module, base)
    if module.kind == "dflash":
        hard += _dflash(module)
    soft += _verifier(module, base)
    return hard, soft


def check(module: Module, base: Base, accept: tuple[str, ...] = ()) -> None:
    """Refuse a module that does not fit the base, saying what differs and what to pass."""
    unknown = set(accept) - set(ACCEPTABLE)
    if unknown:
        raise SpecDeployError(f"--module-accept {sorted(unknown)}: nothing to accept by that name",
                              hint=f"acceptable differences: {', '.join(ACCEPTABLE)}")
    hard, soft = differences(module, base)
    soft = [(name, text) for name, text in soft if name not in accept]
    if not hard and not soft:
        return
    lines = "\n".join(f"  - {text}" for text in hard + [text for _, text in soft])
    where = f" (made for {module.verifier})" if module.verifier else ""
    hint = (f"pass the base this module was made for{where} as MODEL" if hard else
            f"if the module is meant for this base, pass --module-accept {','.join(sorted({n for n, _ in soft}))}")
    raise SpecDeployError(f"the {module.layout} module does not fit this base:\n{lines}", hint=hint)


def _dtypes(module: Module) -> list[str]:
    odd = sorted({str(v.dtype).removeprefix("torch.") for k, v in module.tensors.items()
                  if k != "d2t" and str(v.dtype).removeprefix("torch.") not in FLOATS})
    return [f"weights in {', '.join(odd)}: quantized draft modules are not deployed (drafts run unquantized)"] if odd else []


def _vocab_map(module: Module) -> list[str]:
    import torch

    draft, vocab, d2t = module.draft_vocab_size, module.vocab_size, module.tensors.get("d2t")
    if draft > vocab:
        return [f"draft vocabulary: {draft} tokens, more than the target's {vocab}"]
    if d2t is not None and draft == vocab:
        return [f"draft vocabulary: all {vocab} target tokens in another order (d2t): the runtime's module maps no ids "
                "when the draft vocabulary is the target's"]
    if d2t is None:
        return [] if draft == vocab else [
            f"draft vocabulary: draft_vocab_size {draft} < {vocab} but no d2t (and no t2d): every drafted id would be read as "
            "another token"]
    targets = torch.arange(len(d2t)) + d2t
    if len(d2t) != draft or int(targets.min()) < 0 or int(targets.max()) >= vocab or len(set(targets.tolist())) != len(d2t):
        return [f"draft vocabulary: d2t ({len(d2t)} entries) does not map {draft} draft ids onto distinct target ids below {vocab}"]
    return []


def _layers(module: Module, base: Base) -> list[str]:
    layers, n = module.layers, base.num_layers
    problems = []
    if len(set(layers)) != len(layers):
        problems.append(f"captured layers {layers} repeat a layer (derived from a {n}-layer base?)")
    outside = [i for i in layers if not 0 <= i < n]
    if outside:
        problems.append(f"captured layers {outside} are outside the base's {n} layers (0-{n - 1})")
    elif n - 1 in layers:
        problems.append(f"captured layer {n - 1} is the base's last: transformers hands it over after the final norm, the "
                        "engines before it")
    fc = module.tensors.get("fc.weight")
    if fc is not None and fc.shape[1] != len(layers) * module.hidden_size:
        problems.append(f"captured layers: fc reads {fc.shape[1] // max(module.hidden_size, 1)} hidden states, the module "
                        f"names {len(layers)} ({layers})")
    return problems


def _rope(module: Module, base: Base) -> list[tuple[str, str]]:
    found = []
    if module.rope_theta != base.rope_theta:
        found.append(("rope", f"RoPE theta: module {module.rope_theta:g}, base {base.rope_theta:g}"))
    if module.kind == "dflash" and module.rope_scaling:
        found.append(("rope", f"RoPE scaling {module.rope_scaling}: the runtime's DFlash runs the base's plain RoPE"))
    return found


def _dflash(module: Module) -> list[str]:
    problems = []
    if not module.block_size or module.block_size < 2:
        problems.append(f"block_size {module.block_size}: a DFlash block is the pending token plus at least one draft")
    if module.mask_token_id is None or not 0 <= module.mask_token_id < module.vocab_size:
        problems.append(f"mask_token_id {module.mask_token_id} is not a token of the vocabulary")
    return problems


def _verifier(module: Module, base: Base) -> list[tuple[str, str]]:
    found = []
    if module.verifier and short_name(module.verifier) not in base.names:
        found.append(("verifier", f"verifier: the module names {module.verifier!r}, the base is {sorted(base.names)}"))
    architectures = set(base.config.get("architectures") or [])
    if module.verifier_architectures and architectures and not architectures & set(module.verifier_architectures):
        found.append(("verifier", f"verifier architecture: module {module.verifier_architectures}, base {sorted(architectures)}"))
    return found


# ---------------------------------------------------------------------------------- spec/


def modelopt_config(module: Module) -> dict[str, Any]:
    """The dict mtsp.convert takes for this (normalised) module."""
    if module.kind == "medusa":
        heads, blocks = module.medusa_shape
        return {"medusa_num_heads": heads, "medusa_num_layers": blocks}
    if module.kind == "dflash":
        return {"dflash_block_size": int(module.block_size), "dflash_mask_token_id": int(module.mask_token_id),
                "dflash_use_torch_compile": False,
                # named, as the spec stage's training names it: modules.dflash_config otherwise takes the
                # base config's attribute, which transformers 5 keeps in rope_parameters (Qwen3Config's 10000)
                "dflash_architecture_config": {**module.arch, "rope_theta": module.rope_theta,
                                               "target_layer_ids": list(module.layers)}}
    rope = {"rope_type": "default", **(module.rope_scaling or {}), "rope_theta": module.rope_theta}
    arch = {**module.arch, "draft_vocab_size": module.draft_vocab_size, "use_aux_hidden_state": True,
            "use_last_layernorm": True, "eagle_aux_hidden_state_layer_ids": list(module.layers),
            "rope_theta": module.rope_theta, "rope_scaling": rope, "torch_dtype": "float32",
            **({"has_lm_head": True} if module.draft_vocab_size == module.vocab_size else {}),
            "hidden_norm_input": module.hidden_norm_input, "norm_before_residual": module.norm_before_residual}
    # eagle_export_rope_scaling {}: ModelOpt's export keeps the module's own RoPE instead of injecting YaRN
    return {"eagle_offline": False, "eagle_use_torch_compile": False, "eagle_ttt_steps": 3, "eagle_export_rope_scaling": {},
            "eagle_architecture_config": arch}


def spec_config(module: Module, base_dir: Path, base: Base, provenance: dict[str, Any]) -> dict[str, Any]:
    """spec_config.json for an imported module: what a trained one records, less the training."""
    from specdeploy.speculator.train import TrainSettings, default_choices

    config: dict[str, Any] = {"format_version": 1, "kind": module.kind, "modelopt_config": modelopt_config(module),
                              "base_model": str(base_dir), "imported": provenance}
    if module.kind == "medusa":
        heads, _ = module.medusa_shape
        config.update(choices=default_choices(TrainSettings(kind="medusa", medusa_heads=heads)), hidden_layers=[base.num_layers])
        return config
    config["hidden_layers"] = [i + 1 for i in module.layers]  # output_hidden_states indexing: 0 = embeddings
    if module.kind == "dflash":
        config.update(block_size=int(module.block_size),
                      choices=default_choices(TrainSettings(kind="dflash", block_size=int(module.block_size))))
    else:
        config.update(draft_vocab_size=module.draft_vocab_size, choices=default_choices(TrainSettings(kind="eagle")))
    return config


def spec_tensors(module: Module) -> dict[str, Any]:
    """module.safetensors: the kind's prefix, floats in float32 (the contract's storage dtype)."""
    prefix = PREFIXES[module.kind]
    return {prefix + k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in module.tensors.items()}


def from_spec(spec_dir: Path) -> Module:
    """The module a spec/ folder holds (trained or imported), its vocabulary the base's (unstated)."""
    from safetensors.torch import load_file

    from specdeploy.checkpoints.modules import MODULE_FILE, read_spec_config
    from specdeploy.checkpoints.modules.eagle import first_layer_norms

    config = read_spec_config(spec_dir)
    kind, modelopt = config["kind"], config["modelopt_config"]
    prefix = PREFIXES[kind]
    tensors = {k.removeprefix(prefix): v for k, v in load_file(str(Path(spec_dir) / MODULE_FILE)).items()}
    imported = config.get("imported") or {}
    common = dict(kind=kind, layout=imported.get("layout", "specdeploy"), tensors=tensors, verifier=imported.get("verifier"),
                  verifier_architectures=imported.get("verifier_architectures") or [])
    if kind == "medusa":
        head = next(v for k, v in tensors.items() if k.count(".") == 2 and k.endswith(".weight") and "linear" not in k)
        return Module(hidden_size=int(head.shape[1]), **common)
    if kind == "dflash":
        arch = dict(modelopt["dflash_architecture_config"])
        layers, theta = arch.pop("target_layer_ids"), arch.pop("rope_theta", None)
        return Module(hidden_size=int(tensors["fc.weight"].shape[0]), layers=list(layers), arch=arch,
                      rope_theta=None if theta is None else float(theta), block_size=modelopt["dflash_block_size"],
                      mask_token_id=modelopt["dflash_mask_token_id"], **common)
    arch = modelopt["eagle_architecture_config"]
    norm_input, before_residual = first_layer_norms(arch)
    _, scaling = rope_of({"rope_scaling": arch.get("rope_scaling")})
    return Module(hidden_size=int(tensors["fc.weight"].shape[0]), layers=list(arch["eagle_aux_hidden_state_layer_ids"]),
                  arch={k: arch[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                                             "intermediate_size", "rms_norm_eps")},
                  rope_theta=float(arch["rope_theta"]), rope_scaling=scaling, draft_vocab_size=arch["draft_vocab_size"],
                  hidden_norm_input=norm_input, norm_before_residual=before_residual, **common)


def check_fits(module: Module, base_dir: Path) -> None:
    """The tensors are exactly those of the module ModelOpt builds from modelopt_config (names and
    shapes): a config that misstates heads, widths or depth is refused here, not at load."""
    import torch
    from transformers import AutoConfig

    from specdeploy.speculator import load_module_model, module_state_dict
    from specdeploy.speculator.dflash import converted

    base_config = AutoConfig.from_pretrained(base_dir)
    config = modelopt_config(module)
    # ModelOpt imported inside the meta context would make its import-time tables meta tensors for the
    # whole process (NVFP4's e2m1 bounds: a later quantize fails "Cannot copy out of meta tensor")
    import modelopt.torch.export  # noqa: F401
    import modelopt.torch.quantization  # noqa: F401
    import modelopt.torch.speculative  # noqa: F401

    with torch.device("meta"):
        model = (converted(base_config, config, 0) if module.kind == "dflash" else
                 load_module_model(base_config, module.kind, config))
    expected = {k.removeprefix(PREFIXES[module.kind]): tuple(v.shape) for k, v in module_state_dict(model, module.kind).items()}
    found = {k: tuple(v.shape) for k, v in module.tensors.items()}
    wrong = [f"{k}: {found[k]} (expected {expected[k]})" for k in sorted(set(found) & set(expected)) if found[k] != expected[k]]
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if wrong or missing or extra:
        raise SpecDeployError(f"the {module.layout} module's tensors do not match the module its config describes: "
                              f"shapes {wrong[:3]}, missing {missing[:3]}, unexpected {extra[:3]}",
                              hint="the config misstates the module's shape (heads, head_dim, intermediate_size, layers)")
