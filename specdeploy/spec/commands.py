"""`specdeploy spec train|validate`, and the stage function `run(build, ...)` the pipeline calls.

The stage trains into build/<name>/spec/ (see specdeploy.spec for the folder's contract). Its
resumable checkpoint lives beside it in build/<name>/.spec.ckpt/, so an interrupted or longer
rerun continues where the last one stopped instead of starting over.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from specdeploy.choices import parse_choices
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.spec.train import TrainSettings, train

STAGE = "spec"
OUT = "spec"
CKPT = ".spec.ckpt"
KINDS = ("medusa", "eagle")

# Data: the base reads a ShareGPT answer (teacher-forced) ~12x faster than it writes its own
# (batched generation); both are distilled from the base's own logits, so the presets take most
# tokens read and a share generated. Measured with SmolLM2-135M on an idle 2-core machine:
# ~3,400 tokens/s read, ~290 tokens/s generated, ~0.55 s per training step (4 x 256 tokens).
# What `make engine` uses: ~2 min of data (cached, shared by both kinds and every build of the
# same base) and <= 8 min of training (800 steps when the machine is idle), so that the whole
# default build stays within 15 minutes.
_QUICK_DATA = dict(num_prompts=64, teacher_forced=768)
QUICK = {kind: dict(steps=800, time_budget_s=480.0, **_QUICK_DATA) for kind in KINDS}
# The budget: <= 60 minutes of training, on ~6x the data (~15-20 min to make once, then
# cached), with 768 of the base's own answers: measured on 2 idle threads, 6,000 steps (53 min)
# reached draft accuracies 0.66/0.63/0.59 vs 0.58/0.53/0.49 for 2,804 steps on 128 answers.
_LONG_DATA = dict(num_prompts=768, teacher_forced=2048)
LONG = {
    "eagle": dict(steps=6000, time_budget_s=3600.0, **_LONG_DATA),
    "medusa": dict(steps=4000, time_budget_s=3600.0, **_LONG_DATA),
}


def settings_for(kind: str, preset: str = "quick", **overrides: Any) -> TrainSettings:
    if kind not in KINDS:
        raise SpecDeployError(f"the spec stage trains medusa or eagle, not '{kind}'", hint="use --spec medusa|eagle")
    base = {"quick": QUICK, "long": LONG}[preset][kind]
    settings = TrainSettings(kind=kind, **{**base, **{k: v for k, v in overrides.items() if v is not None}})
    settings.validate()
    return settings


def run(build: BuildDir, spec: str = "eagle", *, preset: str = "quick", **overrides: Any) -> Path:
    """Stage `spec`: train the module on build/<name>/base/ into build/<name>/spec/."""
    settings = settings_for(spec, preset, **overrides)
    recorded = asdict(settings)
    if build.completed(STAGE, recorded, consumes=("resolve",)):
        return build.path(OUT)
    with build.stage(STAGE, OUT, recorded, consumes=("resolve",)) as tmp:
        train(build.path("base"), tmp, settings, ckpt_dir=build.root / CKPT)
    return build.path(OUT)


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    train_p = actions.add_parser("train", help="self-distill, train the module with ModelOpt, write spec/")
    add_build_args(train_p)
    train_p.add_argument("--preset", choices=("quick", "long"), default="quick",
                         help="quick: <= 10 min of training (make engine); long: <= 60 min on 10x the data")
    for f in fields(TrainSettings):
        if f.name in ("kind", "choices"):
            continue
        kind = {"action": argparse.BooleanOptionalAction} if isinstance(f.default, bool) else {"type": type(f.default)}
        train_p.add_argument(f"--{f.name.replace('_', '-')}", default=None, help=f"(default: preset's, else {f.default})", **kind)
    train_p.add_argument("--choices", help="default medusa_choices / eagle_choices, e.g. '[[0], [0, 0], [1]]'")

    val = actions.add_parser("validate", help="acceptance length on held-out prompts per category")
    add_build_args(val)
    val.add_argument("--spec-dir", help="a spec/ folder (default: the build's)")
    val.add_argument("--base-dir", help="the base model folder (default: the build's base/)")
    val.add_argument("--dtype", default="bfloat16", help="target dtype (bfloat16: the CPU serving dtype)")
    val.add_argument("--prompts", type=int, default=8, help="prompts per category (default 8)")
    val.add_argument("--categories", default="chat,code", help="comma list of chat,code")
    val.add_argument("--max-new-tokens", type=int, default=96)
    val.add_argument("--tree", choices=("chain", "static", "dynamic"),
                     help="EAGLE tree kind (default: static with --choices, else dynamic)")
    val.add_argument("--choices", help="medusa_choices / eagle_choices (static trees)")
    val.add_argument("--draft-len", type=int, help="chain length / tree token budget")
    val.add_argument("--depth", type=int, default=5, help="EAGLE dynamic tree depth")
    val.add_argument("--topk", type=int, default=3, help="EAGLE dynamic tree children per node")
    val.add_argument("--width", type=int, default=3, help="EAGLE dynamic tree nodes expanded per depth")
    val.add_argument("--budget", type=int, default=10, help="EAGLE dynamic tree nodes kept (verified) per round")
    val.add_argument("--speedup", action="store_true", help="also time plain decoding, interleaved per prompt")
    val.add_argument("--ar-lower-bound", type=float, help="fail when the mean acceptance length is below this")
    val.add_argument("--json", help="write the results to this file")


def main(args: argparse.Namespace) -> int:
    return _train(args) if args.action == "train" else _validate(args)


def _train(args: argparse.Namespace) -> int:
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainSettings) if f.name not in ("kind", "choices")}
    if args.choices:
        overrides["choices"] = parse_choices(args.choices, f"{args.spec}_choices")
    build = build_from_args(args)
    if build.record("resolve") is None:
        from specdeploy import models

        models.run(build, args.model)
    out = run(build, args.spec, preset=args.preset, **overrides)
    config = json.loads((out / "spec_config.json").read_text())
    stats = config["training"]
    print(f"spec {config['kind']}: {stats['steps']} steps in {stats['seconds']} s on {stats['tokens']} tokens, "
          f"loss {stats['first_loss']} -> {stats['final_loss']}, draft accuracy {stats['final_acc']} -> {out}")
    return 0


def _proposer_options(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.choices:
        options["choices"] = parse_choices(args.choices, f"{kind}_choices")
    if kind == "eagle":
        options.update(mode=args.tree, depth=args.depth, topk=args.topk, width=args.width, budget=args.budget)
        if args.draft_len and args.tree == "chain":
            options["chain_len"] = args.draft_len
    return options


def _validate(args: argparse.Namespace) -> int:
    from specdeploy.fileio import atomic_write_json
    from specdeploy.spec import read_spec_config
    from specdeploy.spec.validate import check_bound, load_for_validation, measure, overall

    build = build_from_args(args)
    spec_dir = Path(args.spec_dir) if args.spec_dir else build.path(OUT)
    kind = read_spec_config(spec_dir)["kind"]
    base_dir = Path(args.base_dir) if args.base_dir else build.path("base")
    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    target, tokenizer, proposer = load_for_validation(base_dir, spec_dir, args.dtype, _proposer_options(args, kind))
    results = measure(target, tokenizer, proposer, categories=categories, num_prompts=args.prompts,
                      max_new_tokens=args.max_new_tokens, speedup=args.speedup, draft_len=args.draft_len)
    tree = getattr(proposer, "mode", "static")
    report = {"kind": kind, "dtype": args.dtype, "tree": tree,
              "overall_acceptance_length": round(overall(results), 3), **{c: r.as_dict() for c, r in results.items()}}
    print(json.dumps(report, indent=2))
    if args.json:
        atomic_write_json(args.json, report)
    check_bound(results, args.ar_lower_bound)
    return 0
