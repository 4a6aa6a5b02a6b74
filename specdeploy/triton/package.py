"""Stage `package`: fill the project's Triton templates into build/<name>/triton_repo/.

Model repositories, side by side, all generated from `triton_repo/` at the project root; the
GPU ones only for the routes the build really has (convert_summary.json says which):

    triton_repo/cpu/      ensemble + preprocessing + postprocessing + tensorrt_llm (Python backend
                          running specdeploy's runtime: what `specdeploy serve` serves here),
                          + tensorrt_llm_bls (the ensemble's steps as BLS: cancellable)
    triton_repo/engine/   the engine flow (TensorRT-LLM 1.1 / 1.2, C++ tensorrtllm backend):
                          base, Medusa, draft-target (tensorrt_llm_bls + tensorrt_llm_draft)
    triton_repo/llmapi/   the LLM API (PyTorch backend): the llmapi model and its model.yaml
                          (+ trtllm_serve.yaml for `trtllm-serve --config`)
    triton_repo/gpu_routes.json   which GPU routes exist, which to run, and what a GPU host needs

Paths: the CPU repository names files relative to each model's folder (served here, wherever the
build sits); the GPU ones as `$BUILD_DIR/...` (trtllm/hostpaths.py), resolved by
build_scripts/gpu_host.sh where the build is mounted. The CPU deployment drafts with the same
structure (chain, dynamic tree, Medusa tree) as the GPU configs, so what is measured here
predicts the GPU host.

Templates use `${name}` placeholders like TensorRT-LLM's own; one filler (string.Template) fills
them. A placeholder left inside a `string_value: "${...}"` parameter is how the tensorrtllm
backend spells "unset", so those may stay; any other one left is an error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from string import Template
from typing import Any, Callable

import yaml

from specdeploy.choices import ChoicesTree, validate_choices
from specdeploy.device import check_device_spec
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, atomic_write_text
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.trtllm import llmapi
from specdeploy.trtllm.build import PLAN, BuildLimits
from specdeploy.trtllm.hostpaths import build_path, resolve
from specdeploy.trtllm.llmapi import DraftStructure
from specdeploy.trtllm.releases import DEFAULT_TRTLLM_VERSION, release_for

STAGE = "package"
OUT = "triton_repo"
TRAINED = ("medusa", "eagle", "dflash")  # kinds whose deployment reads the spec stage's spec/ folder
ROUTES_FILE = "gpu_routes.json"
DEPLOYMENT_FILE = "deployment.json"  # cpu/tensorrt_llm/1/: what the CPU runtime loads
CPU_PLAN = 7  # the --cpu-draft-shape auto planner's version: a build planned by another is packaged again
PLAN_FILE = "draft_plan.json"  # cpu/: the planner's measurement behind the CPU deployment's draft shape
CPU_DRAFT_SHAPES = ("fixed", "auto")
TEMPLATES = Path(__file__).resolve().parents[2] / "triton_repo"
# the CPU runtime's compute dtype: native (bf16 where the device has it, else float32), or a dtype,
# or auto (the one where served greedy parity is exact: quantize.loader.parity_dtype)
SERVE_DTYPES = ("native", "bfloat16", "float32", "float64", "auto")
SERVE_DTYPE_HELP = ("compute dtype of the CPU runtime served by Triton: native (default): bfloat16 where the device "
                    "computes it natively (a GPU deployment's dtype; CUDA, CPUs with AVX512-BF16/AMX), float32 where bf16 "
                    "would be emulated (several times slower there); served parity by the near-tie rule in bf16, "
                    "exactness proven by `verify` in float64. auto: the dtype in which served greedy parity is itself "
                    "exact (float64 when activations or K/V are quantized, else float32)")
ADAPTIVE_HELP = ("CPU deployment: fall back to plain decoding while speculation does not pay (faster on a CPU "
                 "with a weak module); default off: speculate every step, as TensorRT-LLM does")
_UPSTREAM = ("resolve", "spec", "quantize", "convert", "build")
_UNSET_PARAM = re.compile(r'string_value:\s*"\$\{\w+\}"')
_PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
# NVIDIA's llmapi model as the container ships it (config.pbtxt, 1/model.py, 1/helpers.py): its
# inputs and outputs are the release's own; the build brings only 1/model.yaml
LLMAPI_CONTAINER_DIR = "/app/all_models/llmapi/tensorrt_llm"
BLS_CONTAINER_DIR = "/app/all_models/inflight_batcher_llm/tensorrt_llm_bls/1"
# sequences in the CPU deployment's in-flight batch: measured in-process on 2 cores (SmolLM2-135M,
# float32), 8 rows decode 4.2x the tokens/s of one
CPU_MAX_BATCH_SIZE = 8
# perf outputs only the CPU runtime sends (beside NVIDIA's): the tokens it emitted and its target
# forwards, from which verify takes the served acceptance length
CPU_COUNTERS = ("total_generated_tokens", "total_target_forwards")
CPU_MAX_QUEUE = 64  # requests in flight (queued + in the batch) before the CPU model answers "server busy"


# ---------------------------------------------------------------------------------------------
# the filler


def fill(template: str, values: dict[str, Any], *, source: str = "template") -> str:
    """Substitute ${name}; fail on a placeholder left anywhere but an unset backend parameter."""
    text = Template(template).safe_substitute({k: _text(v) for k, v in values.items()})
    leftover = _PLACEHOLDER.findall(_UNSET_PARAM.sub("", text))
    if leftover:
        raise SpecDeployError(
            f"{source}: no value for {sorted(set(leftover))}",
            hint="add them to the values specdeploy.triton.package passes for this model",
        )
    return text


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def backend_fill_args(values: dict[str, Any]) -> str:
    """The same values as one argument for the tensorrtllm_backend's tools/fill_template.py.

    It splits on unescaped ',' and then each item on unescaped ':', consuming one level of
    backslashes each time: '{0, 1}' travels as '{0\\, 1}', and a ':' inside a value needs both levels.
    """
    def esc(text: str) -> str:
        inner = text.replace("\\", "\\\\").replace(":", "\\:")
        return inner.replace("\\", "\\\\").replace(",", "\\,")

    return ",".join(f"{k}:{esc(_text(v))}" for k, v in sorted(values.items()))


def _fill_model(out: Path, src: Path, values: dict[str, Any], rename: str | None = None) -> None:
    """Copy one template model folder into `out`, filling its config.pbtxt."""
    shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    path = out / "config.pbtxt"
    text = fill(path.read_text(), values, source=str(src.relative_to(TEMPLATES) / "config.pbtxt"))
    if rename:
        text = text.replace(f'name: "{src.name}"', f'name: "{rename}"', 1)
    atomic_write_text(path, text)
    (out / "1").mkdir(exist_ok=True)


# ---------------------------------------------------------------------------------------------
# values


def _common(tokenizer_dir: str, limits: BuildLimits, max_batch_size: int, decoupled: bool) -> dict[str, Any]:
    return {
        "triton_max_batch_size": max_batch_size,
        "decoupled_mode": decoupled,
        "max_queue_delay_microseconds": 0,
        "max_queue_size": 0,
        "logits_datatype": "TYPE_FP32",
        "encoder_input_features_data_type": "TYPE_FP16",
        "tokenizer_dir": tokenizer_dir,
        "add_special_tokens": True,  # as Decoder.encode: in-process and served prompts match
        "skip_special_tokens": True,
        "preprocessing_instance_count": 1,
        "postprocessing_instance_count": 1,
        "bls_instance_count": 1,
        "accumulate_tokens": False,
        # TensorRT-LLM's backend default (the parameter unset): NVIDIA's clients that leave the input
        # out expect the prompt in the output; specdeploy's client sends exclude_input_in_output itself
        "exclude_input_in_output": False,
        "max_beam_width": 1,
        # the same numbers trtllm-build gets (build.BuildLimits.fit): prompt and prompt + answer
        "max_input_len": limits.max_input_len,
        "max_output_len": limits.max_seq_len,
    }


def instance_kind(device: str) -> str:
    """The CPU repository's tensorrt_llm instance: KIND_GPU on an explicit CUDA device (Triton
    then hands the model its GPU), KIND_CPU for cpu and auto (the model resolves auto at load)."""
    if not device.startswith("cuda"):
        return "KIND_CPU"
    index = device.partition(":")[2]
    return f"KIND_GPU gpus: [ {index} ]" if index else "KIND_GPU"


def serving_limits(build: BuildDir, model_dir: Path) -> BuildLimits:
    """The build stage's limits (already fitted to the model's context), else its defaults fitted
    the same way: every repository declares what the engines were built for."""
    plan = build.path("engines") / PLAN
    limits = BuildLimits(**json.loads(plan.read_text())["limits"]) if build.record("build") and plan.exists() else BuildLimits()
    return limits.fit(_read_context_len(model_dir))


def _read_context_len(model_dir: Path) -> int | None:
    config = model_dir / "config.json"
    if not config.exists():
        return None
    data = json.loads(config.read_text())
    return data.get("max_position_embeddings") or data.get("max_sequence_length")


# ---------------------------------------------------------------------------------------------
# the repositories


def write_cpu_repo(out: Path, deployment: dict[str, Any], tokenizer_dir: str, limits: BuildLimits, *,
                   max_batch_size: int, tree: ChoicesTree | None, max_queue: int = CPU_MAX_QUEUE,
                   decoupled: bool = True) -> None:
    """Ensemble + pre/postprocessing + the Python-backend tensorrt_llm running the runtime, whose
    in-flight batch holds up to `max_batch_size` sequences and which answers "server busy" beyond
    `max_queue` requests in flight. `decoupled` is TensorRT-LLM's decoupled_mode: streaming, or
    plain infer requests (which Triton refuses for a decoupled model) without it."""
    kind = deployment["spec"]["kind"]
    values = {
        **_common(tokenizer_dir, limits, max_batch_size, decoupled),
        # the model's execute() only queues a request and returns (its own scheduler thread batches
        # across calls): a Triton queue delay would only add latency, and Triton's queue stays empty,
        # so the bound that matters is the model's (specdeploy_max_queue, with a clear message)
        "max_queue_delay_microseconds": 0,
        "max_queue_size": 0,
        "triton_backend": "python",
        "instance_kind": instance_kind(deployment["device"]),
        "specdeploy_deployment": DEPLOYMENT_FILE,
        "batching_strategy": "specdeploy_cpu",
        "engine_dir": "",
        **({"decoding_mode": "medusa", "medusa_choices": tree.to_pbtxt()} if kind == "medusa" and tree else {}),
    }
    ibl = TEMPLATES / "inflight_batcher_llm"
    for model in ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm"):
        _fill_model(out / model, ibl / model, values)
    for model in ("tensorrt_llm", "tensorrt_llm_bls"):
        shutil.copytree(TEMPLATES / "cpu" / model, out / model, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    add_cpu_counters(out)
    write_cpu_bls(out / "tensorrt_llm_bls", (out / "ensemble" / "config.pbtxt").read_text(), decoupled=decoupled)
    _add_parameters(out / "tensorrt_llm" / "config.pbtxt",
                    {"specdeploy_max_batch_size": max_batch_size, "specdeploy_max_queue": max_queue})
    atomic_write_json(out / "tensorrt_llm" / "1" / DEPLOYMENT_FILE, deployment)


def add_cpu_counters(repo: Path) -> None:
    """The CPU runtime's own perf outputs (CPU_COUNTERS) on its tensorrt_llm model and the ensemble.
    The GPU repositories keep NVIDIA's set: their backend never sends these."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    for model in ("tensorrt_llm", "ensemble"):
        path = repo / model / "config.pbtxt"
        config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        for name in CPU_COUNTERS:
            config.output.add(name=name, data_type=model_config_pb2.TYPE_INT32, dims=[1])
        for step in config.ensemble_scheduling.step:
            if step.model_name == "tensorrt_llm":
                step.output_map.update({name: name for name in CPU_COUNTERS})
        atomic_write_text(path, text_format.MessageToString(config))


def write_cpu_bls(out: Path, ensemble_config: str, generator: str = "tensorrt_llm", *, decoupled: bool = True) -> None:
    """tensorrt_llm_bls for the CPU repository: the ensemble's inputs and outputs, and its steps in
    `1/steps.json`, which triton_repo/cpu/tensorrt_llm_bls/1/model.py runs so that a client's
    cancellation reaches the `generator` step while it runs (through the ensemble it does not).
    Decoupled as the `generator` is. It also takes TensorRT-LLM's BLS draft-target inputs, so that
    a client sending them gets that model's own answer: no separate draft model here."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    ensemble = text_format.Parse(ensemble_config, model_config_pb2.ModelConfig())
    steps = [{"model": step.model_name, "inputs": dict(step.input_map), "outputs": dict(step.output_map)}
             for step in ensemble.ensemble_scheduling.step]
    bls = model_config_pb2.ModelConfig(name=out.name, backend="python", max_batch_size=ensemble.max_batch_size,
                                       input=ensemble.input, output=ensemble.output)
    for name, dtype in (("num_draft_tokens", model_config_pb2.TYPE_INT32), ("use_draft_logits", model_config_pb2.TYPE_BOOL)):
        bls.input.add(name=name, data_type=dtype, dims=[1], optional=True)
    bls.model_transaction_policy.decoupled = decoupled
    bls.instance_group.add(count=1, kind=model_config_pb2.ModelInstanceGroup.KIND_CPU)
    (out / "1").mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.pbtxt", text_format.MessageToString(bls))
    atomic_write_json(out / "1" / "steps.json", {"steps": steps, "generator": generator,
                                                 "outputs": [tensor.name for tensor in ensemble.output]})


def _add_parameters(config: Path, parameters: dict[str, Any]) -> None:
    """The CPU runtime's own settings, appended to its model's config (the template is shared with the
    GPU repository, whose backend has no use for them)."""
    lines = [f'parameters: {{ key: "{key}" value: {{ string_value: "{_text(value)}" }} }}\n'
             for key, value in parameters.items()]
    atomic_write_text(config, config.read_text() + "".join(lines))


def write_engine_repo(out: Path, kind: str, tree: ChoicesTree | None, engines: str, tokenizer_dir: str, limits: BuildLimits, *,
                      max_batch_size: int, kv_cache_free_gpu_mem_fraction: float, decoupled: bool) -> dict[str, Any]:
    """The inflight_batcher_llm set for the C++ tensorrtllm backend; returns the values used."""
    values = {
        **_common(tokenizer_dir, limits, max_batch_size, decoupled),
        "triton_backend": "tensorrtllm",
        "instance_kind": "KIND_CPU",  # as upstream: the C++ backend places the engine on its GPUs itself
        "batching_strategy": "inflight_fused_batching",
        "engine_dir": f"{engines}/target",  # the build stage writes engines/target (+ engines/draft)
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction,
        # draft-target needs the target's KV cache reused across the BLS calls of one request
        "enable_kv_cache_reuse": kind == "draft",
        "tensorrt_llm_model_name": "tensorrt_llm",
        "tensorrt_llm_draft_model_name": "tensorrt_llm_draft" if kind == "draft" else "",
        "multimodal_encoders_name": "",
        **({"decoding_mode": "medusa", "medusa_choices": tree.to_pbtxt()} if kind == "medusa" and tree else {}),
    }
    ibl = TEMPLATES / "inflight_batcher_llm"
    for model in ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"):
        _fill_model(out / model, ibl / model, values)
    if kind == "draft":
        draft_values = {**values, "engine_dir": f"{engines}/draft", "decoding_mode": "${decoding_mode}"}
        _fill_model(out / "tensorrt_llm_draft", ibl / "tensorrt_llm", draft_values, rename="tensorrt_llm_draft")
    atomic_write_text(out / "fill_template_args.txt", backend_fill_args(values) + "\n")
    return values


def write_llmapi_repo(out: Path, model: str, summary: dict[str, Any], limits: BuildLimits, *, tp: int, pp: int,
                      max_batch_size: int, kv_cache_free_gpu_mem_fraction: float, decoupled: bool,
                      knobs: dict[str, Any] | None = None) -> None:
    """Triton's llmapi model: its one model.yaml (LLM() arguments from llmapi.llm_args, the
    speculative part as convert wrote it plus the release's speculation controls at scale,
    `knobs`), and trtllm_serve.yaml beside; the model's code and config.pbtxt come from the
    release's container (LLMAPI_CONTAINER_DIR, copied in by build_scripts/gpu_host.sh)."""
    (out / "tensorrt_llm" / "1").mkdir(parents=True, exist_ok=True)
    spec_cfg = summary.get("speculative_config")
    if spec_cfg and knobs:
        spec_cfg = llmapi.checked_config({**spec_cfg, **knobs}, release_for(summary["release"]))
    args = llmapi.llm_args(spec_cfg, tp=tp, pp=pp, max_batch_size=max_batch_size,
                           max_seq_len=limits.max_seq_len, kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction)
    document = llmapi.model_yaml(model, args, decoupled=decoupled)
    atomic_write_text(out / "tensorrt_llm" / "1" / "model.yaml", yaml.safe_dump(document, sort_keys=False))
    atomic_write_text(out / "trtllm_serve.yaml", yaml.safe_dump(args, sort_keys=False))


# ---------------------------------------------------------------------------------------------
# the stage's inputs


def _model_dir(build: BuildDir) -> Path:
    for stage, out in (("quantize", "quantized"), ("resolve", "base")):
        if build.record(stage) is not None:
            return build.path(out).resolve()
    raise SpecDeployError(f"no model to package in {build.root}", hint="run `specdeploy resolve` (or `make engine`) first")


def _tokenizer_dir(build: BuildDir, model_dir: Path) -> Path:
    base = build.path("base").resolve()
    return base if (base / "tokenizer_config.json").exists() else model_dir


def _convert_summary(build: BuildDir) -> dict[str, Any] | None:
    path = build.path("trtllm_ckpt") / "convert_summary.json"
    return json.loads(path.read_text()) if build.record("convert") is not None and path.exists() else None


def _tree(choices: Any) -> ChoicesTree | None:
    return None if choices is None else validate_choices(choices)


def _medusa_tree(spec_dir: Path, choices: Any) -> ChoicesTree | None:
    """The Medusa tree given, else the one the spec stage trained for (spec/spec_config.json)."""
    config = spec_dir / "spec_config.json"
    if choices is None and config.exists():
        choices = json.loads(config.read_text()).get("choices")
    return _tree(choices)


def _structure(kind: str, converted: dict[str, Any] | None, max_draft_len: int | None,
               block_size: int | None = None) -> DraftStructure | None:
    """The drafting the convert stage named for the GPU host (or, without one, a chain: DFlash's
    whole block)."""
    if kind in ("none", "medusa"):
        return None
    recorded = (converted or {}).get("structure")
    if recorded is None:
        return DraftStructure.make("chain", max_draft_len or (block_size - 1 if block_size else 4))
    structure = DraftStructure(**recorded)
    if max_draft_len is not None and max_draft_len != structure.max_draft_len:
        raise SpecDeployError(f"max_draft_len {max_draft_len} differs from the {structure.mode} of {structure.max_draft_len} "
                              "the convert stage wrote for the GPU host",
                              hint="re-run `specdeploy convert` with the same --max-draft-len (the CPU deployment must draft "
                                   "as the GPU host does)")
    return structure


def serve_dtype(choice: str, model_dir: Path, device: str) -> str:
    """The CPU runtime's compute dtype for a SERVE_DTYPES choice, said plainly when it is not bf16."""
    from specdeploy.device import fast_dtype, native_bf16, resolve_device
    from specdeploy.quantize.loader import parity_dtype

    if choice == "auto":
        return parity_dtype(model_dir)
    if choice != "native":
        return choice
    if device.startswith("cuda"):  # packaged for a GPU, maybe on a host without one: bf16 (Ampere and newer)
        return "bfloat16"
    where = resolve_device(device)
    if not native_bf16(where):
        print(f"package: the CPU deployment computes in float32: {where} has no native bf16 (emulated bf16 is several "
              "times slower there); `package --dtype bfloat16` / `engine --serve-dtype bfloat16` to force it")
    return fast_dtype(where)


def _local(path: Path, base: Path, root: Path) -> str:
    """deployment.json's paths: relative to its folder inside the build, absolute outside it."""
    path = path.resolve()
    return os.path.relpath(path, base) if root.resolve() in path.parents else str(path)


def deployment_json(base: Path, root: Path, model_dir: Path, dtype: str, device: str, kind: str, spec_dir: Path, *,
                    choices: list[list[int]] | None, options: dict[str, Any], draft_model_dir: Path | None,
                    adaptive: bool = False, spec_off_above: int | None = None) -> dict[str, Any]:
    """What runtime.deployment.load_decoder reads. Paths inside the build are relative to the
    file's folder (cpu/tensorrt_llm/1/), so the build directory can move as a whole. `device`
    stays as given ("auto" resolves where the model loads, not where it was packaged)."""
    return {
        "model_dir": _local(model_dir, base, root),
        "dtype": dtype,
        "device": device,
        **({"spec_off_above": spec_off_above} if spec_off_above is not None else {}),
        "spec": {
            "kind": kind,
            "path": _local(spec_dir, base, root) if kind in TRAINED and spec_dir.exists() else None,
            "choices": choices,
            "draft_model_dir": _local(draft_model_dir, base, root) if draft_model_dir else None,
            "adaptive": adaptive,
            **options,
        },
    }


def plan_cpu_shape(path: Path, structure: DraftStructure | None) -> dict[str, Any] | None:
    """The draft shape the planner measures fastest here for the CPU deployment (None when its
    proposer has a single fixed tree): {"options": deployment spec options, "plan": the measurement}.
    When plain decoding measures faster than every shape, the fastest shape is still served (the
    build asked for speculation) and the line printed says so."""
    from specdeploy.runtime.decoding import DEFAULT_DRAFT_LEN
    from specdeploy.runtime.deployment import load_decoder
    from specdeploy.runtime.planner import calibration_prompts, choose_draft_shape, describe

    decoder = load_decoder(path)
    max_len = structure.max_draft_len if structure is not None and structure.mode == "chain" else DEFAULT_DRAFT_LEN
    if decoder.proposer is None or not decoder.proposer.draft_shapes(max_len):
        return None
    plan = choose_draft_shape(decoder.target, decoder.proposer, calibration_prompts(decoder.tokenizer), max_len=max_len)
    shape = plan.shape or max(plan.estimates, key=lambda e: e.tokens_per_s).shape
    print(f"specdeploy package: CPU deployment {describe(plan)}", file=sys.stderr)
    if plan.shape is None:
        print(f"specdeploy package: serving {shape} anyway (the build asked for speculation); "
              "`make loadtest` shows where it pays", file=sys.stderr)
    return {"options": decoder.proposer.shape_options(shape), "plan": plan.as_dict()}


# A batch speculates where its rounds measured at least this much faster in-process: served, the
# margin shrinks (2026-11-23: in-process 1.01x / 1.09x at batch 2 / 3, `make loadtest` 0.85x at
# concurrency 2), and a server slower under load than plain decoding is the worse mistake.
LOAD_PAYS = 1.05


def plan_cpu_load(path: Path, max_batch_size: int) -> dict[str, Any]:
    """The CPU deployment's spec_off_above, measured on the deployment as written (its planned
    shape): in-flight batches of 1..max_batch_size, speculative and plain rounds interleaved.
    At least 1: alone, the deployment speculates, as the build asked."""
    from specdeploy.runtime.decoding import DEFAULT_DRAFT_LEN
    from specdeploy.runtime.deployment import load_decoder
    from specdeploy.runtime.planner import calibration_prompts, measure_load_curve, suggested_spec_off_above

    decoder = load_decoder(path)
    sizes = list(range(1, max_batch_size + 1))
    points = measure_load_curve(lambda size: decoder.batcher(max_batch_size=size), calibration_prompts(decoder.tokenizer),
                                sizes, max_draft=decoder.draft_len or DEFAULT_DRAFT_LEN)
    off_above = suggested_spec_off_above([p.batch for p in points], [p.speedup for p in points], LOAD_PAYS)
    off_above = None if off_above is None else max(1, off_above)
    curve = ", ".join(f"{p.batch}: {p.speedup:.2f}x" for p in points)
    print(f"specdeploy package: CPU deployment, speculative over plain rounds by in-flight batch size: {curve}; "
          f"spec_off_above {off_above if off_above is not None else 'none (speculation paid at every size)'}", file=sys.stderr)
    return {"spec_off_above": off_above, "pays": LOAD_PAYS, "curve": [p.as_dict() for p in points]}


def _dflash_block(spec_dir: Path) -> int | None:
    """The block size the spec stage trained DFlash with (spec/spec_config.json)."""
    config = spec_dir / "spec_config.json"
    return json.loads(config.read_text()).get("block_size") if config.is_file() else None


def _cpu_options(kind: str, structure: DraftStructure | None, tree: ChoicesTree | None, converted: dict | None,
                 block_size: int | None = None) -> dict[str, Any]:
    if kind == "dflash":
        return {**structure.runtime_options(kind), "block_size": block_size}
    if kind == "medusa":
        return {"max_draft_len": tree.num_nodes if tree else None}
    if structure is None:
        return {}
    options = structure.runtime_options(kind)
    ngram = (((converted or {}).get("llmapi") or {}).get("speculative_config") or {})
    if kind == "ngram":
        options["max_ngram"] = ngram.get("max_matching_ngram_size", llmapi.NGRAM_DEFAULTS["max_matching_ngram_size"])
    return options


# ---------------------------------------------------------------------------------------------
# routes


def _gpu_knobs(converted: dict[str, Any], structure: DraftStructure | None, plan_file: Path) -> dict[str, Any]:
    """The LLM-API speculation controls at scale for the build's release, seeded from the CPU
    planner's measurement (llmapi.scale_knobs); none without a speculative config or a plan."""
    if not (converted["llmapi"].get("speculative_config") and structure and plan_file.is_file()):
        return {}
    release = release_for(converted["llmapi"]["release"])
    return llmapi.scale_knobs(release, structure.max_draft_len, json.loads(plan_file.read_text()))


def _routes(kind: str, converted: dict[str, Any] | None, structure: DraftStructure | None, settings: dict[str, Any],
            knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """gpu_routes.json: the GPU routes this build has, the one to run, what each needs on the host,
    and the release they were written for (its image, pins and serve flag)."""
    converted = converted or {}
    world = converted.get("tp_size", 1) * converted.get("pp_size", 1)
    routes: dict[str, Any] = {}
    if converted.get("llmapi"):
        routes["llmapi"] = {
            "repo": f"{OUT}/llmapi", "model": "tensorrt_llm", "inputs": "llmapi", "stream": settings["decoupled"],
            "world_size": world, "request": {},
            "container_files": {"from": LLMAPI_CONTAINER_DIR, "to": "tensorrt_llm", "except": ["1/model.yaml"]},
            "trtllm_serve": {"model": converted["llmapi"]["model"], "config": f"{OUT}/llmapi/trtllm_serve.yaml"},
            "speculation_knobs": {"values": knobs or {}, "from": "the CPU planner's measured break-even "
                                  f"({OUT}/cpu/{PLAN_FILE}): starting points; a GPU's costs differ"},
        }
    if converted.get("engine_flow"):
        bls = kind == "draft"  # draft-target runs in the BLS model: only with num_draft_tokens, never streaming
        routes["engine"] = {
            "repo": f"{OUT}/engine", "model": "tensorrt_llm_bls" if bls else "ensemble", "inputs": "ensemble",
            "stream": settings["decoupled"] and not bls, "world_size": world,
            "request": {"num_draft_tokens": structure.max_draft_len} if bls else {},
            "container_files": {"from": BLS_CONTAINER_DIR, "to": "tensorrt_llm_bls/1", "except": []},
            "build_engines": "engines/build_engines.sh",
        }
    recommended = next((r for r in ("llmapi", "engine") if r in routes), None)
    version = converted.get("trtllm_version") or DEFAULT_TRTLLM_VERSION
    return {
        "trtllm_version": version, "release": release_for(version).as_dict(),
        "kind": kind, "recommended": recommended, "routes": routes,
        "refused": {name: converted.get(f"{name}_reason") for name in ("engine", "llmapi") if name not in routes},
        "structure": structure.as_dict() if structure else None,
        "note": "paths are $BUILD_DIR/...: build_scripts/gpu_host.sh resolves them where the build is mounted",
    }


def gpu_routes(build: BuildDir) -> dict[str, Any]:
    """The packaged build's gpu_routes.json (see _routes)."""
    path = build.path(OUT) / ROUTES_FILE
    if not path.exists():
        raise SpecDeployError(f"{path} not found", hint="run `specdeploy package` (or `make engine`) first")
    return json.loads(path.read_text())


def gpu_summary(build: BuildDir) -> list[str]:
    """What a GPU host should run for this build, one line each (for `make engine`'s summary)."""
    routes = gpu_routes(build)
    lines = []
    if routes["recommended"]:
        release = routes["release"]
        image = release["triton_image"] or f"none published ({release['triton_image_note']})"
        lines.append(f"GPU host (TensorRT-LLM {release['version']}, image {image}): build_scripts/gpu_host.sh {build.root} "
                     f"(route {routes['recommended']}: {', '.join(routes['routes'])} packaged in {build.path(OUT)})")
    else:
        lines.append("No TensorRT-LLM route for this build: nothing to run on a GPU host")
    lines += [f"no {name} route: {why}" for name, why in routes["refused"].items() if why]
    return lines


# ---------------------------------------------------------------------------------------------
# the stage


def run(
    build: BuildDir,
    *,
    spec: str = "none",
    choices: list[list[int]] | str | None = None,
    max_draft_len: int | None = None,
    draft_model_dir: str | Path | None = None,
    dtype: str = "native",
    adaptive: bool = False,
    device: str = "auto",
    max_batch_size: int = 64,
    cpu_max_batch_size: int = CPU_MAX_BATCH_SIZE,
    spec_off_above: int | None = None,
    cpu_draft_shape: str = "fixed",
    kv_cache_free_gpu_mem_fraction: float = 0.9,
    decoupled: bool = True,
) -> Path:
    """Write build/<name>/triton_repo/{cpu,engine,llmapi}; skipped when already complete.

    The GPU routes and the draft structure come from the convert stage (convert_summary.json);
    `choices` is a Medusa tree (default: the one the spec stage recorded); EAGLE drafts the chain
    or dynamic tree convert named, never a static tree. `dtype` is the CPU runtime's compute dtype (SERVE_DTYPES):
    "native" bf16 where the device computes it natively, else float32; "auto" the one in which
    served greedy parity is exact (quantize.loader.parity_dtype). `device` is where the CPU deployment
    computes (auto|cpu|cuda|cuda:N, stored as given). `adaptive`: the CPU runtime falls back to
    plain decoding while speculation does not pay; off by default, as TensorRT-LLM speculates.
    `cpu_max_batch_size`: sequences in the CPU deployment's in-flight batch; `spec_off_above`:
    larger batches decode plainly (None: always speculate, or with "auto" below what the planner
    measures; `make loadtest` measures it through the server);
    `cpu_draft_shape` "auto": the CPU deployment drafts the shape the planner measures fastest on
    this machine and stops speculating above the batch size where that stops paying
    (runtime.planner; the GPU routes keep convert's shape), "fixed": convert's."""
    if cpu_draft_shape not in CPU_DRAFT_SHAPES:
        raise SpecDeployError(f"unknown draft shape choice '{cpu_draft_shape}'", hint=f"use {' or '.join(CPU_DRAFT_SHAPES)}")
    if spec == "eagle" and choices is not None:
        raise SpecDeployError("EAGLE deploys as a chain or TensorRT-LLM's dynamic tree, not a static eagle_choices tree "
                              "(discouraged in TensorRT-LLM 1.2, deprecated in 1.3, removed in 1.4)",
                              hint="drop --choices; pick the structure with `specdeploy convert --eagle-tree chain|dynamic`")
    tree = _tree(choices)  # a bad tree fails before anything else
    device = check_device_spec(device)
    model_dir = _model_dir(build)
    dtype = serve_dtype(dtype, model_dir, device)
    spec_dir = build.path("spec").resolve()
    if spec == "medusa":
        tree = tree or _medusa_tree(spec_dir, None)
    converted = _convert_summary(build)
    structure = _structure(spec, converted, max_draft_len, _dflash_block(spec_dir) if spec == "dflash" else None)
    draft = _draft_dir(spec, converted, draft_model_dir, spec_dir, build.root)
    settings = {
        "spec": spec, "choices": tree.to_list() if tree else None, "structure": structure.as_dict() if structure else None,
        "draft_model_dir": str(draft) if draft else None, "dtype": dtype, "device": device, "adaptive": adaptive,
        "max_batch_size": max_batch_size, "cpu_max_batch_size": cpu_max_batch_size, "spec_off_above": spec_off_above,
        "cpu_draft_shape": cpu_draft_shape, "cpu_plan": CPU_PLAN if cpu_draft_shape == "auto" else None, "decoupled": decoupled,
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction, "templates": _templates_digest(),
    }
    consumes = tuple(s for s in _UPSTREAM if build.record(s) is not None)
    if build.completed(STAGE, settings, consumes=consumes):
        return build.path(OUT)
    with build.stage(STAGE, OUT, settings, consumes=consumes) as tmp:
        _write_repos(tmp, build, model_dir, spec_dir, tree, structure, converted, draft, settings)
    return build.path(OUT)


def _draft_dir(kind: str, converted: dict | None, given: str | Path | None, spec_dir: Path, root: Path) -> Path | None:
    """The draft model both sides run: the copy convert put in the build, else the one given."""
    if kind != "draft":
        return None
    carried = (converted or {}).get("draft_model")
    if carried:
        return Path(resolve(carried, root))
    return Path(given).resolve() if given else spec_dir


def _write_repos(tmp: Path, build: BuildDir, model_dir: Path, spec_dir: Path, tree: ChoicesTree | None,
                 structure: DraftStructure | None, converted: dict[str, Any] | None, draft: Path | None,
                 settings: dict[str, Any]) -> None:
    kind, root = settings["spec"], build.root.resolve()
    tokenizer = _tokenizer_dir(build, model_dir)
    limits = serving_limits(build, model_dir)
    final = root / OUT  # where tmp lands: relative paths are computed against it
    deployment = deployment_json(final / "cpu" / "tensorrt_llm" / "1", root, model_dir, settings["dtype"], settings["device"],
                                 kind, spec_dir, choices=tree.to_list() if tree else None,
                                 options=_cpu_options(kind, structure, tree, converted,
                                                      _dflash_block(spec_dir) if kind == "dflash" else None),
                                 draft_model_dir=draft,
                                 adaptive=settings["adaptive"], spec_off_above=settings["spec_off_above"])
    write_cpu_repo(tmp / "cpu", deployment, os.path.relpath(tokenizer, final / "cpu" / "preprocessing"), limits,
                   max_batch_size=settings["cpu_max_batch_size"], tree=tree, decoupled=settings["decoupled"])
    if settings["cpu_draft_shape"] == "auto" and kind != "none":
        # tmp is final's sibling (BuildDir.stage): the file's relative paths resolve alike from it
        written = tmp / "cpu" / "tensorrt_llm" / "1" / DEPLOYMENT_FILE
        planned = plan_cpu_shape(written, structure)
        if planned is not None:
            deployment["spec"].update(planned["options"])
            atomic_write_json(written, deployment)
            if settings["spec_off_above"] is None:  # the user's value wins
                planned["load"] = plan_cpu_load(written, settings["cpu_max_batch_size"])
                if planned["load"]["spec_off_above"] is not None:
                    atomic_write_json(written, {**deployment, "spec_off_above": planned["load"]["spec_off_above"]})
            atomic_write_json(tmp / "cpu" / PLAN_FILE, planned)
    gpu = {"max_batch_size": settings["max_batch_size"], "decoupled": settings["decoupled"],
           "kv_cache_free_gpu_mem_fraction": settings["kv_cache_free_gpu_mem_fraction"]}
    if converted and converted.get("engine_flow"):
        write_engine_repo(tmp / "engine", kind, tree, build_path(build.path("engines"), root), build_path(tokenizer, root),
                          limits, **gpu)
    knobs = None
    if converted and converted.get("llmapi"):
        knobs = _gpu_knobs(converted, structure, tmp / "cpu" / PLAN_FILE)
        write_llmapi_repo(tmp / "llmapi", converted["llmapi"]["model"], converted["llmapi"], limits,
                          tp=converted["tp_size"], pp=converted["pp_size"], knobs=knobs, **gpu)
    routes = _routes(kind, converted, structure, settings, knobs)
    atomic_write_json(tmp / ROUTES_FILE, routes)
    atomic_write_text(tmp / "README.md", _readme(routes))


def _templates_digest() -> str:
    """Changing a template re-runs the stage."""
    digest = hashlib.sha256()
    for path in sorted(TEMPLATES.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(TEMPLATES)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _readme(routes: dict[str, Any]) -> str:
    lines = ["# Triton model repositories (written by `specdeploy package`)", "",
             "- `cpu/`: served here by `specdeploy serve` (Python backend, specdeploy runtime); paths relative to each model."]
    if "engine" in routes["routes"]:
        lines.append("- `engine/`: TensorRT-LLM engine flow (1.1 / 1.2, C++ `tensorrtllm` backend). Engines come from "
                     "`engines/build_engines.sh`; `tensorrt_llm_bls/1/` takes the container's BLS code "
                     f"({BLS_CONTAINER_DIR}). `fill_template_args.txt` holds the values in fill_template.py's syntax.")
        if routes["routes"]["engine"]["model"] == "tensorrt_llm_bls":
            lines.append("  Draft-target runs in `tensorrt_llm_bls`: send `num_draft_tokens` "
                         f"({routes['routes']['engine']['request']['num_draft_tokens']}) with each request; it does not stream.")
    if "llmapi" in routes["routes"]:
        lines.append(f"- `llmapi/`: TensorRT-LLM's LLM API (PyTorch backend): copy everything in {LLMAPI_CONTAINER_DIR} but "
                     "1/model.yaml (config.pbtxt; model.py, which imports helpers.py) into `llmapi/tensorrt_llm/`; "
                     "`trtllm_serve.yaml` is the same "
                     f"configuration for `trtllm-serve {routes['release']['serve_flag']}` (gpu_host.sh --assemble writes it "
                     "with its paths resolved).")
    lines += [f"- no `{name}/`: {why}" for name, why in routes["refused"].items() if why]
    lines += ["", "GPU-side paths read `$BUILD_DIR/...`: `build_scripts/gpu_host.sh build/<name>` resolves them where the "
              "build is mounted, assembles the repository, starts the server and runs `specdeploy verify` against it "
              "(`--dry-run` prints the commands)."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# CLI


def _at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= `minimum`."""
    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*-?\d+\s*", text) or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return int(text)
    return parse


def add_cpu_deployment_args(parser: argparse.ArgumentParser, draft_shape: str) -> None:
    """The CPU deployment's in-flight batching and draft shape (package and engine)."""
    parser.add_argument("--cpu-draft-shape", choices=CPU_DRAFT_SHAPES, default=draft_shape,
                        help="CPU deployment: auto drafts the chain or tree the planner measures fastest on this machine "
                             f"(calibrated on held-out prompts; ~1 min), fixed the convert stage's (default {draft_shape})")
    parser.add_argument("--cpu-max-batch-size", type=_at_least(1), default=CPU_MAX_BATCH_SIZE,
                        help=f"CPU deployment: sequences decoded together in one in-flight batch (default {CPU_MAX_BATCH_SIZE})")
    parser.add_argument("--spec-off-above", type=_at_least(0),
                        help="CPU deployment: batches of more active sequences than this decode plainly (default: with "
                             "--cpu-draft-shape auto, the largest batch up to which speculating measured faster here; "
                             "else always speculate); `make loadtest` measures the curve through the server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdeploy.device import add_device_arg

    add_build_args(parser)
    add_device_arg(parser)
    parser.add_argument("--choices", help="Medusa choices tree, JSON ('[[0], [0, 0]]') or '{0}, {0, 0}'")
    parser.add_argument("--max-draft-len", type=int, help="draft tokens per step (default: what convert wrote, else 4)")
    parser.add_argument("--draft", help="draft model folder (spec=draft); default: the copy convert made, else spec/")
    parser.add_argument("--dtype", choices=SERVE_DTYPES, default="native", help=SERVE_DTYPE_HELP)
    parser.add_argument("--adaptive", action="store_true", help=ADAPTIVE_HELP)
    parser.add_argument("--max-batch-size", type=int, default=64, help="engine/llmapi max batch size")
    add_cpu_deployment_args(parser, draft_shape="fixed")
    parser.add_argument("--kv-cache-free-gpu-mem-fraction", type=float, default=0.9)
    parser.add_argument("--no-stream", action="store_true",
                        help="non-decoupled repositories, CPU and GPU (TensorRT-LLM's decoupled_mode false): plain "
                             "infer requests are answered, streaming ones refused")


def main(args: argparse.Namespace) -> int:
    build = build_from_args(args)
    out = run(
        build, spec=args.spec, choices=args.choices, max_draft_len=args.max_draft_len,
        draft_model_dir=args.draft, dtype=args.dtype, adaptive=args.adaptive, device=args.device,
        max_batch_size=args.max_batch_size, kv_cache_free_gpu_mem_fraction=args.kv_cache_free_gpu_mem_fraction,
        decoupled=not args.no_stream, cpu_max_batch_size=args.cpu_max_batch_size, spec_off_above=args.spec_off_above,
        cpu_draft_shape=args.cpu_draft_shape,
    )
    print(out)
    for line in gpu_summary(build):
        print(line)
    return 0
