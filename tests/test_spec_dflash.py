"""DFlash through the spec stage on the tiny Llama: ModelOpt training on the cached hidden states
lowers the loss, the spec/ folder is what the runtime proposer loads (greedy speculative output
equals plain greedy), checkpoints resume to the same weights, and the HF export names the target's
real depth. On the CPU explicitly (these pin the CPU numerics)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdeploy import cli
from specdeploy.errors import SpecDeployError
from specdeploy.checkpoints import load_causal_lm
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import SamplingParams
from specdeploy.speculator import dflash as dflash_spec
from specdeploy.speculator.distill import distill
from specdeploy.speculator.presets import settings_for
from specdeploy.speculator.train import TrainSettings, data_layers, train

TINY = dict(kind="dflash", num_prompts=8, max_new_tokens=24, window=48, batch_size=4, distill_batch=8, lr=3e-3)


pytestmark = pytest.mark.usefixtures("spec_cache")  # conftest: a private data cache, one thread


@pytest.fixture(scope="module")
def data(tiny_llama_dir):
    return distill(tiny_llama_dir, num_prompts=8, max_new_tokens=24, layers=data_layers(2), batch_size=8, device="cpu")


@pytest.fixture(scope="module")
def trained(tiny_llama_dir, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash") / "spec"
    stats = train(tiny_llama_dir, out, TrainSettings(steps=100, **TINY), data=data, device="cpu")
    return out, stats


def test_target_layer_is_a_captured_one():
    for layers in (2, 4, 30, 32):
        assert dflash_spec.hidden_layers(layers)[0] in data_layers(layers)
    assert dflash_spec.target_layer(30) == 14  # ModelOpt's default would be 15: not captured


def test_training_lowers_the_loss_and_writes_the_contract(tiny_llama_dir, trained):
    out, stats = trained
    assert stats["steps"] == 100
    assert stats["final_loss"] < 0.9 * stats["first_loss"]
    config = json.loads((out / "spec_config.json").read_text())
    assert config["kind"] == "dflash" and config["block_size"] == 4 and config["hidden_layers"] == [2]
    assert "dflash_offline" not in config["modelopt_config"]
    assert config["modelopt_config"]["dflash_use_torch_compile"] is False
    assert config["modelopt_config"]["dflash_architecture_config"]["num_hidden_layers"] == 1
    assert config["choices"] == [[0], [0, 0], [0, 0, 0]]
    assert all(k.startswith("dflash_module.") for k in load_file(str(out / "module.safetensors")))
    export = json.loads((out / "dflash_export" / "config.json").read_text())
    assert export["architectures"] == ["DFlashDraftModel"] and export["block_size"] == 4
    assert export["num_target_layers"] == 2 and export["dflash_config"]["target_layer_ids"] == [1]
    assert export["dflash_config"]["mask_token_id"] == config["modelopt_config"]["dflash_mask_token_id"]


def test_saved_module_drafts_exactly(tiny_llama_dir, trained, data):
    """Prompts of the training data: the base's own answers there are what the module learnt."""
    out, _ = trained
    target = load_causal_lm(tiny_llama_dir)
    proposer = build_proposer("dflash", target, spec_dir=out)
    saved = load_file(str(out / "module.safetensors"))
    loaded = proposer.module.state_dict()
    assert all(torch.equal(saved[f"dflash_module.{k}"], v) for k, v in loaded.items())
    params = SamplingParams(max_new_tokens=24)
    ends = (~data.valid).nonzero().squeeze(1).tolist()[:4]
    accepted = 0
    for start, end in zip([0] + [e + 1 for e in ends[:-1]], ends):
        prompt = data.tokens[start : end - 24].tolist()  # each sample ends with a 24-token answer
        plain = generate(target, prompt, params)
        spec = generate(target, prompt, params, proposer, adaptive=False)
        assert spec.token_ids == plain.token_ids
        accepted += spec.metrics.accepted_draft_tokens
    assert accepted > 0  # multi-token paths were taken (a random module is accepted nowhere here)


def test_resume_gives_the_same_weights(tiny_llama_dir, data, tmp_path):
    settings = dict(checkpoint_every=4, **TINY)
    first = train(tiny_llama_dir, tmp_path / "a", TrainSettings(steps=6, **settings), ckpt_dir=tmp_path / "ck", data=data,
                  stop_at=4, device="cpu")
    assert first["steps"] == 4
    resumed = train(tiny_llama_dir, tmp_path / "b", TrainSettings(steps=6, **settings), ckpt_dir=tmp_path / "ck",
                    data=data, device="cpu")
    straight = train(tiny_llama_dir, tmp_path / "c", TrainSettings(steps=6, **settings), data=data, device="cpu")
    a = load_file(str(tmp_path / "b" / "module.safetensors"))
    b = load_file(str(tmp_path / "c" / "module.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4)
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-3)


def test_bad_block_sizes_are_refused():
    with pytest.raises(SpecDeployError, match="block-size"):
        TrainSettings(block_size=1, **TINY).validate()
    with pytest.raises(SpecDeployError, match="block-size"):
        TrainSettings(**{**TINY, "window": 3}, block_size=4).validate()
    assert settings_for("dflash", "quick").kind == "dflash"


def test_cli_train_then_validate(tmp_path, capsys, tiny_llama_dir):
    build = tmp_path / "build"
    args = ["spec", "train", "--build-dir", str(build), "--model", str(tiny_llama_dir), "--spec", "dflash",
            "--steps", "3", "--num-prompts", "8", "--max-new-tokens", "24", "--window", "16", "--distill-batch", "8",
            "--block-size", "3", "--anchors", "4", "--device", "cpu"]
    assert cli.main(args) == 0
    assert "spec dflash: 3 steps" in capsys.readouterr().out
    config = json.loads((build / "spec" / "spec_config.json").read_text())
    assert config["block_size"] == 3 and config["modelopt_config"]["dflash_num_anchors"] == 4
    validate = ["spec", "validate", "--build-dir", str(build), "--prompts", "1", "--max-new-tokens", "12", "--dtype", "float32",
                "--device", "cpu"]
    assert cli.main(validate) == 0
    assert '"kind": "dflash"' in capsys.readouterr().out


def test_engine_pipeline_with_dflash(tmp_path, tiny_llama_dir):
    """`specdeploy engine --spec dflash --quant none` on the tiny model (in process, small data):
    every stage, the LLM-API config naming the exported draft, and a CPU deployment that drafts the
    same block and decodes exactly as plain greedy."""
    from specdeploy.manifest import BuildDir
    from specdeploy.pipeline import EngineOptions, run_pipeline
    from specdeploy.runtime.deployment import load_decoder

    opts = EngineOptions(model=str(tiny_llama_dir), spec="dflash", quant="none", trtllm_version="1.3.0", device="cpu",
                         serve_dtype="float32", cpu_draft_shape="fixed", calib_size=8, quant_report=False, spec_overrides={"steps": 3, "num_prompts": 8, "teacher_forced": 0,
                                                                           "max_new_tokens": 24, "window": 16})
    build = BuildDir(tmp_path / "tiny-dflash-none")
    rows = run_pipeline(build, opts)
    assert [r["stage"] for r in rows] == ["resolve", "spec", "quantize", "convert", "build", "package"]
    converted = json.loads((build.path("trtllm_ckpt") / "convert_summary.json").read_text())
    assert converted["engine_flow"] is False and "LLM API only" in converted["engine_reason"]
    gpu = converted["llmapi"]["speculative_config"]
    assert gpu["decoding_type"] == "DFlash" and gpu["speculative_model"].endswith("/llmapi/dflash_draft")
    deployment = build.path("triton_repo") / "cpu" / "tensorrt_llm" / "1" / "deployment.json"
    spec = json.loads(deployment.read_text())["spec"]
    assert (spec["kind"], spec["block_size"], spec["max_draft_len"]) == ("dflash", 4, gpu["max_draft_len"])
    decoder = load_decoder(deployment)
    target = load_causal_lm(tiny_llama_dir)
    params = SamplingParams(max_new_tokens=16)
    prompt = [5, 17, 33, 90, 4]
    assert generate(target, prompt, params, decoder.proposer, adaptive=False).token_ids == generate(target, prompt, params).token_ids
