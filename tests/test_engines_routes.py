"""The vLLM and SGLang routes a packaged build gets (specdeploy/engines/), checked against oracles the
project does not write: each release's own argument parser, read from the release's sources.

- SGLang 0.5.23: its wheel from PyPI (39 MB), installed without dependencies into an oracle venv
  (tests/oracle.py, cached under the specdeploy cache dir) and read with `ast` (tests/engine_flags.py):
  every flag ServerArgs.add_cli_args registers with its type and literal choices, SpeculativeAlgorithm's
  names, and the target models' capture hooks.
- vLLM 0.33.0: its wheel is 336 MB, so tests/data/vllm_0.33.0_flags.json, read once from the release's
  sdist by the same script (`python -m tests.engine_flags vllm ...`): the flags of `vllm serve`,
  SpeculativeConfig's fields and `method` values, the models with SupportsEagle3, ModelOpt's quant_algos.

Every generated command is parsed by an argparse parser built from those (exact names, no
abbreviations); the package-time writer's folders read back through our import, and serve.sh runs
the recorded command with `$BUILD_DIR` resolved wherever the build lies.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tests.tiny_modules as tm
from specdeploy.engines import BuildFacts, sglang, vllm
from specdeploy.engines.routes import shell_line, write_engine_routes
from specdeploy.trtllm.hostpaths import resolve
from specdeploy.trtllm.llmapi import DraftStructure
from specdeploy.triton.routes import OUT, gpu_summary, readme, routes_json, write_gpu_routes
from tests import engine_flags, test_modules
from tests.oracle import oracle_venv
from tests.test_modules import assert_same_module, imported, write_layout

base = test_modules.base  # the fixture: the tiny 8-layer Llama every tiny module fits
VLLM = json.loads((Path(__file__).with_name("data") / "vllm_0.33.0_flags.json").read_text())
CHAIN, TREE = DraftStructure.make("chain", 3), DraftStructure.make("dynamic", 3, topk=2, total=5)
ROUTED = [("eagle", CHAIN), ("eagle", TREE), ("dflash", DraftStructure.make("chain", tm.BLOCK - 1)), ("draft", CHAIN)]


@pytest.fixture(scope="module")
def sglang_site() -> Path:
    """site-packages holding the sglang 0.5.23 wheel's files (no dependencies: only read, never imported)."""
    python = oracle_venv("sglang-0.5.23")
    return next(python.parent.parent.glob("lib/python*/site-packages"))


def release_parser(flags: dict[str, dict], positionals: list[str] = ()) -> argparse.ArgumentParser:
    """An argparse parser accepting exactly the flags a release registers, their arity, int types and
    literal choices."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for name in positionals:
        parser.add_argument(name, nargs="?")
    for flag, entry in flags.items():
        if not entry["value"]:
            parser.add_argument(flag, action="store_true")
            continue
        parser.add_argument(flag, type=int if entry["type"] == "int" else str, choices=entry["choices"])
    return parser


def parsed(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    namespace, unknown = parser.parse_known_args(words)
    assert unknown == [], f"not flags of the release: {unknown}"
    return namespace


# ------------------------------------------------------------------------------ the commands, by the releases' parsers


@pytest.mark.parametrize("kind,structure", ROUTED)
def test_sglang_commands_parse_with_the_releases_own_flags(kind, structure, sglang_site):
    flags, algorithms = engine_flags.sglang_cli(sglang_site), engine_flags.sglang_algorithms(sglang_site)
    facts = BuildFacts(kind=kind, structure=structure, tp=2, pp=2)
    argv = sglang.command("$BUILD_DIR/quantized", "$BUILD_DIR/triton_repo/sglang/module", facts)
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    args = parsed(release_parser(flags), argv[3:])
    assert args.speculative_algorithm in algorithms and args.speculative_algorithm == sglang.ALGORITHMS[kind]
    assert (args.model_path, args.speculative_draft_model_path) == ("$BUILD_DIR/quantized", "$BUILD_DIR/triton_repo/sglang/module")
    assert (args.tp_size, args.pp_size) == (2, 2)
    if kind == "dflash":  # one block: the pending token and the chain (speculative_hook.py _handle_dflash)
        assert args.speculative_num_draft_tokens == structure.max_draft_len + 1 and args.speculative_num_steps is None
    elif structure.mode == "chain":  # topk 1: num_draft_tokens = num_steps + 1, or the hook rewrites it
        assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    else:  # the tree's depth, its branching, and its nodes beside the pending token (organize_draft_results)
        assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 2, 6)


@pytest.mark.parametrize("kind,structure", ROUTED)
def test_vllm_commands_parse_with_the_releases_own_flags(kind, structure):
    facts = BuildFacts(kind=kind, structure=structure, tp=2, pp=2)
    argv = vllm.command("$BUILD_DIR/quantized", "$BUILD_DIR/triton_repo/vllm/module", facts)
    assert argv[:2] == ["vllm", "serve"] and VLLM["positionals"] == ["model_tag"]
    args = parsed(release_parser(VLLM["flags"], VLLM["positionals"]), argv[2:])
    assert args.model_tag == "$BUILD_DIR/quantized"
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == ("2", "2")
    config = json.loads(args.speculative_config)
    assert set(config) <= set(VLLM["speculative_config_fields"]) and config["method"] in VLLM["speculative_methods"]
    assert config == {"model": "$BUILD_DIR/triton_repo/vllm/module", "method": vllm.METHODS[kind],
                      "num_speculative_tokens": structure.max_draft_len}


def test_what_the_engine_modules_claim_is_in_the_releases(sglang_site):
    """The tables the routes decide by, against the sources: algorithms, capture hooks, quant formats."""
    algorithms = engine_flags.sglang_algorithms(sglang_site)
    assert set(sglang.ALGORITHMS.values()) <= algorithms and not {"MEDUSA"} & algorithms
    files = {"LlamaForCausalLM": "llama.py", "Qwen2ForCausalLM": "qwen2.py", "Qwen3ForCausalLM": "qwen3.py"}
    for architecture, kinds in sglang.CAPTURE.items():
        methods = engine_flags.sglang_methods(sglang_site, files[architecture], architecture)
        hooks = {"eagle": "set_eagle3_layers_to_capture", "dflash": "set_dflash_layers_to_capture"}
        assert {k for k, hook in hooks.items() if hook in methods} == set(kinds), architecture
    assert set(vllm.METHODS.values()) <= set(VLLM["speculative_methods"]) and "medusa" not in VLLM["speculative_methods"]
    assert vllm.AUX_TARGETS <= set(VLLM["supports_eagle3"])
    assert set(vllm.QUANT_ALGOS) <= set(VLLM["modelopt_quant_algos"]) and "W4A16_AWQ" not in VLLM["modelopt_quant_algos"]
    assert VLLM["version"] == vllm.RELEASE.version and VLLM["commit_id"] == "g4ba787ec9"


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("facts,vllm_why,sglang_why", [
    (BuildFacts("medusa", None), "no Medusa proposer", "no Medusa algorithm"),
    (BuildFacts("ngram", CHAIN), "no module to ship", "no module to ship"),
    (BuildFacts("none", None), "no speculative module", "no speculative module"),
    (BuildFacts("eagle", CHAIN, quant_algo="W8A8_SQ_PER_CHANNEL"), "not W8A8_SQ_PER_CHANNEL", "not W8A8_SQ_PER_CHANNEL"),
    (BuildFacts("eagle", CHAIN, quant_algo="W4A16_AWQ"), "FP8, NVFP4", "FP8, NVFP4"),
    (BuildFacts("eagle", CHAIN, norm_before_residual=True), None, "un-normed fc output"),
    (BuildFacts("dflash", CHAIN, architecture="Qwen2ForCausalLM"), None, "set_dflash_layers_to_capture"),
    (BuildFacts("dflash", CHAIN, pp=2), None, "pp_size 1 only"),
    (BuildFacts("eagle", CHAIN, quant_algo="NVFP4", architecture="Qwen2ForCausalLM"), None, None),
    (BuildFacts("draft", CHAIN, quant_algo="FP8"), None, None),
])
def test_a_build_an_engine_cannot_serve_gets_the_reason(facts, vllm_why, sglang_why):
    for engine, why in ((vllm, vllm_why), (sglang, sglang_why)):
        said = engine.refusal(facts)
        assert (said is None) if why is None else (why in said), (engine.RELEASE.engine, said)


def test_notes_say_what_runs_differently():
    assert "drafts a chain" in vllm.notes(BuildFacts("eagle", TREE, architecture="LlamaForCausalLM"))[0]
    assert "not read" in vllm.notes(BuildFacts("eagle", CHAIN, architecture="GemmaForCausalLM"))[0]
    assert "not read" in sglang.notes(BuildFacts("dflash", CHAIN, architecture="GemmaForCausalLM"))[0]
    assert vllm.notes(BuildFacts("draft", CHAIN)) == [] == sglang.notes(BuildFacts("eagle", TREE, architecture="Qwen3ForCausalLM"))


# ------------------------------------------------------------------------------ package time


def _stub_bin(folder: Path) -> Path:
    """`vllm` and `python3` that print the argv they were given, as JSON."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("vllm", "python3"):
        (folder / name).write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
        (folder / name).chmod(0o755)
    return folder


def _run_script(script: Path, stubs: Path, build_dir: Path | None = None) -> list[str]:
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}
    env.pop("BUILD_DIR", None)
    if build_dir is not None:
        env["BUILD_DIR"] = str(build_dir)
    done = subprocess.run(["sh", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("kind,layout,structure", [("eagle", "speculators", CHAIN),
                                                   ("dflash", "dflash", DraftStructure.make("chain", tm.BLOCK - 1))])
def test_package_writes_each_engines_folder_and_a_relocatable_command(kind, layout, structure, base, tmp_path):
    build = imported(tmp_path / "build", base, kind, write_layout(kind, layout, tmp_path / "src", base))
    out = build.path(OUT)  # written in place: the published folder itself
    out.mkdir()
    routes = write_gpu_routes(out, build, kind, None, structure, {"draft_model_dir": None}, None, model_dir=base)
    assert set(routes["engines"]) == {"vllm", "sglang"} and routes["engines_refused"] == {}
    assert json.loads((out / "gpu_routes.json").read_text()) == routes and routes["routes"] == {}
    stubs = _stub_bin(tmp_path / "bin")
    for name, route in routes["engines"].items():
        module = resolve(route["module"], build.root)
        assert route["module"] == f"$BUILD_DIR/{OUT}/{name}/module" and route["model"] == str(base)  # base outside the build
        # the folder the engine loads reads back through our import as the same module (cast to bf16 for serving)
        again = imported(tmp_path / f"again-{name}", base, kind, Path(module))
        assert sorted(test_modules.spec_of(again)[1]) == sorted(test_modules.spec_of(build)[1])
        # serve.sh runs the recorded argv with $BUILD_DIR resolved where the build lies, or where BUILD_DIR says
        script = Path(resolve(route["script"], build.root))
        assert _run_script(script, stubs) == [resolve(a, build.root) for a in route["argv"][1:]]
        moved = tmp_path / "mounted"
        assert _run_script(script, stubs, moved) == [resolve(a, moved) for a in route["argv"][1:]]
        assert f"`{name}/serve.sh` runs" in readme(routes) and route["command"] in readme(routes)
    assert json.loads(routes["engines"]["vllm"]["argv"][4])["method"] == vllm.METHODS[kind]
    summary = "\n".join(gpu_summary(build))
    assert f"vLLM 0.33.0: {build.root.resolve()}/{OUT}/vllm/serve.sh" in summary and "SGLang 0.5.23" in summary


def test_a_float32_export_of_the_sglang_route_is_the_same_module(base, tmp_path):
    """What the route ships, exported as stored, is the module itself (export.py's round trip)."""
    from specdeploy.modules.export import export

    build = imported(tmp_path / "build", base, "eagle", write_layout("eagle", "eagle3", tmp_path / "src", base))
    out = export(build, sglang.module_format("eagle"), tmp_path / "module", dtype="float32")
    assert_same_module(build, imported(tmp_path / "again", base, "eagle", out))


def test_a_draft_model_build_serves_its_draft_as_it_is(base, tiny_draft_dir, tmp_path):
    from specdeploy import resolve
    from specdeploy.manifest import BuildDir

    build = BuildDir(tmp_path / "build")
    resolve.run(build, str(base))
    routes, refused = write_engine_routes(build.path(OUT), build, "draft", CHAIN, model_dir=build.path("base"),
                                          published=build.path(OUT), draft_model=tiny_draft_dir)
    assert refused == {} and {r["module"] for r in routes.values()} == {str(tiny_draft_dir.resolve())}
    assert sorted(p.name for p in build.path(OUT).iterdir()) == ["sglang", "vllm"]
    assert not (build.path(OUT) / "vllm" / "module").exists()
    assert routes["vllm"]["model"] == "$BUILD_DIR/base" and "STANDALONE" in routes["sglang"]["argv"]


def test_a_module_that_cannot_be_written_is_a_refusal_not_a_failed_package(base, tmp_path):
    """A DFlash spec/ without the export its folders are made from (as before the spec stage wrote it)."""
    build = imported(tmp_path / "build", base, "dflash", write_layout("dflash", "dflash", tmp_path / "src", base))
    shutil.rmtree(build.path("spec") / "dflash_export")
    out = tmp_path / "partial"
    routes, refused = write_engine_routes(out, build, "dflash", CHAIN, model_dir=base, published=build.root / OUT)
    assert set(routes) == {"vllm"} and "SGLang's layout" in refused["sglang"] and "dflash_export" in refused["sglang"]
    assert sorted(p.name for p in out.iterdir()) == ["vllm"]


def test_a_medusa_build_gets_reasons_and_no_folders(base, tmp_path):
    build = imported(tmp_path / "build", base, "medusa", write_layout("medusa", "medusa", tmp_path / "src", base))
    out = tmp_path / "partial"
    routes, refused = write_engine_routes(out, build, "medusa", None, model_dir=base, published=build.root / OUT)
    assert routes == {} and set(refused) == {"vllm", "sglang"} and not out.exists()
    written = routes_json("medusa", None, None, {}, engines=(routes, refused))
    assert [line for line in readme(written).splitlines() if "Medusa" in line] == [
        f"- no `vllm/`: {refused['vllm']}", f"- no `sglang/`: {refused['sglang']}"]


def test_the_shell_line_keeps_every_word_and_expands_only_the_build_dir():
    argv = ["vllm", "serve", "$BUILD_DIR/a b", '{"model": "$BUILD_DIR/m", "x": "`$HOME` \\\\"}', "it's", "--tp-size"]
    line = shell_line(argv)
    assert line.startswith("vllm serve ") and line.endswith(" --tp-size")  # plain words stay plain
    done = subprocess.run(["sh", "-c", f"printf '%s\\n' {line}"], capture_output=True, text=True,
                          env={"BUILD_DIR": "/mnt/x y", "HOME": "/h", "PATH": os.environ["PATH"]})
    assert done.stdout.splitlines() == [resolve(a, "/mnt/x y") for a in argv]


# ------------------------------------------------------------------------------ SGLang's reading of the folder


def _spec_of_trained(root: Path, base: Path, **options) -> Path:
    """spec/ as the spec stage writes it for a module ModelOpt builds (untrained weights; the layer
    norms made distinct so a dropped one shows)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from specdeploy.checkpoints.modules import build_module
    from specdeploy.checkpoints.modules import eagle as modelopt_eagle

    config = AutoConfig.from_pretrained(base)
    modelopt = modelopt_eagle.modelopt_config(config, **options)
    module = build_module("eagle", config, modelopt)
    with torch.no_grad():
        for i, layer in enumerate(module.layers):
            layer.input_layernorm.weight.fill_(2.0 + i)
    spec = root / "spec"
    spec.mkdir(parents=True)
    save_file({"eagle_module." + k: v.contiguous() for k, v in module.state_dict().items()}, str(spec / "module.safetensors"))
    (spec / "spec_config.json").write_text(json.dumps({"format_version": 1, "kind": "eagle", "modelopt_config": modelopt,
                                                       "base_model": str(base), "hidden_layers": [2, 4, 5]}))
    return spec


def _sglang_folder(spec: Path, base: Path, out: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    from specdeploy.modules.spec import Base, from_spec, normalise

    folder = sglang.write_eagle3(normalise(from_spec(spec), Base.of(base)), out, max_positions=256, dtype="float32")
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def _llama_eagle3(sglang_site: Path) -> str:
    return (sglang_site / "sglang" / "srt" / "models" / "llama_eagle3.py").read_text()


def test_sglang_takes_the_targets_head_for_a_module_without_its_own(base, tmp_path, sglang_site):
    """A module drafting over the whole vocabulary has no lm_head (ModelOpt's EagleModule on a base
    no larger than --draft-vocab): SGLang 0.5.23 takes the target's only for a null draft_vocab_size,
    else it builds an empty head and load_weights finds nothing for it."""
    assert "if config.draft_vocab_size is None:\n                self.load_lm_head_from_target = True" in _llama_eagle3(sglang_site)
    config, tensors = _sglang_folder(_spec_of_trained(tmp_path / "full", base, draft_vocab_size=8192), base, tmp_path / "a")
    assert not any("lm_head" in k for k in tensors) and config["draft_vocab_size"] is None
    config, tensors = _sglang_folder(_spec_of_trained(tmp_path / "reduced", base, draft_vocab_size=96), base, tmp_path / "b")
    assert "lm_head.weight" in tensors and config["draft_vocab_size"] == 96


def test_sglang_reads_later_layers_pre_attention_norm_as_hidden_norm(base, tmp_path, sglang_site):
    """SGLang 0.5.23's EAGLE-3 layer i > 0 normalises with hidden_norm (its input_layernorm unused):
    a 2-layer module's second norm is written under that name, and imports back as the same module."""
    import torch

    assert "# Fuse the previous layer's MLP residual add into hidden_norm.\n            hidden_states, residual = " \
           "self.hidden_norm(hidden_states, residual)" in _llama_eagle3(sglang_site)
    spec = _spec_of_trained(tmp_path, base, draft_vocab_size=96, num_layers=2)
    config, tensors = _sglang_folder(spec, base, tmp_path / "sglang")
    assert config["num_hidden_layers"] == 2 and "layers.1.input_layernorm.weight" not in tensors
    assert torch.equal(tensors["layers.1.hidden_norm.weight"], torch.full((64,), 3.0))
    assert torch.equal(tensors["layers.0.input_layernorm.weight"], torch.full((64,), 2.0))  # the first layer's own names
    build = imported(tmp_path / "again", base, "eagle", tmp_path / "sglang")
    again = test_modules.spec_of(build)[1]
    assert torch.equal(again["eagle_module.layers.1.input_layernorm.weight"], torch.full((64,), 3.0))
    assert not any("layers.1.hidden_norm" in k for k in again)
