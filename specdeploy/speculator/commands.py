"""`specdeploy spec train|validate`, and the stage function `run(build, ...)` the pipeline calls.

The stage trains into build/<name>/spec/ (see specdeploy.speculator for the folder's contract) on the
device it is given (`--device auto|cpu|cuda|cuda:N`), with the preset sized to that device and
the base (spec.presets). Its resumable checkpoint lives beside it in build/<name>/.spec.ckpt/<base>/, so
an interrupted rerun continues where the last one stopped instead of starting over.
Under torchrun / accelerate launch the training is data-parallel (speculator.parallel).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from specdeploy.choices import parse_choices
from specdeploy.device import add_device_arg, announce, describe, fast_dtype, resolve_device
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.speculator.parallel import setup
from specdeploy.speculator.presets import PRESETS, TABLE, gpu_tier, settings_for
from specdeploy.speculator.sizing import cpu_recipe, recorded, recorded_settings
from specdeploy.speculator.train import TrainSettings, stage_settings, train

STAGE = "spec"
OUT = "spec"
CKPT = ".spec.ckpt"


def run(build: BuildDir, spec: str = "eagle", *, preset: str = "quick", device: Any = "auto",
        trust_remote_code: bool = False, **overrides: Any) -> Path:
    """Stage `spec`: train the module on build/<name>/base/ into build/<name>/spec/."""
    parallel = setup(resolve_device(device))
    where = announce("spec", parallel.device)
    base_dir = build.path("base")
    if _complete(build, spec, preset, overrides):
        return build.path(OUT)
    if parallel.device.type == "cuda":
        tier, sizing = gpu_tier(base_dir), None
        settings = settings_for(spec, preset, tier=tier, **overrides)
    else:
        tier, settings, sizing = cpu_recipe(build, spec, preset, overrides, parallel,
                                            trust_remote_code=trust_remote_code)
    if parallel.is_main:
        print(f"specdeploy spec: {preset} preset of the {tier} tier: {settings.steps} steps on "
              f"{settings.num_prompts} generated answers, {settings.code_prompts} code completions and "
              f"{settings.teacher_forced} read answers",
              file=sys.stderr)
    ckpt_dir = _checkpoint_dir(build)
    train_args = dict(ckpt_dir=ckpt_dir, parallel=parallel, trust_remote_code=trust_remote_code)
    if parallel.is_main:
        with build.stage(STAGE, OUT, stage_settings(settings), consumes=("resolve",), device=where,
                         notes={"sizing": sizing} if sizing else None) as tmp:
            train(base_dir, tmp, settings, **train_args)
    else:
        train(base_dir, None, settings, **train_args)  # only rank 0 writes
    parallel.barrier()  # rank 0 has recorded the stage
    return build.path(OUT)


def _checkpoint_dir(build: BuildDir) -> Path:
    """The resumable checkpoint of this build's base: a run on another base (the model changed
    under the same build) is never resumed, and its folder goes."""
    ckpt_dir = build.root / CKPT / build.fingerprint("resolve")
    for other in (build.root / CKPT).glob("*"):
        if other != ckpt_dir:
            shutil.rmtree(other) if other.is_dir() else other.unlink()
    return ckpt_dir


def _complete(build: BuildDir, spec: str, preset: str, overrides: dict[str, Any]) -> bool:
    """Trained with this device's preset or another tier's, or the cut recipe this build's sizing
    chose: a build made on a GPU host stays complete when it is mounted on a CPU one, and the other
    way round."""
    candidates = [settings_for(spec, preset, tier=tier, **overrides) for tier in TABLE]
    sizing = recorded(build)
    if sizing is not None and sizing.get("measured_with", {}).get("kind") == spec:  # the sizing of this kind's recipe
        candidates.append(recorded_settings(sizing, spec, preset, overrides))
    return any(build.completed(STAGE, stage_settings(settings), consumes=("resolve",)) for settings in candidates)


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    train_p = actions.add_parser("train", help="self-distill, train the module with ModelOpt, write spec/ "
                                 "(data-parallel under torchrun --nproc_per_node N -m specdeploy spec train ...)")
    add_build_args(train_p)
    add_device_arg(train_p)
    _add_loader_args(train_p)
    train_p.add_argument("--allow-pickle", action="store_true", help="let the resolve stage read pickle checkpoints")
    train_p.add_argument("--preset", choices=PRESETS, default="quick",
                         help="sized to the device and the base: on the CPU (or a base under 1B) quick ~4-8 min on 2 cores "
                              "with native bf16 (distillation cached; a CPU timed too slow for it gets a smaller quick "
                              "EAGLE: 256 read answers, 400 steps, cut to fit, to half, on a slower one), long ~70 min "
                              "on 6x the data (SmolLM2-135M, 2 cores); "
                              "a 1B-8B base on CUDA gets ModelOpt-style GPU presets")
    for f in fields(TrainSettings):
        if f.name in ("kind", "choices"):
            continue
        kind = {"action": argparse.BooleanOptionalAction} if isinstance(f.default, bool) else {"type": type(f.default)}
        train_p.add_argument(f"--{f.name.replace('_', '-')}", default=None, help=f"(default: preset's, else {f.default})", **kind)
    train_p.add_argument("--choices", help="default medusa_choices / eagle_choices, e.g. '[[0], [0, 0], [1]]'")

    imp = actions.add_parser("import", help="write spec/ from a module made elsewhere (--module): EAGLE-3, DFlash or "
                                            "Medusa in the layouts docs/formats.md lists, checked against the base")
    add_build_args(imp)
    add_device_arg(imp)
    _add_loader_args(imp)
    add_import_args(imp)

    val = actions.add_parser("validate", help="acceptance length on held-out prompts per category")
    add_build_args(val)
    add_device_arg(val)
    _add_loader_args(val)
    val.add_argument("--spec-dir", help="a spec/ folder (default: the build's)")
    val.add_argument("--base-dir", help="the base model folder (default: the build's base/)")
    val.add_argument("--dtype", default="native", choices=["native", "float32", "bfloat16", "float16"],
                     help="target dtype; native (default): bfloat16 where the device computes it natively, else float32")
    val.add_argument("--prompts", type=int, default=8, help="prompts per category (default 8)")
    val.add_argument("--categories", default="chat,code", help="comma list of chat,code")
    val.add_argument("--max-new-tokens", type=int, default=96)
    val.add_argument("--tree", choices=("chain", "static", "dynamic"),
                     help="EAGLE tree kind (default: static with --choices, else dynamic)")
    val.add_argument("--choices", help="medusa_choices / eagle_choices (static trees)")
    val.add_argument("--draft-len", type=int, help="chain length / tree token budget")
    val.add_argument("--depth", type=int, help="EAGLE dynamic tree depth (default 5)")
    val.add_argument("--topk", type=int, help="EAGLE dynamic tree children per node (default 3)")
    val.add_argument("--width", type=int, help="EAGLE dynamic tree nodes expanded per depth (default 3)")
    val.add_argument("--budget", type=int, help="EAGLE dynamic tree nodes kept (verified) per round (default 10)")
    val.add_argument("--speedup", action="store_true", help="also time plain decoding, interleaved per prompt")
    val.add_argument("--ar-lower-bound", type=float, help="fail when the mean acceptance length is below this")
    val.add_argument("--json", help="write the results to this file")


def add_import_args(parser: argparse.ArgumentParser) -> None:
    """What an import takes beyond --module (a build argument): engine and `spec import` share them."""
    from specdeploy.modules.spec import ACCEPTABLE
    from specdeploy.modules.stage import GATE_FLOOR

    parser.add_argument("--allow-pickle", action="store_true", help="read pickle weights (*.bin, *.pt): unpickling runs code")
    parser.add_argument("--module-accept", default="", metavar="NAMES",
                        help=f"comma list of differences from the base to accept ({', '.join(ACCEPTABLE)}): the module's "
                             "verifier names another model, or its RoPE theta differs")
    parser.add_argument("--gate-floor", type=float, default=GATE_FLOOR,
                        help=f"refuse an EAGLE-3 / DFlash module whose acceptance length on held-out chat prompts is under "
                             f"this (default {GATE_FLOOR}; a mis-loaded head gives ~1.0; 0 skips the gate)")


def accepted(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(name.strip() for name in args.module_accept.split(",") if name.strip())


def _add_loader_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trust-remote-code", action="store_true", help="let transformers run the model folder's own code")


def main(args: argparse.Namespace) -> int:
    return {"train": _train, "import": _import, "validate": _validate}[args.action](args)


def _import(args: argparse.Namespace) -> int:
    from specdeploy import resolve
    from specdeploy.modules import stage

    if not args.module:
        raise SpecDeployError("spec import needs --module <folder>", hint="the folder holding the module's config and weights")
    build = build_from_args(args)
    resolve.run(build, args.model, allow_pickle=args.allow_pickle, trust_remote_code=args.trust_remote_code)
    out = stage.run(build, args.spec, args.module, allow_pickle=args.allow_pickle, accept=accepted(args),
                    gate_floor=args.gate_floor, device=args.device, trust_remote_code=args.trust_remote_code)
    config = json.loads((out / "spec_config.json").read_text())
    gate = config["imported"].get("gate") or {}
    print(f"spec {config['kind']}: imported from {config['imported']['layout']} layout ({args.module}), acceptance length "
          f"{gate.get('acceptance_length', 'not gated')} -> {out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainSettings) if f.name not in ("kind", "choices")}
    if args.choices:
        overrides["choices"] = parse_choices(args.choices, f"{args.spec}_choices")
    build = build_from_args(args)
    parallel = setup(resolve_device(args.device))
    if build.record("resolve") is None and parallel.is_main:
        from specdeploy import resolve

        resolve.run(build, args.model, allow_pickle=args.allow_pickle, trust_remote_code=args.trust_remote_code)
    parallel.barrier()
    out = run(build, args.spec, preset=args.preset, device=parallel.device, trust_remote_code=args.trust_remote_code,
              **overrides)
    parallel.close()
    if not parallel.is_main:
        return 0
    config = json.loads((out / "spec_config.json").read_text())
    stats = config["training"]
    print(f"spec {config['kind']}: {stats['steps']} steps in {stats['seconds']:.1f} s on {stats['tokens']} tokens, "
          f"loss {stats['first_loss']} -> {stats['final_loss']}, draft accuracy {stats['final_acc']} -> {out}")
    return 0


# `spec validate` flags that shape a draft tree, the proposer options they set and the kinds that take them
TREE_FLAGS = {"--tree": ("mode", ("eagle",)), "--choices": ("choices", ("eagle", "medusa")),
              "--depth": ("depth", ("eagle",)), "--topk": ("topk", ("eagle",)), "--width": ("width", ("eagle",)),
              "--budget": ("budget", ("eagle",))}


def _proposer_options(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """The proposer options the flags given set; a flag the module's kind has no use for is refused
    (it would change nothing, and the report would not say so)."""
    given = {flag: getattr(args, flag[2:]) for flag in TREE_FLAGS if getattr(args, flag[2:]) is not None}
    unused = [flag for flag in given if kind not in TREE_FLAGS[flag][1]]
    if unused:
        raise SpecDeployError(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to a {kind} module",
                              hint="--draft-len caps every kind's draft; --tree/--depth/--topk/--width/--budget shape EAGLE "
                                   "trees, --choices EAGLE and Medusa static trees")
    options = {TREE_FLAGS[flag][0]: value for flag, value in given.items()}
    if "choices" in options:
        options["choices"] = parse_choices(options["choices"], f"{kind}_choices")
    if args.draft_len and args.tree == "chain":
        options["chain_len"] = args.draft_len
    return options


def _validate(args: argparse.Namespace) -> int:
    from specdeploy.fileio import atomic_write_json
    from specdeploy.checkpoints.modules import read_spec_config
    from specdeploy.speculator.validate import check_bound, load_for_validation, measure, overall

    build = build_from_args(args)
    spec_dir = Path(args.spec_dir) if args.spec_dir else build.path(OUT)
    kind = read_spec_config(spec_dir)["kind"]
    base_dir = Path(args.base_dir) if args.base_dir else build.path("base")
    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    device = resolve_device(args.device)
    announce("spec validate", device)
    args.dtype = fast_dtype(device) if args.dtype == "native" else args.dtype
    target, tokenizer, proposer = load_for_validation(base_dir, spec_dir, args.dtype, _proposer_options(args, kind),
                                                      device=device, trust_remote_code=args.trust_remote_code)
    results = measure(target, tokenizer, proposer, categories=categories, num_prompts=args.prompts,
                      max_new_tokens=args.max_new_tokens, speedup=args.speedup, draft_len=args.draft_len)
    tree = getattr(proposer, "mode", "static")
    report = {"kind": kind, "dtype": args.dtype, "tree": tree, "device": describe(device),
              "overall_acceptance_length": round(overall(results), 3), **{c: r.as_dict() for c, r in results.items()}}
    print(json.dumps(report, indent=2))
    if args.json:
        atomic_write_json(args.json, report)
    check_bound(results, args.ar_lower_bound)
    return 0
