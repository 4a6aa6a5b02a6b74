"""Stage `quantize`: ModelOpt PTQ + unified HF export, the CPU loader's numerics, and the traps
(block size, NVFP4 on CPU, fresh instance per export, interrupted calibration)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specdeploy import models
from specdeploy import quantize as Q
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from tests.tiny import make_llama

FAST = dict(calib_size=2, calib_seq_len=32, report=False)


@pytest.fixture(scope="module")
def tiny128_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """hidden 128 / intermediate 256: every Linear fits INT4 AWQ's 128 block."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny128")
    make_llama(out, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), hidden=128, heads=4, kv_heads=2, seed=3)
    return out


def _build(tmp_path: Path, model_dir: Path, name: str = "b") -> BuildDir:
    build = BuildDir(tmp_path / name)
    models.run(build, str(model_dir))
    return build


@pytest.fixture(scope="module")
def fp8_build(tmp_path_factory, tiny128_dir) -> BuildDir:
    build = _build(tmp_path_factory.mktemp("fp8"), tiny128_dir)
    Q.run(build, "fp8", "fp8", calib_size=4, calib_seq_len=48, report=True, report_prompts=2, report_tokens=6, report_texts=2)
    return build


def _calib(model_dir: Path) -> list[torch.Tensor]:
    return Q.calibration_batches(models.load_tokenizer(model_dir), 2, 32)


# ----------------------------------------------------------------------------- configuration


def test_quant_config_is_list_style_with_kv_cache():
    config = Q.quant_config("fp8", "fp8")
    assert isinstance(config["quant_cfg"], list)
    assert config["quant_cfg"][-1] == {"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}}
    awq = Q.quant_config("int4_awq", "none", awq_block_size=64)
    weight = next(e for e in awq["quant_cfg"] if e["quantizer_name"] == "*weight_quantizer")
    assert weight["cfg"]["block_sizes"][-1] == 64
    assert Q.quant_config("none", "none") is None
    with pytest.raises(SpecDeployError, match="unknown --qformat"):
        Q.quant_config("int3", "fp8")
    with pytest.raises(SpecDeployError, match="FP8") as err:
        Q.quant_config("fp8", "int8")
    assert "--kv-cache fp8" in err.value.hint


def test_int4_awq_block_size_mismatch_names_layer_size_and_block(tmp_path, tiny_llama_dir):
    build = _build(tmp_path, tiny_llama_dir)  # hidden 64
    with pytest.raises(SpecDeployError) as err:
        Q.run(build, "int4_awq", "none", **FAST)
    text = str(err.value)
    assert "model.layers.0.self_attn.q_proj" in text and "input size 64" in text and "block size 128" in text
    assert "--awq-block-size 64" in err.value.hint
    assert not build.path("quantized").exists()


def test_quantizing_needs_reduced_precision(tmp_path, tiny_llama_dir):
    build = _build(tmp_path, tiny_llama_dir)
    with pytest.raises(SpecDeployError, match="bfloat16 or float16"):
        Q.run(build, "fp8", "fp8", dtype="float32", **FAST)


# ----------------------------------------------------------------------------- export + loader


def test_fp8_checkpoint_layout(fp8_build):
    out = fp8_build.path("quantized")
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    assert hf_quant["producer"]["name"] == "modelopt"
    assert hf_quant["quantization"]["quant_algo"] == "FP8"
    assert hf_quant["quantization"]["kv_cache_quant_algo"] == "FP8"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16  # cast before quantizing
        assert "model.layers.0.self_attn.k_proj.k_scale" in f.keys()
    assert (out / "tokenizer.json").is_file()
    assert fp8_build.record("quantize")["inputs"] == {"resolve": fp8_build.fingerprint("resolve")}


def test_quality_report_written(fp8_build):
    out = fp8_build.path("quantized")
    report = json.loads((out / "quantize.json").read_text())
    assert report["perplexity"]["base"] > 0 and report["perplexity"]["quantized"] > 0
    agreement = report["greedy_agreement"]
    assert agreement["prompts"] == 2 and 0 <= agreement["mean_first_divergence"] <= 6
    assert "perplexity" in (out / "quantize.md").read_text()


def test_load_causal_lm_serves_the_quantized_checkpoint(fp8_build):
    out = fp8_build.path("quantized")
    model = models.load_causal_lm(out)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Q.QuantLinear) and q_proj.act_format == "fp8"
    assert model.model.layers[0].self_attn._specdeploy_kv[0] == "fp8"
    assert model.config._attn_implementation == "sdpa" and not model.training
    ids = torch.tensor([[1, 5, 9, 30, 44, 2, 7]])
    with torch.no_grad():
        a, b = model(ids).logits, models.load_causal_lm(out)(ids).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)  # deterministic: same numerics every load


def test_stage_is_skipped_when_complete(fp8_build):
    record = fp8_build.record("quantize")
    again = Q.run(fp8_build, "fp8", "fp8", calib_size=4, calib_seq_len=48, report=True, report_prompts=2,
                  report_tokens=6, report_texts=2)
    assert again == fp8_build.path("quantized") and fp8_build.record("quantize") == record


def _modelopt_reference(model_dir: Path, qformat: str, kv: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ModelOpt's in-memory fake-quant model, a fresh export of it loaded by our loader)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    Q.quantize_model(model, qformat, kv, _calib(model_dir))
    reference = copy.deepcopy(model)
    out = model_dir.parent / f"{model_dir.name}-{qformat}-{kv}"
    Q.export_checkpoint(model, out)
    return reference, Q.load_quantized(out, "bfloat16")


def _use_exported_weight(ref: torch.nn.Module, layer: Q.QuantLinear) -> None:
    ref.weight.data = layer.weight.data.clone()
    quantizers = ref.weight_quantizer
    for quantizer in quantizers if isinstance(quantizers, torch.nn.Sequential) else [quantizers]:
        quantizer.disable()  # W4A8: a SequentialQuantizer (int4 then fp8)


@pytest.mark.parametrize("qformat", ["fp8", "int8_sq", "int4_awq", "w4a8_awq"])
def test_loader_matches_modelopt_layer_by_layer(tiny128_dir, qformat):
    """Each QuantLinear equals ModelOpt's quantized Linear on the same input, given the exported
    weights (ModelOpt's export rounds w/scale in bf16, so ~4% of FP8 weights sit one step away
    from its in-memory fake quant: the exported values are what TRT-LLM runs, we follow them)."""
    reference, loaded = _modelopt_reference(tiny128_dir, qformat, "none")
    torch.manual_seed(0)
    checked = 0
    for name, layer in loaded.named_modules():
        if not isinstance(layer, Q.QuantLinear):
            continue
        ref = reference.get_submodule(name)
        if (layer.pre_quant_scale is None) != (getattr(ref.input_quantizer, "_pre_quant_scale", None) is None):
            continue  # AWQ smoothing the export fused (and re-balanced) into the preceding norm
        x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
        _use_exported_weight(ref, layer)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), ref(x), atol=0.05, rtol=0.02)
        checked += 1
    assert checked >= 4  # at least o_proj and down_proj of both layers; all 14 without AWQ fusion


def test_int8_smoothquant_whole_model_equals_modelopt(tiny128_dir):
    """SmoothQuant + FP8 KV cache with the exported weights: the whole forward (smoothing, static
    int8 inputs, fake-quantized K/V at the attention call) is ModelOpt's own, bit for bit."""
    reference, loaded = _modelopt_reference(tiny128_dir, "int8_sq", "fp8")
    assert loaded.model.layers[1].self_attn._specdeploy_kv[0] == "fp8"
    for name, layer in loaded.named_modules():
        if isinstance(layer, Q.QuantLinear):
            _use_exported_weight(reference.get_submodule(name), layer)
    ids = torch.tensor([[1, 5, 9, 30, 44, 2, 7, 100, 200, 13]])
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, loaded(ids).logits)


def test_fresh_model_per_export(tiny128_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny128_dir, dtype=torch.bfloat16).eval()
    Q.quantize_model(model, "fp8", "none", _calib(tiny128_dir))
    Q.export_checkpoint(model, tmp_path / "one")
    with pytest.raises(SpecDeployError, match="already exported"):
        Q.export_checkpoint(model, tmp_path / "two")


def test_int4_awq_stage_and_unpacking(tmp_path, tiny128_dir):
    build = _build(tmp_path, tiny128_dir)
    out = Q.run(build, "int4_awq", "fp8", **FAST)
    quant = Q.read_quant_config(out)
    assert quant["quant_algo"] == "W4A16_AWQ" and quant["group_size"] == 128
    model = models.load_causal_lm(out)
    assert model.model.layers[0].mlp.down_proj.act_format is None  # weight-only
    packed = torch.tensor([[0x1F, 0x80]], dtype=torch.uint8)  # rows (-1 | 1), (0 | -8)
    assert Q.unpack_int4(packed).tolist() == [[-1, 0], [1, -8]]


def test_smaller_awq_block_size_when_asked(tmp_path, tiny_llama_dir):
    out = Q.run(_build(tmp_path, tiny_llama_dir), "int4_awq", "none", awq_block_size=64, **FAST)
    assert Q.read_quant_config(out)["group_size"] == 64
    assert isinstance(models.load_causal_lm(out).model.layers[0].self_attn.q_proj, Q.QuantLinear)


def test_exclude_keeps_linears_unquantized_through_export_loader_and_convert(tmp_path, tiny128_dir):
    """Mixed precision: --exclude'd Linears stay bf16 in the export (named in exclude_modules),
    the CPU loader keeps them plain, and the TRT-LLM checkpoint lists them by TRT-LLM name."""
    from specdeploy.trtllm.convert import convert_all

    build = _build(tmp_path, tiny128_dir)
    out = Q.run(build, "fp8", "fp8", exclude=["*mlp.down_proj", "model.layers.0.self_attn.[qkv]_proj"], **FAST)
    kept = json.loads((out / "specdeploy_quant.json").read_text())["unquantized_linears"]
    assert kept == sorted(["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj",
                           "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"])
    assert build.record("quantize")["settings"]["exclude"] == ["*mlp.down_proj", "model.layers.0.self_attn.[qkv]_proj"]
    model = models.load_causal_lm(out)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            assert isinstance(module, Q.QuantLinear) == (name not in kept), name
    assert model.model.layers[0].self_attn._specdeploy_kv[0] == "fp8"  # the KV cache is still quantized
    convert_all(out, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "target" / "config.json").read_text())
    assert config["quantization"]["exclude_modules"] == [
        "lm_head", "transformer.layers.0.attention.qkv", "transformer.layers.0.mlp.proj", "transformer.layers.1.mlp.proj"]


def test_exclude_errors_say_what_to_do(tmp_path, tiny128_dir):
    model = models.load_causal_lm(tiny128_dir)
    with pytest.raises(SpecDeployError, match="'\\*mlp.down' matches no quantized Linear") as err:
        Q.excluded_linears(model, "fp8", ["*mlp.down"])
    assert "model.layers.0.self_attn.q_proj" in err.value.hint
    with pytest.raises(SpecDeployError, match="not model.layers.1.mlp.up_proj") as err:
        Q.excluded_linears(model, "fp8", ["model.layers.1.mlp.gate_proj"])
    assert "'model.layers.1.mlp.gate_proj' 'model.layers.1.mlp.up_proj'" in err.value.hint
    with pytest.raises(SpecDeployError, match="--exclude is not supported with --qformat int8_sq"):
        Q.run(_build(tmp_path, tiny128_dir), "int8_sq", "none", exclude=["*down_proj"], **FAST)


def test_nvfp4_exports_but_cpu_forward_refused(tmp_path, tiny128_dir):
    build = _build(tmp_path, tiny128_dir)
    out = Q.run(build, "nvfp4", "none", calib_size=2, calib_seq_len=32, report=True, report_prompts=1, report_tokens=4, report_texts=1)
    assert Q.read_quant_config(out)["quant_algo"] == "NVFP4"
    assert "CUDA" in json.loads((out / "quantize.json").read_text())["skipped"]
    with pytest.raises(SpecDeployError, match="CPU forward pass cannot run"):
        models.load_causal_lm(out)


def test_interrupted_calibration_leaves_no_checkpoint(tmp_path, tiny128_dir, monkeypatch):
    build = _build(tmp_path, tiny128_dir)
    real_loop = Q._forward_loop

    def interrupted(batches, desc):
        def loop(model):
            real_loop(batches[:1], desc)(model)
            raise KeyboardInterrupt

        return loop

    monkeypatch.setattr(Q, "_forward_loop", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Q.run(build, "fp8", "fp8", **FAST)
    assert not build.path("quantized").exists() and build.record("quantize") is None
    monkeypatch.setattr(Q, "_forward_loop", real_loop)
    out = Q.run(build, "fp8", "fp8", **FAST)  # the rerun restarts cleanly
    assert (out / "model.safetensors").is_file()
    assert not list(build.root.glob(".quantized*"))


def test_speculative_decoding_exact_on_quantized_model(fp8_build):
    """Speculation on the quantized model reproduces that model's own plain greedy output (fp32)."""
    from specdeploy.runtime.decoding import generate
    from specdeploy.runtime.proposers import build_proposer
    from specdeploy.runtime.types import SamplingParams

    model = models.load_causal_lm(fp8_build.path("quantized"))
    tokenizer = models.load_tokenizer(fp8_build.path("quantized"))
    params = SamplingParams(max_new_tokens=24)
    for text in ["def add(a, b):\n    return a + b\ndef add(", "The quick brown fox. The quick brown"]:
        ids = tokenizer(text)["input_ids"]
        plain = generate(model, ids, params)
        spec = generate(model, ids, params, build_proposer("ngram", model))
        assert spec.token_ids == plain.token_ids
        assert spec.metrics.target_forwards <= plain.metrics.target_forwards


def test_cli_quantize(tmp_path, tiny128_dir):
    from specdeploy.cli import main

    build_dir = tmp_path / "cli"
    assert main(["resolve", "--model", str(tiny128_dir), "--build-dir", str(build_dir)]) == 0
    assert main(["quantize", "--build-dir", str(build_dir), "--qformat", "fp8", "--kv-cache", "none",
                 "--calib-size", "2", "--calib-seq-len", "32", "--no-report"]) == 0
    assert Q.read_quant_config(build_dir / "quantized")["kv_cache_quant_algo"] is None


def _medusa_spec(build: BuildDir, base_dir: Path) -> None:
    """A small untrained Medusa module in build/spec/ (heads start as the base lm_head)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from specdeploy.fileio import atomic_write_json
    from specdeploy.spec import convert_model, medusa, module_state_dict

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    config = medusa.modelopt_config(2, 1)
    convert_model(model, "medusa", config)
    medusa.init_module(model)
    with build.stage("spec", "spec", {"kind": "medusa"}, consumes=("resolve",)) as tmp:
        save_file(module_state_dict(model, "medusa"), str(tmp / "module.safetensors"))
        atomic_write_json(tmp / "spec_config.json", {"kind": "medusa", "modelopt_config": config, "choices": [[0], [0, 0]],
                                                     "base_model": str(base_dir), "hidden_layers": [2], "format_version": 1})


def test_quantize_spec_fp8_medusa_heads_and_acceptance_report(tmp_path, tiny128_dir):
    build = _build(tmp_path, tiny128_dir)
    _medusa_spec(build, build.path("base"))
    out = Q.run(build, "fp8", "fp8", calib_size=3, calib_seq_len=32, quantize_spec=True, report=True,
                report_prompts=2, report_tokens=8, report_texts=1)
    with safe_open(str(out / "spec" / "module.safetensors"), "pt") as f:
        assert f.get_tensor("medusa_heads.0.0.linear.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("medusa_heads.1.1.input_scale").numel() == 1
    assert json.loads((out / "spec" / "spec_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    assert build.record("quantize")["inputs"].keys() == {"resolve", "spec"}
    acceptance = json.loads((out / "quantize.json").read_text())["acceptance_length"]
    assert acceptance["module"] == "quantized"
    assert acceptance["unquantized_pair"] >= 1.0 and acceptance["quantized_base"] >= 1.0
