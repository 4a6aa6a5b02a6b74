"""What the load test shows: the plot (throughput and speed-up, TTFT vs concurrency), the
terminal table, and the spec_off_above suggestion the speed-up curve makes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from specdeploy.loadtest.report import SPEC


def plot(report: dict[str, Any], path: Path) -> None:
    """Tokens/s of both arms and the speed-up (second axis; with the control, the A/A passes' range
    as a band) vs concurrency; TTFT p99 (all requests, and past the cold start) vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [e["concurrency"] for e in report["levels"]]
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in report["arms"]:
        tput.plot(levels, [e[arm]["output_tokens_per_s"] for e in report["levels"]], "o-", label=arm)
        line, = ttft.plot(levels, [(e[arm]["ttft_s"]["p99"] or 0) * 1000 for e in report["levels"]], "o-", label=arm)
        ttft.plot(levels, [(e[arm]["ttft_steady_s"]["p99"] or 0) * 1000 for e in report["levels"]], "o--",
                  color=line.get_color(), label=f"{arm}, steady")
    tput.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="Throughput")
    ttft.set(xscale="log", xlabel="concurrency", ylabel="TTFT p99 (ms)", title="Time to first token")
    if all(e["speedup"] is not None for e in report["levels"]):
        speed = tput.twinx()
        speed.plot(levels, [e["speedup"] for e in report["levels"]], "s--", color="k", label="speed-up")
        speed.axhline(1.0, color="gray", lw=0.8)
        if report.get("control"):  # the A/A passes' range: where two identical deployments landed
            ratios = [pair["pass_ratios"] or [1.0] for pair in report["control"]]
            speed.fill_between(levels, [min(r) for r in ratios], [max(r) for r in ratios], color="gray", alpha=0.2,
                               label="A/A passes")
        speed.set(ylabel="speed-up (speculative / autoregressive)", ylim=(0, None))
        speed.legend(loc="upper right")
    for ax in (tput, ttft):
        ax.minorticks_off()
        ax.set_xticks(levels, [str(level) for level in levels])
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(report: dict[str, Any], title: str) -> Table:
    out = Table(title=title)
    for column in ("conc", "arm", "tok/s", "req/s", "TTFT p50/p99 ms", "steady TTFT", "TPOT p50/p99 ms",
                   "ITL p50/p99 ms", "accept len", "identical", "errors", "speed-up") + (("A/A",) if report.get("control") else ()):
        out.add_column(column, justify="left" if column == "arm" else "right")
    ms = lambda p: "/".join("-" if p[k] is None else f"{p[k] * 1000:.0f}" for k in ("p50", "p99"))  # noqa: E731
    controls = report.get("control") or [None] * len(report["levels"])
    for entry, pair in zip(report["levels"], controls):
        for arm in report["arms"]:
            f = entry[arm]
            speedup = speedup_cell(entry) if arm == SPEC else ""
            aa = (control_cell(pair) if arm == SPEC else "",) if pair else ()
            out.add_row(str(entry["concurrency"]), arm, f"{f['output_tokens_per_s']:.1f}", f"{f['requests_per_s']:.2f}",
                        ms(f["ttft_s"]), ms(f["ttft_steady_s"]), ms(f["tpot_s"]), ms(f["itl_s"]),
                        f"{f['acceptance_length']:.2f}",
                        f"{f['identical']}/{f['compared']}", str(f["errors"]), speedup, *aa)
    return out


def speedup_cell(entry: dict[str, Any]) -> str:
    """'1.08x', and the passes' range where there were several: '1.08x (0.97-1.19)'."""
    if entry["speedup"] is None:
        return ""
    passes = entry["pass_speedups"]
    return f"{entry['speedup']:.2f}x" + (f" ({min(passes):.2f}-{max(passes):.2f})" if len(passes) > 1 else "")


def control_cell(pair: dict[str, Any]) -> str:
    """The A/A pass ratios' range: '0.94-1.07'."""
    ratios = pair["pass_ratios"]
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"


def noise_summary(report: dict[str, Any]) -> str:
    """What the A/A control says about the speculative passes, level by level."""
    parts = []
    for entry, pair in zip(report["levels"], report["control"]):
        if pair["noise_floor"] is None or entry["pass_speedups"] is None:
            parts.append(f"{entry['concurrency']}: no floor (a pass made no tokens)")
            continue
        parts.append(f"{entry['concurrency']}: floor {pair['noise_floor']:.2f}, "
                     f"{entry['slower_than_noise']}/{len(entry['pass_speedups'])} speculative passes below it")
    return ("A/A control (the autoregressive twin against a copy of itself, the same passes): "
            + "; ".join(parts) + ". A pass speed-up above its level's floor is within what two identical deployments "
            "differed by on this host.")


def suggestion(report: dict[str, Any]) -> str:
    """What the sweep says of the deployment's spec_off_above: keep it, or the value it suggests."""
    off_above, current = report["spec_off_above"], report["deployment_spec_off_above"]
    if off_above == current:
        if current is not None and not any(entry["concurrency"] <= current for entry in report["levels"]):
            return (f"every level swept is above the deployment's spec_off_above {current}: speculation stayed off, "
                    "so the sweep suggests nothing (sweep lower levels too)")
        lost = [entry["concurrency"] for entry in report["levels"] if entry["pass_speedups"]
                and max(entry["pass_speedups"]) < 1 and (current is None or entry["concurrency"] <= current)]
        where = "every level swept" if current is None else f"every level up to the deployment's spec_off_above {current}"
        paid = (f"speculation paid at {where}" if not lost else
                f"no break-even at {where}: speculation lost in every pass at concurrency "
                f"{', '.join(map(str, lost))}, but paid at a higher level, so that loss reads as noise (more --passes "
                "tell them apart)")
        if current is None:
            return f"{paid}: keep the deployment as it is (no spec_off_above)"
        return (f"{paid}: keep it (above it batches decode plainly, so those levels cannot tell whether speculating "
                "there would pay)")
    why = ("speculation did not pay even alone: spec_off_above 0 serves plainly until the module accepts more"
           if off_above == 0 else f"batches of more than {off_above} sequences then decode plainly")
    return (f"suggested: spec_off_above {off_above} ({why}); package with --spec-off-above {off_above}, "
            f'or make engine ENGINE_ARGS="--spec-off-above {off_above}"')
