"""Judging outputs that differ from their solo run where parity cannot be exact: which outputs
are disputed, each checked against the Hugging Face reference by verify's near-tie rule, and the
verdict line that says what the differences mean.

Beyond the near-tie limit, up to parity.ROUNDING_CEILING, an output passes as the served dtype's
rounding when the deployment in float64 decodes its prompt in an in-flight batch of the load test's
prompts exactly as plain greedy does (`exact_in_batch`): its batching and speculation are then
exact, and what moved the token is the dtype's rounding in another batch shape (FP8 activations
move a margin by up to 2-4 logits). verify's rule asks more of such a divergence (the deployment
reproduces the served answer in-process, verify/replay.py); a load test cannot replay the batch an
answer was served in, so its outputs beyond the limit are counted apart and named in the verdict."""

from __future__ import annotations

from typing import Any, Callable

from specdeploy.parity import ROUNDING_CEILING
from specdeploy.verify.reference import Reference, near_tie_limit

ExactInBatch = Callable[[], list[bool]]  # per prompt: float64 batched speculative == plain greedy


def disputed_outputs(figures: list[dict[str, Any]], expected: dict[int, str]) -> list[tuple[int, str]]:
    """(prompt, text) of every distinct output that differs from its prompt's solo output, and of
    those solo outputs."""
    disputed = set()
    for figure in figures:
        for row in figure["per_request"]:
            solo = expected.get(row["prompt"])
            if row["error"] is None and row["text"] != solo:
                disputed |= {(row["prompt"], text) for text in (row["text"], solo) if text is not None}
    return sorted(disputed)


def judge_near_ties(disputed: list[tuple[int, str]], prompts: list[str], reference: Reference, lengths: list[int],
                    near_tie: float | None, chunk: int = 1, fixed: bool = False,
                    exact_in_batch: ExactInBatch | None = None) -> dict[str, Any]:
    """verify's near-tie rule for each disputed output: the reference's greedy answer, or parting
    from it where the reference's top-2 logit margin is <= near_tie (None: measured as verify
    measures it, over the disputed outputs with verify rounds of `chunk` tokens). `fixed`: the
    requests sent min_tokens = their length, and the reference holds off its end token as they did.
    `exact_in_batch`: asked only where an output parts beyond the limit (the module docstring)."""
    from tqdm import tqdm

    from specdeploy.parity import parity_holds

    answers = [(prompts[i], text) for i, text in disputed]
    near_tie, measured = near_tie_limit(reference, answers, max(lengths), chunk, near_tie)
    rows = []
    for index, text in tqdm(disputed, desc="near-tie check", unit="output"):
        _, result = reference.check(prompts[index], text, lengths[index], complete=False,
                                    min_tokens=lengths[index] if fixed else 0)
        rows.append({"prompt": index, "match": result.match, "first_divergence_token": result.first_divergence_token,
                     "margin_at_divergence": result.margin_at_divergence, "ok": parity_holds(result, False, near_tie),
                     "rounding": False})
    _pass_rounding(rows, exact_in_batch)
    margins = [r["margin_at_divergence"] for r in rows if r["margin_at_divergence"] is not None]
    return {"rule": f"each output the reference's greedy answer, or parting from it at a top-2 logit margin <= {near_tie:.3g}; "
                    f"up to {ROUNDING_CEILING:g} where the deployment decodes the prompt float64-exactly in an in-flight batch",
            "near_tie": near_tie, "measured": measured, "outputs": len(rows), "passed": sum(r["ok"] for r in rows),
            "rounding": sum(r["rounding"] for r in rows),
            "largest_margin": max(margins, default=None), "ok": all(r["ok"] for r in rows), "rows": rows}


def _pass_rounding(rows: list[dict[str, Any]], exact_in_batch: ExactInBatch | None) -> None:
    """Pass the rows beyond the limit and within ROUNDING_CEILING whose prompt the deployment
    decodes float64-exactly in a batch (asked once, only when there are such rows)."""
    beyond = [r for r in rows if not r["ok"] and r["margin_at_divergence"] is not None
              and r["margin_at_divergence"] <= ROUNDING_CEILING]
    if not beyond or exact_in_batch is None:
        return
    exact = exact_in_batch()
    for row in beyond:
        row["ok"] = row["rounding"] = exact[row["prompt"]]


def verdict(report: dict[str, Any]) -> str:
    """What the outputs that differ from their solo run mean, by the deployment's parity rule."""
    if report["parity_rule"] == "exact":
        return "FAIL: greedy output changed under concurrency (exact parity rule)"
    judged = report["near_tie"]
    largest = "-" if judged["largest_margin"] is None else f"{judged['largest_margin']:.3f}"
    return (f"{'' if judged['ok'] else 'FAIL: '}{report['mismatches']} outputs differ from their solo run ({report['dtype']}: "
            f"a batch of another shape rounds apart); near-tie rule against the reference on the served weights: "
            f"{judged['passed']}/{judged['outputs']} distinct outputs pass (largest margin where one parts {largest}, "
            f"allowed <= {judged['near_tie']:g}{_rounding_words(judged)})")


def _rounding_words(judged: dict[str, Any]) -> str:
    if not judged.get("rounding"):
        return ""
    return (f"; {judged['rounding']} beyond it, up to {ROUNDING_CEILING:g}, as the dtype's rounding: the deployment decodes "
            "its prompt float64-exactly in an in-flight batch (`make verify` replays such answers; a load test cannot)")
