"""The TRT-LLM >= 1.2 route: speculative_config YAML for trtllm-serve and Triton's llmapi
model.yaml (keys from TRT-LLM docs/source/features/speculative-decoding.md and
triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml, see specdeploy/trtllm/llmapi.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from specdeploy.errors import SpecDeployError
from specdeploy.trtllm import convert, llmapi

MODEL_YAML_KEYS = {"model", "backend", "tensor_parallel_size", "pipeline_parallel_size", "triton_config"}


def test_speculative_configs_per_kind(tmp_path):
    draft = llmapi.speculative_config("draft", 5, tmp_path / "draft")
    assert draft == {"decoding_type": "DraftTarget", "max_draft_len": 5, "speculative_model_dir": str(tmp_path / "draft")}
    ngram = llmapi.speculative_config("ngram", 3, ngram={"max_matching_ngram_size": 2})
    assert ngram["decoding_type"] == "NGram" and ngram["max_matching_ngram_size"] == 2 and ngram["is_keep_all"] is True
    assert "speculative_model_dir" not in ngram
    assert llmapi.speculative_config("eagle", 4, tmp_path)["decoding_type"] == "Eagle3"


@pytest.mark.parametrize("kind", ["medusa", "none"])
def test_kinds_without_llmapi_support_are_refused(kind):
    with pytest.raises(SpecDeployError, match="no speculative decoding") as err:
        llmapi.speculative_config(kind, 4)
    assert "engine flow" in err.value.hint


def test_draft_target_yaml_and_model_yaml(tiny_llama_dir, tiny_draft_dir, tmp_path):
    spec = convert.load_spec(None, kind="draft", draft_model=tiny_draft_dir, max_draft_len=3)
    llmapi.write_llmapi(tiny_llama_dir, tmp_path, spec=spec, tp=2)
    options = yaml.safe_load((tmp_path / "speculative_config.yaml").read_text())
    assert options == {"speculative_config": {"decoding_type": "DraftTarget", "max_draft_len": 3,
                                              "speculative_model_dir": str(Path(tiny_draft_dir).resolve())},
                       "disable_overlap_scheduler": True}
    model = yaml.safe_load((tmp_path / "model.yaml").read_text())
    assert MODEL_YAML_KEYS <= set(model)
    assert model["backend"] == "pytorch" and model["tensor_parallel_size"] == 2 and model["model"] == str(Path(tiny_llama_dir).resolve())
    assert model["speculative_config"] == options["speculative_config"]
    assert model["triton_config"] == {"max_batch_size": 0, "decoupled": True}


EAGLE3_CFG = {
    "eagle_use_torch_compile": False,
    "eagle_architecture_config": {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                  "intermediate_size": 96, "use_aux_hidden_state": True, "use_last_layernorm": True,
                                  "eagle_aux_hidden_state_layer_ids": [0, 1], "torch_dtype": "float32"},
}


def test_eagle3_draft_folder_and_yaml(tiny_llama_dir, tmp_path):
    """The EAGLE-3 module ModelOpt trains goes the LLM-API way: ModelOpt's own draft export + Eagle3."""
    import modelopt.torch.speculative as mtsp
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    mtsp.convert(model, [("eagle", json.loads(json.dumps(EAGLE3_CFG)))])
    torch.manual_seed(5)
    for p in model.eagle_module.parameters():
        torch.nn.init.normal_(p, std=0.1)
    spec_dir = tmp_path / "spec"
    spec_dir.mkdir()
    module = {k: v.contiguous() for k, v in model.state_dict().items() if k.startswith("eagle_module.")}
    save_file(module, str(spec_dir / "module.safetensors"))
    (spec_dir / "spec_config.json").write_text(json.dumps({"kind": "eagle", "modelopt_config": EAGLE3_CFG, "choices": [[0], [1], [0, 0], [0, 0, 0]]}))
    spec = convert.load_spec(spec_dir)
    with pytest.raises(SpecDeployError, match="EAGLE-3"):  # the engine flow refuses it ...
        convert.convert_all(tiny_llama_dir, tmp_path / "engine", spec=spec)
    summary = llmapi.write_llmapi(tiny_llama_dir, tmp_path / "llmapi", spec=spec, spec_dir=spec_dir, base_dir=tiny_llama_dir)  # ... this route takes it
    draft = tmp_path / "llmapi" / "eagle3_draft"
    # TRT-LLM's EagleDecodingConfig: max_draft_len = draft layers (tree depth), max_total_draft_tokens = nodes
    assert summary["speculative_config"] == {
        "decoding_type": "Eagle3", "max_draft_len": 3, "eagle_choices": [[0], [1], [0, 0], [0, 0, 0]],
        "max_total_draft_tokens": 4, "speculative_model_dir": str(draft.resolve())}
    config = json.loads((draft / "config.json").read_text())
    assert "Eagle3" in config["architectures"][0]
    exported = load_file(str(next(draft.glob("*.safetensors"))))
    fc = [k for k in exported if k.endswith("fc.weight")]
    assert fc and torch.equal(exported[fc[0]], module["eagle_module.fc.weight"])  # the trained weights, not a fresh init
    options = yaml.safe_load((tmp_path / "llmapi" / "speculative_config.yaml").read_text())
    assert options == {"speculative_config": summary["speculative_config"]}


def test_pipeline_stages_with_an_eagle3_module(tiny_llama_dir, tmp_path):
    """convert (auto route) + build on a build directory whose spec stage trained EAGLE-3: no engine
    flow (said plainly, in the summary, the plan and the script), the LLM-API files instead."""
    import shutil
    import subprocess

    import modelopt.torch.speculative as mtsp
    from transformers import LlamaForCausalLM

    from specdeploy.manifest import BuildDir
    from specdeploy.trtllm import build as trt_build

    build = BuildDir(tmp_path / "b")
    with build.stage("resolve", "base", {}) as tmp:
        for f in Path(tiny_llama_dir).iterdir():
            shutil.copy(f, tmp / f.name)
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    mtsp.convert(model, [("eagle", json.loads(json.dumps(EAGLE3_CFG)))])
    with build.stage("spec", "spec", {}, consumes=("resolve",)) as tmp:  # what the spec stage leaves behind
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k.startswith("eagle_module.")}, str(tmp / "module.safetensors"))
        (tmp / "spec_config.json").write_text(json.dumps({"kind": "eagle", "modelopt_config": EAGLE3_CFG, "choices": [[0], [0, 0]]}))
        llmapi.export_eagle3_draft(tiny_llama_dir, tmp, tmp / "eagle3_export")
    out = convert.run(build, kind="eagle")
    summary = json.loads((out / "convert_summary.json").read_text())
    assert summary["engine_flow"] is False and "EAGLE-3" in summary["reason"] and not (out / "target").exists()
    options = yaml.safe_load((out / "llmapi" / "speculative_config.yaml").read_text())
    assert options["speculative_config"]["decoding_type"] == "Eagle3"
    assert options["speculative_config"]["speculative_model_dir"] == str((build.path("spec") / "eagle3_export").resolve())
    engines = trt_build.run(build)
    plan = json.loads((engines / trt_build.PLAN).read_text())
    assert plan["engine_flow"] is False and plan["commands"] == [] and plan["engines_built"] is False
    done = subprocess.run(["bash", str(engines / trt_build.SCRIPT)], capture_output=True, text=True)
    assert subprocess.run(["bash", "-n", str(engines / trt_build.SCRIPT)]).returncode == 0
    assert done.returncode == 5 and "no TensorRT-LLM engine flow for this build: EAGLE module cannot" in done.stderr
