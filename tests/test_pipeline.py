"""`make engine` end to end on a tiny model: every stage, reruns skipped, a killed run resumed,
then `verify` against real tritonservers (the load test: tests/test_loadtest.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from specdeploy.device import fast_dtype
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from tests.tiny import make_llama

STAGES = ["resolve", "quantize", "convert", "build", "package"]
# the deployments these tests check draft convert's shape (the planner's choice is tested in test_triton_package)
ENGINE = [sys.executable, "-m", "specdeploy", "engine", "--calib-size", "8", "--no-quant-report", "--cpu-draft-shape", "fixed"]


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("tiny_long")
    make_llama(out, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), context=2048, seed=3)
    return out


def _engine(model: Path, build_dir: Path, quant: str, *spec: str) -> subprocess.CompletedProcess:
    spec = spec or ("--spec", "draft", "--draft", str(model))  # self-draft: drafts get accepted
    cmd = ENGINE + ["--model", str(model), "--quant", quant, "--build-dir", str(build_dir), *spec]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def _built(model: Path, build_dir: Path, quant: str, *spec: str) -> BuildDir:
    done = _engine(model, build_dir, quant, *spec)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "NOT built on this host" in done.stdout  # says plainly what needs a GPU host
    return BuildDir(build_dir)


@pytest.fixture(scope="module")
def engine_build(long_context_model, tmp_path_factory) -> BuildDir:
    return _built(long_context_model, tmp_path_factory.mktemp("builds") / "tiny-draft-fp8", "fp8")


def _verify(build: BuildDir, *extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "specdeploy", "verify", "--build-dir", str(build.root),
         "--prompts", "2", "--max-new-tokens", "16", *extra],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((build.path("reports") / "verify.json").read_text())


def test_engine_records_every_stage_and_rerun_skips(engine_build, long_context_model):
    manifest = engine_build.manifest()
    assert sorted(manifest["stages"]) == sorted(STAGES)
    assert (engine_build.path("triton_repo") / "cpu" / "ensemble" / "config.pbtxt").exists()
    assert (engine_build.path("engines") / "build_engines.sh").exists()
    before = {s: r["finished"] for s, r in manifest["stages"].items()}
    again = _engine(long_context_model, engine_build.root, "fp8")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("complete (skipped)") == len(STAGES)
    assert {s: r["finished"] for s, r in engine_build.manifest()["stages"].items()} == before


def test_a_moved_build_stays_complete_and_a_draft_changed_in_place_is_converted_again(long_context_model, tmp_path):
    """Draft-target: the build carries its draft, so a copy of the build elsewhere reruns nothing;
    new weights in the draft's own folder (same path) are converted and packaged again."""
    draft = Path(shutil.copytree(long_context_model, tmp_path / "draft"))
    args = ("--kv-cache", "none", "--spec", "draft", "--draft", str(draft))
    _built(long_context_model, tmp_path / "here", "none", *args)
    moved = Path(shutil.copytree(tmp_path / "here", tmp_path / "elsewhere" / "build"))
    again = _engine(long_context_model, moved, "none", *args)
    assert again.returncode == 0 and again.stdout.count("complete (skipped)") == len(STAGES), again.stdout[-3000:]
    for engine in ("vllm", "sglang"):  # their draft is the carried one, wherever the build is mounted
        serve = (moved / "triton_repo" / engine / "serve.sh").read_text()
        assert "$BUILD_DIR/trtllm_ckpt/draft_model" in serve and "/$BUILD_DIR" not in serve

    weights = load_file(draft / "model.safetensors")
    (draft / "model.safetensors").unlink()  # a new fine-tune written in the draft's place
    save_file({name: tensor + 0.01 for name, tensor in weights.items()}, draft / "model.safetensors")
    changed = _engine(long_context_model, moved, "none", *args)
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert changed.stdout.count("complete (skipped)") == 2  # resolve and quantize; convert and what follows ran
    carried = moved / "trtllm_ckpt" / "draft_model" / "model.safetensors"
    assert load_file(carried).keys() == weights.keys()
    assert all(torch.equal(load_file(carried)[name], weights[name] + 0.01) for name in weights)


def test_killed_engine_resumes_without_a_corrupt_artifact(long_context_model, tmp_path):
    build = BuildDir(tmp_path / "killed")
    cmd = ENGINE + ["--model", str(long_context_model), "--quant", "int8_sq", "--spec", "ngram", "--build-dir", str(build.root)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    partial = build.root / ".quantized.partial"
    deadline = time.monotonic() + 300
    while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert partial.exists(), "the quantize stage never started"
    os.killpg(proc.pid, signal.SIGKILL)  # killed mid-stage, as a crash or Ctrl-C would
    proc.wait()
    assert not build.path("quantized").exists()
    assert "quantize" not in build.manifest()["stages"]

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(build.manifest()["stages"]) == sorted(STAGES)
    assert not partial.exists()
    # every recorded output is on disk with its recorded size: nothing half-written survived
    for stage in STAGES:
        assert build.completed(stage, build.record(stage)["settings"], consumes=tuple(build.record(stage)["inputs"]))


@pytest.mark.server
def test_verify_reports_exactness_served_and_fidelity_on_the_fp8_build(engine_build):
    report = _verify(engine_build)
    summary, rows = report["summary"], report["prompts"]
    # a. the proof: the same deployment in float64, speculative == plain greedy on every prompt,
    # with drafts accepted on every prompt (a self-draft), so more than 1-token steps were compared.
    # The draft is the fp32 original and the target FP8 on weights cast to the CPU's fast dtype, so a
    # bf16 CPU accepts fewer (acceptance length ~1.6 there, > 2 where float32 is served)
    exact = summary["exactness"]
    assert exact["dtype"] == "float64" and exact["ok"] and exact["identical"] == exact["prompts"] == 4
    assert exact["acceptance_length"] > 1.4 and all(r["accepted_draft_tokens"] >= 2 for r in exact["rows"])
    # b. served in the CPU's fast dtype (bf16 where native, else float32): with FP8 activations either
    # rounds a k-token verify apart from a 1-token step, so parity follows the near-tie rule
    served = fast_dtype(torch.device("cpu"))
    assert summary["dtype"] == served and summary["parity_rule"].startswith("near-tie") and summary["parity_ok"]
    tie = summary["near_tie_measured"]  # the limit, measured on the served model (verify.measured_near_tie)
    assert summary["parity_rule"].endswith("measured)") and tie["positions"] > 4 and tie["limit"] == min(max(1.0, tie["p99_shift"]), 1.5)
    assert all(r["match"] or r["margin_at_divergence"] <= tie["limit"] for r in rows)
    # speed-up: output tokens/s of each arm on its own output (they may stop at different lengths)
    assert all(r["ar_tokens"] >= 1 and (not r["ar_matches"] or r["ar_tokens"] == r["tokens"]) for r in rows)
    assert summary["speedup"] == pytest.approx((sum(r["tokens"] for r in rows) / sum(r["latency_s"] for r in rows))
                                               / (sum(r["ar_tokens"] for r in rows) / sum(r["ar_latency_s"] for r in rows)))
    assert summary["speedup_min"] == pytest.approx(min((r["tokens"] / r["latency_s"]) / (r["ar_tokens"] / r["ar_latency_s"])
                                                       for r in rows))
    # c. against the original fp32 model: FP8 weights in bf16 are not it, and the report says how far
    fidelity = summary["fidelity"]
    assert fidelity["prompts"] == 4 and fidelity["identical"] == sum(r["identical"] for r in fidelity["rows"])
    assert "float32" in fidelity["original"] and served in fidelity["served"] and "FP8" in fidelity["served"]
    # where verify's time goes, per report
    assert set(summary["seconds"]) == {"servers_start", "served_and_reference", "near_tie", "fidelity", "exactness"}
    assert all(value > 0 for value in summary["seconds"].values())
    text = (engine_build.path("reports") / "verify.md").read_text()
    assert "Time (s): servers start" in text
    assert "a. exactness (float64" in text and "4/4 identical" in text and "c. fidelity" in text
    assert (engine_build.path("reports") / "acceptance_length.png").stat().st_size > 1000


@pytest.mark.server
def test_an_eagle_deployment_serves_through_triton_with_exact_parity(long_context_model, tmp_path):
    # served in float64 (--serve-dtype auto with FP8 activations): served parity itself is exact
    build = _built(long_context_model, tmp_path / "tiny-eagle-fp8", "fp8", "--spec", "eagle", "--spec-steps", "3",
                   "--spec-prompts", "8", "--spec-ttt-steps", "2", "--serve-dtype", "auto")
    spec_config = json.loads((build.path("spec") / "spec_config.json").read_text())
    assert spec_config["modelopt_config"]["eagle_ttt_steps"] == 2 and len(spec_config["training"]["final_acc"]) == 2
    deployment = json.loads((build.path("triton_repo") / "cpu" / "tensorrt_llm" / "1" / "deployment.json").read_text())
    # the CPU deployment drafts what the LLM-API config names: a chain, as TRT-LLM >= 1.3 does by default
    assert deployment["spec"]["kind"] == "eagle" and deployment["spec"]["mode"] == "chain"
    report = _verify(build, "--no-baseline")
    assert report["summary"]["dtype"] == "float64"
    assert report["summary"]["exact_match_rate"] == 1.0 and report["summary"]["parity_rule"] == "exact"
    # not adaptive by default: it drafts every step, as TensorRT-LLM does, even with a module this
    # bad (3 training steps, little accepted; adaptive would stop drafting after 3 misses)
    assert all(r["perf"]["total_draft_tokens"] >= 2 * r["target_forwards"] for r in report["prompts"])


@pytest.mark.server
def test_bench_served_rows(engine_build, tmp_path):
    out = tmp_path / "served.json"
    done = subprocess.run(
        [sys.executable, "-m", "specdeploy", "bench", "--served", str(engine_build.root), "--prompts", "sharegpt",
         "--num-prompts", "2", "--max-new-tokens", "8", "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["served"]["new_tokens"] == result["inprocess"]["new_tokens"] > 0  # same work on both sides
    assert result["served_over_inprocess"] > 0 and result["served"]["ttft_median_s"] > 0


@pytest.mark.parametrize("options,message", [
    (dict(dtype="float32"), "--dtype float32 deploys unquantized weights"),
    (dict(tp_size=0), "--tp-size 0 / --pp-size 1 must be >= 1"),
    (dict(spec="ngram", max_draft_len=0), "--max-draft-len 0 must be >= 1"),
    (dict(spec="ngram", spec_preset="long", spec_overrides={"steps": 5, "num_prompts": None, "ttt_steps": 3}),
     "--spec-preset, --spec-steps, --spec-ttt-steps: not read with SPEC=ngram"),
    (dict(module_accept=("rope",), gate_floor=0.5), "--module-accept, --gate-floor: not read with SPEC=eagle"),
    (dict(module="/m", spec_overrides={"steps": 5}), "--spec-steps: not read with MODULE=<folder>"),
])
def test_options_a_stage_would_refuse_or_never_read_are_refused_before_any_stage(options, message, tmp_path):
    from specdeploy.pipeline import EngineOptions, _stage_steps

    with pytest.raises(SpecDeployError, match=message):
        _stage_steps(BuildDir(tmp_path / "build"), EngineOptions(**options))
    assert not (tmp_path / "build").exists()


def test_an_architecture_convert_cannot_map_is_refused_before_the_spec_stage(tmp_path, tiny_tokenizer_dir):
    from transformers import MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "mistral")
    tokenizer.save_pretrained(tmp_path / "mistral")
    done = _engine(tmp_path / "mistral", tmp_path / "build", "none", "--kv-cache", "none", "--spec", "eagle")
    assert done.returncode == 2 and "architecture MistralForCausalLM is not supported by the TRT-LLM converter" in done.stderr
    assert sorted(BuildDir(tmp_path / "build").manifest()["stages"]) == ["resolve"]  # nothing trained


def test_a_sliding_window_model_is_refused_before_the_spec_stage(tmp_path, tiny_tokenizer_dir):
    """It passed resolve and convert's check, trained, quantized and converted, and failed only when
    the CPU deployment loaded it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from specdeploy.pipeline import _convertible

    config = Qwen2Config(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=256, use_sliding_window=True, sliding_window=32)
    model = Qwen2ForCausalLM(config)
    model.config.architectures = ["Qwen2ForCausalLM"]
    model.save_pretrained(tmp_path / "windowed")
    with pytest.raises(SpecDeployError, match="sliding-window attention \\(sliding_window=32, context 256\\)") as err:
        _convertible(tmp_path / "windowed")
    assert "full attention" in err.value.hint
    config.use_sliding_window = False  # Qwen2.5's own configs: a window named, not used
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "full")
    assert _convertible(tmp_path / "full") == tmp_path / "full"


def test_next_commands_name_the_build_that_was_made(tmp_path):
    from specdeploy.pipeline import EngineOptions, next_commands

    opts = EngineOptions(model="smollm2-135m", spec="eagle", quant="fp8")
    assert next_commands(BuildDir(Path("build") / "smollm2-135m-eagle-fp8"), opts) == (
        "make verify MODEL=smollm2-135m SPEC=eagle QUANT=fp8 (it starts its own servers); "
        "make serve MODEL=smollm2-135m SPEC=eagle QUANT=fp8 serves the build until Ctrl-C")
    elsewhere = next_commands(BuildDir(tmp_path / "smollm2-135m-eagle-fp8"), opts)
    assert f"make verify MODEL=smollm2-135m SPEC=eagle QUANT=fp8 BUILD={tmp_path} " in elsewhere
    assert next_commands(BuildDir(tmp_path / "mine"), opts).startswith(f"specdeploy verify --build-dir {tmp_path / 'mine'}")


def test_engine_plans_the_cpu_draft_shape_by_default_and_package_alone_keeps_converts():
    import argparse

    from specdeploy import pipeline
    from specdeploy.triton import stage

    for module, default in ((pipeline, "auto"), (stage, "fixed")):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        assert parser.parse_args([]).cpu_draft_shape == default
    assert pipeline.EngineOptions().cpu_draft_shape == "auto"
