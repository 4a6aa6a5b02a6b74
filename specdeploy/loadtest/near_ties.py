"""Judging outputs that differ from their solo run where parity cannot be exact: which outputs
are disputed, each checked against the Hugging Face reference by verify's near-tie rule, and the
verdict line that says what the differences mean."""

from __future__ import annotations

from typing import Any

from specdeploy.verify.reference import Reference, near_tie_limit


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
                    near_tie: float | None, chunk: int = 1, fixed: bool = False) -> dict[str, Any]:
    """verify's near-tie rule for each disputed output: the reference's greedy answer, or parting
    from it where the reference's top-2 logit margin is <= near_tie (None: measured as verify
    measures it, over the disputed outputs with verify rounds of `chunk` tokens). `fixed`: the
    requests sent min_tokens = their length, and the reference holds off its end token as they did."""
    from tqdm import tqdm

    from specdeploy.parity import parity_holds

    answers = [(prompts[i], text) for i, text in disputed]
    near_tie, measured = near_tie_limit(reference, answers, max(lengths), chunk, near_tie)
    rows = []
    for index, text in tqdm(disputed, desc="near-tie check", unit="output"):
        _, result = reference.check(prompts[index], text, lengths[index], complete=False,
                                    min_tokens=lengths[index] if fixed else 0)
        rows.append({"prompt": index, "match": result.match, "first_divergence_token": result.first_divergence_token,
                     "margin_at_divergence": result.margin_at_divergence, "ok": parity_holds(result, False, near_tie)})
    margins = [r["margin_at_divergence"] for r in rows if r["margin_at_divergence"] is not None]
    return {"rule": f"each output the reference's greedy answer, or parting from it at a top-2 logit margin <= {near_tie:.3g}",
            "near_tie": near_tie, "measured": measured, "outputs": len(rows), "passed": sum(r["ok"] for r in rows),
            "largest_margin": max(margins, default=None), "ok": all(r["ok"] for r in rows), "rows": rows}


def verdict(report: dict[str, Any]) -> str:
    """What the outputs that differ from their solo run mean, by the deployment's parity rule."""
    if report["parity_rule"] == "exact":
        return "FAIL: greedy output changed under concurrency (exact parity rule)"
    judged = report["near_tie"]
    largest = "-" if judged["largest_margin"] is None else f"{judged['largest_margin']:.3f}"
    return (f"{'' if judged['ok'] else 'FAIL: '}{report['mismatches']} outputs differ from their solo run ({report['dtype']}: "
            f"a batch of another shape rounds apart); near-tie rule against the reference on the served weights: "
            f"{judged['passed']}/{judged['outputs']} distinct outputs pass (largest margin where one parts {largest}, "
            f"allowed <= {judged['near_tie']:g})")
