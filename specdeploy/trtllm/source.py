"""The Hugging Face side: a safetensors folder (plain, or ModelOpt's unified quantized export)
read into tensors + the model dimensions the TRT-LLM config needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import load_safetensors_dir

FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
# ModelOpt hf_quant_config.json quant_algo -> TRT-LLM QuantAlgo (they share the names; listed to
# refuse anything else clearly, e.g. NVFP4 which this project cannot even run on CPU).
SUPPORTED_QUANT = {None: None, "FP8": "FP8", "W8A8_SQ_PER_CHANNEL": "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ": "W4A16_AWQ"}
SUPPORTED_KV_QUANT = {None: None, "FP8": "FP8"}


@dataclass(frozen=True)
class Dims:
    """What the converter needs from an HF config, in one place."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    norm_eps: float
    max_positions: int
    hidden_act: str
    rope_theta: float
    rope_scaling: dict | None

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass
class Quant:
    algo: str | None = None
    kv_algo: str | None = None
    group_size: int = 128

    @property
    def any(self) -> bool:
        return bool(self.algo or self.kv_algo)


@dataclass
class HFSource:
    path: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    quant: Quant
    family: str
    dims: Dims
    dtype: str


def rope_of(config: dict[str, Any]) -> tuple[float, dict | None]:
    """rope_theta and a TRT-LLM rotary_scaling dict ({'type': ...}) or None for plain RoPE.

    transformers 5 stores both under rope_parameters, 4.x under rope_theta / rope_scaling.
    """
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind in (None, "default"):
        return theta, None
    return theta, {"type": kind, **params}


def dims_of(config: dict[str, Any]) -> Dims:
    heads = config["num_attention_heads"]
    theta, scaling = rope_of(config)
    return Dims(
        hidden=config["hidden_size"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate=config["intermediate_size"],
        layers=config["num_hidden_layers"],
        vocab=config["vocab_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_positions=config.get("max_position_embeddings", 2048),
        hidden_act=config.get("hidden_act", "silu"),
        rope_theta=theta,
        rope_scaling=scaling,
    )


def read_quant(path: Path) -> Quant:
    """ModelOpt's hf_quant_config.json (written by export_hf_checkpoint); absent = unquantized."""
    file = path / "hf_quant_config.json"
    if not file.exists():
        return Quant()
    q = json.loads(file.read_text()).get("quantization", {})
    algo, kv = q.get("quant_algo"), q.get("kv_cache_quant_algo")
    if algo not in SUPPORTED_QUANT or kv not in SUPPORTED_KV_QUANT:
        raise SpecDeployError(
            f"{file}: quant_algo={algo!r}, kv_cache_quant_algo={kv!r} is not supported by the TRT-LLM converter",
            hint="supported: FP8, W8A8_SQ_PER_CHANNEL (int8_sq), W4A16_AWQ (int4_awq), with optional FP8 KV cache",
        )
    return Quant(algo, kv, int(q.get("group_size") or 128))


def _dtype_name(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    name = config.get("dtype") or config.get("torch_dtype")
    if name in ("float32", "float16", "bfloat16"):
        return name
    embed = tensors.get("model.embed_tokens.weight")
    return str(embed.dtype).removeprefix("torch.") if embed is not None else "float16"


def check_architecture(path: str | Path) -> dict:
    """An HF folder's config, refused when the converter does not map its architecture."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise SpecDeployError(f"{config_file} not found", hint="pass an HF model folder (config.json + *.safetensors)")
    config = json.loads(config_file.read_text())
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in FAMILIES:
        raise SpecDeployError(
            f"{path}: architecture {arch} is not supported by the TRT-LLM converter",
            hint=f"supported: {', '.join(FAMILIES)}",
        )
    return config


def load_hf_source(path: str | Path) -> HFSource:
    """Read an HF folder; refuse architectures the converter does not map."""
    path = Path(path)
    config = check_architecture(path)
    arch = config["architectures"][0]
    tensors = load_safetensors_dir(
        path, hint="convert takes an HF safetensors folder (the resolve or quantize stage output)")
    return HFSource(path, config, tensors, read_quant(path), FAMILIES[arch], dims_of(config), _dtype_name(config, tensors))
