"""triton_repo/cpu/: the repository `specdeploy serve` serves here.

Ensemble + preprocessing + postprocessing + tensorrt_llm (Python backend running specdeploy's
runtime, templates/cpu/tensorrt_llm/1/model.py, from the deployment.json written beside it) +
tensorrt_llm_bls (the ensemble's steps as BLS: cancellable). It names files relative to each
model's folder, so it is served wherever the build sits. The CPU deployment drafts with the same
structure (chain, dynamic tree, Medusa tree) as the GPU configs, so what is measured here predicts
the GPU host.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from specdeploy.choices import ChoicesTree
from specdeploy.fileio import atomic_write_json, atomic_write_text
from specdeploy.trtllm import llmapi
from specdeploy.trtllm.build import BuildLimits
from specdeploy.trtllm.llmapi import DraftStructure
from specdeploy.triton.templating import TEMPLATES, common_values, copy_model, fill_model, text_value

TRAINED = ("medusa", "eagle", "dflash")  # kinds whose deployment reads the spec stage's spec/ folder
DEPLOYMENT_FILE = "deployment.json"  # cpu/tensorrt_llm/1/: what the CPU runtime loads
# the CPU runtime's compute dtype: native (bf16 where the device has it, else float32), or a dtype,
# or auto (the one where served greedy parity is exact: checkpoints.quantized.parity_dtype)
SERVE_DTYPES = ("native", "bfloat16", "float32", "float64", "auto")
# sequences in the CPU deployment's in-flight batch: measured in-process on 2 cores (SmolLM2-135M,
# float32), 8 rows decode 4.2x the tokens/s of one
CPU_MAX_BATCH_SIZE = 8
# perf outputs only the CPU runtime sends (beside NVIDIA's): the tokens it emitted and its target
# forwards, from which verify takes the served acceptance length
CPU_COUNTERS = ("total_generated_tokens", "total_target_forwards")
CPU_MAX_QUEUE = 64  # requests in flight (queued + in the batch) before the CPU model answers "server busy"


def instance_kind(device: str) -> str:
    """The CPU repository's tensorrt_llm instance: KIND_GPU on an explicit CUDA device (Triton
    then hands the model its GPU), KIND_CPU for cpu and auto (the model resolves auto at load)."""
    if not device.startswith("cuda"):
        return "KIND_CPU"
    index = device.partition(":")[2]
    return f"KIND_GPU gpus: [ {index} ]" if index else "KIND_GPU"


def write_cpu_repo(out: Path, deployment: dict[str, Any], tokenizer_dir: str, limits: BuildLimits, *,
                   max_batch_size: int, tree: ChoicesTree | None, max_queue: int = CPU_MAX_QUEUE,
                   decoupled: bool = True) -> None:
    """Ensemble + pre/postprocessing + the Python-backend tensorrt_llm running the runtime, whose
    in-flight batch holds up to `max_batch_size` sequences and which answers "server busy" beyond
    `max_queue` requests in flight. `decoupled` is TensorRT-LLM's decoupled_mode: streaming, or
    plain infer requests (which Triton refuses for a decoupled model) without it."""
    kind = deployment["spec"]["kind"]
    values = {
        **common_values(tokenizer_dir, limits, max_batch_size, decoupled),
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
        fill_model(out / model, ibl / model, values)
    for model in ("tensorrt_llm", "tensorrt_llm_bls"):
        copy_model(TEMPLATES / "cpu" / model, out / model)
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
    `1/steps.json`, which templates/cpu/tensorrt_llm_bls/1/model.py runs so that a client's
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
    lines = [f'parameters: {{ key: "{key}" value: {{ string_value: "{text_value(value)}" }} }}\n'
             for key, value in parameters.items()]
    atomic_write_text(config, config.read_text() + "".join(lines))


# ---------------------------------------------------------------------------------------------
# deployment.json


def serve_dtype(choice: str, model_dir: Path, device: str) -> str:
    """The CPU runtime's compute dtype for a SERVE_DTYPES choice, said plainly when it is not bf16."""
    from specdeploy.device import fast_dtype, native_bf16, resolve_device
    from specdeploy.checkpoints.quantized import parity_dtype

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


def cpu_options(kind: str, structure: DraftStructure | None, tree: ChoicesTree | None, converted: dict | None,
                block_size: int | None = None) -> dict[str, Any]:
    """deployment.json's spec options: the drafting the GPU host does, in the runtime's terms."""
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
