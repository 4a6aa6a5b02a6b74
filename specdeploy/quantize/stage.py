"""The `quantize` stage and its command line: validate, preflight, calibrate + export the base,
optionally the module, write the summary and the quality report (package docstring: the layout)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from specdeploy.device import add_device_arg, announce, fast_dtype, resolve_device
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, atomic_write_text
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.checkpoints import checkpoint_dtype, load_tokenizer
from specdeploy.quantize.calibrate import calibration_batches, quantize_model
from specdeploy.quantize.config import check_block_size, check_exclude_format, check_format, excluded_linears, quant_config
from specdeploy.quantize.export import copy_tokenizer_files, export_checkpoint, load_base
from specdeploy.quantize.formats import DEPLOY_DTYPES, FP4_QFORMATS, KV_CACHE
from specdeploy.checkpoints.quantized import torch_dtype
from specdeploy.quantize.placement import Placement, place
from specdeploy.quantize.report import quality_report, report_markdown
from specdeploy.quantize.spec_module import quantize_spec_module

STAGE = "quantize"
OUT = "quantized"
PPL_SEQ_LEN = 256  # tokens per held-out text in the report's perplexity
REPORT_PROMPT_TOKENS = 512  # held-out prompts are <= 400 characters, in the chat template


def run(build: BuildDir, qformat: str = "fp8", kv_cache: str = "fp8", *, calib_size: int = 64,
        calib_seq_len: int = 256, quantize_spec: bool = False, dtype: str = "bfloat16", awq_block_size: int = 128,
        report: bool = True, report_prompts: int = 8, report_tokens: int = 32, report_texts: int = 16,
        seed: int = 0, exclude: list[str] | None = None, device: str = "auto", trust_remote_code: bool = False) -> Path:
    """Stage `quantize`: build/<name>/quantized/, computed on `device` (auto|cpu|cuda|cuda:N)."""
    check_deploy_dtype(dtype, qformat, kv_cache)
    check_format(qformat, kv_cache, awq_block_size)  # before loading anything
    check_exclude_format(qformat, exclude or [])
    counts = {"--calib-size": calib_size, "--calib-seq-len": calib_seq_len}
    if report:  # refused before calibrating: the report runs last, after minutes of work
        counts.update({"--report-prompts": report_prompts, "--report-tokens": report_tokens, "--report-texts": report_texts})
    for flag, value in counts.items():
        if value < 1:
            raise SpecDeployError(f"{flag} must be at least 1, got {value}",
                                  hint="--no-report skips the quality report" if flag.startswith("--report") else "")
    if build.record("resolve") is None:
        raise SpecDeployError(f"stage 'resolve' has not run in {build.root}", hint="run `specdeploy resolve` first")
    spec_dir = build.path("spec") if build.record("spec") else None
    if quantize_spec and spec_dir is None:
        raise SpecDeployError("--quantize-spec needs a trained module in spec/", hint="run `specdeploy spec train` first")
    # the module matters to the report (its acceptance on the quantized base) and to --quantize-spec
    # only: otherwise a retrained module does not calibrate the base again (hours on a 70B one)
    if not (report or quantize_spec):
        spec_dir = None
    consumes = ("resolve", "spec") if spec_dir is not None else ("resolve",)
    settings = {"qformat": qformat, "kv_cache": kv_cache, "calib_size": calib_size, "calib_seq_len": calib_seq_len,
                "quantize_spec": quantize_spec, "dtype": dtype, "awq_block_size": awq_block_size,
                "report": report, "report_prompts": report_prompts, "report_tokens": report_tokens,
                "report_texts": report_texts, "seed": seed}
    if exclude:  # only when used: builds made before --exclude existed stay complete
        settings["exclude"] = list(exclude)
    if dtype == "float16" or quantize_spec:  # made again: fp16 was computed in bf16 on a bf16 CPU, the
        settings["revision"] = 2  # EAGLE module's LM head was FP8; no other build's output changed
    if build.completed(STAGE, settings, consumes=consumes):
        return build.path(OUT)
    torch_device = resolve_device(device)
    described = announce(STAGE, torch_device)
    saved = checkpoint_dtype(build.path("base"))
    if saved != dtype:  # said plainly: a cast changes the model's output a little (verify's fidelity report)
        print(f"the base was saved in {saved}; the deployment's weights are cast to {dtype} (--dtype)")
    with build.stage(STAGE, OUT, settings, consumes=consumes, device=described) as tmp:
        _quantize_into(tmp, build.path("base"), spec_dir, {**settings, "compute_dtype": compute_dtype(dtype, torch_device)},
                       torch_device, trust_remote_code)
    return build.path(OUT)


def compute_dtype(export_dtype: str, device: torch.device) -> str:
    """What calibration and the report compute in: the export dtype, unless the CPU would emulate
    it (bf16/fp16 without native support: several times slower than float32); then float32, never
    the other half type (bf16 holds 3 mantissa bits fewer than fp16: an fp16 deployment computed in
    bf16 would ship bf16-rounded weights). The calibrated model is cast to the export dtype just
    before export."""
    return export_dtype if device.type == "cuda" or export_dtype == fast_dtype(device) else "float32"


def _placements(base_dir: Path, settings: dict[str, Any], device: torch.device) -> tuple[Placement, Placement | None]:
    """Where calibration and the report load their models, checked before either loads one."""
    dtype = settings["compute_dtype"]
    other_device = "--device cpu on a host with enough RAM" if device.type == "cuda" else "--device cuda on a GPU host"
    calibration = place("calibration", base_dir, dtype, device, settings["calib_seq_len"], options=[
        f"a shorter --calib-seq-len than {settings['calib_seq_len']} (activations)",
        "more or larger GPUs (a model that fits all visible GPUs together is spread over them, device_map=auto)",
        other_device])
    if not settings["report"]:
        return calibration, None
    report_seq_len = max(PPL_SEQ_LEN, REPORT_PROMPT_TOKENS + settings["report_tokens"])
    report = place("quality report (base + quantized)", base_dir, dtype, device, report_seq_len, copies=2, options=[
        "--no-report (calibration and export alone fit)", "more or larger GPUs", other_device])
    return calibration, report


def _quantize_into(out: Path, base_dir: Path, spec_dir: Path | None, settings: dict[str, Any], device: torch.device,
                   trust_remote_code: bool) -> None:
    calibration, report_placement = _placements(base_dir, settings, device)
    tokenizer = load_tokenizer(base_dir, trust_remote_code=trust_remote_code)
    batches = calibration_batches(tokenizer, settings["calib_size"], settings["calib_seq_len"], settings["seed"])
    calib_seconds, kept = _quantize_and_export(out, base_dir, batches, settings, calibration, trust_remote_code)
    copy_tokenizer_files(base_dir, out)
    quant_spec_dir = None
    if settings["quantize_spec"]:
        quant_spec_dir = quantize_spec_module(base_dir, spec_dir, out / "spec", batches, settings["compute_dtype"], calibration,
                                              trust_remote_code)
    atomic_write_json(out / "specdeploy_quant.json", {
        "settings": settings,
        "modelopt_config": _jsonable(quant_config(settings["qformat"], settings["kv_cache"], settings["awq_block_size"], kept)),
        "unquantized_linears": kept,
        "calibration": {"sequences": len(batches), "tokens": sum(b.shape[1] for b in batches), "seconds": round(calib_seconds, 1),
                        "device_map": calibration.device_map},
        "runtime_loadable": settings["qformat"] not in FP4_QFORMATS,
        "note": "load with specdeploy.checkpoints.load_causal_lm (dequantized weights + static fake-quantized inputs/KV)",
    })
    if report_placement is not None:
        _write_report(out, base_dir, spec_dir, quant_spec_dir, settings, report_placement, trust_remote_code)


def check_deploy_dtype(dtype: str, qformat: str, kv_cache: str) -> None:
    """The deployment's weight dtype: bf16/fp16 always; float32 only where nothing is calibrated
    (--quant none, no KV quantization), to deploy the original fp32 weights unchanged."""
    if dtype not in DEPLOY_DTYPES:
        raise SpecDeployError(f"unknown deployment dtype {dtype!r}", hint=f"use one of {', '.join(DEPLOY_DTYPES)}")
    if dtype == "float32" and (qformat != "none" or kv_cache != "none"):
        raise SpecDeployError(f"--dtype float32 deploys unquantized weights, but --quant {qformat} / KV cache {kv_cache} was asked",
                              hint="quantize in bfloat16 or float16, or use --quant none --kv-cache none for float32")


def _quantize_and_export(out: Path, base_dir: Path, batches: list[torch.Tensor], settings: dict[str, Any],
                         placement: Placement, trust_remote_code: bool) -> tuple[float, list[str]]:
    """Calibrate a fresh bf16/fp16 instance and export it into `out`: (calibration seconds,
    the Linears --exclude kept unquantized)."""
    qformat, kv_cache = settings["qformat"], settings["kv_cache"]
    model = load_base(base_dir, settings["compute_dtype"], placement, trust_remote_code)  # fresh: export mutates it
    kept = excluded_linears(model, qformat, settings.get("exclude", []))
    check_block_size(model, qformat, settings["awq_block_size"], kept)
    started = time.time()
    quantize_model(model, qformat, kv_cache, batches, settings["awq_block_size"], kept)
    seconds = time.time() - started
    model.to(torch_dtype(settings["dtype"]))  # the deployment's dtype (a no-op unless computed in another)
    if qformat == "none" and kv_cache == "none":
        model.save_pretrained(out)
    else:
        print(f"exporting the {qformat} checkpoint (ModelOpt unified HF format)")
        export_checkpoint(model, out)
    return seconds, kept


def _write_report(out: Path, base_dir: Path, spec_dir: Path | None, quant_spec_dir: Path | None,
                  settings: dict[str, Any], placement: Placement, trust_remote_code: bool) -> None:
    report = quality_report(base_dir, out, dtype=settings["compute_dtype"], prompts=settings["report_prompts"],
                            max_new_tokens=settings["report_tokens"], ppl_texts=settings["report_texts"],
                            ppl_seq_len=PPL_SEQ_LEN, spec_dir=spec_dir, quant_spec_dir=quant_spec_dir,
                            seed=settings["seed"], placement=placement, trust_remote_code=trust_remote_code)
    atomic_write_json(out / "quantize.json", report)
    atomic_write_text(out / "quantize.md", report_markdown(report, settings))
    print(report_markdown(report, settings))


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)  # --quant: the weight/activation format
    add_device_arg(parser)
    parser.add_argument("--kv-cache", choices=list(KV_CACHE), default="fp8", help="KV cache quantization (default fp8)")
    parser.add_argument("--calib-size", type=int, default=64, help="calibration sequences (ShareGPT train split)")
    parser.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration sequence")
    parser.add_argument("--quantize-spec", action="store_true", help="measure only: also calibrate the Medusa/EAGLE module in FP8 and report its acceptance; "
                        "no TensorRT-LLM route checked loads a quantized drafter, so builds deploy the module unquantized "
                        "(convert refuses a quantized spec/)")
    parser.add_argument("--dtype", choices=DEPLOY_DTYPES, default="bfloat16",
                        help="the deployment's weight dtype, cast before quantizing (float32: only with --quant none "
                             "--kv-cache none); `make verify`'s fidelity report measures its effect")
    parser.add_argument("--awq-block-size", type=int, default=128, help="INT4 AWQ block size: 64 or 128 for int4_awq, 128 for w4a8_awq (default 128)")
    parser.add_argument("--exclude", nargs="+", metavar="PATTERN",
                        help="keep these Linears in the model dtype (fnmatch on HF names, e.g. '*mlp.down_proj' "
                             "'model.layers.0.*'); fp8 and int4_awq; TRT-LLM's fused q/k/v and gate/up go together")
    parser.add_argument("--trust-remote-code", action="store_true", help="load a base whose config has a remote-code auto_map")
    parser.add_argument("--no-report", action="store_true", help="skip the quality report")
    parser.add_argument("--report-prompts", type=int, default=8, help="held-out prompts for the greedy agreement")
    parser.add_argument("--report-tokens", type=int, default=32, help="new tokens per prompt in the report")
    parser.add_argument("--report-texts", type=int, default=16, help="held-out texts (256 tokens each) for perplexity")


def main(args: argparse.Namespace) -> int:
    out = run(build_from_args(args), args.quant, args.kv_cache, calib_size=args.calib_size,
              calib_seq_len=args.calib_seq_len, quantize_spec=args.quantize_spec, dtype=args.dtype,
              awq_block_size=args.awq_block_size, report=not args.no_report,
              report_prompts=args.report_prompts, report_tokens=args.report_tokens, report_texts=args.report_texts,
              exclude=args.exclude, device=args.device, trust_remote_code=args.trust_remote_code)
    print(out)
    return 0
