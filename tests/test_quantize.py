"""Stage `quantize`: ModelOpt PTQ + unified HF export, the loader's numerics on CPU and CUDA, the
memory preflight, and the traps (block size, NVFP4, fresh instance per export, interrupted
calibration)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specdeploy import checkpoints, resolve
from specdeploy import quantize as Q
from specdeploy.errors import SpecDeployError
from specdeploy.checkpoints import quantized
from specdeploy.quantize import calibrate, config, export, placement, stage
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
    resolve.run(build, str(model_dir))
    return build


@pytest.fixture(scope="module")
def fp8_build(tmp_path_factory, tiny128_dir) -> BuildDir:
    build = _build(tmp_path_factory.mktemp("fp8"), tiny128_dir)
    Q.run(build, "fp8", "fp8", calib_size=4, calib_seq_len=48, report=True, report_prompts=2, report_tokens=6, report_texts=2)
    return build


def _calib(model_dir: Path) -> list[torch.Tensor]:
    return calibrate.calibration_batches(checkpoints.load_tokenizer(model_dir), 2, 32)


# ----------------------------------------------------------------------------- configuration


def test_quant_config_is_list_style_with_kv_cache():
    fp8 = config.quant_config("fp8", "fp8")
    assert isinstance(fp8["quant_cfg"], list)
    assert fp8["quant_cfg"][-1] == {"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}}
    awq = config.quant_config("int4_awq", "none", awq_block_size=64)
    weight = next(e for e in awq["quant_cfg"] if e["quantizer_name"] == "*weight_quantizer")
    assert weight["cfg"]["block_sizes"][-1] == 64
    assert config.quant_config("none", "none") is None
    with pytest.raises(SpecDeployError, match="unknown --quant"):
        config.quant_config("int3", "fp8")
    with pytest.raises(SpecDeployError, match="FP8") as err:
        config.quant_config("fp8", "int8")
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


@pytest.mark.parametrize("option", ["report_tokens", "report_prompts", "report_texts", "calib_size"])
def test_counts_below_one_are_refused_before_calibrating(tmp_path, tiny_llama_dir, monkeypatch, option):
    """The report runs after calibration and export: --report-tokens 0 used to fail only there, and
    0 texts / prompts reported a perplexity of 1.000 over nothing."""
    build = _build(tmp_path, tiny_llama_dir)
    from specdeploy.quantize import stage as quantize_stage

    monkeypatch.setattr(quantize_stage, "_quantize_into", lambda *a, **k: pytest.fail("calibrated before refusing"))
    with pytest.raises(SpecDeployError, match=f"--{option.replace('_', '-')} must be at least 1"):
        Q.run(build, "fp8", "fp8", **{**FAST, "report": True, option: 0})
    if option != "calib_size":  # without the report its counts are not read
        with pytest.raises(BaseException, match="calibrated before refusing"):
            Q.run(build, "fp8", "fp8", **{**FAST, "report": False, option: 0})


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
    model = checkpoints.load_causal_lm(out)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, quantized.QuantLinear) and q_proj.act_format == "fp8"
    assert model.model.layers[0].self_attn.specdeploy_kv_format == "fp8"
    assert model.config._attn_implementation == "sdpa" and not model.training
    ids = torch.tensor([[1, 5, 9, 30, 44, 2, 7]])
    with torch.no_grad():
        a, b = model(ids).logits, checkpoints.load_causal_lm(out)(ids).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)  # deterministic: same numerics every load


def test_kv_quantized_once_on_write_equals_requantizing_the_cache(fp8_build):
    """K/V enter a DynamicCache fake-quantized, once; a prefill, 1-token and multi-token steps give
    the same logits, bit for bit, as re-quantizing the whole cache at every step (what a cache
    that hands attention copies gets: nothing can be quantized in place)."""
    from transformers import DynamicCache

    class CopyingCache(DynamicCache):
        def update(self, *args, **kwargs):
            return tuple(t.clone() for t in super().update(*args, **kwargs))

    model = checkpoints.load_causal_lm(fp8_build.path("quantized"))

    def run(cache: DynamicCache) -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
                    for ids in ([1, 5, 9, 30, 44, 2, 7], [3], [8, 9, 10], [4], [11, 12])]

    on_write, every_step = DynamicCache(config=model.config), CopyingCache(config=model.config)
    assert all(torch.equal(a, b) for a, b in zip(run(on_write), run(every_step)))
    attention = model.model.layers[1].self_attn
    stored, raw = on_write.layers[1], every_step.layers[1]
    assert stored.keys.shape[-2] == 14
    assert torch.equal(quantized.fake_quant(stored.keys, attention.specdeploy_k_scale, "fp8"), stored.keys)
    assert torch.equal(quantized.fake_quant(stored.values, attention.specdeploy_v_scale, "fp8"), stored.values)
    assert not torch.equal(quantized.fake_quant(raw.keys, attention.specdeploy_k_scale, "fp8"), raw.keys)  # two paths


def test_siblings_quantize_the_input_they_share_once(fp8_build, monkeypatch):
    """q/k/v and gate/up (one input scale each in the export) quantize their input once per
    forward, with the same logits as quantizing it per Linear, and keep nothing afterwards."""
    model = checkpoints.load_causal_lm(fp8_build.path("quantized"))
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attention.q_proj.shared_input is attention.k_proj.shared_input is attention.v_proj.shared_input
    assert mlp.gate_proj.shared_input is mlp.up_proj.shared_input
    assert attention.q_proj.shared_input is not None and mlp.up_proj.shared_input is not None
    assert attention.o_proj.shared_input is None and mlp.down_proj.shared_input is None

    calls = []
    apply_fake_quant = quantized.apply_fake_quant
    monkeypatch.setattr(quantized, "apply_fake_quant", lambda x, *a: calls.append(x.shape) or apply_fake_quant(x, *a))
    ids = torch.tensor([[1, 5, 9, 30, 44, 2, 7]])
    with torch.no_grad():
        shared = model(ids).logits
        per_layer_shared = len(calls) // model.config.num_hidden_layers
        assert all(m.shared_input._entry is None for m in model.modules() if getattr(m, "shared_input", None))
        for module in model.modules():
            if isinstance(module, quantized.QuantLinear):
                module.shared_input = None
        calls.clear()
        alone = model(ids).logits
    assert torch.equal(shared, alone)
    # 4 input quantizations (qkv, o, gate/up, down) + K and V; 7 + 2 without sharing
    assert (per_layer_shared, len(calls) // model.config.num_hidden_layers) == (6, 9)


def test_stage_is_skipped_when_complete(fp8_build):
    record = fp8_build.record("quantize")
    again = Q.run(fp8_build, "fp8", "fp8", calib_size=4, calib_seq_len=48, report=True, report_prompts=2,
                  report_tokens=6, report_texts=2)
    assert again == fp8_build.path("quantized") and fp8_build.record("quantize") == record


def test_a_retrained_module_calibrates_the_base_again_only_where_the_stage_reads_it(tmp_path, tiny128_dir):
    """Without the report and --quantize-spec the module is not read: a new one keeps the base's
    quantization (minutes to hours of calibration on a large base)."""
    build = _build(tmp_path, tiny128_dir)

    def module(content: str) -> None:
        with build.stage("spec", "spec", {"module": content}) as tmp:
            (tmp / "module.safetensors").write_text(content)

    module("first")
    Q.run(build, "fp8", "fp8", calib_size=2, calib_seq_len=32, report=False)
    record = build.record("quantize")
    assert set(record["inputs"]) == {"resolve"}
    module("retrained")
    assert Q.run(build, "fp8", "fp8", calib_size=2, calib_seq_len=32, report=False) == build.path("quantized")
    assert build.record("quantize") == record  # complete: not calibrated again


def _modelopt_reference(model_dir: Path, qformat: str, kv: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ModelOpt's in-memory fake-quant model, a fresh export of it loaded by our loader)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    calibrate.quantize_model(model, qformat, kv, _calib(model_dir))
    reference = copy.deepcopy(model)
    out = model_dir.parent / f"{model_dir.name}-{qformat}-{kv}"
    export.export_checkpoint(model, out)
    return reference, quantized.load_quantized(out, "bfloat16")


def _use_exported_weight(ref: torch.nn.Module, layer: quantized.QuantLinear) -> None:
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
        if not isinstance(layer, quantized.QuantLinear):
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
    assert loaded.model.layers[1].self_attn.specdeploy_kv_format == "fp8"
    for name, layer in loaded.named_modules():
        if isinstance(layer, quantized.QuantLinear):
            _use_exported_weight(reference.get_submodule(name), layer)
    ids = torch.tensor([[1, 5, 9, 30, 44, 2, 7, 100, 200, 13]])
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, loaded(ids).logits)


def test_fresh_model_per_export(tiny128_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny128_dir, dtype=torch.bfloat16).eval()
    calibrate.quantize_model(model, "fp8", "none", _calib(tiny128_dir))
    export.export_checkpoint(model, tmp_path / "one")
    with pytest.raises(SpecDeployError, match="already exported"):
        export.export_checkpoint(model, tmp_path / "two")


def test_int4_awq_stage_and_unpacking(tmp_path, tiny128_dir):
    build = _build(tmp_path, tiny128_dir)
    out = Q.run(build, "int4_awq", "fp8", **FAST)
    quant = quantized.read_quant_config(out)
    assert quant["quant_algo"] == "W4A16_AWQ" and quant["group_size"] == 128
    model = checkpoints.load_causal_lm(out)
    assert model.model.layers[0].mlp.down_proj.act_format is None  # weight-only
    packed = torch.tensor([[0x1F, 0x80]], dtype=torch.uint8)  # rows (-1 | 1), (0 | -8)
    assert quantized.unpack_int4(packed).tolist() == [[-1, 0], [1, -8]]


def test_smaller_awq_block_size_when_asked(tmp_path, tiny_llama_dir):
    out = Q.run(_build(tmp_path, tiny_llama_dir), "int4_awq", "none", awq_block_size=64, **FAST)
    assert quantized.read_quant_config(out)["group_size"] == 64
    assert isinstance(checkpoints.load_causal_lm(out).model.layers[0].self_attn.q_proj, quantized.QuantLinear)


def test_exclude_keeps_linears_unquantized_through_export_loader_and_convert(tmp_path, tiny128_dir):
    """Mixed precision: --exclude'd Linears stay bf16 in the export (named in exclude_modules),
    the CPU loader keeps them plain, and the TRT-LLM checkpoint lists them by TRT-LLM name."""
    from specdeploy.trtllm.engine_checkpoint import convert_all

    build = _build(tmp_path, tiny128_dir)
    out = Q.run(build, "fp8", "fp8", exclude=["*mlp.down_proj", "model.layers.0.self_attn.[qkv]_proj"], **FAST)
    kept = json.loads((out / "specdeploy_quant.json").read_text())["unquantized_linears"]
    assert kept == sorted(["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj",
                           "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"])
    assert build.record("quantize")["settings"]["exclude"] == ["*mlp.down_proj", "model.layers.0.self_attn.[qkv]_proj"]
    model = checkpoints.load_causal_lm(out)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            assert isinstance(module, quantized.QuantLinear) == (name not in kept), name
    assert model.model.layers[0].self_attn.specdeploy_kv_format == "fp8"  # the KV cache is still quantized
    convert_all(out, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "target" / "config.json").read_text())
    assert config["quantization"]["exclude_modules"] == [
        "lm_head", "transformer.layers.0.attention.qkv", "transformer.layers.0.mlp.proj", "transformer.layers.1.mlp.proj"]


def test_exclude_errors_say_what_to_do(tmp_path, tiny128_dir):
    model = checkpoints.load_causal_lm(tiny128_dir)
    with pytest.raises(SpecDeployError, match="'\\*mlp.down' matches no quantized Linear") as err:
        config.excluded_linears(model, "fp8", ["*mlp.down"])
    assert "model.layers.0.self_attn.q_proj" in err.value.hint
    with pytest.raises(SpecDeployError, match="not model.layers.1.mlp.up_proj") as err:
        config.excluded_linears(model, "fp8", ["model.layers.1.mlp.gate_proj"])
    assert "'model.layers.1.mlp.gate_proj' 'model.layers.1.mlp.up_proj'" in err.value.hint
    with pytest.raises(SpecDeployError, match="--exclude is not supported with --quant int8_sq"):
        Q.run(_build(tmp_path, tiny128_dir), "int8_sq", "none", exclude=["*down_proj"], **FAST)


def test_nvfp4_exports_but_the_loader_refuses_it(tmp_path, tiny128_dir):
    build = _build(tmp_path, tiny128_dir)
    out = Q.run(build, "nvfp4", "none", calib_size=2, calib_seq_len=32, report=True, report_prompts=1, report_tokens=4, report_texts=1)
    assert quantized.read_quant_config(out)["quant_algo"] == "NVFP4"
    assert "FP4 block quantization" in json.loads((out / "quantize.json").read_text())["skipped"]
    with pytest.raises(SpecDeployError, match="fake-quant loader cannot run") as err:
        checkpoints.load_causal_lm(out)
    assert "TensorRT-LLM" in err.value.hint


def test_interrupted_calibration_leaves_no_checkpoint(tmp_path, tiny128_dir, monkeypatch):
    build = _build(tmp_path, tiny128_dir)
    real_loop = calibrate.forward_loop

    def interrupted(batches, desc):
        def loop(model):
            real_loop(batches[:1], desc)(model)
            raise KeyboardInterrupt

        return loop

    monkeypatch.setattr(calibrate, "forward_loop", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Q.run(build, "fp8", "fp8", **FAST)
    assert not build.path("quantized").exists() and build.record("quantize") is None
    monkeypatch.setattr(calibrate, "forward_loop", real_loop)
    out = Q.run(build, "fp8", "fp8", **FAST)  # the rerun restarts cleanly
    assert (out / "model.safetensors").is_file()
    assert not list(build.root.glob(".quantized*"))


def test_speculative_decoding_exact_on_quantized_model(fp8_build):
    """Speculation on the quantized model reproduces that model's own plain greedy output (fp32)."""
    from specdeploy.runtime.decoding import generate
    from specdeploy.runtime.proposers import build_proposer
    from specdeploy.runtime.types import SamplingParams

    model = checkpoints.load_causal_lm(fp8_build.path("quantized"))
    tokenizer = checkpoints.load_tokenizer(fp8_build.path("quantized"))
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
    assert main(["quantize", "--build-dir", str(build_dir), "--quant", "fp8", "--kv-cache", "none", "--device", "cpu",
                 "--calib-size", "2", "--calib-seq-len", "32", "--no-report"]) == 0
    assert quantized.read_quant_config(build_dir / "quantized")["kv_cache_quant_algo"] is None
    assert BuildDir(build_dir).record("quantize")["device"].startswith("cpu")


def _medusa_spec(build: BuildDir, base_dir: Path) -> None:
    """A small untrained Medusa module in build/spec/ (heads start as the base lm_head)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from specdeploy.fileio import atomic_write_json
    from specdeploy.checkpoints.modules.medusa import modelopt_config as medusa_modelopt_config
    from specdeploy.speculator import convert_model, medusa, module_state_dict

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    config = medusa_modelopt_config(2, 1)
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
        assert f.get_tensor("medusa_heads.1.0.linear.input_scale").numel() == 1
        # each head's vocabulary projection (head[-1]) stays unquantized, as the base's lm_head
        assert f.get_tensor("medusa_heads.1.1.weight").dtype == torch.float32
        assert not any(k.startswith(("medusa_heads.0.1.", "medusa_heads.1.1.")) and k.endswith("_scale") for k in f.keys())
    assert json.loads((out / "spec" / "spec_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    assert build.record("quantize")["inputs"].keys() == {"resolve", "spec"}
    acceptance = json.loads((out / "quantize.json").read_text())["acceptance_length"]
    assert acceptance["module"] == "quantized"
    for side in ("unquantized_pair", "quantized_base"):  # TRT-LLM's definition, from the summed counts
        counts = acceptance["counts"][side]
        assert counts["target_forwards"] > 0 and 0 <= counts["accepted_draft_tokens"] <= counts["draft_tokens"]
        forwards = counts["target_forwards"]
        assert acceptance[side] == pytest.approx((counts["accepted_draft_tokens"] + forwards) / forwards)
    unquantized = acceptance["counts"]["unquantized_pair"]  # choices [[0], [0, 0]]: 2 drafts a round, fewer at the end
    assert acceptance["draft_tokens_per_round"] == pytest.approx(unquantized["draft_tokens"] / unquantized["target_forwards"])
    assert 1 < acceptance["draft_tokens_per_round"] <= 2
    assert "draft tokens a round: the module's recorded shape" in (out / "quantize.md").read_text()
    assert _recount_acceptance(build, prompts=2, max_new_tokens=8) == (
        acceptance["counts"]["unquantized_pair"]["accepted_draft_tokens"], acceptance["counts"]["unquantized_pair"]["target_forwards"])


def _stage_device(build: BuildDir) -> str:
    """The device the quantize stage computed on ("cuda:0 (NVIDIA ...)" -> "cuda:0")."""
    return build.record("quantize")["device"].split()[0]


def _recount_acceptance(build: BuildDir, prompts: int, max_new_tokens: int) -> tuple[int, int]:
    """(accepted draft tokens, target forwards) of the unquantized pair, counted here with the
    runtime directly: the report's figure must come from exactly these counts."""
    from specdeploy.quantize.report import report_prompts
    from specdeploy.runtime.decoding import generate
    from specdeploy.runtime.proposers import build_proposer
    from specdeploy.runtime.types import SamplingParams

    base = checkpoints.load_causal_lm(build.path("base"), "bfloat16", device=_stage_device(build))
    proposer = build_proposer("medusa", base, spec_dir=build.path("spec"))
    accepted = forwards = 0
    for ids in report_prompts(checkpoints.load_tokenizer(build.path("base")), prompts):
        metrics = generate(base, ids, SamplingParams(max_new_tokens=max_new_tokens), proposer, adaptive=False).metrics
        accepted, forwards = accepted + metrics.accepted_draft_tokens, forwards + metrics.target_forwards
    return accepted, forwards


# ----------------------------------------------------------------------------- devices and memory


def test_stage_records_its_device(fp8_build):
    assert fp8_build.record("quantize")["device"].startswith("cuda" if torch.cuda.is_available() else "cpu")  # auto
    assert "device" not in fp8_build.record("quantize")["settings"]  # a build stays complete on another host


def test_preflight_refuses_before_loading_the_base(tmp_path, tiny128_dir, monkeypatch):
    build = _build(tmp_path, tiny128_dir)
    monkeypatch.setenv("SPECDEPLOY_MEMORY_BUDGET_GIB", "0.0001")  # a 100 KiB device
    monkeypatch.setattr(stage, "load_base", lambda *a, **k: pytest.fail("loaded the base despite the preflight"))
    with pytest.raises(SpecDeployError, match="calibration needs") as err:
        Q.run(build, "fp8", "fp8", device="cpu", **FAST)
    assert "--calib-seq-len" in err.value.hint and "device_map=auto" in err.value.hint
    assert not build.path("quantized").exists() and build.record("quantize") is None


def test_preflight_names_no_report_when_only_the_report_is_too_big(tmp_path, tiny128_dir, monkeypatch, capsys):
    """Calibration holds one copy of the model, the report two (base + quantized)."""
    build = _build(tmp_path, tiny128_dir)
    base = build.path("base")
    dtype = stage.compute_dtype("bfloat16", torch.device("cpu"))  # float32 where the CPU has no native bf16
    weights = placement.preflight.weights_bytes(base, dtype)
    calibration = weights + placement.activation_bytes(base, 32, dtype)
    report = 2 * weights + placement.activation_bytes(base, stage.REPORT_PROMPT_TOKENS + 32, dtype)
    assert report > 1.1 * calibration
    monkeypatch.setenv("SPECDEPLOY_MEMORY_BUDGET_GIB", str(1.05 * calibration / 0.9 / 2**30))
    with pytest.raises(SpecDeployError, match="quality report") as err:
        Q.run(build, "fp8", "fp8", device="cpu", calib_size=2, calib_seq_len=32)
    assert "--no-report" in err.value.hint
    out = Q.run(build, "fp8", "fp8", device="cpu", **FAST)  # FAST has report=False: it fits
    assert (out / "model.safetensors").is_file()
    assert "specdeploy quantize: computing on cpu" in capsys.readouterr().err


def test_placement_spreads_over_gpus_only_when_one_is_too_small(tmp_path, tiny128_dir, monkeypatch):
    """The decision alone, with the GPUs simulated (free memory and count): 1 KiB on one GPU,
    1 GiB on all of them together -> device_map "auto"; with a single GPU -> refused."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(placement.preflight, "available_bytes", lambda device, all_gpus=False: 2**30 if all_gpus else 1024)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert placement.place("calibration", tiny128_dir, "bfloat16", gpu, 32, options=["x"]) == placement.Placement(gpu, "auto")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SpecDeployError, match="calibration needs"):
        placement.place("calibration", tiny128_dir, "bfloat16", gpu, 32, options=["x"])


def test_quantized_checkpoint_loads_with_a_device_map(fp8_build):
    """device_map (accelerate dispatch) gives the same numbers as a plain load on the device it
    picks: every layer on the CPU without CUDA, on the GPU with one; several GPUs share them."""
    out = fp8_build.path("quantized")
    with torch.no_grad():
        mapped = checkpoints.load_causal_lm(out, device_map="auto")
        ids = torch.tensor([[1, 5, 9, 30, 44, 2, 7]], device=mapped.device)
        plain = checkpoints.load_causal_lm(out, device=mapped.device)(ids).logits
        assert isinstance(mapped.model.layers[0].mlp.down_proj, quantized.QuantLinear)
        assert torch.equal(mapped(ids).logits, plain)


def test_the_runtime_loader_imports_no_modelopt_and_no_stage(fp8_build):
    """checkpoints.load_causal_lm reads downward only: serving a quantized checkpoint (the Triton
    model, verify, bench) imports neither ModelOpt nor any stage; the format tables import no torch."""
    import subprocess
    import sys

    script = f"""
import sys
from specdeploy.quantize.formats import QUANT_FORMATS
assert "torch" not in sys.modules and QUANT_FORMATS[0] == "fp8"
before = set(sys.modules)
from specdeploy import checkpoints
checkpoints.load_causal_lm({str(fp8_build.path("quantized"))!r})
stages = ("modelopt", "specdeploy.quantize", "specdeploy.speculator", "specdeploy.resolve", "specdeploy.trtllm", "specdeploy.triton")
loaded = sorted(m for m in set(sys.modules) - before if m.startswith(stages))
assert loaded == [], loaded
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.gpu
def test_fp8_on_cuda_serves_the_same_greedy_tokens_as_on_cpu(tmp_path, tiny128_dir, cuda_device):
    """Calibration + export on CUDA, then the checkpoint served on CUDA and on the CPU: identical
    greedy tokens in the checkpoint's parity dtype (float64: FP8 activations and K/V are rounded
    with static scales, and fp32's device-to-device matmul differences could flip a rounding)."""
    from specdeploy.runtime.decoding import generate
    from specdeploy.runtime.types import SamplingParams

    build = _build(tmp_path, tiny128_dir)
    out = Q.run(build, "fp8", "fp8", device=str(cuda_device), calib_size=4, calib_seq_len=48, report=True,
                report_prompts=2, report_tokens=6, report_texts=2)
    assert build.record("quantize")["device"].startswith("cuda")
    assert "perplexity" in json.loads((out / "quantize.json").read_text())
    dtype = quantized.parity_dtype(out)
    assert dtype == "float64"
    on_gpu = checkpoints.load_causal_lm(out, dtype, device=cuda_device)
    on_cpu = checkpoints.load_causal_lm(out, dtype, device="cpu")
    assert on_gpu.model.layers[0].self_attn.specdeploy_k_scale.device.type == "cuda"
    tokenizer = checkpoints.load_tokenizer(out)
    for text in ["def add(a, b):\n    return a + b\ndef add(", "The quick brown fox. The quick brown"]:
        ids = tokenizer(text)["input_ids"]
        gpu = generate(on_gpu, ids, SamplingParams(max_new_tokens=24)).token_ids
        assert gpu == generate(on_cpu, ids, SamplingParams(max_new_tokens=24)).token_ids


@pytest.mark.parametrize("fast", ["bfloat16", "float32"])
def test_a_half_type_the_cpu_lacks_computes_in_float32_never_in_the_other_half(monkeypatch, fast):
    """bf16 keeps 3 mantissa bits fewer than fp16: an fp16 deployment calibrated in bf16 would ship
    bf16-rounded embeddings, LM head and excluded layers, labelled float16."""
    monkeypatch.setattr(stage, "fast_dtype", lambda device: fast)
    cpu = torch.device("cpu")
    assert stage.compute_dtype("float16", cpu) == "float32"
    assert stage.compute_dtype("bfloat16", cpu) == ("bfloat16" if fast == "bfloat16" else "float32")
    assert stage.compute_dtype("float16", torch.device("cuda")) == "float16"


def test_awq_block_sizes_are_the_ones_tensorrt_llm_kernels_run():
    for qformat, kv, size in (("int4_awq", "none", 64), ("int4_awq", "fp8", 128), ("w4a8_awq", "fp8", 128)):
        config.check_format(qformat, kv, size)
    for qformat, kv, size in (("int4_awq", "none", 32), ("w4a8_awq", "fp8", 64), ("w4a8_awq", "fp8", 32)):
        with pytest.raises(SpecDeployError, match=f"block size {size}") as err:
            config.check_format(qformat, kv, size)
        assert err.value.hint.startswith("--awq-block-size") and err.value.hint.endswith("128")


def test_excluded_layers_need_no_whole_blocks():
    """A Linear whose input is no multiple of the block stays unquantized with --exclude: ModelOpt
    does not pack it, so it must not be refused."""
    from torch import nn

    mlp = nn.ModuleDict({"up_proj": nn.Linear(64, 200), "down_proj": nn.Linear(200, 64)})
    model = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"mlp": mlp})])})})
    with pytest.raises(SpecDeployError, match="down_proj has input size 200") as err:
        config.check_block_size(model, "int4_awq", 64)
    assert "--exclude 'model.layers.0.mlp.down_proj'" in err.value.hint
    kept = config.excluded_linears(model, "int4_awq", ["*down_proj"])
    assert kept == ["model.layers.0.mlp.down_proj"]
    config.check_block_size(model, "int4_awq", 64, kept)
    with pytest.raises(SpecDeployError) as err:  # W4A8 takes no --exclude: the hint does not offer it
        config.check_block_size(model, "w4a8_awq", 128)
    assert "--exclude" not in err.value.hint


def test_the_quantized_spec_module_keeps_its_lm_head_unquantized():
    """As ModelOpt's presets leave the base's LM head: the FP8 module's acceptance is not measured
    with a draft head no preset would make."""
    import modelopt.torch.quantization as mtq
    from torch import nn

    from specdeploy.quantize.spec_module import _spec_quant_config

    model = nn.ModuleDict({"eagle_module": nn.ModuleDict({"fc": nn.Linear(16, 8), "lm_head": nn.Linear(8, 32)})})
    forward = lambda m: m["eagle_module"]["lm_head"](m["eagle_module"]["fc"](torch.randn(4, 16)))  # noqa: E731
    mtq.quantize(model, _spec_quant_config("eagle_module"), forward)
    assert model["eagle_module"]["fc"].weight_quantizer.is_enabled
    assert not model["eagle_module"]["lm_head"].weight_quantizer.is_enabled
    assert not model["eagle_module"]["lm_head"].input_quantizer.is_enabled


def test_the_quantized_medusa_heads_keep_their_vocabulary_projections_unquantized():
    """Medusa's heads end in their own vocabulary projections (head[-1]), which no lm_head pattern
    names: they stay unquantized as EAGLE's lm_head does, the ResBlocks are FP8."""
    import modelopt.torch.quantization as mtq
    from torch import nn

    from specdeploy.checkpoints.modules.medusa import medusa_heads
    from specdeploy.quantize.spec_module import _spec_quant_config, _vocab_projections

    model = nn.ModuleDict({"medusa_heads": medusa_heads(num_heads=11, num_layers=1, hidden_size=8, vocab_size=32)})
    forward = lambda m: [head(torch.randn(4, 8)) for head in m["medusa_heads"]]  # noqa: E731
    mtq.quantize(model, _spec_quant_config("medusa_heads", _vocab_projections(model, "medusa_heads")), forward)
    for head in model["medusa_heads"]:  # 11 heads: medusa_heads.1.1 must not reach medusa_heads.11.0
        assert head[0].linear.weight_quantizer.is_enabled and head[0].linear.input_quantizer.is_enabled
        assert not head[-1].weight_quantizer.is_enabled and not head[-1].input_quantizer.is_enabled


@pytest.mark.parametrize("dtype,made_again", [("float16", True), ("bfloat16", False)])
def test_an_fp16_build_of_before_the_compute_fix_is_quantized_again_and_no_other(tmp_path, tiny128_dir, monkeypatch,
                                                                                  dtype, made_again):
    """An fp16 build made before computed in bf16 on a bf16 CPU: its record (no revision) no longer
    counts as complete; a bf16 build's output did not change and is kept."""
    build = _build(tmp_path, tiny128_dir)
    calls = []
    monkeypatch.setattr(stage, "_quantize_into", lambda tmp, *a, **k: calls.append(tmp))
    Q.run(build, "fp8", "fp8", dtype=dtype, **FAST)
    manifest = json.loads((build.root / "manifest.json").read_text())
    manifest["stages"]["quantize"]["settings"].pop("revision", None)  # as the build made before recorded it
    (build.root / "manifest.json").write_text(json.dumps(manifest))
    Q.run(build, "fp8", "fp8", dtype=dtype, **FAST)
    assert len(calls) == 1 + made_again
