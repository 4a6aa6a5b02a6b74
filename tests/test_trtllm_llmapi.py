"""The LLM-API route: every speculative_config it writes, checked against the field sets of each
release line it names (read from each release's llm_args.py; sources in specdeploy/trtllm/
releases.py and docs/releases.md), the combinations it refuses and why, and the draft folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from specdeploy.trtllm import convert, draft_folders, llmapi, releases, spec_input
from specdeploy.trtllm.llmapi import DraftStructure

RELEASES = list(releases.RELEASES.values())
CHAIN = DraftStructure.make("chain", 4)
DYNAMIC = DraftStructure.make("dynamic", 3, topk=2, total=5)
EAGLE3_CFG = {
    "eagle_use_torch_compile": False,
    "eagle_architecture_config": {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                  "intermediate_size": 96, "use_aux_hidden_state": True, "use_last_layernorm": True,
                                  "eagle_aux_hidden_state_layer_ids": [0, 1], "torch_dtype": "float32"},
}


def check_fields(config: dict, release: releases.Release) -> None:
    """What TRT-LLM's StrictBaseModel would do: refuse any key the release's config class lacks."""
    assert config["decoding_type"] in release.decoding_types.values()
    assert set(config) - {"decoding_type"} <= release.fields(config["decoding_type"])
    assert "eagle_choices" not in config  # discouraged in 1.1/1.2, deprecated in 1.3, removed in 1.4
    assert "eagle3_one_model" not in config  # two-model EAGLE-3 is deprecated in 1.2 and gone from 1.3 on


# What each release line's LLM API takes, as read (releases.py names the sources): 1.1 from the
# llm_args.py of main at 1.1.0rc6 (Ataraksia/TensorRT-LLM @ a451bf93; from_dict keys "Eagle",
# "DraftTarget", field speculative_model_dir); 1.2 from a 1.2-era llm_args.py (index file 7019226376)
# and NVIDIA's Triton guide for the 1.2.x containers (tutorials @ 4fe2b90: Eagle3, Draft_Target,
# speculative_model); 1.3 / 1.4 from the 1.3.0rc27 / 1.4.0rc1 API reference pages.
SCHEMA = {
    "1.1": ("Eagle", "DraftTarget", "speculative_model_dir"),
    "1.2": ("Eagle3", "Draft_Target", "speculative_model"),
    "1.3": ("Eagle3", "Draft_Target", "speculative_model"),
    "1.4": ("Eagle3", "Draft_Target", "speculative_model"),
}


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.name)
def test_every_config_fits_the_release_it_names(release):
    configs = [
        llmapi.speculative_config("eagle", CHAIN, release, draft="$BUILD_DIR/d", layers_to_capture=[3, 1, 26]),
        llmapi.speculative_config("draft", CHAIN, release, draft="$BUILD_DIR/trtllm_ckpt/draft_model"),
        llmapi.speculative_config("ngram", CHAIN, release),
    ]
    if release.dynamic_tree:
        configs.append(llmapi.speculative_config("eagle", DYNAMIC, release, draft="/d", layers_to_capture=[1]))
    for config in configs:
        check_fields(config, release)
    eagle, draft, ngram = configs[:3]
    eagle_type, draft_type, model_key = SCHEMA[release.name]
    assert eagle == {"decoding_type": eagle_type, "max_draft_len": 4, model_key: "$BUILD_DIR/d",
                     "eagle3_layers_to_capture": [1, 3, 26]}  # explicit: TRT-LLM's default set collapses on shallow bases
    assert draft == {"decoding_type": draft_type, "max_draft_len": 4, model_key: "$BUILD_DIR/trtllm_ckpt/draft_model"}
    assert ngram == {"decoding_type": "NGram", "max_draft_len": 4, **llmapi.NGRAM_DEFAULTS}
    assert llmapi.llm_options(ngram)["disable_overlap_scheduler"] is True
    assert "disable_overlap_scheduler" not in llmapi.llm_options(eagle)


def test_dynamic_tree_only_where_the_release_has_it():
    config = llmapi.speculative_config("eagle", DYNAMIC, releases.RELEASES[(1, 3)], draft="/d", layers_to_capture=[1])
    assert (config["use_dynamic_tree"], config["dynamic_tree_max_topK"], config["max_total_draft_tokens"], config["max_draft_len"]) == (True, 2, 5, 3)
    for old in ((1, 1), (1, 2)):
        with pytest.raises(SpecDeployError, match=f"{old[0]}.{old[1]} has no EAGLE-3 dynamic tree") as err:
            llmapi.speculative_config("eagle", DYNAMIC, releases.RELEASES[old], draft="/d")
        assert "--trtllm-version 1.3" in err.value.hint
    with pytest.raises(SpecDeployError, match="EAGLE-3 only"):
        llmapi.speculative_config("ngram", DYNAMIC, releases.RELEASES[(1, 3)])
    # TRT-LLM's bounds: max_draft_len <= max_total_draft_tokens <= topK * max_draft_len
    with pytest.raises(SpecDeployError, match=r"outside \[max_draft_len 3, topK \* max_draft_len 6\]"):
        DraftStructure.make("dynamic", 3, topk=2, total=7)
    assert DraftStructure.make("dynamic", 3, topk=2).total == 6  # min(10, topK * depth)


def test_release_lines_as_read():
    table = releases.RELEASES
    assert table[(1, 2)].static_tree == "discouraged" and not table[(1, 2)].dynamic_tree
    assert table[(1, 3)].static_tree == "deprecated" and table[(1, 3)].dynamic_tree
    assert "eagle_choices" not in table[(1, 4)].fields("Eagle3")  # PR #18210
    assert all("eagle3_one_model" not in r.fields("Eagle3") for r in (table[(1, 3)], table[(1, 4)]))
    assert releases.release_for("1.2.0rc6").name == "1.2" and releases.release_for("1.1.0").name == "1.1"
    with pytest.raises(SpecDeployError, match="1.5.0 was not checked"):
        releases.release_for("1.5.0")
    with pytest.raises(SpecDeployError, match="1.0.0 was not checked"):
        releases.release_for("1.0.0")
    assert [releases.has_engine_flow(v) for v in ("1.1.0", "1.2.1", "1.3.0rc29", "1.4.0rc1")] == [True, True, False, False]
    # the serve flag: --config arrived in 1.2 (PR #9104); 1.1's trtllm-serve has --extra_llm_api_options only
    assert [r.serve_flag for r in RELEASES] == ["--extra_llm_api_options", "--config", "--config", "--config"]
    # each release's own transformers pin (its wheel's Requires-Dist)
    assert [r.transformers for r in RELEASES] == ["4.56.0", "4.57.3", "5.5.4", "5.5.4"]


def test_the_default_release_and_its_image_agree():
    """The default build targets 1.2.1, which Triton's compatibility matrix puts in the 26.04-26.07
    trtllm-python-py3 images (server docs/introduction/compatibility.md @ e1db8a603)."""
    default = releases.release_for(releases.DEFAULT_TRTLLM_VERSION)
    assert (default.version, default.triton_image) == ("1.2.1", "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3")
    assert releases.RELEASES[(1, 1)].triton_image == "nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3"
    assert all(r.triton_image is None and "no NGC Triton image" in r.triton_image_note for r in RELEASES[2:])
    assert default.as_dict()["serve_image"] == "nvcr.io/nvidia/tensorrt-llm/release:1.2.1"


@pytest.mark.parametrize("kind, quant, kv, release, reason", [
    ("medusa", None, None, (1, 3), "no medusa speculative decoding"),
    ("none", "W8A8_SQ_PER_CHANNEL", None, (1, 2), "no INT8 SmoothQuant"),
    ("eagle", "FP8", "FP8", (1, 1), "only from 1.2 on (PR #8910"),
    ("dflash", None, None, (1, 2), "no DFlash"),
])
def test_refused_combinations_give_their_reason(kind, quant, kv, release, reason):
    assert reason in llmapi.refusal(kind, quant, releases.RELEASES[release], kv)


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.name)
def test_the_default_build_has_an_llmapi_route_where_the_release_runs_it(release):
    """EAGLE-3 on FP8 weights + FP8 KV (the default build): 1.2 on; 1.1 runs it with a bf16 KV cache."""
    expected = None if release.fp8_kv_eagle3 else "PR #8910"
    reason = llmapi.refusal("eagle", "FP8", release, "FP8")
    assert (reason is None) if expected is None else (expected in reason)
    assert llmapi.refusal("eagle", "FP8", release, None) is None


def test_int8_sq_goes_to_the_engine_flow_and_is_refused_on_the_llm_api(tiny_llama_dir, tmp_path):
    model = tmp_path / "sq"
    shutil.copytree(tiny_llama_dir, model)
    (model / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W8A8_SQ_PER_CHANNEL"}}))
    with pytest.raises(SpecDeployError, match="no INT8 SmoothQuant"):
        convert.convert_routes(model, tmp_path / "out", spec_input.load_spec(None), route="llmapi")


def test_draft_target_carries_its_draft_model_in_the_build(tiny_llama_dir, tiny_draft_dir, tmp_path):
    spec = spec_input.load_spec(None, kind="draft", draft_model=tiny_draft_dir, max_draft_len=3)
    summary = convert.convert_routes(tiny_llama_dir, tmp_path / "out", spec, route="llmapi", root=tmp_path)
    options = yaml.safe_load((tmp_path / "out" / "llmapi" / "speculative_config.yaml").read_text())
    # the carried draft as it is (the engine flow's and the CPU's), the LLM API's in bfloat16 (it is float32)
    assert options == {"speculative_config": {"decoding_type": "Draft_Target", "max_draft_len": 3,
                                              "speculative_model": "$BUILD_DIR/out/llmapi/draft_model_bf16"},
                       "disable_overlap_scheduler": True}
    assert summary["draft_model"] == "$BUILD_DIR/out/draft_model" and summary["engine_flow"] is False
    assert (tmp_path / "out" / "draft_model" / "model.safetensors").read_bytes() == (tiny_draft_dir / "model.safetensors").read_bytes()
    assert summary["llmapi"]["structure"] == {"mode": "chain", "max_draft_len": 3}


def test_a_float32_model_gets_a_bfloat16_copy_on_the_llmapi_route(tiny_llama_dir, tmp_path):
    """TensorRT-LLM's PyTorch backend takes the dtype from config.json and its kernels lack float32
    (#5260): the route names a bfloat16 copy that transformers reads as the same model, rounded."""
    from transformers import AutoModelForCausalLM

    source = (tiny_llama_dir / "model.safetensors").read_bytes()
    summary = convert.convert_routes(tiny_llama_dir, tmp_path / "out", spec_input.load_spec(None, kind="none"),
                                     route="llmapi", root=tmp_path)
    half = tmp_path / "out" / "llmapi" / "model_bf16"
    assert summary["llmapi"]["model"] == "$BUILD_DIR/out/llmapi/model_bf16"
    assert {p.name for p in tiny_llama_dir.iterdir() if p.is_file()} <= {p.name for p in half.iterdir()}
    ids = torch.tensor([[1, 17, 60, 2, 201, 33]])
    with torch.inference_mode():
        full = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
        copy = AutoModelForCausalLM.from_pretrained(half).eval()  # in the dtype its config declares
        assert copy.dtype == torch.bfloat16 and full.dtype == torch.float32
        for name, weight in full.state_dict().items():
            assert torch.equal(copy.state_dict()[name], weight.to(torch.bfloat16)), name
        scale = full(ids).logits.abs().max()
        torch.testing.assert_close(copy(ids).logits.float(), full(ids).logits, rtol=0, atol=0.05 * float(scale))
    assert (tiny_llama_dir / "model.safetensors").read_bytes() == source  # hard-linked, never written through
    # a bfloat16 model is named as it is
    (tmp_path / "bf16").mkdir()
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tiny_llama_dir / name, tmp_path / "bf16" / name)
    summary = convert.convert_routes(tmp_path / "bf16", tmp_path / "out2", spec_input.load_spec(None, kind="none"),
                                     route="llmapi", root=tmp_path)
    assert summary["llmapi"]["model"] == "$BUILD_DIR/bf16" and not (tmp_path / "out2" / "llmapi" / "model_bf16").exists()


def _eagle3_spec(base: Path, out: Path) -> dict[str, torch.Tensor]:
    import modelopt.torch.speculative as mtsp
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    mtsp.convert(model, [("eagle", json.loads(json.dumps(EAGLE3_CFG)))])
    torch.manual_seed(5)
    for p in model.eagle_module.parameters():
        torch.nn.init.normal_(p, std=0.1)
    out.mkdir(parents=True, exist_ok=True)
    module = {k: v.contiguous() for k, v in model.state_dict().items() if k.startswith("eagle_module.")}
    save_file(module, str(out / "module.safetensors"))
    (out / "spec_config.json").write_text(json.dumps({"kind": "eagle", "modelopt_config": EAGLE3_CFG, "choices": [[0], [0, 0]]}))
    return module


def test_eagle3_draft_folder_takes_the_form_every_loader_accepts(tiny_llama_dir, tmp_path):
    module = _eagle3_spec(tiny_llama_dir, tmp_path / "spec")
    spec = spec_input.load_spec(tmp_path / "spec")
    with pytest.raises(SpecDeployError, match="EAGLE-1/2 \\(EagleForCausalLM\\) only"):  # no engine flow for it ...
        convert.convert_routes(tiny_llama_dir, tmp_path / "engine", spec, route="engine")
    summary = convert.convert_routes(tiny_llama_dir, tmp_path / "out", spec, spec_dir=tmp_path / "spec",
                                     base_dir=tiny_llama_dir, root=tmp_path)  # ... this route takes it
    config = summary["llmapi"]["speculative_config"]
    check_fields(config, releases.RELEASES[(1, 2)])
    assert config == {"decoding_type": "Eagle3", "max_draft_len": 4, "speculative_model": "$BUILD_DIR/out/llmapi/eagle3_draft",
                      "eagle3_layers_to_capture": [0, 1]}
    draft = tmp_path / "out" / "llmapi" / "eagle3_draft"
    exported = load_file(str(draft / "model.safetensors"))
    assert {k for k in exported if k.startswith("midlayer.")} and not any(k.startswith("layers.") for k in exported)
    # the trained weights, not a fresh init, in the deployment's dtype (bf16; ModelOpt exports fp32)
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert torch.equal(exported["fc.weight"], module["eagle_module.fc.weight"].to(torch.bfloat16))
    assert torch.equal(exported["midlayer.hidden_norm.weight"], module["eagle_module.layers.0.hidden_norm.weight"].to(torch.bfloat16))
    draft_config = json.loads((draft / "config.json").read_text())
    assert "Eagle3" in draft_config["architectures"][0]
    assert draft_config["torch_dtype"] == draft_config["dtype"] == "bfloat16"
    assert draft_config["rope_scaling"] is None  # the plain RoPE it was trained with, not ModelOpt's injected YaRN
    assert summary["engine_flow"] is False and "EAGLE-1/2" in summary["engine_reason"]


def test_the_draft_folder_is_modelopts_draft_file_not_the_lora_beside_it(tiny_llama_dir, tmp_path):
    """ModelOpt exports a module trained with eagle_base_lora as model.safetensors (the draft) and
    adapter_model.safetensors (the base's LoRA) side by side: the draft folder holds the first only."""
    _eagle3_spec(tiny_llama_dir, tmp_path / "spec")
    export = draft_folders.export_eagle3(tiny_llama_dir, tmp_path / "spec", tmp_path / "export")
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 64)},
              str(export / "adapter_model.safetensors"))
    draft = draft_folders.write_draft_folder(export, tmp_path / "draft", None)
    tensors = load_file(str(draft / "model.safetensors"))
    assert "fc.weight" in tensors and not any(k.startswith("base_model.") for k in tensors)


def test_pipeline_stages_with_an_eagle3_module(tiny_llama_dir, tmp_path):
    """convert (auto route) + build on a build directory whose spec stage trained EAGLE-3: no engine
    flow (said plainly, in the summary, the plan and the script), the LLM-API files instead."""
    import subprocess

    from specdeploy.trtllm import build as trt_build

    build = BuildDir(tmp_path / "b")
    with build.stage("resolve", "base", {}) as tmp:
        for f in Path(tiny_llama_dir).iterdir():
            shutil.copy(f, tmp / f.name)
    with build.stage("spec", "spec", {}, consumes=("resolve",)) as tmp:  # what the spec stage leaves behind
        _eagle3_spec(tiny_llama_dir, tmp)
        draft_folders.export_eagle3(tiny_llama_dir, tmp, tmp / "eagle3_export")
    out = convert.run(build, kind="eagle", max_draft_len=3)
    summary = json.loads((out / "convert_summary.json").read_text())
    assert summary["engine_flow"] is False and "EAGLE-3" in summary["engine_reason"] and not (out / "target").exists()
    options = yaml.safe_load((out / "llmapi" / "speculative_config.yaml").read_text())
    assert options["speculative_config"]["speculative_model"] == "$BUILD_DIR/trtllm_ckpt/llmapi/eagle3_draft"
    assert (out / "llmapi" / "eagle3_draft" / "config.json").exists() and options["speculative_config"]["max_draft_len"] == 3
    engines = trt_build.run(build)
    plan = json.loads((engines / trt_build.PLAN).read_text())
    assert plan["engine_flow"] is False and plan["commands"] == [] and plan["engines_built"] is False
    done = subprocess.run(["bash", str(engines / trt_build.SCRIPT)], capture_output=True, text=True)
    assert subprocess.run(["bash", "-n", str(engines / trt_build.SCRIPT)]).returncode == 0
    assert done.returncode == 5 and "no TensorRT-LLM engine flow for this build: the engine flow runs EAGLE-1/2" in done.stderr


def test_a_build_without_any_route_says_why_for_each(tiny_llama_dir, tmp_path):
    """EAGLE-3 on an FP8 KV cache for 1.1: no engine flow for EAGLE-3, no one-model EAGLE-3 on FP8 KV."""
    spec_dir = tmp_path / "spec"
    _eagle3_spec(tiny_llama_dir, spec_dir)
    model = tmp_path / "fp8kv"
    shutil.copytree(tiny_llama_dir, model)
    (model / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    summary = convert.convert_routes(model, tmp_path / "out", spec_input.load_spec(spec_dir), trtllm_version="1.1.0")
    assert summary["engine_flow"] is False and summary["llmapi"] is None
    assert "EAGLE-1/2" in summary["engine_reason"] and "PR #8910" in summary["llmapi_reason"]
    with pytest.raises(SpecDeployError, match="--kv-cache none"):  # insisting on a route it lacks
        convert.convert_routes(model, tmp_path / "x", spec_input.load_spec(spec_dir), route="llmapi", trtllm_version="1.1.0")


def test_a_quantized_module_from_quantize_spec_is_refused_with_the_reason(tiny_llama_dir, tmp_path):
    model = tmp_path / "quantized"
    shutil.copytree(tiny_llama_dir, model)
    (model / "spec").mkdir()
    (model / "spec" / "spec_config.json").write_text(json.dumps({"kind": "eagle", "quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(SpecDeployError, match="could not be confirmed") as err:
        spec_input.refuse_quantized_spec(model)
    assert "without --quantize-spec" in err.value.hint
    spec_input.refuse_quantized_spec(tiny_llama_dir)  # no quantized module: nothing to refuse


# ------------------------------------------------------------------------------ DFlash


def dflash_spec(base: Path, out: Path) -> dict[str, torch.Tensor]:
    """What the spec stage leaves for DFlash (a freshly initialized module): spec_config.json,
    module.safetensors and ModelOpt's export in dflash_export/."""
    from transformers import AutoConfig

    from specdeploy.speculator import convert_model, module_state_dict
    from specdeploy.speculator import dflash as dflash_spec_module
    from specdeploy.speculator.common import load_offline_base, save_tensors
    from specdeploy.speculator.train import export_draft

    config = dflash_spec_module.modelopt_config(AutoConfig.from_pretrained(base), block_size=4, anchors=8)
    model = convert_model(load_offline_base(base, torch.float32), "dflash", {**config, "dflash_offline": True})
    out.mkdir(parents=True, exist_ok=True)
    module = module_state_dict(model, "dflash")
    save_tensors(out / "module.safetensors", module)
    (out / "spec_config.json").write_text(json.dumps({"kind": "dflash", "modelopt_config": config, "block_size": 4}))
    export_draft(base, out, device="cpu")
    return module


DFLASH = {"mask_token_id": 383, "target_layer_ids": [1]}


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.name)
def test_dflash_config_only_where_the_release_has_it(release):
    chain = DraftStructure.make("chain", 3)
    if not release.dflash:
        assert release.line < (1, 3)  # DFlashDecodingConfig arrived in the 1.3 line
        assert "no DFlash" in llmapi.refusal("dflash", None, release)
        with pytest.raises(SpecDeployError, match="no DFlash"):
            llmapi.speculative_config("dflash", chain, release, draft="/d", dflash=DFLASH)
        return
    assert llmapi.refusal("dflash", None, release) is None
    config = llmapi.speculative_config("dflash", chain, release, draft="$BUILD_DIR/d", dflash=DFLASH)
    check_fields(config, release)
    assert config == {"decoding_type": "DFlash", "max_draft_len": 3, "speculative_model": "$BUILD_DIR/d", **DFLASH}
    with pytest.raises(SpecDeployError, match="dynamic tree is EAGLE-3 only"):
        llmapi.speculative_config("dflash", DYNAMIC, release, draft="/d", dflash=DFLASH)


def test_dflash_routes_and_draft_folder(tiny_llama_dir, tmp_path):
    module = dflash_spec(tiny_llama_dir, tmp_path / "spec")
    spec = spec_input.load_spec(tmp_path / "spec")
    with pytest.raises(SpecDeployError, match="LLM API only"):  # no engine flow for it, even where the release has one
        convert.convert_routes(tiny_llama_dir, tmp_path / "engine", spec, route="engine")
    refused = convert.convert_routes(tiny_llama_dir, tmp_path / "old", spec, spec_dir=tmp_path / "spec", root=tmp_path)
    assert refused["llmapi"] is None and "no DFlash" in refused["llmapi_reason"]  # the default release, 1.2
    summary = convert.convert_routes(tiny_llama_dir, tmp_path / "out", spec, spec_dir=tmp_path / "spec",
                                     base_dir=tiny_llama_dir, root=tmp_path, trtllm_version="1.3.0")
    config = summary["llmapi"]["speculative_config"]
    check_fields(config, releases.RELEASES[(1, 3)])
    assert config == {"decoding_type": "DFlash", "max_draft_len": 3,  # the whole block: block_size - 1
                      "speculative_model": "$BUILD_DIR/out/llmapi/dflash_draft", **DFLASH}
    draft = tmp_path / "out" / "llmapi" / "dflash_draft"
    draft_config = json.loads((draft / "config.json").read_text())
    assert draft_config["architectures"] == ["DFlashDraftModel"] and draft_config["block_size"] == 4
    assert draft_config["dflash_config"]["mask_token_id"] == 383 and draft_config["num_target_layers"] == 2
    assert draft_config["torch_dtype"] == draft_config["dtype"] == "bfloat16"
    exported = load_file(str(draft / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], module["dflash_module.fc.weight"].to(torch.bfloat16))  # the module's, cast
    with pytest.raises(SpecDeployError, match="at most block_size - 1 = 3"):
        convert.convert_routes(tiny_llama_dir, tmp_path / "long", spec_input.load_spec(tmp_path / "spec", max_draft_len=5),
                               spec_dir=tmp_path / "spec", root=tmp_path, trtllm_version="1.3.0", route="llmapi")


# ------------------------------------------------------------------------------ speculation at scale

CPU_PLAN = {"plan": {"ar_tokens_per_s": 20.0, "estimates": [{"shape": "chain 1", "round_s": 0.055},
                                                             {"shape": "chain 4", "round_s": 0.08}]},
            "load": {"spec_off_above": 4}}


def test_scale_knobs_start_from_the_cpu_planners_break_even():
    # a chain-4 round took 0.08 s = 1.6 plain steps (1 / 20 tokens/s): it pays while 1 + 4 * rate > 1.6
    assert llmapi.break_even_rate(CPU_PLAN, 4) == pytest.approx(0.15)
    assert llmapi.break_even_rate(CPU_PLAN, 2) is None  # that chain was not measured: nothing to start from
    assert llmapi.break_even_rate(None, 4) is None
    expected = {
        "1.1": {"max_concurrency": 4},
        "1.2": {"max_concurrency": 4},
        "1.3": {"max_concurrency": 4, "acceptance_rate_threshold": 0.15, "acceptance_rate_window_size": 128},
        "1.4": {"max_concurrency": 4, "acceptance_rate_threshold": 0.15, "acceptance_rate_window_size": 128},
    }
    for release in RELEASES:
        knobs = llmapi.scale_knobs(release, 4, CPU_PLAN)
        assert knobs == expected[release.name], release.name
        config = llmapi.speculative_config("eagle", CHAIN, release, draft="/d", layers_to_capture=[1])
        check_fields(llmapi.checked_config({**config, **knobs}, release), release)
    with pytest.raises(SpecDeployError, match=r"1.2 does not accept \['acceptance_rate_threshold'"):
        llmapi.checked_config({"decoding_type": "Eagle3", "acceptance_rate_threshold": 0.1}, releases.RELEASES[(1, 2)])
