"""Stage `package`: fill the project's Triton templates into build/<name>/triton_repo/.

Three model repositories, side by side, all generated from `triton_repo/` at the project root:

    triton_repo/cpu/      ensemble + preprocessing + postprocessing + tensorrt_llm (Python backend
                          running specdeploy's runtime: what `specdeploy serve` serves here)
    triton_repo/engine/   the same ensemble with the C++ tensorrtllm backend on TensorRT engines
                          (TRT-LLM <= 1.1), plus tensorrt_llm_bls (and tensorrt_llm_draft for
                          draft-target)
    triton_repo/llmapi/   TensorRT-LLM >= 1.2: the llmapi model and its model.yaml

Templates use `${name}` placeholders like TensorRT-LLM's own; one filler (string.Template) fills
them. A placeholder left inside a `string_value: "${...}"` parameter is how the tensorrtllm
backend spells "unset", so those may stay; any other one left is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path
from string import Template
from typing import Any

from specdeploy.choices import ChoicesTree, validate_choices
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, atomic_write_text
from specdeploy.manifest import BuildDir, add_build_args, build_from_args

STAGE = "package"
OUT = "triton_repo"
TEMPLATES = Path(__file__).resolve().parents[2] / "triton_repo"
FLAVORS = ("cpu", "engine", "llmapi")
SERVE_DTYPES = ("auto", "float32", "float64", "bfloat16")
ADAPTIVE_HELP = ("CPU deployment: fall back to plain decoding while speculation does not pay (faster on a CPU "
                 "with a weak module); default off: speculate every step, as TensorRT-LLM does")
_UPSTREAM = ("resolve", "spec", "quantize", "convert", "build")
_UNSET_PARAM = re.compile(r'string_value:\s*"\$\{\w+\}"')
_PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
# decoding_mode of the tensorrtllm backend per spec kind (draft-target is driven by BLS instead)
_DECODING_MODE = {"medusa": "medusa", "eagle": "eagle"}
# TRT-LLM >= 1.2 (PyTorch backend) speculative_config.decoding_type; Medusa is not supported there


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
    """Copy one template model folder into `out`, filling config.pbtxt / model.yaml."""
    shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("config.pbtxt", "1/model.yaml"):
        path = out / name
        if path.exists():
            text = fill(path.read_text(), values, source=str(src.relative_to(TEMPLATES) / name))
            if rename:
                text = text.replace(f'name: "{src.name}"', f'name: "{rename}"', 1)
            atomic_write_text(path, text)
    (out / "1").mkdir(exist_ok=True)


# ---------------------------------------------------------------------------------------------
# values


def _common(tokenizer_dir: Path, max_batch_size: int, decoupled: bool) -> dict[str, Any]:
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
        "exclude_input_in_output": True,
        "max_beam_width": 1,
    }


def _choices_values(kind: str, tree: ChoicesTree | None) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if kind in _DECODING_MODE:
        values["decoding_mode"] = _DECODING_MODE[kind]
    if tree is not None and kind in ("medusa", "eagle"):
        values[f"{kind}_choices"] = tree.to_pbtxt()
    return values


def _read_context_len(model_dir: Path) -> int | None:
    config = model_dir / "config.json"
    if not config.exists():
        return None
    data = json.loads(config.read_text())
    return data.get("max_position_embeddings") or data.get("max_sequence_length")


# ---------------------------------------------------------------------------------------------
# the three repositories


def write_cpu_repo(
    out: Path, deployment: dict[str, Any], model_dir: Path, tokenizer_dir: Path, *, max_batch_size: int
) -> None:
    """Ensemble + pre/postprocessing + the Python-backend tensorrt_llm running the runtime."""
    context = _read_context_len(model_dir) or 0
    values = {
        **_common(tokenizer_dir, max_batch_size, decoupled=True),
        "triton_backend": "python",
        "max_input_len": context,
        "max_output_len": context,
        "specdeploy_deployment": "deployment.json",
        "batching_strategy": "specdeploy_cpu",
        "engine_dir": "",
        **_choices_values(deployment["spec"]["kind"], _tree(deployment["spec"].get("choices"))),
    }
    ibl = TEMPLATES / "inflight_batcher_llm"
    for model in ("ensemble", "preprocessing", "postprocessing"):
        _fill_model(out / model, ibl / model, values)
    _fill_model(out / "tensorrt_llm", ibl / "tensorrt_llm", values)
    shutil.copytree(TEMPLATES / "cpu" / "tensorrt_llm", out / "tensorrt_llm", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    atomic_write_json(out / "tensorrt_llm" / "1" / "deployment.json", deployment)


def write_engine_repo(
    out: Path, kind: str, tree: ChoicesTree | None, engines: Path, tokenizer_dir: Path, *,
    max_batch_size: int, kv_cache_free_gpu_mem_fraction: float, decoupled: bool,
) -> dict[str, Any]:
    """The inflight_batcher_llm set for the C++ tensorrtllm backend; returns the values used."""
    target = engines / "target"  # the build stage writes engines/target (+ engines/draft)
    values = {
        **_common(tokenizer_dir, max_batch_size, decoupled),
        "triton_backend": "tensorrtllm",
        "batching_strategy": "inflight_fused_batching",
        "engine_dir": target,
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction,
        # draft-target needs the target's KV cache reused across the BLS calls of one request
        "enable_kv_cache_reuse": kind == "draft",
        "tensorrt_llm_model_name": "tensorrt_llm",
        "tensorrt_llm_draft_model_name": "tensorrt_llm_draft" if kind == "draft" else "",
        "multimodal_encoders_name": "",
        **_choices_values(kind, tree),
    }
    ibl = TEMPLATES / "inflight_batcher_llm"
    for model in ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"):
        _fill_model(out / model, ibl / model, values)
    if kind == "draft":
        draft_values = {**values, "engine_dir": engines / "draft", "decoding_mode": "${decoding_mode}"}
        _fill_model(out / "tensorrt_llm_draft", ibl / "tensorrt_llm", draft_values, rename="tensorrt_llm_draft")
    return values


def llmapi_speculative_yaml(kind: str, spec_dir: Path, draft_model_dir: Path | None, max_draft_len: int,
                            tree: ChoicesTree | None = None) -> str:
    """model.yaml's speculative_config block (TRT-LLM >= 1.2 LLM API), '' without speculation.
    The mapping itself comes from the convert stage's LLM-API route, so both write the same."""
    from specdeploy.trtllm.llmapi import DECODING_TYPES, speculative_config

    if kind not in DECODING_TYPES:
        return ""
    # EAGLE-3: the draft folder ModelOpt's export_speculative_decoding wrote in the spec stage
    draft = {"draft": draft_model_dir, "eagle": spec_dir / "eagle3_export"}.get(kind)
    config = speculative_config(kind, max_draft_len, draft, tree=tree)
    return "\n".join(["speculative_config:"] + [f"  {key}: {value}" for key, value in config.items()])


def write_llmapi_repo(
    out: Path, kind: str, model_dir: Path, spec_dir: Path, draft_model_dir: Path | None, *, tree: ChoicesTree | None,
    max_draft_len: int, max_batch_size: int, kv_cache_free_gpu_mem_fraction: float, decoupled: bool,
) -> None:
    values = {
        "model_dir": model_dir,
        "tensor_parallel_size": 1,
        "max_batch_size": max_batch_size,
        "max_seq_len": _read_context_len(model_dir) or 2048,
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction,
        "speculative_config": llmapi_speculative_yaml(kind, spec_dir, draft_model_dir, max_draft_len, tree),
        "decoupled_mode": decoupled,
    }
    _fill_model(out / "tensorrt_llm", TEMPLATES / "llmapi" / "tensorrt_llm", values)


def _tree(choices: Any) -> ChoicesTree | None:
    return None if choices is None else validate_choices(choices)


def _recorded_choices(spec_dir: Path, kind: str) -> list[list[int]] | None:
    """The tree the spec stage trained for (spec/spec_config.json), when one was not given."""
    config = spec_dir / "spec_config.json"
    if kind not in ("medusa", "eagle") or not config.exists():
        return None
    return json.loads(config.read_text()).get("choices")


# ---------------------------------------------------------------------------------------------
# the stage


def _model_dir(build: BuildDir) -> Path:
    for stage, out in (("quantize", "quantized"), ("resolve", "base")):
        if build.record(stage) is not None:
            return build.path(out).resolve()
    raise SpecDeployError(f"no model to package in {build.root}", hint="run `specdeploy resolve` (or `make engine`) first")


def _tokenizer_dir(build: BuildDir, model_dir: Path) -> Path:
    base = build.path("base").resolve()
    return base if (base / "tokenizer_config.json").exists() else model_dir


def deployment_json(
    base: Path, model_dir: Path, dtype: str, kind: str, spec_dir: Path, *,
    choices: list[list[int]] | None, max_draft_len: int, draft_model_dir: Path | None, adaptive: bool = False,
) -> dict[str, Any]:
    """What runtime.deployment.load_decoder reads. Paths are relative to the file's folder
    (cpu/tensorrt_llm/1/), so the build directory can move as a whole."""
    return {
        "model_dir": os.path.relpath(model_dir, base),
        "dtype": dtype,
        "spec": {
            "kind": kind,
            "path": os.path.relpath(spec_dir, base) if spec_dir.exists() else None,
            "choices": choices,
            "max_draft_len": max_draft_len,
            "draft_model_dir": os.path.relpath(draft_model_dir, base) if draft_model_dir else None,
            "adaptive": adaptive,
        },
    }


def run(
    build: BuildDir,
    *,
    spec: str = "none",
    choices: list[list[int]] | str | None = None,
    max_draft_len: int | None = None,
    draft_model_dir: str | Path | None = None,
    dtype: str = "auto",
    adaptive: bool = False,
    max_batch_size: int = 64,
    cpu_max_batch_size: int = 4,
    kv_cache_free_gpu_mem_fraction: float = 0.9,
    decoupled: bool = True,
) -> Path:
    """Write build/<name>/triton_repo/{cpu,engine,llmapi}; skipped when already complete.

    `choices` defaults to the tree recorded by the spec stage (spec/spec_config.json);
    `max_draft_len` to that tree's size, else 4 draft tokens (draft-target, n-gram).
    `dtype` "auto" is the CPU runtime dtype in which greedy parity is exact (quantize.parity_dtype).
    `adaptive`: the CPU runtime falls back to plain decoding while speculation does not pay; off by
    default, so that the CPU deployment speculates as TensorRT-LLM does and shows the module's
    own acceptance."""
    tree = _tree(choices)  # a bad tree fails before anything else
    model_dir = _model_dir(build)
    if dtype == "auto":
        from specdeploy.quantize import parity_dtype

        dtype = parity_dtype(model_dir)
    spec_dir = build.path("spec").resolve()
    tree = tree or _tree(_recorded_choices(spec_dir, spec))
    max_draft_len = max_draft_len or (tree.num_nodes if tree else 4)
    draft = Path(draft_model_dir).resolve() if draft_model_dir else (spec_dir if spec == "draft" else None)
    settings = {
        "spec": spec, "choices": tree.to_list() if tree else None, "max_draft_len": max_draft_len,
        "draft_model_dir": str(draft) if draft else None, "dtype": dtype, "adaptive": adaptive, "max_batch_size": max_batch_size,
        "cpu_max_batch_size": cpu_max_batch_size, "decoupled": decoupled,
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction,
        "templates": _templates_digest(),
    }
    consumes = tuple(s for s in _UPSTREAM if build.record(s) is not None)
    if build.completed(STAGE, settings, consumes=consumes):
        return build.path(OUT)
    with build.stage(STAGE, OUT, settings, consumes=consumes) as tmp:
        _write_repos(tmp, build, model_dir, spec_dir, tree, draft, settings)
    return build.path(OUT)


def _write_repos(
    tmp: Path, build: BuildDir, model_dir: Path, spec_dir: Path, tree: ChoicesTree | None,
    draft: Path | None, settings: dict[str, Any],
) -> None:
    kind = settings["spec"]
    tokenizer_dir = _tokenizer_dir(build, model_dir)
    gpu = {"max_batch_size": settings["max_batch_size"], "decoupled": settings["decoupled"],
           "kv_cache_free_gpu_mem_fraction": settings["kv_cache_free_gpu_mem_fraction"]}
    base = build.root.resolve() / OUT / "cpu" / "tensorrt_llm" / "1"  # where deployment.json lives
    deployment = deployment_json(base, model_dir, settings["dtype"], kind, spec_dir, choices=settings["choices"],
                                 max_draft_len=settings["max_draft_len"], draft_model_dir=draft, adaptive=settings["adaptive"])
    write_cpu_repo(tmp / "cpu", deployment, model_dir, tokenizer_dir, max_batch_size=settings["cpu_max_batch_size"])
    values = write_engine_repo(tmp / "engine", kind, tree, build.path("engines").resolve(), tokenizer_dir, **gpu)
    atomic_write_text(tmp / "engine" / "fill_template_args.txt", backend_fill_args(values) + "\n")
    write_llmapi_repo(tmp / "llmapi", kind, model_dir, spec_dir, draft, tree=tree, max_draft_len=settings["max_draft_len"], **gpu)
    atomic_write_text(tmp / "README.md", _readme(kind))


def _templates_digest() -> str:
    """Changing a template re-runs the stage."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(TEMPLATES.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(TEMPLATES)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _readme(kind: str) -> str:
    llmapi = ("speculative_config set" if kind in ("eagle", "draft", "ngram") else "no speculative_config: "
              + ("no speculation asked" if kind == "none" else f"TRT-LLM >= 1.2 does not support '{kind}'"))
    return (
        "# Triton model repositories (written by `specdeploy package`)\n\n"
        "- `cpu/`: served here by `specdeploy serve` (Python backend, specdeploy runtime).\n"
        "- `engine/`: TensorRT-LLM <= 1.1 engines with the C++ `tensorrtllm` backend, in NVIDIA's\n"
        "  Triton TRT-LLM container. `tensorrt_llm_bls/1/` takes the container's BLS code:\n"
        "  `cp -r /app/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/* engine/tensorrt_llm_bls/1/`.\n"
        "  `fill_template_args.txt` holds the values in the backend's fill_template.py syntax.\n"
        f"- `llmapi/`: TensorRT-LLM >= 1.2 (`llmapi` model; {llmapi}); its model.py is\n"
        "  `/app/all_models/llmapi/tensorrt_llm/1/model.py` from the container.\n"
    )


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    parser.add_argument("--choices", help="medusa/eagle choices tree, JSON ('[[0], [0, 0]]') or '{0}, {0, 0}'")
    parser.add_argument("--max-draft-len", type=int, help="default: the choices tree's size, else 4")
    parser.add_argument("--draft", help="draft model folder (spec=draft); default: the build's spec/")
    parser.add_argument("--dtype", choices=SERVE_DTYPES, default="auto",
                        help="CPU runtime dtype; auto: float64 when activations or K/V are quantized, else float32 "
                             "(the dtypes in which greedy parity is exact); bfloat16 is faster, parity at near-ties only")
    parser.add_argument("--adaptive", action="store_true", help=ADAPTIVE_HELP)
    parser.add_argument("--max-batch-size", type=int, default=64, help="engine/llmapi max batch size")
    parser.add_argument("--kv-cache-free-gpu-mem-fraction", type=float, default=0.9)
    parser.add_argument("--no-stream", action="store_true", help="non-decoupled GPU configs (no streaming)")


def main(args: argparse.Namespace) -> int:
    build = build_from_args(args)
    out = run(
        build, spec=args.spec, choices=args.choices, max_draft_len=args.max_draft_len,
        draft_model_dir=args.draft, dtype=args.dtype, adaptive=args.adaptive, max_batch_size=args.max_batch_size,
        kv_cache_free_gpu_mem_fraction=args.kv_cache_free_gpu_mem_fraction, decoupled=not args.no_stream,
    )
    print(out)
    return 0
