"""`specdeploy build`: the trtllm-build plan and script, and the refusal to pretend on a host
without TensorRT-LLM or a GPU. Every generated command is parsed against the argument list of
trtllm-build as each release with the engine flow has it (tests/data/trtllm_build_flags.json,
read from NVIDIA's build.py / plugin.py; the snapshots are named there)."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from specdeploy.trtllm import build as trt_build
from specdeploy.trtllm import convert, engine_checkpoint, releases, spec_input
from specdeploy.trtllm.formats import SPECULATIVE_MODES
from specdeploy.triton import stage

ROOT = Path(__file__).resolve().parents[1]
FLAGS = json.loads((ROOT / "tests" / "data" / "trtllm_build_flags.json").read_text())


def release_parser(line: str) -> argparse.ArgumentParser:
    """trtllm-build's command line as release `line` parses it: the options it has, with their arity
    and, where the option restricts them, its choices."""
    parser = argparse.ArgumentParser(prog=f"trtllm-build {line}", exit_on_error=False, add_help=False)
    for flag in FLAGS["releases"][line]["value"]:
        kwargs = {"nargs": "+"} if flag in FLAGS["nargs_plus"] else {"type": int} if flag in FLAGS["int"] else {}
        parser.add_argument(flag, choices=FLAGS["choices"].get(flag), **kwargs)
    for flag in FLAGS["store_true"]:
        parser.add_argument(flag, action="store_true")
    return parser


def parse_as_release(argv: list[str], line: str) -> argparse.Namespace:
    """`argv` (a trtllm-build command) parsed by release `line`'s options; argparse refuses the rest."""
    assert argv[0] == "trtllm-build"
    args, unknown = release_parser(line).parse_known_args(argv[1:])
    assert not unknown, f"trtllm-build {line} has no option(s) {unknown}"
    return args


def _medusa_module(hidden: int = 64, vocab: int = 384, heads: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for h in range(heads):
        out[f"medusa_heads.{h}.0.linear.weight"] = torch.randn(hidden, hidden, generator=g)
        out[f"medusa_heads.{h}.0.linear.bias"] = torch.randn(hidden, generator=g)
        out[f"medusa_heads.{h}.1.weight"] = torch.randn(vocab, hidden, generator=g)
    return out


def _spec_dir(path: Path, kind: str, module: dict, choices: list) -> Path:
    path.mkdir(parents=True)
    save_file(module, str(path / "module.safetensors"))
    (path / "spec_config.json").write_text(json.dumps({"kind": kind, "choices": choices, "modelopt_config": {"medusa_num_heads": 3}}))
    return path


def _plan(ckpt: Path) -> dict:
    return trt_build.make_plan(ckpt)


def _cmd(plan: dict, role: str) -> list[str]:
    return next(c for c in plan["commands"] if f"{{ckpt}}/{role}" in c)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_medusa_plan_uses_the_choices_tree(tiny_llama_dir, tmp_path):
    choices = [[0], [1], [2], [0, 0], [0, 1], [0, 0, 0], [1, 0]]
    spec = spec_input.load_spec(_spec_dir(tmp_path / "spec", "medusa", _medusa_module(), choices))
    engine_checkpoint.convert_all(tiny_llama_dir, tmp_path / "ckpt", spec=spec)
    argv = _cmd(_plan(tmp_path / "ckpt"), "target")
    assert argv[0] == "trtllm-build" and _flag(argv, "--speculative_decoding_mode") == "medusa"
    assert _flag(argv, "--max_draft_len") == "7"  # the number of nodes of the tree
    assert "--use_paged_context_fmha" not in argv
    assert _flag(argv, "--speculative_decoding_mode") in SPECULATIVE_MODES
    assert any("greedy only" in n for n in _plan(tmp_path / "ckpt")["notes"])


def test_limits_never_exceed_the_models_context(tiny_llama_dir, tmp_path):
    """--max_seq_len / --max_input_len capped at max_position_embeddings (256 for the tiny model):
    the Triton repositories declare the same numbers."""
    engine_checkpoint.convert_all(tiny_llama_dir, tmp_path / "ckpt")
    plan = _plan(tmp_path / "ckpt")
    argv = _cmd(plan, "target")
    assert (_flag(argv, "--max_seq_len"), _flag(argv, "--max_input_len")) == ("256", "256")
    assert plan["limits"]["max_seq_len"] == 256
    # the engines run as many sequences at once as the packaged repositories declare by default
    assert plan["limits"]["max_batch_size"] == inspect.signature(stage.run).parameters["max_batch_size"].default == 64
    small = trt_build.make_plan(tmp_path / "ckpt", trt_build.BuildLimits(max_seq_len=100, max_input_len=200))
    assert (small["limits"]["max_seq_len"], small["limits"]["max_input_len"]) == (100, 100)


def test_draft_target_plan_builds_the_target_for_external_drafts(tiny_llama_dir, tiny_draft_dir, tmp_path):
    spec = spec_input.load_spec(None, kind="draft", draft_model=tiny_draft_dir, max_draft_len=6)
    engine_checkpoint.convert_all(tiny_llama_dir, tmp_path / "ckpt", spec=spec)
    plan = _plan(tmp_path / "ckpt")
    target, draft = _cmd(plan, "target"), _cmd(plan, "draft")
    assert _flag(target, "--speculative_decoding_mode") == "draft_tokens_external" and _flag(target, "--max_draft_len") == "6"
    assert "--speculative_decoding_mode" not in draft and "--max_draft_len" not in draft
    assert "--gather_generation_logits" in draft and _flag(draft, "--output_dir") == "{engines}/draft"


QUANTIZATIONS = [
    {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None},
    {"quant_algo": "W8A8_SQ_PER_CHANNEL", "kv_cache_quant_algo": None},
    {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
    {"quant_algo": None, "kv_cache_quant_algo": None},
]


@pytest.mark.parametrize("quantization, flags", list(zip(QUANTIZATIONS, [
    {"--gemm_plugin": "auto"},  # the groupwise weight-only plugin comes from the checkpoint (builder.py)
    {"--gemm_plugin": "auto"},  # so do the SmoothQuant plugins
    {"--use_fp8_context_fmha": "enable", "--use_paged_context_fmha": "enable"},
    {"--gemm_plugin": "auto"},
])))
def test_quantization_plugins(quantization, flags):
    config = {"architecture": "LlamaForCausalLM", "quantization": quantization}
    argv = trt_build.engine_command(config, "target", {"kind": "none"}, trt_build.BuildLimits())
    for name, value in flags.items():
        assert _flag(argv, name) == value, name
    assert not set(argv) & set(FLAGS["not_flags"])  # PluginConfig fields the command line does not expose


def _every_command(tiny_llama_dir: Path, tiny_draft_dir: Path, tmp_path: Path) -> list[list[str]]:
    """The trtllm-build commands of every plan the project writes: base, Medusa, draft-target
    (target + draft), and the base under each quantization."""
    commands = []
    medusa = spec_input.load_spec(_spec_dir(tmp_path / "spec", "medusa", _medusa_module(), [[0], [0, 0], [1]]))
    draft = spec_input.load_spec(None, kind="draft", draft_model=tiny_draft_dir, max_draft_len=4)
    for name, spec in (("base", None), ("medusa", medusa), ("draft", draft)):
        engine_checkpoint.convert_all(tiny_llama_dir, tmp_path / name, spec=spec)
        commands += _plan(tmp_path / name)["commands"]
    for quantization in QUANTIZATIONS:
        config = {"architecture": "LlamaForCausalLM", "quantization": quantization}
        commands.append(trt_build.engine_command(config, "target", {"kind": "none"}, trt_build.BuildLimits()))
    return commands


@pytest.mark.parametrize("line", sorted(FLAGS["releases"]))
def test_every_generated_command_parses_as_that_releases_trtllm_build(line, tiny_llama_dir, tiny_draft_dir, tmp_path):
    assert releases.release_for(line).engine_flow != "removed"  # the data covers exactly the lines that build engines
    commands = _every_command(tiny_llama_dir, tiny_draft_dir, tmp_path)
    assert len(commands) == 8
    for argv in commands:
        args = parse_as_release(argv, line)
        assert args.kv_cache_type == "paged" and args.remove_input_padding == "enable"
    # the oracle refuses what the release lacks (the flags this project used to pass)
    with pytest.raises(AssertionError, match="has no option"):
        parse_as_release(["trtllm-build", "--weight_only_groupwise_quant_matmul_plugin", "auto"], line)


def test_the_flag_data_covers_every_release_with_an_engine_flow():
    lines = {r.name for r in releases.RELEASES.values() if r.engine_flow != "removed"}
    assert set(FLAGS["releases"]) == lines


def test_script_is_valid_bash_and_refuses_to_run_here(tiny_llama_dir, tmp_path):
    spec = spec_input.load_spec(_spec_dir(tmp_path / "spec", "medusa", _medusa_module(), [[0], [0, 0]]))
    engine_checkpoint.convert_all(tiny_llama_dir, tmp_path / "trtllm_ckpt", spec=spec)
    plan = trt_build.write_plan(tmp_path / "trtllm_ckpt", tmp_path / "engines")
    script = tmp_path / "engines" / trt_build.SCRIPT
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert '--checkpoint_dir "$CKPT_DIR"/target' in text and '--output_dir "$ENGINE_DIR"/target' in text
    assert "--speculative_decoding_mode medusa --max_draft_len 2" in text
    assert json.loads((tmp_path / "engines" / trt_build.PLAN).read_text())["commands"] == plan["commands"]
    # a host without trtllm-build (this one; on a GPU host, a PATH without it): stop, do not pretend
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("bash", "dirname"):
        (bare / tool).symlink_to(shutil.which(tool))
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": str(bare)})
    assert done.returncode == 3 and "trtllm-build not found" in done.stderr
    assert not list((tmp_path / "engines").rglob("*.engine"))


@pytest.mark.parametrize("version, ok", [("1.1.0", True), ("1.1.0rc5", True), ("1.2.0", True), ("1.2.1", True),
                                         ("1.3.0rc29", False), ("1.4.0rc1", False), ("1.0.0", False), ("2.0.1", False)])
def test_version_window(version, ok, capsys):
    """Engines are built on the release lines whose trtllm-build was read and still has the engine
    flow (1.1, and 1.2 where it is deprecated); 1.3 removed it; other lines were never checked."""
    if ok:
        trt_build.check_engine_flow_version(version)
        assert ("deprecated" in capsys.readouterr().out) == version.startswith("1.2")
    else:
        with pytest.raises(SpecDeployError) as err:
            trt_build.check_engine_flow_version(version)
        if releases.parse_version(version) in ((1, 3), (1, 4)):
            assert "--route llmapi" in err.value.hint and "removed in the 1.3 line" in str(err.value)
        else:
            assert "was not checked" in str(err.value)


def test_host_checks(monkeypatch):
    """Built only with tensorrt_llm importable, in the window, and a GPU visible."""
    monkeypatch.setattr(trt_build, "trtllm_version", lambda: None)
    assert trt_build.host_can_build() == (False, "tensorrt_llm is not importable on this host (it cannot be installed on these machines)")
    monkeypatch.setattr(trt_build, "trtllm_version", lambda: "1.1.0")
    monkeypatch.setattr(trt_build, "gpu_visible", lambda: False)
    assert trt_build.host_can_build()[0] is False
    monkeypatch.setattr(trt_build, "gpu_visible", lambda: True)
    assert trt_build.host_can_build()[0] is True
    monkeypatch.setattr(trt_build, "trtllm_version", lambda: "1.2.1")
    assert trt_build.host_can_build()[0] is True  # deprecated there, still builds
    monkeypatch.setattr(trt_build, "trtllm_version", lambda: "1.4.0")
    with pytest.raises(SpecDeployError, match="no trtllm-build"):
        trt_build.host_can_build()


def test_build_stage_on_a_trtllm_without_engines_points_to_the_llmapi_route(tiny_llama_dir, tmp_path, monkeypatch):
    build = _build_dir_with_convert(tmp_path, tiny_llama_dir)
    monkeypatch.setattr(trt_build, "trtllm_version", lambda: "1.4.0")
    monkeypatch.setattr(trt_build, "run_plan", lambda *a: pytest.fail("must not run trtllm-build"))
    plan = json.loads((trt_build.run(build) / trt_build.PLAN).read_text())
    assert plan["engines_built"] is False and "--route llmapi" in plan["host"]


def _build_dir_with_convert(tmp_path: Path, model: Path) -> BuildDir:
    build = BuildDir(tmp_path / "b")
    with build.stage("resolve", "base", {"model": str(model)}) as tmp:
        for f in model.iterdir():
            shutil.copy(f, tmp / f.name)
    convert.run(build, tp=1, pp=1)
    assert build.record("convert") and (build.path("trtllm_ckpt") / "target" / "config.json").exists()
    return build


def test_build_stage_where_a_gpu_host_would_run_trtllm_build(tiny_llama_dir, tmp_path, monkeypatch):
    build = _build_dir_with_convert(tmp_path, tiny_llama_dir)
    monkeypatch.setattr(trt_build, "host_can_build", lambda: (True, "tensorrt_llm 1.0.0 with a GPU"))
    ran: list[list[str]] = []
    monkeypatch.setattr(trt_build.subprocess, "run", lambda argv, check: ran.append(argv))
    out = trt_build.run(build)
    assert len(ran) == 1 and ran[0][0] == "trtllm-build"
    assert _flag(ran[0], "--checkpoint_dir") == str(build.path("trtllm_ckpt") / "target")
    assert _flag(ran[0], "--output_dir").endswith(".engines.partial/target")  # built inside the stage's temp dir
    assert json.loads((out / trt_build.PLAN).read_text())["engines_built"] is True


def test_build_command_says_engines_were_not_built_here(tiny_llama_dir, tmp_path):
    """The real CLI on this host: exit 0, plan + script written, a plain statement, no engine."""
    build = _build_dir_with_convert(tmp_path, tiny_llama_dir)
    if trt_build.host_can_build()[0]:
        pytest.skip("this host has TensorRT-LLM and a GPU, so the stage builds engines here "
                    "(test_build_stage_where_a_gpu_host_would_run_trtllm_build covers that path)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "specdeploy", "build", "--build-dir", str(build.root)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "engines were NOT built on this host" in done.stdout and "build_engines.sh" in done.stdout
    plan = json.loads((build.path("engines") / trt_build.PLAN).read_text())
    assert plan["engines_built"] is False and "not importable" in plan["host"]
    assert build.record("build")["settings"]["built_here"] is False
    assert not [p for p in build.path("engines").rglob("*") if p.suffix == ".engine"]
