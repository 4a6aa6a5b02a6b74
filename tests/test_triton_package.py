"""Stage `package` offline: every generated config.pbtxt parses into Triton's ModelConfig
protobuf, the ensemble's wiring matches the models it calls (names, dtypes, required inputs),
only the GPU routes the build has are packaged, and the CPU deployment drafts as the GPU config says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from google.protobuf import text_format
from safetensors.torch import save_file
from tritonclient.grpc import model_config_pb2 as mc

from specdeploy import resolve
from specdeploy.choices import validate_choices
from specdeploy.cli import main as cli_main
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from specdeploy.runtime.deployment import load_decoder
from specdeploy.runtime.load_plan import LoadPoint, suggested_spec_off_above
from specdeploy.triton import stage
from specdeploy.triton.cpu_plan import LOAD_PAYS, PLAN_FILE, load_sizes, load_summary, pooled_near_border
from specdeploy.triton.cpu_repo import CPU_COUNTERS, CPU_MAX_BATCH_SIZE
from specdeploy.triton.routes import gpu_routes, gpu_summary
from specdeploy.triton.templating import backend_fill_args, fill
from specdeploy.trtllm import build as trt_build
from specdeploy.trtllm import convert, llmapi, releases

TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
EAGLE3_CFG = {
    "eagle_use_torch_compile": False,
    "eagle_architecture_config": {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                  "intermediate_size": 96, "use_aux_hidden_state": True, "use_last_layernorm": True,
                                  "eagle_aux_hidden_state_layer_ids": [0, 1], "torch_dtype": "float32",
                                  # what the spec stage records beside (checkpoints.modules.eagle.modelopt_config)
                                  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "draft_vocab_size": 384},
}
ROUTES = {"medusa": {"engine"}, "eagle": {"llmapi"}, "draft": {"engine", "llmapi"}, "ngram": {"llmapi"}, "none": {"engine", "llmapi"}}
# vLLM and SGLang serve a module or a draft model; Medusa (neither release has it), n-gram and plain builds get none
ENGINES = {"medusa": set(), "eagle": {"vllm", "sglang"}, "draft": {"vllm", "sglang"}, "ngram": set(), "none": set()}


# ----------------------------------------------------------------------------- build helpers
# (also used by tests/test_gpu_host.py)


def medusa_module(hidden: int = 64, vocab: int = 384, heads: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for h in range(heads):
        out[f"medusa_heads.{h}.0.linear.weight"] = torch.randn(hidden, hidden, generator=g)
        out[f"medusa_heads.{h}.0.linear.bias"] = torch.randn(hidden, generator=g)
        out[f"medusa_heads.{h}.1.weight"] = torch.randn(vocab, hidden, generator=g)
    return out


def eagle3_module(base: Path) -> dict[str, torch.Tensor]:
    import modelopt.torch.speculative as mtsp
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    mtsp.convert(model, [("eagle", json.loads(json.dumps(EAGLE3_CFG)))])
    return {k: v.contiguous() for k, v in model.state_dict().items() if k.startswith("eagle_module.")}


def spec_stage(build: BuildDir, kind: str, module: dict[str, torch.Tensor], config: dict) -> None:
    with build.stage("spec", "spec", {"kind": kind}, consumes=("resolve",)) as tmp:
        save_file(module, str(tmp / "module.safetensors"))
        (tmp / "spec_config.json").write_text(json.dumps({"kind": kind, **config}))


def new_build(root: Path, model: Path, kind: str, eagle: dict | None = None, **convert_options) -> BuildDir:
    """A build directory through resolve (+ spec for medusa/eagle) + convert, ready to package."""
    build = BuildDir(root)
    resolve.run(build, str(model))
    if kind == "medusa":
        spec_stage(build, "medusa", medusa_module(), {"choices": TREE, "modelopt_config": {"medusa_num_heads": 3}})
    if kind == "eagle":
        spec_stage(build, "eagle", eagle, {"choices": TREE, "modelopt_config": EAGLE3_CFG})
    convert.run(build, kind=kind if kind in ("draft", "ngram") else None, **convert_options)
    return build


@pytest.fixture(scope="module")
def eagle_tensors(tiny_llama_dir) -> dict[str, torch.Tensor]:
    return eagle3_module(tiny_llama_dir)


@pytest.fixture
def make(tmp_path, tiny_llama_dir, tiny_draft_dir, eagle_tensors):
    """make(kind, **convert options) -> a converted build directory under tmp_path."""
    def _make(kind: str, name: str = "build", **options) -> BuildDir:
        if kind == "draft":
            options.setdefault("draft_model", str(tiny_draft_dir))
        return new_build(tmp_path / name, tiny_llama_dir, kind, eagle_tensors, **options)
    return _make


# ----------------------------------------------------------------------------- parsing helpers


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


def weight_dtypes(folder: Path) -> set:
    """The floating dtypes of a model folder's safetensors weights."""
    from safetensors.torch import load_file

    return {t.dtype for f in folder.glob("*.safetensors") for t in load_file(str(f)).values() if t.is_floating_point()}


def tensors(config: mc.ModelConfig) -> tuple[list, list]:
    def sig(ts):
        return [(t.name, t.data_type, list(t.dims), getattr(t, "optional", False)) for t in ts]

    return sig(config.input), sig(config.output)


def model_yaml(out: Path) -> dict:
    return yaml.safe_load((out / "llmapi" / "tensorrt_llm" / "1" / "model.yaml").read_text())


def deployment(out: Path) -> dict:
    return json.loads((out / "cpu" / "tensorrt_llm" / "1" / "deployment.json").read_text())


def check_cpu_bls(repo: Path, configs: dict[str, mc.ModelConfig]) -> None:
    """The CPU tensorrt_llm_bls answers like the ensemble (same tensors) and runs the ensemble's
    steps, with tensorrt_llm as the step it watches for cancellations."""
    bls, ensemble = configs["tensorrt_llm_bls"], configs["ensemble"]
    assert bls.backend == "python" and bls.model_transaction_policy.decoupled
    inputs, outputs = tensors(bls)
    draft_target = [("num_draft_tokens", mc.TYPE_INT32, [1], True), ("use_draft_logits", mc.TYPE_BOOL, [1], True)]
    assert (inputs, outputs) == (tensors(ensemble)[0] + draft_target, tensors(ensemble)[1])
    plan = json.loads((repo / "tensorrt_llm_bls" / "1" / "steps.json").read_text())
    assert [(s["model"], s["inputs"], s["outputs"]) for s in plan["steps"]] == [
        (s.model_name, dict(s.input_map), dict(s.output_map)) for s in ensemble.ensemble_scheduling.step]
    assert plan["generator"] == "tensorrt_llm" and plan["outputs"] == [t.name for t in ensemble.output]
    assert (repo / "tensorrt_llm_bls" / "1" / "model.py").is_file()


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("spec", ["medusa", "eagle", "draft", "ngram", "none"])
def test_every_config_parses_and_only_the_routes_the_build_has_are_packaged(make, spec):
    build = make(spec)
    out = stage.run(build, spec=spec)
    cpu = load_repo(out / "cpu")
    assert set(cpu) == {"ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"}
    check_ensemble_wiring(cpu)
    check_cpu_bls(out / "cpu", cpu)
    assert cpu["tensorrt_llm"].backend == "python"
    routes = gpu_routes(build)
    assert set(routes["routes"]) == ROUTES[spec]
    assert {p.name for p in out.iterdir() if p.is_dir()} == {"cpu", *ROUTES[spec], *ENGINES[spec]}
    assert set(routes["engines"]) == ENGINES[spec] and set(routes["engines_refused"]) == {"vllm", "sglang"} - ENGINES[spec]
    assert routes["recommended"] == ("llmapi" if "llmapi" in ROUTES[spec] else "engine")
    assert set(routes["refused"]) == {"engine", "llmapi"} - ROUTES[spec] and all(routes["refused"].values())
    if "engine" in ROUTES[spec]:
        engine = load_repo(out / "engine")
        check_ensemble_wiring(engine)
        # the CPU model answers under the same name with the same inputs/outputs as the engine's
        # (plus, on the CPU side only, the runtime's own counters: NVIDIA's backend never sends them)
        for model in ("tensorrt_llm", "ensemble"):
            cpu_in, cpu_out = tensors(cpu[model])
            assert (cpu_in, [t for t in cpu_out if t[0] not in CPU_COUNTERS]) == tensors(engine[model])
            assert [t[0] for t in cpu_out if t[0] in CPU_COUNTERS] == list(CPU_COUNTERS)
            assert not {t[0] for t in tensors(engine[model])[1]} & set(CPU_COUNTERS)
        assert engine["tensorrt_llm"].backend == "tensorrtllm"
    if "llmapi" in ROUTES[spec]:
        assert not (out / "llmapi" / "tensorrt_llm" / "config.pbtxt").exists()  # the release's own, from its container
        serve = routes["routes"]["llmapi"]["trtllm_serve"]
        assert (build.root / serve["config"]).is_file() and serve["model"].startswith("$BUILD_DIR/")
    # the release the GPU side was written for, with the image that carries it (releases.py)
    assert routes["release"] == releases.release_for(releases.DEFAULT_TRTLLM_VERSION).as_dict()
    assert routes["release"]["triton_image"] == "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
    summary = "\n".join(gpu_summary(build))
    assert f"build_scripts/gpu_host.sh {build.root}" in summary and "build_engines.sh" not in summary


def test_ensemble_matches_trtllm_client_contract(make):
    ensemble = load_repo(stage.run(make("none"), spec="none") / "cpu")["ensemble"]
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


def test_medusa_engine_config_carries_the_tree_the_cpu_deployment_drafts(make):
    out = stage.run(make("medusa"), spec="medusa", kv_cache_free_gpu_mem_fraction=0.85)
    trt = load_repo(out / "engine")["tensorrt_llm"]
    assert param(trt, "decoding_mode") == "medusa"
    assert validate_choices(param(trt, "medusa_choices")).to_list() == validate_choices(TREE).to_list()
    assert param(trt, "gpt_model_path") == "$BUILD_DIR/engines/target"  # resolved by gpu_host.sh
    assert param(trt, "tokenizer_dir") == "$BUILD_DIR/base"
    assert param(trt, "kv_cache_free_gpu_mem_fraction") == "0.85"
    assert param(trt, "gpt_model_type") == "inflight_fused_batching"
    assert trt.model_transaction_policy.decoupled and trt.max_batch_size == 64
    assert param(trt, "eagle_choices") == "${eagle_choices}"  # unset, as the backend expects
    spec = deployment(out)["spec"]
    assert spec["choices"] == validate_choices(TREE).to_list() and spec["max_draft_len"] == 5
    # the same values in the backend's own fill_template.py syntax: commas inside values escaped
    args = (out / "engine" / "fill_template_args.txt").read_text().strip()
    assert "medusa_choices:" + validate_choices(TREE).to_pbtxt().replace(",", "\\,") in args
    assert split_like_fill_template(args)["medusa_choices"] == validate_choices(TREE).to_pbtxt()


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


def test_engine_repo_declares_what_nvidias_bls_asks_of_each_model(make, tiny_draft_dir):
    # Triton refuses a BLS request naming an output (or input) the called model does not declare:
    # every name NVIDIA's BLS code asks for (its own lists, tests/data) is in the filled configs
    asked = json.loads((Path(__file__).parent / "data" / "nvidia_bls_requests.json").read_text())
    build = make("draft", max_draft_len=3)
    engine = load_repo(stage.run(build, spec="draft", max_draft_len=3) / "engine")

    def names(config: mc.ModelConfig, kind: str) -> set[str]:
        return {tensor.name for tensor in getattr(config, kind)}

    assert set(asked["preprocessing_outputs"]) <= names(engine["preprocessing"], "output")
    for model in ("tensorrt_llm", "tensorrt_llm_draft"):
        assert set(asked["llm_outputs"]) <= names(engine[model], "output"), model
        assert set(asked["llm_inputs"]) <= names(engine[model], "input"), model
    assert set(asked["postprocessing_inputs"]) <= names(engine["postprocessing"], "input")
    assert set(asked["postprocessing_outputs"]) <= names(engine["postprocessing"], "output")
    # and a client asking the BLS for the token counts gets them passed on
    assert {"return_num_input_tokens", "return_num_output_tokens"} <= names(engine["tensorrt_llm_bls"], "input")
    assert {"num_input_tokens", "num_output_tokens"} <= names(engine["tensorrt_llm_bls"], "output")


def test_draft_target_goes_through_bls_with_num_draft_tokens_and_no_streaming(make, tiny_draft_dir):
    build = make("draft", max_draft_len=3)
    out = stage.run(build, spec="draft", max_draft_len=3)
    engine = load_repo(out / "engine")
    bls = engine["tensorrt_llm_bls"]
    assert param(bls, "tensorrt_llm_model_name") == "tensorrt_llm"
    assert param(bls, "tensorrt_llm_draft_model_name") == "tensorrt_llm_draft"
    assert {"num_draft_tokens", "use_draft_logits"} <= {t.name for t in bls.input}
    draft = engine["tensorrt_llm_draft"]
    assert tensors(draft) == tensors(engine["tensorrt_llm"])
    assert param(draft, "gpt_model_path") == "$BUILD_DIR/engines/draft"
    assert param(engine["tensorrt_llm"], "enable_kv_cache_reuse") == "true"
    # NVIDIA's BLS calls both models non-decoupled: a decoupled one refuses that call
    assert not any(engine[name].model_transaction_policy.decoupled for name in ("tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls"))
    route = gpu_routes(build)["routes"]["engine"]
    assert route["model"] == "tensorrt_llm_bls" and route["request"] == {"num_draft_tokens": 3} and route["stream"] is False
    assert "num_draft_tokens" in (out / "README.md").read_text() and "does not stream" in (out / "README.md").read_text()
    # the LLM API drafts the same 3 tokens from the draft model the build carries, in bfloat16: the tiny
    # draft is float32, which the PyTorch backend's kernels lack (the engine flow and the CPU keep it)
    spec = model_yaml(out)["speculative_config"]
    assert spec == {"decoding_type": "Draft_Target", "max_draft_len": 3,
                    "speculative_model": "$BUILD_DIR/trtllm_ckpt/llmapi/draft_model_bf16"}
    carried = build.path("trtllm_ckpt") / "draft_model"
    assert weight_dtypes(build.path("trtllm_ckpt") / "llmapi" / "draft_model_bf16") == {torch.bfloat16}
    assert weight_dtypes(carried) == {torch.float32}
    assert (carried / "model.safetensors").read_bytes() == (tiny_draft_dir / "model.safetensors").read_bytes()
    # its config written for the release's transformers too (hfcompat): what it had, and the 4.x spellings
    original, written = (json.loads((d / "config.json").read_text()) for d in (tiny_draft_dir, carried))
    assert original.items() <= written.items()
    assert "rope_theta" in written


def test_cpu_deployment_json_is_what_load_decoder_reads(make):
    build = make("draft", max_draft_len=3)
    out = stage.run(build, spec="draft", max_draft_len=3)
    folder = out / "cpu" / "tensorrt_llm" / "1"
    config = deployment(out)
    assert (folder / config["model_dir"]).resolve() == build.path("base").resolve()
    assert (folder / config["spec"]["draft_model_dir"]).resolve() == (build.path("trtllm_ckpt") / "draft_model").resolve()
    assert not Path(config["spec"]["draft_model_dir"]).is_absolute()  # inside the build: relative
    assert config["spec"]["kind"] == "draft" and config["spec"]["max_draft_len"] == 3
    assert config["spec"]["adaptive"] is False  # speculates every step, as TensorRT-LLM does
    decoder = load_decoder(folder / "deployment.json")
    assert decoder.adaptive is False and decoder.draft_len == 3
    assert (folder / "model.py").exists()
    trt = load_repo(out / "cpu")["tensorrt_llm"]
    assert param(trt, "specdeploy_deployment") == "deployment.json"
    assert trt.model_transaction_policy.decoupled
    with pytest.raises(SpecDeployError, match="differs from the chain of 3"):
        stage.run(build, spec="draft", max_draft_len=5)
    assert "spec_off_above" not in config and decoder.spec_off_above is None  # always speculates by default
    assert param(trt, "specdeploy_max_batch_size") == str(CPU_MAX_BATCH_SIZE)


def test_the_cpu_batch_flags_reach_the_deployment(make, tmp_path):
    build = make("draft", max_draft_len=3)
    cli_main(["package", "--build-dir", str(build.root), "--spec", "draft", "--max-draft-len", "3",
              "--cpu-max-batch-size", "3", "--spec-off-above", "2"])
    out = build.path("triton_repo")
    decoder = load_decoder(out / "cpu" / "tensorrt_llm" / "1" / "deployment.json")
    assert decoder.spec_off_above == 2 and decoder.batcher().spec_off_above == 2
    assert param(load_repo(out / "cpu")["tensorrt_llm"], "specdeploy_max_batch_size") == "3"
    with pytest.raises(SystemExit):  # argparse: a clear message, exit 2
        cli_main(["package", "--build-dir", str(tmp_path), "--spec-off-above", "-1"])


def test_the_load_plan_summary_names_a_size_that_lost_below_one_that_paid():
    def point(batch: int, speedup: float) -> LoadPoint:
        return LoadPoint(batch, spec_tokens=int(speedup * 1000), spec_s=1.0, plain_tokens=1000, plain_s=1.0)

    paid = [point(1, 1.21), point(2, 1.24), point(4, 1.10), point(8, 1.07)]
    assert load_summary(paid, None).endswith("spec_off_above none (speculation paid at every size)")
    noisy = [point(1, 1.21), point(2, 1.24), point(4, 0.94), point(8, 1.07)]  # as a default build measured it
    assert load_summary(noisy, None).endswith(f"none (speculation paid at the largest size; below {LOAD_PAYS}x at 4, read as noise)")
    assert "1: 1.21x, 2: 1.24x, 4: 0.94x, 8: 1.07x" in load_summary(noisy, None)
    assert load_summary(noisy[:3], 2).endswith("spec_off_above 2")


def test_a_load_plan_size_measured_near_the_margin_is_measured_again_and_pooled():
    """A size within LOAD_BORDER of LOAD_PAYS is measured again (only it), its rounds pooled, up to
    LOAD_MEASUREMENTS in all; a size clear of the margin is measured once."""
    def point(batch: int, speedup: float) -> LoadPoint:
        return LoadPoint(batch, spec_tokens=round(speedup * 1000), spec_s=1.0, plain_tokens=1000, plain_s=1.0)

    asked = []
    answers = iter([[point(4, LOAD_PAYS + 0.04)], [point(4, LOAD_PAYS + 0.03)]])

    def measure(sizes: list[int]) -> list[LoadPoint]:
        asked.append(sizes)
        return next(answers)

    first = [point(1, 1.27), point(2, 1.15), point(4, LOAD_PAYS - 0.02), point(8, LOAD_PAYS - 0.10)]
    pooled = pooled_near_border(measure, first)
    # 4: below the margin, then pooled with a reading above it (+0.01, still close), then with another:
    # three measurements in all, and the pooled rounds pay
    assert asked == [[4], [4]] and [p.batch for p in pooled] == [1, 2, 4, 8]
    assert pooled[2].speedup == pytest.approx(LOAD_PAYS + 0.05 / 3, abs=1e-3) and pooled[2].spec_s == 3.0
    assert pooled[0] is first[0] and pooled[3] is first[3]
    assert suggested_spec_off_above([p.batch for p in pooled], [p.speedup for p in pooled], LOAD_PAYS) == 4
    assert suggested_spec_off_above([p.batch for p in first], [p.speedup for p in first], LOAD_PAYS) == 2  # unpooled
    clear = [point(1, 1.27), point(8, LOAD_PAYS - 0.10)]
    assert pooled_near_border(measure, clear) == clear and len(asked) == 2  # nothing near the margin: not measured again


def test_llmapi_model_yaml_is_one_writer_that_honours_the_converted_tp(make):
    build = make("ngram", tp=2)
    out = stage.run(build, spec="ngram")
    config = model_yaml(out)
    assert config["backend"] == "pytorch" and config["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    assert config["tensor_parallel_size"] == 2 and config["pipeline_parallel_size"] == 1
    # the tiny model is float32: the PyTorch backend gets its bfloat16 copy (trtllm/half_folder.py)
    assert config["model"] == "$BUILD_DIR/trtllm_ckpt/llmapi/model_bf16" and config["max_seq_len"] == 256
    assert config["kv_cache_config"] == {"free_gpu_memory_fraction": 0.9}
    assert config["speculative_config"]["decoding_type"] == "NGram" and config["disable_overlap_scheduler"] is True
    serve = yaml.safe_load((out / "llmapi" / "trtllm_serve.yaml").read_text())
    assert serve == {k: v for k, v in config.items() if k not in ("model", "triton_config")}
    assert gpu_routes(build)["routes"]["llmapi"]["world_size"] == 2
    # the CPU n-gram proposer looks up the same n-gram size and drafts as many tokens
    assert {"kind": "ngram", "max_ngram": 3, "max_draft_len": 4}.items() <= deployment(out)["spec"].items()


def test_eagle_drafts_the_same_chain_on_both_sides_and_never_a_static_tree(make):
    build = make("eagle")
    out = stage.run(build, spec="eagle")
    gpu = model_yaml(out)["speculative_config"]
    assert gpu["max_draft_len"] == 4 and "eagle_choices" not in gpu and "use_dynamic_tree" not in gpu
    spec = deployment(out)["spec"]
    assert (spec["mode"], spec["chain_len"], spec["max_draft_len"], spec["choices"]) == ("chain", 4, 4, None)
    assert param(load_repo(out / "cpu")["tensorrt_llm"], "eagle_choices") == "${eagle_choices}"  # unset
    decoder = load_decoder(out / "cpu" / "tensorrt_llm" / "1" / "deployment.json")
    assert decoder.proposer.mode == "chain" and decoder.proposer.chain_len == 4 and decoder.draft_len == 4
    with pytest.raises(SpecDeployError, match="not a static eagle_choices tree"):
        stage.run(build, spec="eagle", choices=TREE)


def test_auto_draft_shape_serves_the_planners_fastest_shape_on_the_cpu_only(make, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))  # the verify-cost curve it measures
    build = make("eagle")
    out = stage.run(build, spec="eagle", cpu_draft_shape="auto")
    planned = json.loads((out / "cpu" / PLAN_FILE).read_text())
    estimates = {e["shape"]: e["tokens_per_s"] for e in planned["plan"]["estimates"]}
    assert {"chain 1", "chain 4", "tree 10"} <= set(estimates) and "chain 5" not in estimates  # up to convert's 4
    fastest = max(estimates, key=estimates.get)
    mode, size = fastest.split()
    spec = deployment(out)["spec"]
    assert spec["max_draft_len"] == int(size) and spec["mode"] == {"chain": "chain", "tree": "dynamic"}[mode]
    assert planned["options"].items() <= spec.items()
    decoder = load_decoder(out / "cpu" / "tensorrt_llm" / "1" / "deployment.json")
    assert decoder.draft_len == int(size) and decoder.proposer.kind == mode
    gpu = model_yaml(out)["speculative_config"]
    assert gpu["max_draft_len"] == 4  # the GPU keeps convert's chain
    # and the load up to which it speculates: measured batches of 1, 2, 4, ..., cpu_max_batch_size
    curve = planned["load"]["curve"]
    assert [p["batch"] for p in curve] == load_sizes(CPU_MAX_BATCH_SIZE) == [1, 2, 4, 8]
    assert load_sizes(6) == [1, 2, 4, 6] and load_sizes(1) == [1]
    rule = suggested_spec_off_above([p["batch"] for p in curve], [p["speedup"] for p in curve], LOAD_PAYS)
    assert planned["load"]["spec_off_above"] == (None if rule is None else max(1, rule))  # alone, it speculates
    assert deployment(out).get("spec_off_above") == planned["load"]["spec_off_above"] == decoder.spec_off_above
    # the GPU config's speculation controls start from this measurement, and say so
    knobs = gpu_routes(build)["routes"]["llmapi"]["speculation_knobs"]
    assert knobs["values"] == llmapi.scale_knobs(releases.release_for(releases.DEFAULT_TRTLLM_VERSION), 4, planned)
    assert knobs["values"].items() <= gpu.items() and "CPU planner" in knobs["from"]
    assert gpu.get("max_concurrency") == planned["load"]["spec_off_above"]
    given = stage.run(build, spec="eagle", cpu_draft_shape="auto", spec_off_above=3)  # the user's value wins
    assert deployment(given)["spec_off_above"] == 3 and "load" not in json.loads((given / "cpu" / PLAN_FILE).read_text())
    fixed = stage.run(build, spec="eagle")  # another setting: packaged again, convert's chain
    assert deployment(fixed)["spec"]["max_draft_len"] == 4 and not (fixed / "cpu" / PLAN_FILE).exists()
    with pytest.raises(SpecDeployError, match="unknown draft shape"):
        stage.run(build, spec="eagle", cpu_draft_shape="best")


def test_auto_plans_the_load_of_a_fixed_tree_too(tiny_llama_dir, monkeypatch, tmp_path):
    """Medusa drafts its one tree, so there is no shape to plan; the load up to which that tree pays
    still is (it got none: the deployment speculated at every batch size)."""
    from transformers import AutoModelForCausalLM

    from specdeploy.checkpoints.modules.medusa import modelopt_config as medusa_config
    from specdeploy.speculator import convert_model, medusa, module_state_dict

    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))
    build = BuildDir(tmp_path / "medusa")
    resolve.run(build, str(tiny_llama_dir))
    model, config = AutoModelForCausalLM.from_pretrained(build.path("base")), medusa_config(3, 1)
    convert_model(model, "medusa", config)
    medusa.init_module(model)  # a module the runtime loads (medusa_module() is only read by convert)
    spec_stage(build, "medusa", module_state_dict(model, "medusa"), {"choices": TREE, "modelopt_config": config})
    convert.run(build)
    out = stage.run(build, spec="medusa", cpu_draft_shape="auto")
    planned = json.loads((out / "cpu" / PLAN_FILE).read_text())
    assert planned["plan"] is None and planned["options"] == {}
    assert [p["batch"] for p in planned["load"]["curve"]] == load_sizes(CPU_MAX_BATCH_SIZE)
    assert deployment(out).get("spec_off_above") == planned["load"]["spec_off_above"]
    assert deployment(out)["spec"]["max_draft_len"] == validate_choices(TREE).num_nodes  # the tree as packaged


def test_dynamic_tree_on_a_release_that_has_it_both_sides(make):
    build = make("eagle", trtllm_version="1.3.0", eagle_tree="dynamic", max_draft_len=3, tree_topk=2, tree_total=5)
    out = stage.run(build, spec="eagle")
    gpu = model_yaml(out)["speculative_config"]
    assert (gpu["use_dynamic_tree"], gpu["dynamic_tree_max_topK"], gpu["max_total_draft_tokens"], gpu["max_draft_len"]) == (True, 2, 5, 3)
    spec = deployment(out)["spec"]
    assert (spec["mode"], spec["depth"], spec["topk"], spec["width"], spec["budget"], spec["max_draft_len"]) == ("dynamic", 3, 2, 2, 5, 5)
    decoder = load_decoder(out / "cpu" / "tensorrt_llm" / "1" / "deployment.json")
    assert (decoder.proposer.mode, decoder.proposer.depth, decoder.proposer.topk, decoder.proposer.budget) == ("dynamic", 3, 2, 5)


def test_dflash_drafts_the_block_the_gpu_config_names(tmp_path, tiny_llama_dir):
    from specdeploy.runtime.proposers.dflash import DFlashProposer
    from tests.test_trtllm_llmapi import dflash_spec

    build = BuildDir(tmp_path / "b")
    resolve.run(build, str(tiny_llama_dir))
    with build.stage("spec", "spec", {}, consumes=("resolve",)) as tmp:  # what the spec stage leaves behind
        dflash_spec(tiny_llama_dir, tmp)
    convert.run(build, trtllm_version="1.3.0")
    out = stage.run(build, spec="dflash")
    gpu = model_yaml(out)["speculative_config"]
    assert (gpu["decoding_type"], gpu["max_draft_len"]) == ("DFlash", 3)
    spec = deployment(out)["spec"]
    assert (spec["kind"], spec["block_size"], spec["max_draft_len"]) == ("dflash", 4, 3)
    assert (out / "cpu" / "tensorrt_llm" / "1" / spec["path"]).resolve() == build.path("spec").resolve()
    decoder = load_decoder(out / "cpu" / "tensorrt_llm" / "1" / "deployment.json")
    assert isinstance(decoder.proposer, DFlashProposer) and decoder.proposer.block_size == 4 and decoder.draft_len == 3
    with pytest.raises(SpecDeployError, match="differs from the chain of 3"):
        stage.run(build, spec="dflash", max_draft_len=2)


@pytest.mark.parametrize("device", ["cpu", "auto", "cuda", "cuda:1"])
def test_device_is_recorded_as_given_and_picks_the_instance_kind(make, device):
    out = stage.run(make("none"), spec="none", device=device)
    assert deployment(out)["device"] == device  # "auto" resolves where the model loads, not here
    group = parse_config(out / "cpu" / "tensorrt_llm" / "config.pbtxt").instance_group[0]
    assert group.kind == (mc.ModelInstanceGroup.KIND_GPU if device.startswith("cuda") else mc.ModelInstanceGroup.KIND_CPU)
    assert list(group.gpus) == ([1] if device == "cuda:1" else [])
    assert "kind: KIND_CPU" in (out / "engine" / "tensorrt_llm" / "config.pbtxt").read_text()  # the C++ backend's


def test_the_build_limits_and_every_repository_declare_the_same_context(make):
    build = make("draft", max_draft_len=3)
    trt_build.run(build, trt_build.BuildLimits(max_seq_len=128, max_input_len=100))
    out = stage.run(build, spec="draft", max_draft_len=3)
    plan = json.loads((build.path("engines") / trt_build.PLAN).read_text())
    argv = plan["commands"][0]
    assert argv[argv.index("--max_seq_len") + 1] == "128" and argv[argv.index("--max_input_len") + 1] == "100"
    for repo in ("cpu", "engine"):
        pre = load_repo(out / repo)["preprocessing"]
        assert (param(pre, "max_input_len"), param(pre, "max_output_len")) == ("100", "128"), repo
    assert model_yaml(out)["max_seq_len"] == 128
    # without a build stage, the defaults fitted to the model's context (256 here)
    assert model_yaml(stage.run(make("none", name="other"), spec="none"))["max_seq_len"] == 256


def test_stage_is_skipped_when_complete_and_redone_when_settings_change(make):
    build = make("ngram")
    root = stage.run(build, spec="ngram").parent
    config = root / "triton_repo" / "cpu" / "ensemble" / "config.pbtxt"
    stamp = config.stat().st_mtime_ns
    stage.run(build, spec="ngram")
    assert config.stat().st_mtime_ns == stamp
    stage.run(build, spec="ngram", cpu_max_batch_size=2)
    assert parse_config(config).max_batch_size == 2


def test_filler_rejects_a_structural_placeholder_left_unfilled():
    assert fill('parameters: { key: "x" value: { string_value: "${x}" } }', {}) .count("${x}") == 1
    with pytest.raises(SpecDeployError, match="triton_max_batch_size"):
        fill("max_batch_size: ${triton_max_batch_size}", {})
    with pytest.raises(SpecDeployError, match="choices"):
        stage.run(BuildDir("/nonexistent/build"), spec="medusa", choices=[[0, 0]])


def test_backend_fill_args_round_trip_through_fill_template_parsing():
    values = {"medusa_choices": "{0, 0}, {1}", "engine_dir": "/x/y:z", "plain": "64", "weird": "a\\b,c"}
    assert split_like_fill_template(backend_fill_args(values)) == values


def test_no_stream_makes_every_repository_non_decoupled(make):
    build = make("none")
    out = stage.run(build, spec="none", decoupled=False)
    engine = load_repo(out / "engine")
    assert not engine["tensorrt_llm"].model_transaction_policy.decoupled
    assert not engine["tensorrt_llm_bls"].model_transaction_policy.decoupled
    assert model_yaml(out)["triton_config"]["decoupled"] is False
    cpu = load_repo(out / "cpu")
    assert not cpu["tensorrt_llm"].model_transaction_policy.decoupled
    assert not cpu["tensorrt_llm_bls"].model_transaction_policy.decoupled
    check_ensemble_wiring(cpu)
    assert gpu_routes(build)["routes"]["llmapi"]["stream"] is False


def test_a_standalone_package_without_convert_has_only_the_cpu_repository(tmp_path, tiny_llama_dir):
    build = BuildDir(tmp_path / "b")
    resolve.run(build, str(tiny_llama_dir))
    out = stage.run(build, spec="ngram", max_draft_len=2)
    assert {p.name for p in out.iterdir() if p.is_dir()} == {"cpu"}
    assert gpu_routes(build)["recommended"] is None
    assert "nothing to run on a GPU host" in gpu_summary(build)[0]
    assert deployment(out)["spec"]["max_draft_len"] == 2
    shutil.rmtree(out)  # gpu_routes needs the packaged repository
    with pytest.raises(SpecDeployError, match="gpu_routes.json not found"):
        gpu_routes(build)
