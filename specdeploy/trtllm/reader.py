"""Read a TensorRT-LLM checkpoint back into the Hugging Face layout: the offline check that the
converter wrote what TRT-LLM's loaders expect, since no engine can be built here.

Undoes everything convert.py does: pipeline stages (local layer indices -> global), tensor-
parallel slices (column: output dim, row: input dim), the fused attention.qkv per rank
([q_r; k_r; v_r]) and duplicated KV heads, lm_head vocabulary padding, and the Medusa
renaming. Unquantized, the HF model rebuilt from the result reproduces the source logits
bit for bit (tests/test_trtllm_convert.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdeploy.errors import SpecDeployError
from specdeploy.trtllm.source import dims_of
from specdeploy.trtllm.specmodules import MedusaShape, medusa_from_trt
from specdeploy.trtllm.weights import LAYER_LINEARS, TRT_TO_ROLE, merge_role, split_qkv, undup_heads

LINEARS = {trt: (hf, kind) for hf, (trt, kind) in LAYER_LINEARS.items()}
NORMS = {"input_layernorm.weight": "input_layernorm.weight", "post_layernorm.weight": "post_attention_layernorm.weight"}


@dataclass
class TrtCheckpoint:
    config: dict[str, Any]
    sidecar: dict[str, Any]
    ranks: list[dict[str, torch.Tensor]]

    @property
    def tp(self) -> int:
        return self.config["mapping"]["tp_size"]

    @property
    def pp(self) -> int:
        return self.config["mapping"]["pp_size"]


@dataclass
class HFLayout:
    config: dict[str, Any]                     # the HF config.json the checkpoint came from
    tensors: dict[str, torch.Tensor]           # model.* / lm_head.* (HF / ModelOpt unified names)
    module: dict[str, torch.Tensor] = field(default_factory=dict)  # medusa_heads.*


def load_checkpoint(path: str | Path) -> TrtCheckpoint:
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    sidecar_file = path / "specdeploy.json"
    if not sidecar_file.exists():
        raise SpecDeployError(f"{sidecar_file} not found", hint="the reader reads checkpoints written by `specdeploy convert`")
    world = config["mapping"]["world_size"]
    ranks = [load_file(str(path / f"rank{r}.safetensors")) for r in range(world)]
    return TrtCheckpoint(config, json.loads(sidecar_file.read_text()), ranks)


def _group(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def _merge_linear(pieces: list[dict[str, torch.Tensor]], kind: str) -> dict[str, torch.Tensor]:
    """Rank slices of one TRT linear (TRT suffixes) -> HF roles."""
    out = {}
    for suffix, role in TRT_TO_ROLE.items():
        if suffix in pieces[0]:
            out[role] = merge_role(role, [p[suffix] for p in pieces], kind)
    return out


def _merge_qkv(pieces: list[dict[str, torch.Tensor]], dims, tp: int, rep: int, packed: bool) -> list[dict[str, torch.Tensor]]:
    per_rank = [split_qkv(p, dims, tp, packed) for p in pieces]
    merged = []
    for i in range(3):
        part = {role: merge_role(role, [r[i][role] for r in per_rank], "col") for role in per_rank[0][i]}
        if i > 0 and rep > 1:
            part = {role: undup_heads(t, dims.kv_heads, rep) if role in ("weight", "bias") or (role == "weight_scale" and t.numel() > 1) else t
                    for role, t in part.items()}
        merged.append(part)
    return merged


def layer_to_hf(pieces: list[dict[str, torch.Tensor]], hf_prefix: str, dims, tp: int, rep: int, packed: bool) -> dict[str, torch.Tensor]:
    """One decoder layer's TP slices (names relative to the layer) -> HF tensors."""
    out: dict[str, torch.Tensor] = {}
    qkv = _merge_qkv([_group(p, "attention.qkv.") for p in pieces], dims, tp, rep, packed)
    for name, part in zip(("q_proj", "k_proj", "v_proj"), qkv):
        out.update({f"{hf_prefix}.self_attn.{name}.{role}": t for role, t in part.items()})
    for trt, (hf, kind) in LINEARS.items():
        out.update({f"{hf_prefix}.{hf}.{role}": t for role, t in _merge_linear([_group(p, f"{trt}.") for p in pieces], kind).items()})
    for trt, hf in NORMS.items():
        if trt in pieces[0]:
            out[f"{hf_prefix}.{hf}"] = pieces[0][trt]
    return out


def _layer_pieces(ckpt: TrtCheckpoint, layer: int) -> list[dict[str, torch.Tensor]]:
    per_stage = ckpt.config["num_hidden_layers"] // ckpt.pp
    stage, local = divmod(layer, per_stage)
    return [_group(ckpt.ranks[stage * ckpt.tp + t], f"transformer.layers.{local}.") for t in range(ckpt.tp)]


def _last_stage(ckpt: TrtCheckpoint) -> list[dict[str, torch.Tensor]]:
    return [ckpt.ranks[(ckpt.pp - 1) * ckpt.tp + t] for t in range(ckpt.tp)]


def read_checkpoint(path: str | Path) -> HFLayout:
    """A converter-written TRT-LLM checkpoint -> HF config + tensors (+ the spec module)."""
    ckpt = load_checkpoint(path)
    hf_config = ckpt.sidecar["hf_config"]
    dims, tp, rep = dims_of(hf_config), ckpt.tp, ckpt.sidecar.get("kv_rep", 1)
    packed = ckpt.config["quantization"].get("quant_algo") == "W4A16_AWQ"
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": ckpt.ranks[0]["transformer.vocab_embedding.weight"]}
    for layer in range(dims.layers):
        tensors.update(layer_to_hf(_layer_pieces(ckpt, layer), f"model.layers.{layer}", dims, tp, rep, packed))
    last = _last_stage(ckpt)
    if packed:  # back to the uint8 ModelOpt's HF export uses for packed INT4
        tensors = {k: v.view(torch.uint8) if v.dtype == torch.int8 else v for k, v in tensors.items()}
    tensors["model.norm.weight"] = last[0]["transformer.ln_f.weight"]
    tensors["lm_head.weight"] = torch.cat([r["lm_head.weight"] for r in last])[: dims.vocab]
    layout = HFLayout(hf_config, tensors)
    kind = ckpt.sidecar["spec"]["kind"]
    merged_last = {k: merge_role("weight" if k.endswith("weight") else "bias", [r[k] for r in last], "col")
                   for k in last[0] if k.startswith("medusa_heads.")}
    if kind == "medusa":
        spec = ckpt.sidecar["spec"]
        layout.module = medusa_from_trt(merged_last, MedusaShape(spec["heads"], spec["layers"]), dims.vocab)
    return layout


def build_hf_model(layout: HFLayout, dtype: torch.dtype = torch.float32) -> Any:
    """An HF causal LM holding the read-back weights (unquantized checkpoints)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in layout.config.items() if k not in ("architectures",)})
    config.architectures = layout.config.get("architectures")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    missing, unexpected = model.load_state_dict(layout.tensors, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SpecDeployError(f"read-back weights do not fit the HF model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model
