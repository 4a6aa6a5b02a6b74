"""The served report's figures and rules: the parity rule a dtype allows, acceptance length and
speed-up with their definitions, the summary of the rows, and the one-line headlines per report
that the command prints and verify.md opens with."""

from __future__ import annotations

import statistics
from collections.abc import Collection
from typing import Any

from specdeploy.parity import ROUNDING_CEILING, ParityResult, parity_holds
from specdeploy.runtime.types import acceptance_length

ACCEPTANCE_DEFINITION = ("TensorRT-LLM's: (accepted draft tokens + 1 per target forward) / target forwards, prefill "
                         "not counted; counts summed over prompts, from the server's own counters of emitted tokens and "
                         "target forwards (TensorRT-LLM: its total_accepted_draft_tokens and the answer's tokens)")
SPEEDUP_DEFINITION = ("output tokens/s of the speculative deployment over its AR twin's, each counted on its own served "
                      "output (the tokens the server emitted) over its request's latency, TTFT included; summed over prompts")


def _speedup(runs: list[tuple[int, float, int | None, float | None]]) -> float | None:
    """Output tokens/s of the speculative arm over the AR twin's, over (tokens, latency_s,
    ar_tokens, ar_latency_s) runs, each arm counted on its own output: outside float64 the two
    can part at a near-tie and one stop early, so a latency ratio would compare different work."""
    spec_s, ar_s = sum(run[1] for run in runs), sum(run[3] or 0.0 for run in runs)
    ar_tokens = sum(run[2] or 0 for run in runs)
    if spec_s <= 0 or ar_s <= 0 or not ar_tokens:
        return None
    return (sum(run[0] for run in runs) / spec_s) / (ar_tokens / ar_s)


def parity_rule(dtype: str, quant: dict[str, Any]) -> str:
    """"exact" where speculative greedy decoding can equal the reference token for token."""
    from specdeploy.checkpoints.quantized import rounds_activations

    return "exact" if dtype == "float64" or (dtype == "float32" and not rounds_activations(quant)) else "near-tie"


def _acceptance(rows: list[dict[str, Any]]) -> float | None:
    """None where the server returned no draft counts (an llmapi model without perf outputs)."""
    if any(r["accepted_draft_tokens"] is None for r in rows):
        return None
    return acceptance_length(sum(r["accepted_draft_tokens"] for r in rows), sum(r["target_forwards"] for r in rows))


def _runs(rows: list[dict[str, Any]]) -> list[tuple[int, float, int | None, float | None]]:
    return [(r["tokens"], r["latency_s"], r["ar_tokens"], r["ar_latency_s"]) for r in rows if r["speedup"]]


def beyond_limit(rows: list[dict[str, Any]], rule: str, near_tie: float | None) -> list[int]:
    """The rows whose divergence the parity rule alone does not pass."""
    exact = rule == "exact"
    return [i for i, r in enumerate(rows)
            if not parity_holds(ParityResult(**{k: r[k] for k in ParityResult.__dataclass_fields__}), exact, near_tie)]


def may_be_rounding(row: dict[str, Any], exactness_row: dict[str, Any] | None) -> bool:
    """Whether a divergence beyond the near-tie limit can be the served dtype's rounding, to be
    confirmed by replaying it (verify/replay.py): report a. found the deployment's speculative
    decoding of the prompt identical to plain greedy in float64, and the reference preferred its
    token by at most ROUNDING_CEILING."""
    margin = row["margin_at_divergence"]
    return exactness_row is not None and exactness_row["identical"] and margin is not None and margin <= ROUNDING_CEILING


def summarize(rows: list[dict[str, Any]], dtype: str, rule: str, near_tie: float | None,
              measured: dict[str, Any] | None = None, reproduced: Collection[int] = ()) -> dict[str, Any]:
    """The served report. `near_tie`: the limit where the rule is not exact; `measured`: its
    report where it was measured on the served model; `reproduced`: the rows beyond the limit
    whose answers the deployment reproduced in-process (may_be_rounding, then verify/replay.py)."""
    failing = set(beyond_limit(rows, rule, near_tie)) - set(reproduced)
    exact = rule == "exact"
    speedups = [r["speedup"] for r in rows if r["speedup"]]
    summary = {
        "prompts": len(rows),
        "dtype": dtype,
        "parity_rule": "exact" if exact else f"near-tie (margin <= {near_tie:.3g}{', measured' if measured else ''})",
        "exact_match_rate": sum(r["match"] for r in rows) / len(rows),
        "parity_ok": not failing,
        "divergences": [{"prompt": r["shown"][:80], "token": r["first_divergence_token"], "margin": r["margin_at_divergence"],
                         "reproduced_in_process": i in reproduced}
                        for i, r in enumerate(rows) if not r["match"]],
        "acceptance_length": _acceptance(rows),
        "acceptance_length_definition": ACCEPTANCE_DEFINITION,
        # total tokens over total time per arm: one slow prompt weighs as much as its share of the work
        "speedup": _speedup(_runs(rows)) if speedups else None,
        "speedup_definition": SPEEDUP_DEFINITION,
        "speedup_min": min(speedups) if speedups else None,
        "served_tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["latency_s"] for r in rows),
        "ttft_s_median": statistics.median(r["ttft_s"] for r in rows),
    }
    if measured:
        summary["near_tie_measured"] = measured
    for category in sorted({r["category"] for r in rows}):
        subset = [r for r in rows if r["category"] == category]
        summary[f"acceptance_length_{category}"] = _acceptance(subset)
        if speedups:
            summary[f"speedup_{category}"] = _speedup(_runs(subset))
            summary[f"speedup_min_{category}"] = min((r["speedup"] for r in subset if r["speedup"]), default=None)
    return summary


def _flat(summary: dict[str, Any]) -> dict[str, Any]:
    """The served report's own figures (the other reports and long texts are printed apart)."""
    return {k: v for k, v in summary.items()
            if k not in ("divergences", "acceptance_length_definition", "speedup_definition") and not isinstance(v, dict)}


def headlines(summary: dict[str, Any]) -> list[str]:
    """One line per report with its rule: what `make verify` prints and verify.md opens with."""
    lines = []
    exact = summary.get("exactness")
    if exact:
        lines.append(f"a. exactness ({exact['dtype']}, speculative vs plain greedy on the deployment's weights): "
                     f"{exact['identical']}/{exact['prompts']} identical, acceptance length {exact['acceptance_length']:.2f}"
                     f" -> {'PASS' if exact['ok'] else 'FAIL'} (rule: 100% identical)")
    speed = "" if summary.get("speedup") is None else f", speed-up {summary['speedup']:.2f}x over the AR twin"
    accepted = summary["acceptance_length"]
    accepted = "not reported by the server (no draft counts)" if accepted is None else f"{accepted:.2f}"
    lines.append(f"b. served ({summary['dtype']}): parity {'PASS' if summary['parity_ok'] else 'FAIL'} "
                 f"({summary['parity_rule']}; {summary['exact_match_rate']:.0%} identical{_margins(summary)}), "
                 f"acceptance length {accepted}{speed}")
    tie = summary.get("near_tie_measured")
    if tie:
        lines.append(f"   near-tie limit {tie['limit']:.3g}: {tie['rule']} (largest {tie['largest_shift']:.3f}, "
                     f"p99 {tie['p99_shift']:.3f}, over {tie['positions']} positions)")
    fid = summary.get("fidelity")
    if fid:
        where = "" if fid["mean_first_divergence_token"] is None else \
            f", the others part at token {fid['mean_first_divergence_token']:.1f} on average"
        lines.append(f"c. fidelity ({fid['served']} vs the original model, {fid['original']}): "
                     f"{fid['identical']}/{fid['prompts']} identical{where} (reported, not judged)")
    return lines


def _margins(summary: dict[str, Any]) -> str:
    """The reference's top-2 margins where the served answers parted from it ("none": past its end)."""
    margins = [d["margin"] for d in summary["divergences"]]
    if not margins:
        return ""
    replayed = sum(d.get("reproduced_in_process", False) for d in summary["divergences"])
    return "; parted at margins " + ", ".join("none" if m is None else f"{m:.2f}" for m in margins) + (
        f"; {replayed} beyond the limit reproduced by the deployment in-process and float64-exact (a.): rounding"
        if replayed else "")
