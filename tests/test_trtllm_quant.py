"""Quantized checkpoints: the converter reads ModelOpt's unified HF export (the quantize stage's
hand-off) and must write the scales TRT-LLM's quantized layers declare, under their names,
dtypes and shapes. The oracle is ModelOpt's own export_tensorrt_llm_checkpoint of the same
(identically calibrated) model: NVIDIA's exporter for TRT-LLM.

Tiny Llama with hidden 128: INT4 AWQ needs input widths that are multiples of its 128 block.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdeploy.trtllm import formats
from specdeploy.trtllm.engine_checkpoint import convert_all
from specdeploy.trtllm.reader import read_checkpoint

FORMATS = ["fp8_kv", "int8_sq", "int4_awq"]


def _fresh(tiny_dir: Path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval().to(torch.bfloat16)
    model.config.architectures = ["LlamaForCausalLM"]
    return model


# What `quantize --exclude` keeps unquantized in the mixed-precision tests: layer 0's fused q/k/v
# and layer 1's down_proj.
KEPT = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
        "model.layers.1.mlp.down_proj"]


def _quantized(tiny_dir: Path, fmt: str, keep: list[str] = ()):
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy({"fp8_kv": mtq.FP8_DEFAULT_CFG, "int8_sq": mtq.INT8_SMOOTHQUANT_CFG, "int4_awq": mtq.INT4_AWQ_CFG}[fmt])
    if fmt == "fp8_kv":
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(mtq.FP8_KV_CFG["quant_cfg"])
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [{"quantizer_name": f"{name}.*", "enable": False} for name in keep]
    model = _fresh(tiny_dir)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    mtq.quantize(model, cfg, lambda m: m(ids))
    return model


@pytest.fixture(scope="module")
def tiny128(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from transformers import AutoTokenizer

    from tests.tiny import make_llama

    out = tmp_path_factory.mktemp("tiny128")
    make_llama(out, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), hidden=128, layers=2, heads=4, kv_heads=2, seed=2)
    return out


@pytest.fixture(scope="module")
def exports(tiny128, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """fmt -> (ModelOpt unified HF export, ModelOpt TRT-LLM export), each from a fresh model."""
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint

    root = tmp_path_factory.mktemp("quant_exports")
    out = {}
    for fmt in FORMATS:
        hf, trt = root / f"{fmt}_hf", root / f"{fmt}_trt"
        with torch.inference_mode():
            export_hf_checkpoint(_quantized(tiny128, fmt), export_dir=hf)
            export_tensorrt_llm_checkpoint(_quantized(tiny128, fmt), "llama", torch.bfloat16, export_dir=trt, inference_tensor_parallel=1)
        out[fmt] = (hf, trt)
    return out


@pytest.fixture(scope="module")
def mixed_exports(tiny128, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Like `exports`, with KEPT unquantized (quantize --exclude)."""
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint

    root = tmp_path_factory.mktemp("mixed_exports")
    out = {}
    for fmt in ("fp8_kv", "int4_awq"):
        hf, trt = root / f"{fmt}_hf", root / f"{fmt}_trt"
        with torch.inference_mode():
            export_hf_checkpoint(_quantized(tiny128, fmt, KEPT), export_dir=hf)
            export_tensorrt_llm_checkpoint(_quantized(tiny128, fmt, KEPT), "llama", torch.bfloat16, export_dir=trt,
                                           inference_tensor_parallel=1)
        out[fmt] = (hf, trt)
    return out


def _fp8_step(x: torch.Tensor) -> torch.Tensor:
    """Spacing of float8_e4m3fn around |x| (3 mantissa bits)."""
    exp = torch.floor(torch.log2(x.abs().clamp(min=2.0 ** -6)))
    return 2.0 ** (exp - 3)


def _skip_value_check(fmt: str, name: str) -> bool:
    if fmt == "fp8_kv" and name.endswith(("attention.qkv.weight", "mlp.fc.weight", "mlp.gate.weight",
                                          "mlp.fc.weights_scaling_factor", "mlp.gate.weights_scaling_factor")):
        return True  # shared-scale requantization: checked in the FP8 test below
    if fmt == "int4_awq" and (name.endswith(("input_layernorm.weight", "post_layernorm.weight", "qkv.prequant_scaling_factor"))
                              or ".mlp.fc." in name or ".mlp.gate." in name):
        return True  # the HF export re-smooths gate/up to one pre-quant scale and folds it into the norm: checked below
    return False


def _compare_ranks(ours_dir: Path, oracle_dir: Path, fmt: str, world: int) -> None:
    for r in range(world):
        ours = load_file(str(ours_dir / f"rank{r}.safetensors"))
        theirs = load_file(str(oracle_dir / f"rank{r}.safetensors"))
        assert set(ours) == set(theirs), (set(ours) ^ set(theirs))
        for name, want in theirs.items():
            got = ours[name]
            if name == "transformer.vocab_embedding.weight" and world > 1:
                continue  # ModelOpt shards it (use_parallel_embedding=True); we replicate it
            assert (got.dtype, got.shape) == (want.dtype, want.shape), name
            if not _skip_value_check(fmt, name):
                assert torch.equal(got, want), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_checkpoint_matches_modelopt_trtllm_export(exports, tmp_path, fmt):
    hf, oracle_dir = exports[fmt]
    convert_all(hf, tmp_path)
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    oracle_cfg = json.loads((oracle_dir / "config.json").read_text())
    q = config["quantization"]
    assert set(q) <= formats.QUANT_CONFIG_FIELDS and q["quant_algo"] in formats.QUANT_ALGOS
    for key in ("quant_algo", "kv_cache_quant_algo", "exclude_modules", "group_size", "has_zero_point", "pre_quant_scale"):
        assert q.get(key) == oracle_cfg["quantization"].get(key), key
    _compare_ranks(tmp_path / "target", oracle_dir, fmt, 1)


@pytest.mark.parametrize("fmt", ["fp8_kv", "int8_sq"])
def test_quantized_tensor_parallel_matches_modelopt_trtllm_export(tiny128, exports, tmp_path, fmt):
    """tp=2 split rules for scales (per-tensor replicated, per-channel split with the output
    rows, pre-quant scales split with the input columns) against ModelOpt's tp=2 export."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    with torch.inference_mode():
        export_tensorrt_llm_checkpoint(_quantized(tiny128, fmt), "llama", torch.bfloat16, export_dir=tmp_path / "oracle",
                                       inference_tensor_parallel=2)
    convert_all(exports[fmt][0], tmp_path / "ours", tp=2)
    _compare_ranks(tmp_path / "ours" / "target", tmp_path / "oracle", fmt, 2)


@pytest.mark.parametrize("fmt", ["fp8_kv", "int4_awq"])
def test_mixed_precision_checkpoint_matches_modelopt_trtllm_export(mixed_exports, tmp_path, fmt):
    """Linears kept unquantized: named in exclude_modules as ModelOpt's TRT-LLM export names them,
    stored in the model dtype without scales; the quantized rest as before; the reader gives the
    kept weights back unchanged."""
    hf, oracle_dir = mixed_exports[fmt]
    convert_all(hf, tmp_path)
    q = json.loads((tmp_path / "target" / "config.json").read_text())["quantization"]
    oracle = json.loads((oracle_dir / "config.json").read_text())["quantization"]
    assert set(q["exclude_modules"]) == set(oracle["exclude_modules"]) == {
        "lm_head", "transformer.layers.0.attention.qkv", "transformer.layers.1.mlp.proj"}
    _compare_ranks(tmp_path / "target", oracle_dir, fmt, 1)
    ours = load_file(str(tmp_path / "target" / "rank0.safetensors"))
    assert ours["transformer.layers.0.attention.qkv.weight"].dtype == torch.bfloat16
    assert not any(k.startswith("transformer.layers.1.mlp.proj.") and not k.endswith(".weight") for k in ours)
    src, back = load_file(str(hf / "model.safetensors")), read_checkpoint(tmp_path / "target").tensors
    for name in KEPT + ["model.layers.0.mlp.down_proj.weight_scale"]:
        key = name if name.endswith("scale") else f"{name}.weight"
        assert torch.equal(back[key].reshape(-1), src[key].reshape(-1)), key


def test_mixed_precision_refuses_pipeline_parallel_and_split_fused_gemms(mixed_exports, tmp_path):
    from safetensors.torch import save_file

    from specdeploy.errors import SpecDeployError

    hf, _ = mixed_exports["fp8_kv"]
    with pytest.raises(SpecDeployError, match="pipeline stage's local layer names") as err:
        convert_all(hf, tmp_path / "pp", pp=2)
    assert "--pp-size 1" in err.value.hint
    split = tmp_path / "split"  # only up_proj of layer 0 unquantized: TRT-LLM fuses it with gate_proj
    split.mkdir()
    for f in hf.iterdir():
        if f.name != "model.safetensors":
            (split / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(hf / "model.safetensors"))
    up = "model.layers.0.mlp.up_proj"
    tensors[f"{up}.weight"] = tensors[f"{up}.weight"].float().to(torch.bfloat16)
    for suffix in ("weight_scale", "input_scale"):
        tensors.pop(f"{up}.{suffix}")
    save_file(tensors, str(split / "model.safetensors"))
    with pytest.raises(SpecDeployError, match="mlp.up_proj unquantized but mlp.gate_proj quantized"):
        convert_all(split, tmp_path / "split_out")


def test_fp8_fused_qkv_uses_the_max_scale_within_one_fp8_step(exports, tmp_path):
    hf, oracle_dir = exports["fp8_kv"]
    convert_all(hf, tmp_path)
    ours = load_file(str(tmp_path / "target" / "rank0.safetensors"))
    src = load_file(str(hf / "model.safetensors"))
    for layer in range(2):
        pre = f"transformer.layers.{layer}.attention."
        scale = ours[pre + "qkv.weights_scaling_factor"]
        parts = [f"model.layers.{layer}.self_attn.{p}_proj" for p in "qkv"]
        assert torch.equal(scale, torch.stack([src[p + ".weight_scale"] for p in parts]).max().reshape(1))
        exact = torch.cat([src[p + ".weight"].float() * src[p + ".weight_scale"] for p in parts])
        fused = ours[pre + "qkv.weight"].float() * scale
        assert ((fused - exact).abs() <= _fp8_step(exact / scale) * scale).all()
        # fc (gate_proj) / gate (up_proj) keep their own scales and exact FP8 values; ModelOpt's
        # exporter requantizes both to their max, as TRT-LLM's fuse_gate_mlp does at build time
        pair = [ours[f"transformer.layers.{layer}.mlp.{n}.weights_scaling_factor"] for n in ("fc", "gate")]
        assert torch.equal(torch.maximum(*pair), load_file(str(oracle_dir / "rank0.safetensors"))[f"transformer.layers.{layer}.mlp.fc.weights_scaling_factor"])
        for trt, hf_name in (("fc", "gate_proj"), ("gate", "up_proj")):
            assert torch.equal(ours[f"transformer.layers.{layer}.mlp.{trt}.weight"].view(torch.int8),
                               src[f"model.layers.{layer}.mlp.{hf_name}.weight"].view(torch.int8))
        # FP8 KV cache: scales clamped to >= 1 as ModelOpt does for TRT-LLM
        k, v = src[parts[1] + ".k_scale"], src[parts[2] + ".v_scale"]
        assert torch.equal(ours[pre + "kv_cache_scaling_factor"], torch.maximum(torch.maximum(k, v), torch.tensor(1.0)).reshape(1))
        assert ours[pre + "kv_cache_scaling_factor"].dtype == torch.float32


def test_awq_folded_prequant_scale_is_equivalent(exports, tmp_path):
    """norm * prequant is the same product in both: ModelOpt's HF export folded the AWQ scale
    into the RMSNorm, so our prequant_scaling_factor is all ones there."""
    hf, oracle_dir = exports["int4_awq"]
    convert_all(hf, tmp_path)
    ours = load_file(str(tmp_path / "target" / "rank0.safetensors"))
    theirs = load_file(str(oracle_dir / "rank0.safetensors"))
    for layer in range(2):
        for norm, linear in (("input_layernorm", "attention.qkv"),):
            pre = f"transformer.layers.{layer}."
            mine = ours[pre + f"{norm}.weight"].float() * ours[pre + f"{linear}.prequant_scaling_factor"].float()
            ref = theirs[pre + f"{norm}.weight"].float() * theirs[pre + f"{linear}.prequant_scaling_factor"].float()
            assert torch.allclose(mine, ref, rtol=1e-2, atol=0), (layer, linear)
        src = load_file(str(hf / "model.safetensors"))
        for trt, hf_name in (("fc", "gate_proj"), ("gate", "up_proj")):  # bytes and scales as ModelOpt's HF export has them
            assert torch.equal(ours[pre + f"mlp.{trt}.weight"], src[f"model.layers.{layer}.mlp.{hf_name}.weight"].view(torch.int8))
            assert torch.equal(ours[pre + f"mlp.{trt}.weights_scaling_factor"], src[f"model.layers.{layer}.mlp.{hf_name}.weight_scale"])
        assert ours[pre + "attention.qkv.weight"].dtype == torch.int8
        assert ours[pre + "attention.qkv.weights_scaling_factor"].shape == (128 + 2 * 64, 1)  # (q + k + v out, in / 128)


def test_fp8_tensor_parallel_shards_and_reader(exports, tmp_path):
    hf, _ = exports["fp8_kv"]
    convert_all(hf, tmp_path, tp=2)
    r0, r1 = (load_file(str(tmp_path / "target" / f"rank{r}.safetensors")) for r in range(2))
    name = "transformer.layers.0.attention.qkv.weight"
    assert r0[name].shape == (128 // 2 + 2 * 64 // 2, 128) and r0[name].dtype == torch.float8_e4m3fn
    assert torch.equal(r0["transformer.layers.0.mlp.proj.weights_scaling_factor"], r1["transformer.layers.0.mlp.proj.weights_scaling_factor"])
    assert r0["transformer.layers.0.mlp.proj.weight"].shape == (128, 128)  # row-parallel: input halves
    layout = read_checkpoint(tmp_path / "target")
    src = load_file(str(hf / "model.safetensors"))
    for key in ("model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight_scale", "model.layers.0.self_attn.o_proj.input_scale"):
        assert torch.equal(layout.tensors[key].float().reshape(-1), src[key].float().reshape(-1)), key


def test_awq_row_parallel_must_keep_whole_groups(exports, tmp_path):
    from specdeploy.errors import SpecDeployError

    hf, _ = exports["int4_awq"]
    with pytest.raises(SpecDeployError, match="not a multiple of the group size 128"):
        convert_all(hf, tmp_path, tp=2)


def test_medusa_heads_stay_unquantized_on_an_fp8_base(exports, tmp_path):
    """FP8 base + Medusa heads: the heads are excluded from quantization and cast to the model dtype."""
    from safetensors.torch import save_file

    from specdeploy.trtllm.spec_input import load_spec

    hf, _ = exports["fp8_kv"]
    g = torch.Generator().manual_seed(0)
    module = {"medusa_heads.0.0.linear.weight": torch.randn(128, 128, generator=g), "medusa_heads.0.0.linear.bias": torch.randn(128, generator=g),
              "medusa_heads.0.1.weight": torch.randn(384, 128, generator=g)}
    spec = tmp_path / "spec"
    spec.mkdir()
    save_file(module, str(spec / "module.safetensors"))
    (spec / "spec_config.json").write_text(json.dumps({"kind": "medusa", "choices": [[0], [1]]}))
    convert_all(hf, tmp_path / "out", spec=load_spec(spec))
    config = json.loads((tmp_path / "out" / "target" / "config.json").read_text())
    assert config["quantization"]["exclude_modules"] == ["lm_head", "medusa_heads*"]
    assert config["architecture"] == "MedusaForCausalLM" and config["dtype"] == "bfloat16"
    rank = load_file(str(tmp_path / "out" / "target" / "rank0.safetensors"))
    assert rank["medusa_heads.0.medusa_layers.0.linear.weight"].dtype == torch.bfloat16
    assert rank["transformer.layers.0.attention.qkv.weight"].dtype == torch.float8_e4m3fn
