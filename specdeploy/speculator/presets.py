"""Training presets of the spec stage (`--preset quick|long`), sized to the base and the hardware.

Three tiers: `gpu` (a 1B-8B base on CUDA, after ModelOpt's EAGLE-3 recipe in
examples/speculative_decoding: sequences of 2048 tokens, lr 3e-4 with batches of several sequences
as in its offline pipeline, a 32k draft vocabulary, a few epochs over the data), `cpu` (sized for
SmolLM2-135M on 2 fast CPU cores; also what a base under 1B gets on a GPU, which then trains the
same module, only faster) and `cpu-small` (a quick EAGLE that reads fewer answers and trains fewer
steps, for a CPU too slow for `cpu`'s; on a CPU too slow for this one, its reads and steps are cut to
fit, to half). A CPU's tier is chosen by its measured speed (sizing.py); the settings a build used are
in its manifest.
Budgets count steps, never seconds: the same settings make the same module on any machine.
"""

from __future__ import annotations

import os
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.preflight import parameter_count
from specdeploy.speculator.train import KINDS, TrainSettings

PRESETS = ("quick", "long")
GPU_MIN_PARAMS = 1_000_000_000

# CPU tier. The base reads a ShareGPT answer (teacher-forced) ~12x faster than it writes its own
# (batched generation); both are distilled from the base's own logits, so the presets take most
# tokens read and a share generated. Measured with SmolLM2-135M on an idle 2-core machine:
# ~3,400 tokens/s read, ~290 tokens/s generated, ~1.55 EAGLE steps/s (4 x 256 tokens) on a CPU
# with native bf16; on an AVX2-only AMD EPYC in float32 (2026-11-23): ~570 tokens/s read (256
# answers in 135 s), 64 answers generated in ~165-190 s in batches of 16, 1.5-2.2 s per EAGLE step.
# quick (what `make engine` uses): the data is cached, shared by both kinds and every build of the
# same base; 64 code completions came with the batch-16 speed-up at no extra data time. Swapping
# 512 of the reads for 128 more answers of the base's own (equal data time, 300 steps) measured
# held-out chain-3 acceptance 1.38 vs 1.41 chat and 1.35 vs 1.30 code: the reads stay.
# Generated in batches of 64 (a shard's worth): a decode step's cost grows slowly with the batch on a
# CPU, so the 64 chat answers took 99 s instead of 132 s in batches of 16 (2026-11-26, bf16). On a Xeon
# with AMX, since a single bf16 query's attention runs as one row there (specdeploy.attention): 64 chat
# answers 38.6 s, 64 code completions 41.1 s, 768 conversations read 96.2 s (2026-11-27).
_CPU_QUICK_DATA = dict(num_prompts=64, code_prompts=64, teacher_forced=768, distill_batch=64)
# quick EAGLE trains one TTT step (ModelOpt's eagle_ttt_steps): on a CPU the package stage's planner
# has served a chain of ONE draft on every default build measured since 2026-11-25, and only the
# first draft position serves it. A TTT step is ~0.24 s of a ~0.78-s step (4 x 256 tokens, bf16), so one
# step trains ~2.6x faster. Measured (2026-11-25 in docs/measurements.md; the same cached data; `spec validate
# --tree chain --draft-len 1 --prompts 24 --max-new-tokens 96`, bf16 base, acceptance length over both categories):
# 3 TTT x 750 steps (584 s) 1.349; 1 x 750 (227 s) 1.354; 1 x 1000 (305 s) 1.375; 1 x 1500 (465 s)
# 1.399; on the FP8 served model 1.349 / - / 1.365 / 1.382. A chain of 3 loses ~0.03-0.05 with one
# TTT step (FP8 model, 1 x 1000 vs 3 x 750: 1.427 vs 1.460): `--ttt-steps 3` (engine:
# `--spec-ttt-steps 3`) for deeper drafts, e.g. a small base on a GPU, where a longer chain costs
# little more to verify.
# 800 steps since 2026-11-26 (1,000 before): on the batch-64 data, `make verify` on a fresh clone measured
# served acceptance 1.32 (chat 1.44), where 1,000 steps had made 1.30 (chat 1.40); ~60 s less training.
_CPU_QUICK_EAGLE = dict(steps=800, ttt_steps=1)
# quick on a CPU too slow for that (sizing.py): 256 reads and 400 steps. The float32 path forced on the Xeon
# (SPECDEPLOY_CPU_BF16=0, 2026-11-27, the same float32 data; `spec validate --tree chain --draft-len 1
# --prompts 24 --max-new-tokens 96`, float32 base, acceptance length over both categories): 768 reads x
# 800 steps (data 8.3 min, 471 s training) 1.362; 256 x 400 (224 s) 1.317; 256 x 600 (299 s) 1.328;
# 768 x 400 (216 s) 1.321: reads past 256 bought nothing at 400 steps; they cost ~3.5 min of the float32
# distillation there, 400 fewer steps ~4 min. On the bf16 path (the Xeon, its own data, same command):
# 768 x 800 1.355, 256 x 400 1.304. An EPYC with AVX512-BF16 but no AMX distilled the 896 samples in
# 6m02s and trained 3.06 steps/s (2026-11-26), ~2x and ~1.2x the Xeon's times with AMX: there the 512
# fewer reads and 400 fewer steps come to ~4.5 min of a `make engine` last measured at 16-18 min (an
# estimate). A Zen 5 EPYC without AMX (2026-11-27) ran this recipe's spec stage in 234 s, `make engine` 6m34s;
# timed (sizing.py), it affords the larger one: spec stage 370 s, `make engine` 9m13s, served acceptance 1.34.
_CPU_SMALL_QUICK_DATA = dict(_CPU_QUICK_DATA, teacher_forced=256)
_CPU_SMALL_QUICK_EAGLE = dict(_CPU_QUICK_EAGLE, steps=400)
# long: ~6x the data (~15-20 min to make once, then cached) with 768 of the base's own answers;
# measured on 2 idle threads, 6,000 EAGLE steps took 53 min, 4,000 Medusa steps 19 min.
_CPU_LONG_DATA = dict(num_prompts=768, teacher_forced=2048, distill_batch=64)
_CPU_QUICK = {"eagle": dict(**_CPU_QUICK_EAGLE, **_CPU_QUICK_DATA), "medusa": dict(steps=800, **_CPU_QUICK_DATA),
              "dflash": dict(steps=750, **_CPU_QUICK_DATA)}
_CPU_LONG = {"eagle": dict(steps=6000, **_CPU_LONG_DATA), "medusa": dict(steps=4000, **_CPU_LONG_DATA),
             "dflash": dict(steps=6000, **_CPU_LONG_DATA)}
# GPU tier (1B-8B). ~1.5M tokens (quick) / ~6M tokens (long), 3-4 epochs of 4 x 2048-token windows.
_GPU_DATA = dict(max_new_tokens=512, tf_max_tokens=2048, window=2048, batch_size=4, distill_batch=32, draft_vocab=32000,
                 checkpoint_every=250)  # an 8B module's checkpoint (module + AdamW) is ~5 GB
TABLE: dict[str, dict[str, dict[str, dict[str, Any]]]] = {
    "cpu": {
        "quick": _CPU_QUICK,
        "long": _CPU_LONG,
    },
    "cpu-small": {
        "quick": {"eagle": dict(**_CPU_SMALL_QUICK_EAGLE, **_CPU_SMALL_QUICK_DATA),
                  "medusa": _CPU_QUICK["medusa"], "dflash": _CPU_QUICK["dflash"]},
        "long": _CPU_LONG,
    },
    "gpu": {
        "quick": {"eagle": dict(steps=600, lr=3e-4, num_prompts=512, teacher_forced=2048, **_GPU_DATA),
                  "medusa": dict(steps=600, num_prompts=512, teacher_forced=2048, **_GPU_DATA),
                  "dflash": dict(steps=600, lr=3e-4, anchors=512, num_prompts=512, teacher_forced=2048, **_GPU_DATA)},
        "long": {"eagle": dict(steps=3000, lr=3e-4, num_prompts=2048, teacher_forced=8192, **_GPU_DATA),
                 "medusa": dict(steps=3000, num_prompts=2048, teacher_forced=8192, **_GPU_DATA),
                 "dflash": dict(steps=3000, lr=3e-4, anchors=512, num_prompts=2048, teacher_forced=8192, **_GPU_DATA)},
    },
}


def gpu_tier(base_dir: str | os.PathLike) -> str:
    """The tier of a base on CUDA: 'gpu' from 1B parameters, else 'cpu' (the same module, faster)."""
    return "gpu" if parameter_count(base_dir) >= GPU_MIN_PARAMS else "cpu"


def settings_for(kind: str, preset: str = "quick", *, tier: str = "cpu", **overrides: Any) -> TrainSettings:
    if kind not in KINDS:
        raise SpecDeployError(f"the spec stage trains {', '.join(KINDS)}, not '{kind}'", hint=f"use --spec {'|'.join(KINDS)}")
    if preset not in PRESETS:
        raise SpecDeployError(f"unknown preset '{preset}'", hint=f"use one of {', '.join(PRESETS)}")
    base = TABLE[tier][preset][kind]
    settings = TrainSettings(kind=kind, **{**base, **{k: v for k, v in overrides.items() if v is not None}})
    settings.validate()
    return settings
