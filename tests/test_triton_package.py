"""Stage `package` offline: every generated config.pbtxt parses into Triton's ModelConfig
protobuf, and the ensemble's wiring matches the models it calls (names, dtypes, required inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from specdeploy import models
from specdeploy.choices import validate_choices
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from specdeploy.runtime.deployment import load_decoder
from specdeploy.triton import package

TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def parse_config(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def load_repo(repo: Path) -> dict[str, mc.ModelConfig]:
    configs = {p.parent.name: parse_config(p) for p in sorted(repo.glob("*/config.pbtxt"))}
    for name, config in configs.items():
        assert config.name == name, f"{repo / name}: config name {config.name!r}"
        assert (repo / name / "1").is_dir(), f"{repo / name} has no version folder"
    return configs


def param(config: mc.ModelConfig, key: str) -> str:
    return config.parameters[key].string_value


def check_ensemble_wiring(configs: dict[str, mc.ModelConfig]) -> None:
    """Every tensor an ensemble step reads exists with the same dtype where it comes from, every
    required input of a step is fed, and every ensemble output is produced by some step."""
    ensemble = configs["ensemble"]
    produced = {t.name: t.data_type for t in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        model = configs[step.model_name]
        inputs = {t.name: t for t in model.input}
        outputs = {t.name: t for t in model.output}
        for key, tensor in step.input_map.items():
            assert key in inputs, f"{step.model_name} has no input {key}"
            assert tensor in produced, f"{step.model_name}.{key} <- {tensor}: nothing produces it"
            assert produced[tensor] == inputs[key].data_type, f"{step.model_name}.{key}: dtype mismatch with {tensor}"
        missing = [n for n, t in inputs.items() if not t.optional and n not in step.input_map]
        assert not missing, f"{step.model_name}: required inputs not mapped: {missing}"
        for key, tensor in step.output_map.items():
            assert key in outputs, f"{step.model_name} has no output {key}"
            produced[tensor] = outputs[key].data_type
    for out in ensemble.output:
        assert out.name in produced, f"ensemble output {out.name} is produced by no step"
        assert produced[out.name] == out.data_type, f"ensemble output {out.name}: dtype mismatch"


def tensors(config: mc.ModelConfig) -> tuple[list, list]:
    def sig(ts):
        return [(t.name, t.data_type, list(t.dims), getattr(t, "optional", False)) for t in ts]

    return sig(config.input), sig(config.output)


@pytest.fixture(scope="module")
def base_build(tmp_path_factory, tiny_llama_dir) -> Path:
    root = tmp_path_factory.mktemp("pkg") / "build"
    models.run(BuildDir(root), str(tiny_llama_dir))
    return root


def packaged(base_build: Path, tmp_path: Path, **options) -> Path:
    root = tmp_path / "build"
    root.mkdir(parents=True)
    for item in base_build.iterdir():  # a fresh build dir per test sharing the resolved model
        (root / item.name).symlink_to(item) if item.is_dir() else (root / item.name).write_bytes(item.read_bytes())
    return package.run(BuildDir(root), **options)


@pytest.mark.parametrize("spec", ["medusa", "eagle", "draft", "ngram", "none"])
def test_every_config_parses_and_the_ensemble_is_wired(base_build, tmp_path, tiny_llama_dir, spec):
    choices = TREE if spec in ("medusa", "eagle") else None
    draft = tiny_llama_dir if spec == "draft" else None
    out = packaged(base_build, tmp_path, spec=spec, choices=choices, draft_model_dir=draft)
    cpu, engine = load_repo(out / "cpu"), load_repo(out / "engine")
    assert set(cpu) == {"ensemble", "preprocessing", "tensorrt_llm", "postprocessing"}
    check_ensemble_wiring(cpu)
    check_ensemble_wiring(engine)
    # the CPU model answers under the same name with the same inputs/outputs as the engine's
    assert tensors(cpu["tensorrt_llm"]) == tensors(engine["tensorrt_llm"])
    assert tensors(cpu["ensemble"]) == tensors(engine["ensemble"])
    assert cpu["tensorrt_llm"].backend == "python" and engine["tensorrt_llm"].backend == "tensorrtllm"
    assert load_repo(out / "llmapi")["tensorrt_llm"].backend == "python"


def test_ensemble_matches_trtllm_client_contract(base_build, tmp_path):
    ensemble = load_repo(packaged(base_build, tmp_path, spec="none") / "cpu")["ensemble"]
    inputs = {t.name: t for t in ensemble.input}
    required = {n for n, t in inputs.items() if not t.optional}
    assert required == {"text_input", "max_tokens"}
    T = mc.DataType
    expected = {"text_input": T.TYPE_STRING, "max_tokens": T.TYPE_INT32, "stream": T.TYPE_BOOL,
                "temperature": T.TYPE_FP32, "top_k": T.TYPE_INT32, "top_p": T.TYPE_FP32, "seed": T.TYPE_UINT64,
                "end_id": T.TYPE_INT32, "pad_id": T.TYPE_INT32, "stop_words": T.TYPE_STRING,
                "bad_words": T.TYPE_STRING, "return_perf_metrics": T.TYPE_BOOL}
    assert {n: inputs[n].data_type for n in expected} == expected
    outputs = {t.name: t.data_type for t in ensemble.output}
    assert outputs["text_output"] == T.TYPE_STRING
    assert outputs["total_accepted_draft_tokens"] == T.TYPE_INT32
    assert outputs["total_draft_tokens"] == T.TYPE_INT32
    assert outputs["acceptance_rate"] == T.TYPE_FP32


@pytest.mark.parametrize("spec", ["medusa", "eagle"])
def test_engine_config_carries_tree_and_decoding_mode(base_build, tmp_path, spec):
    out = packaged(base_build, tmp_path, spec=spec, choices=TREE, kv_cache_free_gpu_mem_fraction=0.85)
    trt = load_repo(out / "engine")["tensorrt_llm"]
    assert param(trt, "decoding_mode") == spec
    assert validate_choices(param(trt, f"{spec}_choices")).to_list() == validate_choices(TREE).to_list()
    assert param(trt, "gpt_model_path") == str((out.parent / "engines" / "target").resolve())
    assert param(trt, "kv_cache_free_gpu_mem_fraction") == "0.85"
    assert param(trt, "gpt_model_type") == "inflight_fused_batching"
    assert trt.model_transaction_policy.decoupled and trt.max_batch_size == 64
    other = "eagle" if spec == "medusa" else "medusa"
    assert param(trt, f"{other}_choices") == f"${{{other}_choices}}"  # unset, as the backend expects
    # the same values in the backend's own fill_template.py syntax: commas inside values escaped
    args = (out / "engine" / "fill_template_args.txt").read_text().strip()
    assert f"{spec}_choices:" + validate_choices(TREE).to_pbtxt().replace(",", "\\,") in args
    assert split_like_fill_template(args)[f"{spec}_choices"] == validate_choices(TREE).to_pbtxt()


def split_like_fill_template(args: str) -> dict[str, str]:
    """tensorrtllm_backend tools/fill_template.py's parsing: split on unescaped ',' then ':'."""
    def split(text: str, delim: str) -> list[str]:
        parts, cur, esc = [], "", False
        for ch in text:
            if esc:
                cur, esc = cur + ch, False
            elif ch == "\\":
                esc = True
            elif ch == delim:
                parts, cur = parts + [cur], ""
            else:
                cur += ch
        return parts + [cur]

    result = {}
    for item in split(args, ","):
        key, value = split(item, ":")
        result[key] = value
    return result


def test_draft_target_goes_through_bls(base_build, tmp_path, tiny_llama_dir):
    out = packaged(base_build, tmp_path, spec="draft", draft_model_dir=tiny_llama_dir)
    engine = load_repo(out / "engine")
    bls = engine["tensorrt_llm_bls"]
    assert param(bls, "tensorrt_llm_model_name") == "tensorrt_llm"
    assert param(bls, "tensorrt_llm_draft_model_name") == "tensorrt_llm_draft"
    assert {"num_draft_tokens", "use_draft_logits"} <= {t.name for t in bls.input}
    draft = engine["tensorrt_llm_draft"]
    assert tensors(draft) == tensors(engine["tensorrt_llm"])
    assert param(draft, "gpt_model_path").endswith("engines/draft")
    assert param(engine["tensorrt_llm"], "gpt_model_path").endswith("engines/target")
    assert param(engine["tensorrt_llm"], "enable_kv_cache_reuse") == "true"
    spec = yaml.safe_load((out / "llmapi" / "tensorrt_llm" / "1" / "model.yaml").read_text())["speculative_config"]
    assert spec["decoding_type"] == "DraftTarget" and spec["speculative_model_dir"] == str(tiny_llama_dir.resolve())


def test_cpu_deployment_json_is_what_load_decoder_reads(base_build, tmp_path, tiny_llama_dir):
    out = packaged(base_build, tmp_path, spec="draft", draft_model_dir=tiny_llama_dir, max_draft_len=3)
    folder = out / "cpu" / "tensorrt_llm" / "1"
    deployment = json.loads((folder / "deployment.json").read_text())
    assert (folder / deployment["model_dir"]).resolve() == (out.parent / "base").resolve()
    assert (folder / deployment["spec"]["draft_model_dir"]).resolve() == tiny_llama_dir.resolve()
    assert deployment["spec"]["kind"] == "draft" and deployment["spec"]["max_draft_len"] == 3
    assert deployment["spec"]["adaptive"] is False  # speculates every step, as TensorRT-LLM does
    assert load_decoder(folder / "deployment.json").adaptive is False
    assert (folder / "model.py").exists()
    trt = load_repo(out / "cpu")["tensorrt_llm"]
    assert param(trt, "specdeploy_deployment") == "deployment.json"
    assert trt.model_transaction_policy.decoupled


def test_llmapi_model_yaml(base_build, tmp_path):
    for spec, decoding in (("eagle", "Eagle3"), ("ngram", "NGram"), ("medusa", None)):
        out = packaged(base_build, tmp_path / spec, spec=spec, choices=TREE if spec != "ngram" else None)
        config = yaml.safe_load((out / "llmapi" / "tensorrt_llm" / "1" / "model.yaml").read_text())
        assert config["backend"] == "pytorch" and config["triton_config"]["decoupled"] is True
        assert config["kv_cache_config"]["free_gpu_memory_fraction"] == 0.9
        assert config.get("speculative_config", {}).get("decoding_type") == decoding
        assert config["max_seq_len"] == 256


def test_stage_is_skipped_when_complete_and_redone_when_settings_change(base_build, tmp_path):
    root = packaged(base_build, tmp_path, spec="ngram").parent
    build = BuildDir(root)
    config = root / "triton_repo" / "cpu" / "ensemble" / "config.pbtxt"
    stamp = config.stat().st_mtime_ns
    package.run(build, spec="ngram")
    assert config.stat().st_mtime_ns == stamp
    package.run(build, spec="ngram", cpu_max_batch_size=2)
    assert parse_config(config).max_batch_size == 2


def test_filler_rejects_a_structural_placeholder_left_unfilled():
    assert package.fill('parameters: { key: "x" value: { string_value: "${x}" } }', {}) .count("${x}") == 1
    with pytest.raises(SpecDeployError, match="triton_max_batch_size"):
        package.fill("max_batch_size: ${triton_max_batch_size}", {})
    with pytest.raises(SpecDeployError, match="choices"):
        package.run(BuildDir("/nonexistent/build"), spec="medusa", choices=[[0, 0]])


def test_backend_fill_args_round_trip_through_fill_template_parsing():
    values = {"medusa_choices": "{0, 0}, {1}", "engine_dir": "/x/y:z", "plain": "64", "weird": "a\\b,c"}
    assert split_like_fill_template(package.backend_fill_args(values)) == values


def test_tree_defaults_to_the_one_the_spec_stage_recorded(base_build, tmp_path):
    root = tmp_path / "build"
    root.mkdir()
    for item in base_build.iterdir():
        (root / item.name).symlink_to(item) if item.is_dir() else (root / item.name).write_bytes(item.read_bytes())
    build = BuildDir(root)
    with build.stage("spec", "spec", {"kind": "eagle"}, consumes=("resolve",)) as tmp:
        (tmp / "spec_config.json").write_text(json.dumps({"kind": "eagle", "choices": TREE}))
        (tmp / "eagle3_export").mkdir()
        (tmp / "eagle3_export" / "config.json").write_text("{}")
    out = package.run(build, spec="eagle")
    trt = load_repo(out / "engine")["tensorrt_llm"]
    assert validate_choices(param(trt, "eagle_choices")).to_list() == validate_choices(TREE).to_list()
    deployment = json.loads((out / "cpu" / "tensorrt_llm" / "1" / "deployment.json").read_text())
    assert deployment["spec"]["choices"] == validate_choices(TREE).to_list() and deployment["spec"]["path"] == "../../../../spec"
    spec = yaml.safe_load((out / "llmapi" / "tensorrt_llm" / "1" / "model.yaml").read_text())["speculative_config"]
    assert spec["speculative_model_dir"] == str(root.resolve() / "spec" / "eagle3_export")
    tree = validate_choices(TREE)
    assert (spec["max_draft_len"], spec["max_total_draft_tokens"]) == (tree.depth, tree.num_nodes)
    assert validate_choices(spec["eagle_choices"]).to_list() == tree.to_list()


def test_no_stream_makes_gpu_configs_non_decoupled_but_cpu_stays_streaming(base_build, tmp_path):
    out = packaged(base_build, tmp_path, spec="ngram", decoupled=False)
    engine = load_repo(out / "engine")
    assert not engine["tensorrt_llm"].model_transaction_policy.decoupled
    assert not engine["tensorrt_llm_bls"].model_transaction_policy.decoupled
    assert yaml.safe_load((out / "llmapi" / "tensorrt_llm" / "1" / "model.yaml").read_text())["triton_config"]["decoupled"] is False
    assert load_repo(out / "cpu")["tensorrt_llm"].model_transaction_policy.decoupled
