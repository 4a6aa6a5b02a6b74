"""`--cpu-draft-shape auto`: the CPU deployment drafts the chain or tree the planner
(runtime.planner) measures fastest on this machine, and stops speculating above the in-flight
batch size where that stops paying. The GPU routes keep convert's shape; their LLM-API speculation
controls start from this measurement (llmapi_repo.gpu_knobs).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from specdeploy.fileio import atomic_write_json
from specdeploy.trtllm.llmapi import DraftStructure
from specdeploy.triton.cpu_repo import DEPLOYMENT_FILE

if TYPE_CHECKING:
    from specdeploy.runtime.load_plan import LoadPoint

CPU_PLAN = 11  # the --cpu-draft-shape auto planner's version: a build planned by another is packaged again
PLAN_FILE = "draft_plan.json"  # cpu/: the planner's measurement behind the CPU deployment's draft shape
CPU_DRAFT_SHAPES = ("fixed", "auto")
# A batch size speculates where the load test's closed loop, run in-process on the calibration prompts
# (load_plan.measure_load_curve), went at least as fast as the plain twin: what the plan measures is
# what a served load test sees, prefill and the proposer's pass over each prompt included.
LOAD_PAYS = 1.0
# Held-out prompts the plan's requests cycle through (half chat, half code). With 4, one batch held
# them all and its answers decided every size at once.
LOAD_PROMPTS = 8
# A size measured this close to LOAD_PAYS is measured again, up to LOAD_MEASUREMENTS times in all, its
# requests pooled: the closed loop's readings of one build moved by up to 0.04 from run to run (bf16 at
# 8 clients: 1.07-1.10x; docs/measurements.md, 2026-11-29).
LOAD_BORDER, LOAD_MEASUREMENTS = 0.04, 3


def plan_cpu_repo(cpu: Path, deployment: dict[str, Any], structure: DraftStructure | None, *,
                  max_batch_size: int, spec_off_above: int | None) -> None:
    """Plan the written CPU repository `cpu` (its deployment.json is `deployment`, which speculates):
    the shape (a fixed tree, Medusa's or static EAGLE choices, keeps its own), then, unless the user
    gave `spec_off_above`, the load; the measurement goes to cpu/PLAN_FILE."""
    written = cpu / "tensorrt_llm" / "1" / DEPLOYMENT_FILE
    planned = plan_cpu_shape(written, structure) or {"options": {}, "plan": None}
    if planned["options"]:
        deployment["spec"].update(planned["options"])
        atomic_write_json(written, deployment)
    if spec_off_above is None:  # the user's value wins
        planned["load"] = plan_cpu_load(written, max_batch_size)
        if planned["load"]["spec_off_above"] is not None:
            atomic_write_json(written, {**deployment, "spec_off_above": planned["load"]["spec_off_above"]})
    atomic_write_json(cpu / PLAN_FILE, planned)


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


def load_sizes(max_batch_size: int) -> list[int]:
    """The in-flight batch sizes the load plan measures: the powers of two up to max_batch_size,
    and max_batch_size itself. The speed-up falls smoothly with the batch, so these place the
    break-even as `make loadtest`'s concurrencies (1, 2, 4, 8) see it, in about half the time of
    every size; between two measured sizes, speculation stops at the smaller (the safe side)."""
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size]
    return sizes + ([max_batch_size] if sizes[-1] != max_batch_size else [])


def plan_cpu_load(path: Path, max_batch_size: int) -> dict[str, Any]:
    """The CPU deployment's spec_off_above, measured on the deployment as written (its planned
    shape): the load test's closed loop at load_sizes(max_batch_size) clients, speculative and
    plain side by side. At least 1: alone, the deployment speculates, as the build asked."""
    from specdeploy.runtime.deployment import load_decoder
    from specdeploy.runtime.load_plan import measure_load_curve, suggested_spec_off_above
    from specdeploy.runtime.planner import calibration_prompts

    decoder = load_decoder(path)
    prompts = calibration_prompts(decoder.tokenizer, LOAD_PROMPTS)

    def measure(sizes: list[int]) -> list[LoadPoint]:
        return measure_load_curve(lambda size: decoder.batcher(max_batch_size=size), prompts, sizes)

    points = pooled_near_border(measure, measure(load_sizes(max_batch_size)))
    off_above = suggested_spec_off_above([p.batch for p in points], [p.speedup for p in points], LOAD_PAYS)
    off_above = None if off_above is None else max(1, off_above)
    print(f"specdeploy package: {load_summary(points, off_above)}", file=sys.stderr)
    return {"spec_off_above": off_above, "pays": LOAD_PAYS, "curve": [p.as_dict() for p in points]}


def pooled_near_border(measure: Callable[[list[int]], list[LoadPoint]], points: list[LoadPoint]) -> list[LoadPoint]:
    """`points` with each size whose speed-up lies within LOAD_BORDER of LOAD_PAYS measured again
    (`measure`) and pooled, until LOAD_MEASUREMENTS or none is that close."""
    for _ in range(LOAD_MEASUREMENTS - 1):
        close = [p.batch for p in points if abs(p.speedup - LOAD_PAYS) < LOAD_BORDER]
        if not close:
            break
        again = {p.batch: p for p in measure(close)}
        points = [p.pooled(again[p.batch]) if p.batch in again else p for p in points]
    return points


def load_summary(points: list[LoadPoint], off_above: int | None) -> str:
    """The load plan in one line: the curve, and spec_off_above with why. With none, a size that lost
    lies below one that paid (break_even reads it as noise): named, not hidden under "every size"."""
    curve = ", ".join(f"{p.batch}: {p.speedup:.2f}x" for p in points)
    if off_above is not None:
        verdict = str(off_above)
    else:
        lost = [str(p.batch) for p in points if p.speedup < LOAD_PAYS]
        verdict = ("none (speculation paid at every size)" if not lost else
                   f"none (speculation paid at the largest size; below {LOAD_PAYS}x at {', '.join(lost)}, read as noise)")
    return (f"CPU deployment, speculative over plain by clients in a closed loop (the load test's answers): {curve}; "
            f"spec_off_above {verdict}")
