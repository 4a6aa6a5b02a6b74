"""The load test's report from a sweep's results: per-level figures of both arms, the speed-up
curve, break-even concurrency and the suggested spec_off_above, and pass/fail (errors, outputs that
differ from their solo run under the deployment's parity rule). With a control (a second copy of
the autoregressive twin, a third arm of the same passes: A/A), each level also gets the pass ratios
of two identical deployments: the noise floor a pass speed-up is read against."""

from __future__ import annotations

from typing import Any, Callable

from specdeploy.loadtest.figures import DEFINITIONS, measure, summarize_level
from specdeploy.loadtest.near_ties import disputed_outputs
from specdeploy.loadtest.sending import Results
from specdeploy.runtime.load_plan import break_even, suggested_spec_off_above

SPEC, AR, CONTROL = "speculative", "autoregressive", "control"


Judge = Callable[[list[tuple[int, str]]], dict[str, Any]]


def build_report(results: Results, tokenizer: Any, levels: list[int], rule: str, judge: Judge | None = None,
                 control: Results | None = None, spec_off_above: int | None = None,
                 fixed_lengths: list[int] | None = None) -> dict[str, Any]:
    """Rows, per-level figures, the speed-up curve, break-even, pass/fail. Outside the exact rule,
    `judge` rules on the outputs that differ from their solo run (judge_near_ties). `control`: the
    copy's results (CONTROL) with the twin's of the same passes (AR, as in `results`: counted once);
    the copy's outputs are held to the same rule. `spec_off_above`: the
    deployment's; at the levels above it batches decode plainly, so break-even and the suggestion
    come from the levels at or below it (the others say nothing of speculating there). `fixed_lengths`:
    each prompt's length, where the requests asked for exactly that (min_tokens): the answers short
    of it are counted."""
    rows = _rows(results, tokenizer)
    reference = list(results)[-1]  # the autoregressive arm, when there is one
    solo = rows[reference][min(rows[reference])]  # concurrency 1, or the solo pass (key 0)
    expected = {r["prompt"]: r["text"] for r in solo if r["error"] is None}
    report_levels = []
    for level in levels:
        entry: dict[str, Any] = {"concurrency": level}
        for arm in results:
            entry[arm] = summarize_level(rows[arm][level], results[arm][level][1], expected)
        # a level where requests failed measured no speed-up: its tokens/s counts only what came back
        both = SPEC in entry and AR in entry and not (entry[SPEC]["errors"] or entry[AR]["errors"]) \
            and min(entry[AR]["pass_tokens_per_s"]) > 0
        entry["speedup"] = entry[SPEC]["output_tokens_per_s"] / entry[AR]["output_tokens_per_s"] if both else None
        entry["pass_speedups"] = ([spec / ar for spec, ar in zip(entry[SPEC]["pass_tokens_per_s"], entry[AR]["pass_tokens_per_s"])]
                                  if both else None)
        report_levels.append(entry)
    controls = _control_levels(control, tokenizer, levels, expected) if control else []
    for entry, pair in zip(report_levels, controls):
        if pair["noise_floor"] is not None and entry["pass_speedups"] is not None:
            entry["slower_than_noise"] = sum(s < pair["noise_floor"] for s in entry["pass_speedups"])
    best_pass = [None if e["pass_speedups"] is None else max(e["pass_speedups"]) for e in report_levels]
    speculating = [(level, best) for level, best in zip(levels, best_pass) if spec_off_above is None or level <= spec_off_above]
    swept, paid = [level for level, _ in speculating], [best for _, best in speculating]
    suggested = suggested_spec_off_above(swept, paid)
    figures = [entry[arm] for entry in report_levels for arm in results] + [pair[CONTROL] for pair in controls]
    solo_errors = sum(r["error"] is not None for r in rows[reference].get(0, []))  # the solo pass, when there was one
    errors = sum(f["errors"] for f in figures) + solo_errors
    mismatches = sum(f["compared"] - f["identical"] for f in figures)
    near_tie = judge(disputed_outputs(figures, expected)) if mismatches and rule != "exact" and judge else None
    # a server that does not read min_tokens lets answers end at EOS: the arms' passes then did unequal work
    answered = [r for f in figures for r in f["per_request"]] + (rows[reference].get(0) or [])
    short = None if fixed_lengths is None else sum(r["tokens"] < fixed_lengths[r["prompt"]] for r in answered
                                                   if r["error"] is None)
    return {
        "arms": list(results), "parity_rule": rule, "definitions": DEFINITIONS, "levels": report_levels,
        "solo_reference": rows[reference].get(0),
        # speculation stops paying where it lost in every pass there and at every level above
        "break_even_concurrency": break_even(swept, paid),
        "deployment_spec_off_above": spec_off_above,
        "spec_off_above": spec_off_above if suggested is None else suggested,
        "errors": errors, "mismatches": mismatches, "near_tie": near_tie, "control": controls or None,
        "short_answers": short,
        "ok": errors == 0 and (mismatches == 0 or rule != "exact") and (near_tie is None or near_tie["ok"]),
    }


def _rows(results: Results, tokenizer: Any) -> dict[str, dict[int, list[dict[str, Any]]]]:
    return {arm: {level: [measure(t, tokenizer) for t in timed] for level, (timed, _) in by_level.items()}
            for arm, by_level in results.items()}


def _control_levels(control: Results, tokenizer: Any, levels: list[int], expected: dict[int, str]) -> list[dict[str, Any]]:
    """Per level: both copies' figures, the pass ratios (CONTROL over AR tokens/s, each pass's pair
    one run apart as the speculative arm's is) and the noise floor: the lowest ratio either way round,
    since the two copies are interchangeable. A speculative pass below it lost by more than two
    identical deployments ever differed."""
    rows = _rows(control, tokenizer)
    entries = []
    for level in levels:
        pair = {arm: summarize_level(rows[arm][level], control[arm][level][1], expected) for arm in (CONTROL, AR)}
        ratios = [c / a for c, a in zip(pair[CONTROL]["pass_tokens_per_s"], pair[AR]["pass_tokens_per_s"]) if c > 0 and a > 0]
        floor = min(min(r, 1 / r) for r in ratios) if ratios else None  # None: a pass of either copy made no tokens
        entries.append({"concurrency": level, **pair, "pass_ratios": ratios, "noise_floor": floor})
    return entries
