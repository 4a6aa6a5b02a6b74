"""`make verify`: is the served output still the base model's, and is it faster?

Three reports, each with its own rule (the CPU deployment):
a. exactness (the algorithm's proof): the deployment's own weights loaded in float64 in-process,
   speculative vs plain greedy decoding, token for token; 100% identical required (exactness.py).
b. served: tritonserver on the packaged CPU repository (or a running one with --url) is sent
   held-out chat and code prompts through tritonclient (gRPC streaming); every answer is compared
   with the Hugging Face reference, greedy decoding in-process on the very weights and dtype the
   server loaded (for a quantized build, the same fake-quantized model), on --device: the served
   tokens are checked in one forward pass and `generate(do_sample=False)` runs on only from where
   they leave the model's greedy path (parity.hf_reference). An autoregressive twin (same
   repository, speculation off) runs beside it and the two are asked the same prompts in
   alternation, so the speed-up is measured on one noisy machine in one run. Parity is exact where
   the served dtype allows, else by the near-tie rule.
c. fidelity: the served answers against the user's original model (the resolved base checkpoint in
   its own dtype, unquantized): how much quantization and the deployment dtype change the output,
   apart from speculation. Reported, not judged: the user decides what is close enough.

`--server trtllm --url HOST:PORT` checks a TensorRT-LLM deployment instead (what
build_scripts/gpu_host.sh starts): the route's entry model and request inputs come from
triton_repo/gpu_routes.json, the reference runs in float32 on --device, and parity follows the
near-tie rule, because TensorRT-LLM computes in bf16/fp16 (FP8 kernels for FP8 checkpoints) where a
k-token verify and a 1-token step round apart. Reports: reports_gpu/. It runs in two phases,
`--phase served` (the served answers and perf counters to a JSON file; no model loaded) and
`--phase reference` (reads that file, computes the reference; no server needed), so that the
reference can load after the server stopped: TensorRT-LLM takes most of the GPU's free memory for
its KV cache. `--phase all` (default) runs both in one process while the server is still up: fine
where the reference fits beside it (another GPU, --device cpu, a small model).

Writes reports/verify.json, verify.md and two PNG plots; exits 1 when a. is not 100%, when served
parity fails or the acceptance length is under --ar-lower-bound. Served parity is exact (any
difference fails) where the runtime can be exact: float64, or float32 without quantized
activations/KV (see quantize.rounds_activations); elsewhere (bf16, the default serving dtype) a
divergence passes only at a near-tie.

Acceptance length is TensorRT-LLM's (runtime.types.acceptance_length): (accepted draft tokens +
1 per target forward) / target forwards, the prefill not counted, summed over prompts first, from
the server's own counters: the CPU repository's emitted tokens and target forwards (so a draft
accepted but never sent, past a stop, does not count); a TensorRT-LLM server reports neither, so
there its total_accepted_draft_tokens and the answer's tokens counted on its text.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from specdeploy.client import Request, TritonLLMClient
from specdeploy.device import add_device_arg
from specdeploy.errors import SpecDeployError
from specdeploy.exactness import speculative_exactness
from specdeploy.fileio import atomic_write_json, atomic_write_text
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.parity import NEAR_TIE, NEAR_TIE_CAP, ParityResult, compare, hf_reference, margin_shift, parity_holds
from specdeploy.parity import Reference as Greedy  # verify's Reference is the model that computes it
from specdeploy.prompts import chat_text, text_ids
from specdeploy.runtime.types import acceptance_length
from specdeploy.stats import percentiles

STAGE, OUT = "verify", "reports"
GPU_STAGE, GPU_OUT = "verify_gpu", "reports_gpu"
GPU_SERVED = "reports_gpu_served.json"  # `verify --server trtllm --phase served` writes it, --phase reference reads it
TRTLLM_PHASES = ("all", "served", "reference")
DEPLOYMENT = Path("tensorrt_llm") / "1" / "deployment.json"
ACCEPTANCE_DEFINITION = ("TensorRT-LLM's: (accepted draft tokens + 1 per target forward) / target forwards, prefill "
                         "not counted; counts summed over prompts, from the server's own counters of emitted tokens and "
                         "target forwards (TensorRT-LLM: its total_accepted_draft_tokens and the answer's tokens)")
SPEEDUP_DEFINITION = ("output tokens/s of the speculative deployment over its AR twin's, each counted on its own served "
                      "output (the tokens the server emitted) over its request's latency, TTFT included; summed over prompts")
# the Triton llmapi model's names for the ensemble's inputs (triton_backend/all_models/llmapi)
LLMAPI_INPUTS = {"max_tokens": "sampling_param_max_tokens", "stream": "streaming",
                 "return_perf_metrics": "sampling_param_return_perf_metrics", "temperature": "sampling_param_temperature",
                 "top_k": "sampling_param_top_k", "top_p": "sampling_param_top_p", "seed": "sampling_param_seed"}


@dataclass
class RouteRequest(Request):
    """A Request in the served model's own input names, with the inputs its route needs."""

    names: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def tensors(self, stream: bool) -> dict[str, Any]:
        values = {self.names.get(k, k): v for k, v in super().tensors(stream).items()}
        return {**values, **self.extra}


@dataclass
class Target:
    """What verify talks to and how: the model it sends to, names, extra inputs, streaming."""

    model: str = "ensemble"
    names: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    stream: bool = True

    def request(self, text: str, max_tokens: int) -> RouteRequest:
        return RouteRequest(text, max_tokens=max_tokens, names=self.names, extra=self.extra)


def trtllm_target(routes: dict[str, Any], route: str | None) -> Target:
    """The entry model of a packaged GPU route (triton_repo/gpu_routes.json)."""
    route = route or routes.get("recommended")
    if route not in routes.get("routes", {}):
        raise SpecDeployError(f"this build has no GPU route {route!r} (it has: {', '.join(routes.get('routes', {})) or 'none'})",
                              hint="pass --route with one the build has; `specdeploy package` says which")
    entry = routes["routes"][route]
    names = LLMAPI_INPUTS if entry["inputs"] == "llmapi" else {}
    extra = {**entry.get("request", {}), **({"sampling_param_exclude_input_from_output": True} if names else {})}
    return Target(entry["model"], names, extra, bool(entry["stream"]))


class Prompt(NamedTuple):
    category: str
    shown: str  # what the user wrote (reports show this, not the chat template around it)
    text_input: str  # what is sent


def load_prompts(per_category: int, tokenizer: Any) -> list[Prompt]:
    """Held-out ShareGPT chat turns in the model's chat template (as a chat client sends them; the
    module was trained on that format) and HumanEval code completions. Long pasted chat turns are
    left out: they measure prefill, not speculation."""
    from specdeploy.data import humaneval_prompts, sharegpt_prompts

    chats = sharegpt_prompts(per_category, split="heldout", max_chars=800)
    return ([Prompt("chat", p, chat_text(tokenizer, p)) for p in chats]
            + [Prompt("code", p, p) for p in humaneval_prompts(per_category)])


def autoregressive_twin(cpu_repo: Path, out: Path) -> Path:
    """A copy of the CPU repository whose deployment does not speculate. `out` sits as deep as
    the repository, so its relative paths (tokenizer, model) hold unchanged."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(cpu_repo, out, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    config = json.loads((cpu_repo / DEPLOYMENT).read_text())
    config["spec"] = {"kind": "none"}
    atomic_write_json(out / DEPLOYMENT, config)
    return out


def served_forwards(tokens: int, accepted: int) -> int:
    """Target forwards after the prefill: the prefill yields the first token, every later
    forward its accepted drafts plus one."""
    return max(tokens - 1 - accepted, 0)


def served_counts(perf: dict[str, float], text_tokens: int) -> tuple[int, int, int]:
    """(emitted tokens, accepted draft tokens, target forwards after the prefill) of one answer,
    from the server's counters where it has them (the CPU repository): accepted are then the
    emitted tokens no forward's own token accounts for, so only tokens that were sent count. A
    TensorRT-LLM server reports only its draft counts: then `text_tokens` (the answer counted on
    its text) and its total_accepted_draft_tokens."""
    if "total_generated_tokens" in perf and "total_target_forwards" in perf:
        tokens, forwards = int(perf["total_generated_tokens"]), int(perf["total_target_forwards"])
        return tokens, max(tokens - 1 - forwards, 0), forwards
    accepted = int(perf.get("total_accepted_draft_tokens", 0))
    return text_tokens, accepted, served_forwards(text_tokens, accepted)


class Reference(NamedTuple):
    """The Hugging Face reference: the model, its tokenizer, where it computes."""

    model: Any
    tokenizer: Any

    def ids(self, text: str) -> torch.Tensor:
        """The prompt as the served preprocessing tokenizes it (specdeploy.prompts)."""
        from specdeploy.runtime.types import model_device

        return torch.tensor([text_ids(self.tokenizer, text)], device=model_device(self.model))

    def check(self, prompt: str, served: str, max_new_tokens: int, *, complete: bool = True) -> tuple[Greedy, ParityResult]:
        """The greedy reference for `prompt`, checked along the served answer (parity.hf_reference;
        `complete` False stops where they part), and how the served answer compares with it."""
        ref = hf_reference(self.model, self.tokenizer, self.ids(prompt), max_new_tokens, guess=served, complete=complete)
        return ref, compare(prompt, ref, served, self.tokenizer)


def round_tokens(deployment: dict[str, Any]) -> int:
    """The tokens one verify round of the deployment runs: the pending token and its draft."""
    return (deployment.get("spec") or {}).get("max_draft_len", 0) + 1


def measured_near_tie(reference: Reference, answers: list[tuple[str, str]], max_new_tokens: int,
                      chunk: int) -> dict[str, Any]:
    """The near-tie limit from the served numerics themselves: the p99 of the top-2 margin shifts
    between the reference's one forward and rounds of `chunk` tokens over the served answers
    ((prompt, answer) texts; parity.margin_shift), within [NEAR_TIE, NEAR_TIE_CAP]. The reference
    is the served model (weights, dtype, fake quantization): this is how far its own rounding
    moves a margin, speculation apart. Not the largest shift: a maximum grows with the positions
    measured, up to a limit that passes almost any divergence on an FP8 build; the cap keeps one
    the reference clearly preferred a failure whatever the rounding."""
    shifts: list[float] = []
    for prompt, text in answers:
        answer = reference.tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
        if answer:
            shifts += margin_shift(reference.model, reference.ids(prompt), answer, chunk)
    p99 = percentiles(shifts)["p99"] or 0.0
    return {"limit": min(max(p99, NEAR_TIE), NEAR_TIE_CAP), "largest_shift": max(shifts, default=0.0), "p99_shift": p99,
            "positions": len(shifts), "round_tokens": chunk,
            "rule": f"the p99 top-2 logit margin shift between one forward and rounds of {chunk} tokens over the "
                    f"served answers on the served model, at least {NEAR_TIE:g} and at most {NEAR_TIE_CAP:g}"}


def near_tie_limit(reference: Reference, answers: list[tuple[str, str]], max_new_tokens: int, chunk: int,
                   given: float | None) -> tuple[float, dict[str, Any] | None]:
    """The near-tie limit: `given`, or (None) measured on the served model, with its report."""
    if given is not None:
        return given, None
    measured = measured_near_tie(reference, answers, max_new_tokens, chunk)
    return measured["limit"], measured


def load_reference(model_dir: Path, dtype: str, device: str, role: str = "reference") -> Reference:
    from specdeploy.device import announce, resolve_device
    from specdeploy.models import load_causal_lm, load_tokenizer

    where = resolve_device(device)
    announce(f"verify ({role}, {dtype})", where)
    return Reference(load_causal_lm(model_dir, dtype=dtype, device=str(where)), load_tokenizer(model_dir))


def fidelity(original: Reference, prompts: list[Prompt], rows: list[dict[str, Any]], max_new_tokens: int,
             served: str, dtype: str) -> dict[str, Any]:
    """Greedy agreement of the served answers (`rows`) with the user's original model."""
    agreement = []
    for prompt, row in zip(prompts, rows):
        # where they part is all this report needs
        ref, result = original.check(prompt.text_input, row["served"], max_new_tokens, complete=False)
        agreement.append({"category": prompt.category, "identical": result.match, "tokens_checked": len(ref.token_ids),
                          "first_divergence_token": result.first_divergence_token})
    differing = [a["first_divergence_token"] for a in agreement if not a["identical"]]
    return {
        "original": f"the resolved base checkpoint in its own dtype ({dtype}), unquantized",
        "served": served,
        "prompts": len(agreement),
        "identical": sum(a["identical"] for a in agreement),
        # where answers part: early = the deployment changed what the model says, late = a detail
        "mean_first_divergence_token": statistics.fmean(differing) if differing else None,
        "rule": "reported, not judged: the effect of quantization and the deployment dtype, apart from speculation",
        "rows": agreement,
    }


def run_prompts(spec: TritonLLMClient, ar: TritonLLMClient | None, reference: Reference, prompts: list[Prompt],
                max_new_tokens: int, target: Target = Target()) -> list[dict[str, Any]]:
    """Interleave speculative and autoregressive requests; compute each HF reference."""
    rows = []
    for client in filter(None, (spec, ar)):  # warm-up: first requests pay one-off costs
        client.generate(target.request(prompts[0].text_input, 4), stream=target.stream)
    for i, (category, shown, prompt) in enumerate(tqdm(prompts, desc="verify", unit="prompt")):
        request = target.request(prompt, max_new_tokens)
        baseline = ar.generate(request, stream=True) if ar and i % 2 else None  # alternate who goes first
        served = spec.generate(request, stream=target.stream)
        if ar and not i % 2:
            baseline = ar.generate(request, stream=True)
        ref, parity = reference.check(prompt, served.text, max_new_tokens)
        text_tokens = len(ref.token_ids) if parity.match else _count_tokens(reference.tokenizer, served.text)
        tokens, accepted, forwards = served_counts(served.perf, text_tokens)
        ar_tokens = None
        if baseline is not None:
            same = baseline.text == served.text
            ar_tokens = served_counts(baseline.perf, text_tokens if same else _count_tokens(reference.tokenizer, baseline.text))[0]
        rows.append({
            "category": category, "shown": shown, **parity.as_dict(), "tokens": tokens, "perf": served.perf,
            "accepted_draft_tokens": accepted, "target_forwards": forwards,
            "acceptance_length": acceptance_length(accepted, forwards),
            "latency_s": served.latency_s, "ttft_s": served.time_to_first_chunk_s,
            "ar_latency_s": baseline.latency_s if baseline else None, "ar_tokens": ar_tokens,
            "ar_matches": baseline.text == served.text if baseline else None,
            "speedup": _speedup([(tokens, served.latency_s, ar_tokens, baseline.latency_s)]) if baseline else None,
        })
    return rows


def _count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


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
    from specdeploy.quantize.loader import rounds_activations

    return "exact" if dtype == "float64" or (dtype == "float32" and not rounds_activations(quant)) else "near-tie"


def _acceptance(rows: list[dict[str, Any]]) -> float:
    return acceptance_length(sum(r["accepted_draft_tokens"] for r in rows), sum(r["target_forwards"] for r in rows))


def _runs(rows: list[dict[str, Any]]) -> list[tuple[int, float, int | None, float | None]]:
    return [(r["tokens"], r["latency_s"], r["ar_tokens"], r["ar_latency_s"]) for r in rows if r["speedup"]]


def summarize(rows: list[dict[str, Any]], dtype: str, rule: str, near_tie: float | None,
              measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """The served report. `near_tie`: the limit where the rule is not exact; `measured`: its
    report where it was measured on the served model."""
    exact = rule == "exact"
    passed = [parity_holds(ParityResult(**{k: r[k] for k in ParityResult.__dataclass_fields__}), exact, near_tie) for r in rows]
    speedups = [r["speedup"] for r in rows if r["speedup"]]
    summary = {
        "prompts": len(rows),
        "dtype": dtype,
        "parity_rule": "exact" if exact else f"near-tie (margin <= {near_tie:.3g}{', measured' if measured else ''})",
        "exact_match_rate": sum(r["match"] for r in rows) / len(rows),
        "parity_ok": all(passed),
        "divergences": [{"prompt": r["shown"][:80], "token": r["first_divergence_token"], "margin": r["margin_at_divergence"]}
                        for r in rows if not r["match"]],
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
            summary[f"speedup_min_{category}"] = min(r["speedup"] for r in subset)
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
    lines.append(f"b. served ({summary['dtype']}): parity {'PASS' if summary['parity_ok'] else 'FAIL'} "
                 f"({summary['parity_rule']}; {summary['exact_match_rate']:.0%} identical{_margins(summary)}), "
                 f"acceptance length {summary['acceptance_length']:.2f}{speed}")
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
    return "; parted at margins " + ", ".join("none" if m is None else f"{m:.2f}" for m in margins)


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
        lines.append(f"| {r['category']} | {r['match']} | {r['first_divergence_token'] or '-'} | {margin} | "
                     f"{r['acceptance_length']:.2f} | {r['tokens']}{ar_tokens} | {speedup} |")
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
    ax.hist([r["acceptance_length"] for r in rows], bins=10)
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


def _model_dir(build: BuildDir) -> Path:
    """The checkpoint a TensorRT-LLM server loads: the quantized one, else the resolved base."""
    return build.path("quantized") if build.record("quantize") else build.path("base")


def verify(build: BuildDir, *, per_category: int = 4, max_new_tokens: int = 64, url: str | None = None,
           near_tie: float | None = None, baseline: bool = True, device: str = "auto", server: str = "cpu",
           route: str | None = None, phase: str = "all", served_file: str | Path | None = None) -> dict[str, Any]:
    """Run the checks; return the summary (also written to reports/, or reports_gpu/ for a
    TensorRT-LLM server). `near_tie` None: measured on the served model (CPU), NEAR_TIE (TensorRT-LLM).
    `phase`, `served_file`: TensorRT-LLM only (see _verify_trtllm)."""
    _check_sizes(per_category, max_new_tokens)
    if server == "trtllm":
        return _verify_trtllm(build, per_category=per_category, max_new_tokens=max_new_tokens, url=url,
                              near_tie=near_tie, device=device, route=route, phase=phase, served_file=served_file)
    if phase != "all":
        raise SpecDeployError(f"--phase {phase} is for --server trtllm", hint="the CPU server's checks run in one go")
    from specdeploy.triton.serve import TritonServer, start_together

    cpu_repo = build.path("triton_repo") / "cpu"
    if build.record("package") is None or not (cpu_repo / DEPLOYMENT).exists():
        raise SpecDeployError(f"no packaged repository in {build.root}", hint="run `make engine` (or `specdeploy package`) first")
    settings = {"per_category": per_category, "max_new_tokens": max_new_tokens, "url": url,
                "near_tie": "measured" if near_tie is None else near_tie}
    deployment = json.loads((cpu_repo / DEPLOYMENT).read_text())
    dtype = deployment["dtype"]
    reference = load_reference((cpu_repo / DEPLOYMENT).parent / deployment["model_dir"], dtype, device)
    quant = getattr(reference.model, "specdeploy_quant", {})
    prompts = load_prompts(per_category, reference.tokenizer)
    twin_dir = build.root / ".ar_repo" / "cpu"  # as deep as triton_repo/cpu: relative paths hold
    seconds: dict[str, float] = {}  # per report: what a verify run's time goes to
    with build.stage(STAGE, OUT, settings, consumes=("package",)) as tmp:
        start = time.perf_counter()
        with ExitStack() as stack:  # the servers stop before the in-process checks load their models
            servers = {}
            if url is None:
                servers["spec"] = TritonServer(cpu_repo, log_path=tmp / "tritonserver.log")
            if baseline:
                servers["ar"] = TritonServer(autoregressive_twin(cpu_repo, twin_dir), log_path=tmp / "tritonserver_ar.log")
            start_together(stack, servers)
            url = servers["spec"].grpc_url if url is None else url
            ar = None
            if baseline:
                ar = TritonLLMClient(servers["ar"].grpc_url)
                ar.wait_ready()
            spec = TritonLLMClient(url)
            spec.wait_ready()
            seconds["servers_start"] = time.perf_counter() - start
            rows = run_prompts(spec, ar, reference, prompts, max_new_tokens)
            seconds["served_and_reference"] = time.perf_counter() - start - seconds["servers_start"]
        shutil.rmtree(twin_dir.parent, ignore_errors=True)
        rule, limit, tie = parity_rule(dtype, quant), near_tie, None
        if rule != "exact":
            start = time.perf_counter()
            answers = [(prompt.text_input, row["served"]) for prompt, row in zip(prompts, rows)]
            limit, tie = near_tie_limit(reference, answers, max_new_tokens, round_tokens(deployment), near_tie)
            if tie:
                seconds["near_tie"] = time.perf_counter() - start
        summary = summarize(rows, dtype, rule, limit, measured=tie)
        ids = [reference.ids(p.text_input)[0].tolist() for p in prompts]
        del reference  # one model in memory at a time
        from specdeploy.models import checkpoint_dtype

        start = time.perf_counter()

        base = build.path("base")
        original = load_reference(base, checkpoint_dtype(base), device, role="original model")
        served = f"{dtype} CPU runtime on {quant.get('quant_algo') or 'unquantized'} weights"
        summary["fidelity"] = fidelity(original, prompts, rows, max_new_tokens, served, checkpoint_dtype(base))
        del original
        seconds["fidelity"], start = time.perf_counter() - start, time.perf_counter()
        summary["exactness"] = speculative_exactness(cpu_repo / DEPLOYMENT, ids, max_new_tokens, device)
        seconds["exactness"] = time.perf_counter() - start
        summary["seconds"] = {name: round(value, 3) for name, value in seconds.items()}
        write_reports(tmp, summary, rows)
    return summary


def _check_sizes(per_category: int, max_new_tokens: int) -> None:
    """Refuse a run with nothing to judge: its reports would divide by no prompts or tokens."""
    for option, value, what in (("--prompts", per_category, "prompts per category (chat, code)"),
                                ("--max-new-tokens", max_new_tokens, "tokens an answer may have")):
        if value < 1:
            raise SpecDeployError(f"{option} must be at least 1, got {value}", hint=f"it is the number of {what}")


def _verify_trtllm(build: BuildDir, *, per_category: int, max_new_tokens: int, url: str | None, near_tie: float | None,
                   device: str, route: str | None, phase: str = "all", served_file: str | Path | None = None) -> dict[str, Any]:
    """Against a TensorRT-LLM server: float32 reference on `device`, the near-tie rule (NEAR_TIE
    unless given: the server's own rounding cannot be measured from here).

    `phase` "served" asks the server and writes its answers to `served_file` (default
    <build>/reports_gpu_served.json) without loading a model; "reference" reads that file and
    computes the reference without a server, so the caller can stop the server in between;
    "all" does both in one go, the server still up. Returns the summary (phase "served": what it wrote)."""
    if phase not in TRTLLM_PHASES:
        raise SpecDeployError(f"unknown verify phase {phase!r}", hint=f"use {', '.join(TRTLLM_PHASES)}")
    path = Path(served_file) if served_file else build.root / GPU_SERVED
    if phase == "reference":
        served = _read_served(path)
    else:
        served = _ask_trtllm(build, per_category=per_category, max_new_tokens=max_new_tokens, url=url, route=route)
        atomic_write_json(path, served)
        if phase == "served":
            return served
    return _trtllm_reference(build, served, NEAR_TIE if near_tie is None else near_tie, device)


def _ask_trtllm(build: BuildDir, *, per_category: int, max_new_tokens: int, url: str | None,
                route: str | None) -> dict[str, Any]:
    """The served phase: the prompts, the server's answers and perf counters (the tokenizer only:
    no model competes with the server for the GPU)."""
    from specdeploy.models import load_tokenizer
    from specdeploy.triton.package import gpu_routes

    if url is None:
        raise SpecDeployError("--server trtllm needs --url (the gRPC address of the TensorRT-LLM Triton server)",
                              hint="build_scripts/gpu_host.sh build/<name> starts one and passes it")
    routes = gpu_routes(build)
    target = trtllm_target(routes, route)
    route = route or routes["recommended"]
    prompts = load_prompts(per_category, load_tokenizer(_model_dir(build)))
    client = TritonLLMClient(url, model=target.model)
    client.wait_ready(timeout_s=600)
    client.generate(target.request(prompts[0].text_input, 4), stream=target.stream)  # warm-up: one-off costs
    answers = []
    for category, shown, text_input in tqdm(prompts, desc="served", unit="prompt"):
        done = client.generate(target.request(text_input, max_new_tokens), stream=target.stream)
        answers.append({"category": category, "shown": shown, "text_input": text_input, "served": done.text,
                        "perf": done.perf, "latency_s": done.latency_s, "ttft_s": done.time_to_first_chunk_s})
    return {"server": f"TensorRT-LLM {routes['trtllm_version']} ({route} route, {target.model})", "url": url,
            "route": route, "model": target.model, "per_category": per_category, "max_new_tokens": max_new_tokens,
            "prompts": answers}


def _read_served(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise SpecDeployError(f"{path} not found: the reference phase reads the served phase's answers",
                              hint="run `specdeploy verify --server trtllm --phase served --url HOST:PORT` first "
                                   "(or pass --served-file)")
    return json.loads(path.read_text())


def _trtllm_reference(build: BuildDir, served: dict[str, Any], near_tie: float, device: str) -> dict[str, Any]:
    """The reference phase: each served answer against the float32 reference, reports_gpu/."""
    max_new_tokens = served["max_new_tokens"]
    settings = {key: served[key] for key in ("per_category", "max_new_tokens", "url", "route", "model")}
    settings["near_tie"] = near_tie
    reference = load_reference(_model_dir(build), "float32", device)
    with build.stage(GPU_STAGE, GPU_OUT, settings, consumes=("package",)) as tmp:
        rows = [_trtllm_row(reference, answer, max_new_tokens)
                for answer in tqdm(served["prompts"], desc="reference", unit="prompt")]
        summary = {"server": served["server"],
                   **summarize(rows, "float32 reference; TensorRT-LLM serves bf16/fp16 or FP8", "near-tie", near_tie)}
        atomic_write_json(tmp / "served.json", served)  # what the server answered, beside what it was judged by
        write_reports(tmp, summary, rows)
    return summary


def _trtllm_row(reference: Reference, answer: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """One served answer judged: run_prompts' row, without an AR twin."""
    ref, parity = reference.check(answer["text_input"], answer["served"], max_new_tokens)
    text_tokens = len(ref.token_ids) if parity.match else _count_tokens(reference.tokenizer, answer["served"])
    tokens, accepted, forwards = served_counts(answer["perf"], text_tokens)
    return {"category": answer["category"], "shown": answer["shown"], **parity.as_dict(), "tokens": tokens,
            "perf": answer["perf"], "accepted_draft_tokens": accepted, "target_forwards": forwards,
            "acceptance_length": acceptance_length(accepted, forwards), "latency_s": answer["latency_s"],
            "ttft_s": answer["ttft_s"], "ar_latency_s": None, "ar_tokens": None, "ar_matches": None, "speedup": None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    add_device_arg(parser)  # where the Hugging Face reference computes
    parser.add_argument("--url", help="use a running server (gRPC host:port) instead of starting one")
    parser.add_argument("--server", choices=["cpu", "trtllm"], default="cpu",
                        help="cpu (default): the CPU repository (exact parity where the dtype allows); trtllm: a TensorRT-LLM "
                             "deployment at --url (reference in float32 on --device, near-tie rule)")
    parser.add_argument("--route", choices=["engine", "llmapi"],
                        help="--server trtllm: the GPU route served (default: the one gpu_routes.json recommends)")
    parser.add_argument("--phase", choices=TRTLLM_PHASES, default="all",
                        help="--server trtllm: served (ask the server, write its answers to --served-file; loads no "
                             "model), reference (judge that file; needs no server: run it after the server stopped, so "
                             "the reference does not compete with TensorRT-LLM's KV cache for the GPU), all (default: "
                             "both in one go, the server still up)")
    parser.add_argument("--served-file",
                        help=f"--server trtllm: the served phase's answers (default <build>/{GPU_SERVED}); the reference "
                             "phase takes prompts, max tokens and route from it")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per category (chat, code); default 4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--near-tie", type=float,
                        help="where parity cannot be exact (bf16; fp32 with quantized activations; any TensorRT-LLM server): "
                             "a divergence passes when the reference's top-2 logit margin there is <= this. Default: on the "
                             "CPU deployment, measured (the p99 of how far the served model's own rounding moves a margin "
                             f"between one forward and a verify round's shape, within [{NEAR_TIE:g}, {NEAR_TIE_CAP:g}]); "
                             f"{NEAR_TIE:g} for TensorRT-LLM")
    parser.add_argument("--no-baseline", action="store_true", help="skip the autoregressive twin (no speed-up figure)")
    parser.add_argument("--ar-lower-bound", type=float, help="fail when the acceptance length is below this")


def main(args: argparse.Namespace) -> int:
    build = build_from_args(args)
    summary = verify(build, per_category=args.prompts, max_new_tokens=args.max_new_tokens, url=args.url,
                     near_tie=args.near_tie, baseline=not args.no_baseline, device=args.device, server=args.server,
                     route=args.route, phase=args.phase, served_file=args.served_file)
    if args.server == "trtllm" and args.phase == "served":
        print(f"{len(summary['prompts'])} served answers of {summary['server']}: "
              f"{args.served_file or build.root / GPU_SERVED}; judge them with --phase reference")
        return 0
    for key, value in _flat(summary).items():
        print(f"{key:>28}: {value:.3f}" if isinstance(value, float) else f"{key:>28}: {value}")
    print("\n".join(headlines(summary)))
    if summary.get("seconds"):
        print("time (s): " + ", ".join(f"{name.replace('_', ' ')} {value:.0f}" for name, value in summary["seconds"].items()))
    for d in summary["divergences"]:
        print(f"  divergence at token {d['token']} (margin {d['margin']}): {d['prompt']!r}")
    out = build.path(GPU_OUT if args.server == "trtllm" else OUT)
    print(f"reports: {out}/verify.json, verify.md, acceptance_length.png" + (", speedup.png" if summary["speedup"] else ""))
    if summary["parity_rule"] != "exact" and args.server == "cpu":
        print(f"note: served {summary['dtype']} cannot be exact, so its divergences are judged by the near-tie rule; "
              "report a. is the exact check (float64, in-process, the same deployment)")
    failed = not summary["parity_ok"]
    if summary.get("exactness") and not summary["exactness"]["ok"]:
        print("FAIL: speculative decoding changed the greedy output in float64 (report a.): a bug in speculation")
        failed = True
    if args.ar_lower_bound is not None and summary["acceptance_length"] < args.ar_lower_bound:
        print(f"FAIL: acceptance length {summary['acceptance_length']:.2f} < --ar-lower-bound {args.ar_lower_bound}")
        failed = True
    if not summary["parity_ok"]:
        print("FAIL: served output differs from the Hugging Face reference (see divergences above)")
    return 1 if failed else 0
