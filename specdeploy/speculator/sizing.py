"""Which quick recipe a CPU affords, by its measured speed (issue #36's "sized to the host").

On a CPU the quick EAGLE comes in two sizes (presets: `cpu`, 768 read answers and 800 steps;
`cpu-small`, 256 and 400, ~0.05 less acceptance); on a CPU too slow for `cpu-small` within the
budget, its reads and steps are cut to fit, to half at most. A CPU's flags do not tell its speed: a Zen 5 EPYC
without AMX ran training's bf16 product as fast as a Xeon with AMX, an older EPYC with AVX512-BF16
distilled at half the Xeon's speed (docs/measurements.md, 2026-11-26 and 2026-11-27). So the stage
times units of the `cpu` recipe's work on the base itself with the functions the stage runs (one
batch of read answers: a forward's cost per position, the prefills' too; decode steps at the
distillation batch's size; a few training steps), counts that recipe's units from its own prompts
and answers, and takes it when the predicted time fits SPEC_BUDGET_S, else `cpu-small`, cut where
that does not fit.

Decided once per build: the choice and what it measured are kept in build/<name>/.spec.sizing.json
(a rerun, or a resumed run, reads it back) and in the spec stage's manifest record. The settings it
picks count steps, never seconds, so the manifest alone reproduces the module.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specdeploy.fileio import atomic_write_json
from specdeploy.manifest import BuildDir
from specdeploy.speculator.parallel import Parallel
from specdeploy.speculator.presets import settings_for
from specdeploy.speculator.train import TrainSettings

# The spec stage's budget on a CPU, in predicted seconds: `make engine` <= 12 min on a CPU with native
# bf16 (issue #36), of which the other stages and the venv took 2.7-4.2 min (2026-11-27: a Zen 5 EPYC
# 160 s, a Xeon with AMX 250 s). The prediction leaves out loading, writing shards and the export,
# and decodes at a short context: on the Zen 5 EPYC it said 298-335 s for `cpu` stages of 370-375 s (SmolLM2-135M)
# and 342 s for a `cpu-small` stage of 401 s (Qwen2.5-Coder-0.5B, whose `cpu` recipe it put at 665 s). The `cpu`
# recipe's stage took 380-444 s on that Xeon (~305-405 s predicted at those ratios: within the budget);
# the older EPYC's data and 800 steps come to ~620 s from its 2026-11-26 times (~560 s: beyond it).
# Estimates: the probe has run on the Zen 5 EPYC only.
SPEC_BUDGET_S = 420.0
# Below `cpu-small`, its reads and training steps are cut to the share of them that fits the budget (the
# base's own answers stay: a batch of 64 costs about what a smaller one does), in steps of CUT_STEP, to
# MIN_FRACTION at most; a host too slow for that trains the half recipe, beyond the budget, and says so.
# Half costs ~0.05 acceptance: on the float32 path, 128 reads x 200 steps 1.257 against cpu-small's 1.307
# (`spec validate --tree chain --draft-len 1 --prompts 24 --max-new-tokens 96`, a Zen 5 EPYC, 2026-11-29).
# With that host's float32 speed scaled (an estimate: no slower CPU has run it), 1.5x slower cuts to 0.65
# (cpu-small 549 -> 407 s predicted), 1.7x to 0.55, 2x to half (732 -> 462 s, beyond the budget).
MIN_FRACTION = 0.5
CUT_STEP = 0.05
CUT_FIELDS = ("teacher_forced", "steps")
SIZING_FILE = ".spec.sizing.json"
DECODE_STEPS = 16  # decode steps timed at a distillation batch's size
TRAIN_STEPS = 12  # training steps timed, the first (slower) one among them: an upper bound


@dataclass
class HostSpeed:
    """Seconds of the spec stage's units of work on this host, for one base."""

    token_s: float  # one position of a batched forward that keeps hidden states (a prefill, a read)
    decode_step_s: float  # one more token for every answer of a distillation batch
    train_step_s: float  # one training step


@dataclass
class Work:
    """What the spec stage computes for some settings: counted from its own prompts and answers."""

    prefill_tokens: int  # generation batches' prompts, padded to each batch's longest
    read_tokens: int  # read answers, padded the same way
    decode_steps: int  # every answer generated to max_new_tokens: an upper bound
    train_steps: int

    def seconds(self, speed: HostSpeed) -> float:
        return ((self.prefill_tokens + self.read_tokens) * speed.token_s + self.decode_steps * speed.decode_step_s
                + self.train_steps * speed.train_step_s)


# TrainSettings that count the work without changing what a unit of it costs; every other one (batch,
# window, the module's shape) shapes the speed measure() times, so a change to it measures again
WORK_COUNTS = frozenset({"steps", "lr", "num_prompts", "max_new_tokens", "teacher_forced", "code_prompts",
                         "checkpoint_every", "seed", "choices"})


def measured_with(settings: TrainSettings) -> dict[str, Any]:
    return {key: value for key, value in asdict(settings).items() if key not in WORK_COUNTS}


def cpu_recipe(build: BuildDir, kind: str, preset: str, overrides: dict[str, Any], parallel: Parallel, *,
               trust_remote_code: bool = False) -> tuple[str, TrainSettings, dict[str, Any] | None]:
    """The tier, the settings and the sizing they rest on for this build on this CPU: 'cpu' where its
    predicted time fits the budget, else 'cpu-small', cut to fit where even that does not (`cut`). The
    host's speed is measured once per build, base and per-unit settings (recorded: another --batch-size
    or window is measured again), the work counted for the recipe asked this time; rank 0 decides, the
    other ranks read its choice. No sizing where both tiers train the same."""
    large, small = (settings_for(kind, preset, tier=tier, **overrides) for tier in ("cpu", "cpu-small"))
    if large == small:
        return "cpu", large, None
    if parallel.is_main:
        from specdeploy.checkpoints import load_tokenizer

        base_dir = build.path("base")
        known = recorded(build)
        same = known is not None and known.get("measured_with") == measured_with(large)
        speed = HostSpeed(**known["speed"]) if same else measure(base_dir, large, parallel.device,
                                                                  trust_remote_code=trust_remote_code)
        tokenizer = load_tokenizer(base_dir)
        work = work_for(large, tokenizer)
        predicted = work.seconds(speed)
        if predicted <= SPEC_BUDGET_S:
            tier, fraction, chosen_s = "cpu", 1.0, predicted
        else:
            tier, fraction = "cpu-small", _fraction(small, overrides, tokenizer, speed)
            chosen_s = work_for(cut(small, fraction, overrides), tokenizer).seconds(speed)
        _announce(f"{preset} {kind}", predicted, tier, fraction, chosen_s)
        atomic_write_json(build.root / SIZING_FILE, {
            "tier": tier, "fraction": fraction, "predicted_s": round(predicted, 1), "chosen_predicted_s": round(chosen_s, 1),
            "budget_s": SPEC_BUDGET_S, "speed": asdict(speed), "work": asdict(work), "base": build.fingerprint("resolve"),
            "measured_with": measured_with(large)})
    parallel.barrier()  # rank 0 has written the choice
    sizing = recorded(build)
    return sizing["tier"], recorded_settings(sizing, kind, preset, overrides), sizing


def recorded_settings(sizing: dict[str, Any], kind: str, preset: str, overrides: dict[str, Any]) -> TrainSettings:
    """The settings a recorded sizing chose for this recipe."""
    settings = settings_for(kind, preset, tier=sizing["tier"], **overrides)
    return cut(settings, sizing.get("fraction", 1.0), overrides) if sizing["tier"] == "cpu-small" else settings


def cut(settings: TrainSettings, fraction: float, overrides: dict[str, Any]) -> TrainSettings:
    """`settings` with the reads and steps the user did not set cut to `fraction` of theirs."""
    return replace(settings, **{name: max(1, round(getattr(settings, name) * fraction))
                                for name in CUT_FIELDS if overrides.get(name) is None})


def _fraction(small: TrainSettings, overrides: dict[str, Any], tokenizer: Any, speed: HostSpeed) -> float:
    """The largest share (in CUT_STEPs, to MIN_FRACTION) of `small`'s reads and steps predicted within
    the budget; the prefills and decode steps of its own answers are not cut, nor what the user set."""
    work = work_for(small, tokenizer)
    seconds = {"teacher_forced": work.read_tokens * speed.token_s, "steps": work.train_steps * speed.train_step_s}
    cut_s = sum(seconds[name] for name in CUT_FIELDS if overrides.get(name) is None)
    kept_s = work.seconds(speed) - cut_s
    if kept_s + cut_s <= SPEC_BUDGET_S:
        return 1.0
    share = (SPEC_BUDGET_S - kept_s) / cut_s if cut_s else 0.0
    return max(MIN_FRACTION, round(math.floor(round(share / CUT_STEP, 6)) * CUT_STEP, 2))


def _announce(recipe: str, predicted: float, tier: str, fraction: float, chosen_s: float) -> None:
    cut_to = f" cut to {fraction:.0%} (~{chosen_s:.0f} s)" if fraction < 1 else ""
    print(f"specdeploy spec: the cpu tier's {recipe} would take ~{predicted:.0f} s on this host "
          f"(budget {SPEC_BUDGET_S:.0f} s): {tier} tier{cut_to}", file=sys.stderr)
    if fraction == MIN_FRACTION and chosen_s > SPEC_BUDGET_S:
        print(f"specdeploy spec: this host is too slow for the budget even at {MIN_FRACTION:.0%} of the cpu-small "
              f"recipe: the stage will take longer than {SPEC_BUDGET_S:.0f} s; fewer steps trade acceptance for time "
              f"(make engine ENGINE_ARGS=\"--spec-steps N\", spec train --steps N)", file=sys.stderr)


def recorded(build: BuildDir) -> dict[str, Any] | None:
    """The build's sizing (.spec.sizing.json) for its base, the last recipe's; None before it was measured."""
    path = build.root / SIZING_FILE
    sizing = json.loads(path.read_text()) if path.is_file() else None
    return sizing if sizing and sizing.get("base") == build.fingerprint("resolve") else None


def work_for(settings: TrainSettings, tokenizer: Any) -> Work:
    """The stage's work for `settings`: the prompts and answers distill() takes, batched as it does."""
    from specdeploy.data import sharegpt_conversations, stdlib_code_prompts
    from specdeploy.speculator.common import chat_prompts
    from specdeploy.speculator.distill import MAX_PROMPT_TOKENS, TF_BATCH, readable
    from specdeploy.speculator.validate import encode

    chat = [encode(tokenizer, p, "chat", MAX_PROMPT_TOKENS) for p in chat_prompts(settings.num_prompts, "train")]
    code = [encode(tokenizer, p, "code", MAX_PROMPT_TOKENS) for p in stdlib_code_prompts(settings.code_prompts)]
    reads = readable(tokenizer, sharegpt_conversations(settings.teacher_forced, "train", seed=1), settings.tf_max_tokens)
    batches = [_padded(chat, settings.distill_batch), _padded(code, settings.distill_batch)]
    return Work(prefill_tokens=sum(tokens for tokens, _ in batches), read_tokens=_padded(reads, TF_BATCH)[0],
                decode_steps=sum(count for _, count in batches) * (settings.max_new_tokens - 1),
                train_steps=settings.steps)


def _padded(sequences: list[list[int]], batch_size: int) -> tuple[int, int]:
    """(positions, batches) of `sequences` batched longest first, each batch padded to its longest."""
    lengths = sorted((len(s) for s in sequences), reverse=True)
    batches = range(0, len(lengths), batch_size)
    return sum(lengths[i] * len(lengths[i:i + batch_size]) for i in batches), len(batches)


def measure(base_dir: Path, settings: TrainSettings, device: torch.device, *, trust_remote_code: bool = False) -> HostSpeed:
    """Time the units of `settings`' work with the stage's own functions."""
    from tqdm import tqdm

    from specdeploy.data import sharegpt_conversations
    from specdeploy.speculator.common import chat_prompts
    from specdeploy.speculator.distill import TF_BATCH, generate, readable, teacher_forced

    print("specdeploy spec: timing distillation and training on this host to size the preset", file=sys.stderr)
    model, tokenizer = _base(base_dir, device, trust_remote_code)
    layers = _layers(base_dir)
    with tqdm(total=3, desc="sizing", unit="probe") as bar:
        # a batch of reads, the faster of two (the first pays for allocations)
        conversations = sharegpt_conversations(TF_BATCH, "train", seed=1)
        reads = readable(tokenizer, conversations, settings.tf_max_tokens)
        read_s = min(_seconds(teacher_forced, model, tokenizer, conversations, layers=layers,
                              max_tokens=settings.tf_max_tokens) for _ in range(2))
        token_s = read_s / _padded(reads, TF_BATCH)[0]
        bar.update(1)
        # decode steps at the distillation batch's size, on prompts cut short (their prefill is not what is timed)
        short = [p[:200] for p in chat_prompts(settings.distill_batch, "train")]
        once, longer = (_seconds(generate, model, tokenizer, short, max_new_tokens=n, layers=layers, batch_size=len(short))
                        for n in (1, 1 + DECODE_STEPS))
        # a difference of two timings: noise, or answers all ending at EOS within the steps, can make it
        # <= 0, which would leave decoding out of the prediction; a step computes one position per
        # answer, never cheaper than a position of the batched reads
        decode_step_s = max((longer - once) / DECODE_STEPS, len(short) * token_s)
        del model  # training loads its own copy of the base: one in memory at a time
        bar.update(1)
        train_step_s = _time_training(base_dir, settings, device, trust_remote_code)
        bar.update(1)
    return HostSpeed(token_s, decode_step_s, train_step_s)


def _seconds(function: Any, *args: Any, **kwargs: Any) -> float:
    start = time.perf_counter()
    function(*args, **kwargs)
    return time.perf_counter() - start


def _base(base_dir: Path, device: torch.device, trust_remote_code: bool) -> tuple[Any, Any]:
    from specdeploy.checkpoints import load_tokenizer
    from specdeploy.device import fast_dtype
    from specdeploy.speculator.distill import distillation_model

    return (distillation_model(base_dir, fast_dtype(device), device=device, trust_remote_code=trust_remote_code),
            load_tokenizer(base_dir))


def _layers(base_dir: Path) -> list[int]:
    from specdeploy.speculator.train import data_layers

    return data_layers(json.loads((base_dir / "config.json").read_text())["num_hidden_layers"])


def _time_training(base_dir: Path, settings: TrainSettings, device: torch.device, trust_remote_code: bool) -> float:
    """One training step of `settings`, the mean of TRAIN_STEPS on hidden states of the base's width
    (random: a step's cost does not depend on the values)."""
    from specdeploy.speculator.shards import DistillData
    from specdeploy.speculator.train import fit

    config = json.loads((base_dir / "config.json").read_text())
    positions = 2 * settings.batch_size * settings.window
    generator = torch.Generator().manual_seed(0)
    data = DistillData(
        tokens=torch.randint(config["vocab_size"], (positions,), generator=generator),
        valid=torch.arange(positions) % settings.window != settings.window - 1,  # samples of one window each
        hidden={layer: torch.randn(positions, config["hidden_size"], generator=generator).to(torch.bfloat16)
                for layer in _layers(base_dir)},
        info={})
    return fit(base_dir, replace(settings, steps=TRAIN_STEPS), data=data, device=device,
               trust_remote_code=trust_remote_code).stats["seconds"] / TRAIN_STEPS
