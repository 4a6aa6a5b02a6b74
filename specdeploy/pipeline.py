"""`make engine`: every stage in order, each skipped when the manifest says it is complete.

    resolve -> spec -> quantize -> convert -> build -> package

A stage that was interrupted left only a temp folder, so rerunning the same command resumes at
the first incomplete stage. The summary says plainly which stages ran here and what is left for
a GPU host (trtllm-build and the TensorRT-LLM backend never run on a machine without them).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

from specdeploy.device import add_device_arg
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir, add_build_args, build_from_args, build_name
from specdeploy.quantize.formats import DEPLOY_DTYPES
from specdeploy.speculator.commands import accepted, add_import_args
from specdeploy.triton.cpu_repo import CPU_MAX_BATCH_SIZE, SERVE_DTYPES
from specdeploy.triton.routes import gpu_summary
from specdeploy.triton.stage import ADAPTIVE_HELP, SERVE_DTYPE_HELP, add_cpu_deployment_args
from specdeploy.trtllm.llmapi import DEFAULT_TRTLLM_VERSION, add_trtllm_version_arg
from specdeploy.trtllm.releases import release_for

console = Console()
TRAINED_SPECS = ("eagle", "medusa", "dflash")
# FP8 KV cache where the weight format already needs FP8 hardware (Ada/Hopper+); INT8/INT4 also
# target Ampere, which has no FP8, so they keep the KV cache unquantized unless asked.
KV_CACHE_FOR = {"fp8": "fp8", "nvfp4": "fp8", "w4a8_awq": "fp8"}
SPEC_OVERRIDE_FLAGS = {"steps": "--spec-steps", "num_prompts": "--spec-prompts", "ttt_steps": "--spec-ttt-steps"}  # setting -> flag


@dataclass
class EngineOptions:
    model: str = "smollm2-135m"
    device: str = "auto"  # device.resolve_device: every computing stage runs there
    allow_pickle: bool = False  # resolve: accept pickle weights (runs pickle)
    trust_remote_code: bool = False  # resolve and every loader: a config with a remote-code auto_map
    spec: str = "eagle"
    quant: str = "fp8"
    draft: str | None = None
    kv_cache: str | None = None  # None: follow the weight format (KV_CACHE_FOR)
    spec_preset: str = "quick"
    dtype: str = "bfloat16"  # the deployment's weights (quantize.stage.DEPLOY_DTYPES): cast explicitly, never silently
    serve_dtype: str = "native"  # the CPU runtime's compute dtype (triton.cpu_repo.SERVE_DTYPES)
    adaptive: bool = False  # triton.stage.ADAPTIVE_HELP
    cpu_max_batch_size: int = CPU_MAX_BATCH_SIZE
    spec_off_above: int | None = None  # the CPU deployment decodes larger batches plainly
    cpu_draft_shape: str = "auto"  # the CPU deployment drafts the shape measured fastest here (triton.cpu_plan.plan_cpu_shape)
    trtllm_version: str = DEFAULT_TRTLLM_VERSION  # the release the GPU host runs (convert: routes, LLM-API config)
    tp_size: int = 1
    pp_size: int = 1
    max_draft_len: int = 4  # draft-target and n-gram; Medusa/EAGLE trees come from the spec stage
    calib_size: int = 64
    quant_exclude: list[str] | None = None  # Linears kept in the model dtype (quantize --exclude)
    quant_report: bool = True
    spec_overrides: dict | None = None  # e.g. {"steps": 5} for a quick look
    module: str | None = None  # a module made elsewhere: the spec stage imports it (modules.stage) instead of training
    module_accept: tuple[str, ...] = ()  # differences from the base the user vouches for (modules.spec.ACCEPTABLE)
    gate_floor: float | None = None  # the import's acceptance floor (None: modules.stage.GATE_FLOOR)


def _stage_steps(build: BuildDir, opts: EngineOptions) -> list[tuple[str, Callable[[], Path]]]:
    from specdeploy import quantize, resolve
    from specdeploy.triton import stage as package_stage
    from specdeploy.trtllm import build as trt_build, convert

    kv_cache = opts.kv_cache or KV_CACHE_FOR.get(opts.quant, "none")
    _check_options(opts, kv_cache)
    draft_dir = _draft_dir(opts)
    loader = {"device": opts.device, "trust_remote_code": opts.trust_remote_code}
    steps: list[tuple[str, Callable[[], Path]]] = [
        ("resolve", lambda: _convertible(resolve.run(build, opts.model, allow_pickle=opts.allow_pickle,
                                                     trust_remote_code=opts.trust_remote_code))),
    ]
    if opts.module:
        steps.append(("spec", lambda: _import_module(build, opts)))
    elif opts.spec in TRAINED_SPECS:
        from specdeploy.speculator import commands as spec

        overrides = {k: v for k, v in (opts.spec_overrides or {}).items() if v is not None}
        steps.append(("spec", lambda: spec.run(build, opts.spec, preset=opts.spec_preset, **loader, **overrides)))
    kind = None if opts.spec == "none" else opts.spec
    chain_len = opts.max_draft_len if opts.spec in ("draft", "ngram") else None  # trees: the spec stage's own
    steps += [
        ("quantize", lambda: quantize.run(build, opts.quant, kv_cache,
                                           calib_size=opts.calib_size, report=opts.quant_report,
                                           exclude=opts.quant_exclude, dtype=opts.dtype, **loader)),
        ("convert", lambda: convert.run(build, tp=opts.tp_size, pp=opts.pp_size, kind=kind, trtllm_version=opts.trtllm_version,
                                        draft_model=draft_dir, max_draft_len=chain_len)),
        ("build", lambda: trt_build.run(build)),
        ("package", lambda: package_stage.run(build, spec=opts.spec, max_draft_len=chain_len,
                                              draft_model_dir=draft_dir, dtype=opts.serve_dtype, adaptive=opts.adaptive,
                                              device=opts.device, cpu_max_batch_size=opts.cpu_max_batch_size,
                                              spec_off_above=opts.spec_off_above, cpu_draft_shape=opts.cpu_draft_shape)),
    ]
    return steps


def _convertible(base_dir: Path) -> Path:
    """The resolved base, refused now when the convert stage or the CPU deployment would refuse
    it, not after training."""
    from transformers import AutoConfig

    from specdeploy.runtime.kv_cache import check_full_attention
    from specdeploy.trtllm.source import check_architecture

    check_architecture(base_dir)
    check_full_attention(AutoConfig.from_pretrained(base_dir), "the pipeline (its CPU deployment serves in-flight batches)",
                         hint="choose a model with full attention; `specdeploy generate --spec none` decodes this one plainly")
    return base_dir


def _check_options(opts: EngineOptions, kv_cache: str) -> None:
    """What a later stage would refuse, or never read, refused before the first stage runs (the
    spec stage alone takes minutes)."""
    from specdeploy.modules.stage import GATE_FLOOR
    from specdeploy.quantize.config import check_exclude_format, check_format
    from specdeploy.quantize.stage import check_deploy_dtype

    check_deploy_dtype(opts.dtype, opts.quant, kv_cache)
    check_format(opts.quant, kv_cache)
    check_exclude_format(opts.quant, opts.quant_exclude or [])
    if opts.tp_size < 1 or opts.pp_size < 1:
        raise SpecDeployError(f"--tp-size {opts.tp_size} / --pp-size {opts.pp_size} must be >= 1", hint="1 and 1 for one GPU")
    if opts.max_draft_len < 1:
        raise SpecDeployError(f"--max-draft-len {opts.max_draft_len} must be >= 1", hint="draft tokens per step, e.g. 4")
    trains = opts.spec in TRAINED_SPECS and not opts.module
    unread = [flag for flag, used, given in (
        ("--spec-preset", trains, opts.spec_preset != "quick"),
        *((SPEC_OVERRIDE_FLAGS.get(name, name), trains, value is not None) for name, value in (opts.spec_overrides or {}).items()),
        ("--module-accept", bool(opts.module), bool(opts.module_accept)),
        ("--gate-floor", bool(opts.module), opts.gate_floor not in (None, GATE_FLOOR)),
    ) if given and not used]
    if unread:
        what = "MODULE=<folder>" if opts.module else f"SPEC={opts.spec}"
        raise SpecDeployError(f"{', '.join(unread)}: not read with {what}",
                              hint="the --spec-* flags size a module's training (SPEC=eagle|dflash|medusa without MODULE); "
                                   "--module-accept and --gate-floor check an imported MODULE; drop the others")


def _import_module(build: BuildDir, opts: EngineOptions) -> Path:
    """MODULE=<folder>: the spec stage reads a module made elsewhere instead of training one."""
    from specdeploy.modules import stage

    if opts.spec not in TRAINED_SPECS:
        raise SpecDeployError(f"MODULE is a speculative module for SPEC=eagle|dflash|medusa, not SPEC={opts.spec}",
                              hint="pass SPEC= the module's kind, or drop MODULE")
    floor = stage.GATE_FLOOR if opts.gate_floor is None else opts.gate_floor
    return stage.run(build, opts.spec, opts.module, allow_pickle=opts.allow_pickle, accept=opts.module_accept,
                     gate_floor=floor, device=opts.device, trust_remote_code=opts.trust_remote_code)


def _draft_dir(opts: EngineOptions) -> str | None:
    """SPEC=draft needs DRAFT=<model>, resolved like MODEL and checked for the same tokenizer."""
    if opts.spec != "draft":
        if opts.draft:
            raise SpecDeployError(f"DRAFT is only used with SPEC=draft, not SPEC={opts.spec}", hint="drop DRAFT or set SPEC=draft")
        return None
    if not opts.draft:
        raise SpecDeployError("SPEC=draft needs a draft model", hint="pass DRAFT=<hf folder | .gguf | bundled name> to make (--draft to specdeploy engine), "
                                                          "e.g. qwen2.5-coder-0.5b")
    from specdeploy.checkpoints import load_tokenizer
    from specdeploy.resolve import resolve_model_dir
    from specdeploy.runtime.proposers.draft import check_tokenizers

    flags = {"allow_pickle": opts.allow_pickle, "trust_remote_code": opts.trust_remote_code}
    draft = resolve_model_dir(opts.draft, **flags)
    check_tokenizers(load_tokenizer(resolve_model_dir(opts.model, **flags), trust_remote_code=opts.trust_remote_code),
                     load_tokenizer(draft, trust_remote_code=opts.trust_remote_code))
    return str(draft)


def gpu_route_notes(opts: EngineOptions) -> list[str]:
    """What the GPU host will and will not get, said before the long stages run (the convert
    stage decides it after them). Refuses a --trtllm-version this project never read."""
    release = release_for(opts.trtllm_version)
    notes = []
    if opts.spec == "medusa":
        where = ("none: the engine flow was removed in 1.3" if release.engine_flow == "removed"
                 else f"the engine flow of TensorRT-LLM {release.version}" + (" (deprecated there)" if release.engine_flow == "deprecated" else ""))
        notes.append("SPEC=medusa: only TensorRT-LLM's engine flow serves Medusa heads (releases 1.1 and 1.2; deprecated in "
                     "1.2, removed in 1.3), and no current vLLM or SGLang release does. This build's GPU route: "
                     f"{where}. The CPU deployment serves it here; SPEC=eagle deploys on every release.")
    if opts.spec == "dflash" and not release.dflash:
        notes.append(f"SPEC=dflash: TensorRT-LLM {release.version} has no DFlash (1.3 on): the build gets no GPU route; "
                     "pass ENGINE_ARGS=\"--trtllm-version 1.3\" for one")
    if opts.spec == "eagle" and KV_CACHE_FOR.get(opts.quant) == "fp8" and opts.kv_cache != "none" and not release.fp8_kv_eagle3:
        notes.append(f"SPEC=eagle with an FP8 KV cache: TensorRT-LLM {release.version} cannot run it (1.2 on): the build gets "
                     "no LLM-API route; pass ENGINE_ARGS=\"--kv-cache none\" or the default --trtllm-version")
    return notes


def run_pipeline(build: BuildDir, opts: EngineOptions) -> list[dict]:
    """Run every stage; return one row per stage: name, ran or skipped, seconds, output."""
    rows = []
    for name, step in _stage_steps(build, opts):
        before = (build.record(name) or {}).get("finished")
        console.rule(f"[bold]{name}")
        started = time.time()
        out = step()
        ran = (build.record(name) or {}).get("finished") != before
        rows.append({"stage": name, "status": "ran" if ran else "complete (skipped)",
                     "seconds": round(time.time() - started, 1), "output": str(out)})
    return rows


def _engines_built(build: BuildDir) -> bool:
    plan = build.path("engines") / "build_plan.json"
    return plan.exists() and bool(json.loads(plan.read_text()).get("engines_built"))


def print_summary(build: BuildDir, rows: list[dict], opts: EngineOptions) -> None:
    table = Table(title=f"specdeploy engine: {build.root}")
    for column in ("stage", "status", "seconds", "output"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["stage"], row["status"], str(row["seconds"]), row["output"])
    console.print(table)
    if _engines_built(build):
        console.print("TensorRT-LLM engines were built on this host.")
    else:
        console.print("[yellow]TensorRT-LLM artifacts were NOT built on this host[/yellow] (no TensorRT-LLM / no GPU).")
    for line in gpu_summary(build):  # the routes this build has and what a GPU host runs
        console.print(line)
    console.print(f"CPU model repository (served here): {build.path('triton_repo')}/cpu")
    console.print(f"Next: {next_commands(build, opts)}")


def next_commands(build: BuildDir, opts: EngineOptions) -> str:
    """How to serve and verify this build: make variables when they name it, else the CLI."""
    if build.root.name != build_name(opts.model, opts.spec, opts.quant, opts.module):  # an explicit --build-dir
        return (f"specdeploy verify --build-dir {build.root} (it starts its own servers); "
                f"specdeploy serve --build-dir {build.root} serves the build until Ctrl-C")
    flags = f"MODEL={opts.model} SPEC={opts.spec} QUANT={opts.quant}" + (f" DRAFT={opts.draft}" if opts.draft else "")
    flags += f" MODULE={opts.module}" if opts.module else ""
    if build.root.parent.resolve() != Path("build").resolve():
        flags += f" BUILD={build.root.parent}"
    return f"make verify {flags} (it starts its own servers); make serve {flags} serves the build until Ctrl-C"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    add_device_arg(parser)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="resolve and every loader: accept a config with a remote-code auto_map")
    add_import_args(parser)  # --allow-pickle (resolve and the import), --module-accept, --gate-floor
    parser.add_argument("--draft", help="SPEC=draft: the draft model (folder, .gguf or bundled name)")
    parser.add_argument("--kv-cache", choices=["fp8", "none"], help="KV-cache quantization (default: follows --quant)")
    parser.add_argument("--spec-preset", choices=["quick", "long"], default="quick",
                        help="module training budget: quick (default; on a CPU the spec stage takes ~4-8 min on 2 cores with "
                             "native bf16) or long (~70 min); see the preset table in docs/environment.md")
    parser.add_argument("--dtype", choices=DEPLOY_DTYPES, default="bfloat16",
                        help="the deployment's weight dtype (what TensorRT-LLM loads and the CPU repository serves): the "
                             "base is cast to it, also with --quant none; float32 keeps an fp32 base unchanged (--quant "
                             "none only). `make verify` reports its effect against the original model (fidelity)")
    parser.add_argument("--serve-dtype", choices=SERVE_DTYPES, default="native", help=SERVE_DTYPE_HELP)
    parser.add_argument("--adaptive", action="store_true", help=ADAPTIVE_HELP)
    add_cpu_deployment_args(parser, draft_shape="auto")
    add_trtllm_version_arg(parser)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--pp-size", type=int, default=1)
    parser.add_argument("--max-draft-len", type=int, default=4, help="draft tokens per step for draft/ngram")
    parser.add_argument("--calib-size", type=int, default=64, help="calibration prompts for quantization")
    parser.add_argument("--quant-exclude", nargs="+", metavar="PATTERN",
                        help="keep these Linears unquantized (mixed precision; see `specdeploy quantize --exclude`)")
    parser.add_argument("--no-quant-report", action="store_true", help="skip the quantization quality report")
    parser.add_argument("--spec-steps", type=int, help="override the module training steps")
    parser.add_argument("--spec-prompts", type=int, help="override the number of self-distillation prompts")
    parser.add_argument("--spec-ttt-steps", type=int,
                        help="override EAGLE's training-time-test steps (the CPU quick preset trains 1, for the chain of "
                             "one draft its planner serves; 3 trains deeper drafts)")


def main(args: argparse.Namespace) -> int:
    opts = EngineOptions(
        model=args.model, device=args.device, allow_pickle=args.allow_pickle, trust_remote_code=args.trust_remote_code,
        spec=args.spec, quant=args.quant, draft=args.draft, kv_cache=args.kv_cache,
        spec_preset=args.spec_preset, dtype=args.dtype, serve_dtype=args.serve_dtype, adaptive=args.adaptive,
        cpu_max_batch_size=args.cpu_max_batch_size, spec_off_above=args.spec_off_above, cpu_draft_shape=args.cpu_draft_shape,
        trtllm_version=args.trtllm_version, tp_size=args.tp_size, pp_size=args.pp_size, max_draft_len=args.max_draft_len,
        calib_size=args.calib_size, quant_exclude=args.quant_exclude, quant_report=not args.no_quant_report,
        spec_overrides={name: getattr(args, flag[2:].replace("-", "_")) for name, flag in SPEC_OVERRIDE_FLAGS.items()},
        module=args.module, module_accept=accepted(args), gate_floor=args.gate_floor,
    )
    build = build_from_args(args)
    for note in gpu_route_notes(opts):
        console.print(f"[yellow]note:[/yellow] {note}")
    rows = run_pipeline(build, opts)
    print_summary(build, rows, opts)
    return 0
