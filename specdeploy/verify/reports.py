"""verify's files: verify.json, verify.md (the headlines, the served figures, a table per report)
and the plots acceptance_length.png and speedup.png."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdeploy.fileio import atomic_write_json, atomic_write_text
from specdeploy.verify.summary import ACCEPTANCE_DEFINITION, SPEEDUP_DEFINITION, _flat, headlines


def write_reports(out: Path, summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    atomic_write_json(out / "verify.json", {"summary": summary, "prompts": rows})
    lines = ["# specdeploy verify", "", *[f"- {line}" for line in headlines(summary)], "",
             "## b. Served", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in _flat(summary).items()]
    lines += ["", f"Acceptance length: {ACCEPTANCE_DEFINITION}.", "", f"Speed-up: {SPEEDUP_DEFINITION}."]
    if summary.get("seconds"):
        lines += ["", "Time (s): " + ", ".join(f"{name.replace('_', ' ')} {value:.0f}" for name, value in summary["seconds"].items()) + "."]
    lines += ["", "## b. Served, per prompt", "",
              "| category | match | first divergence | margin | accept len | tokens (AR twin) | speed-up |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        margin = f"{r['margin_at_divergence']:.3f}" if r["margin_at_divergence"] is not None else "-"
        ar_tokens = "" if r.get("ar_tokens") is None else f" ({r['ar_tokens']})"
        accepted = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        lines.append(f"| {r['category']} | {r['match']} | {_first(r)} | {margin} | "
                     f"{accepted} | {r['tokens']}{ar_tokens} | {speedup} |")
    for name, report in (("a. Exactness", summary.get("exactness")), ("c. Fidelity", summary.get("fidelity"))):
        if report:
            lines += ["", f"## {name}", "", f"Rule: {report['rule']}.", "", "| prompt | identical | first difference |", "|---|---|---|"]
            lines += [f"| {i} | {r['identical']} | {_first(r)} |" for i, r in enumerate(report["rows"])]
    atomic_write_text(out / "verify.md", "\n".join(lines) + "\n")
    _plots(out, rows)


def _first(row: dict[str, Any]) -> str:
    index = row.get("first_difference", row.get("first_divergence_token"))
    return "-" if index is None else str(index)


def _plots(out: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist([r["acceptance_length"] for r in rows if r["acceptance_length"] is not None], bins=10)  # none: not reported
    ax.set(xlabel="acceptance length (tokens per target forward)", ylabel="prompts", title="Acceptance length")
    fig.tight_layout()
    fig.savefig(out / "acceptance_length.png", dpi=100)
    plt.close(fig)
    if any(r["speedup"] for r in rows):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar(range(len(rows)), [r["speedup"] or 0 for r in rows], color=["C0" if r["category"] == "chat" else "C1" for r in rows])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(xlabel="prompt (blue chat, orange code)", ylabel="speed-up vs autoregressive", title="Served speed-up per prompt")
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=100)
        plt.close(fig)
