"""`make verify`: is the served output still the base model's, and is it faster?

Starts tritonserver on the packaged CPU repository (or uses a running one with --url), sends
held-out chat and code prompts through tritonclient (gRPC streaming), and compares every answer
with the Hugging Face reference: `transformers.generate(do_sample=False)` in-process on the very
weights and dtype the server loaded (for a quantized build, the same fake-quantized model). An
autoregressive twin of the deployment (same repository, speculation off) runs beside it, and the
two are asked the same prompts in alternation, so the speed-up is measured on one noisy machine
in one run.

Writes reports/verify.json, verify.md and two PNG plots; exits 1 when parity fails or the mean
acceptance length is under --ar-lower-bound. Parity is exact (any difference fails) where the
runtime can be exact: float64, or float32 without quantized activations/KV (see
quantize.rounds_activations); elsewhere a divergence passes only at a near-tie.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from specdeploy.client import Request, TritonLLMClient
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, atomic_write_text
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.parity import ParityResult, compare, hf_reference

STAGE, OUT = "verify", "reports"
DEPLOYMENT = Path("tensorrt_llm") / "1" / "deployment.json"


class Prompt(NamedTuple):
    category: str
    shown: str  # what the user wrote (reports show this, not the chat template around it)
    text_input: str  # what is sent


def load_prompts(per_category: int, tokenizer: Any) -> list[Prompt]:
    """Held-out ShareGPT chat turns in the model's chat template (as a chat client sends them; the
    module was trained on that format) and HumanEval code completions. Long pasted chat turns are
    left out: they measure prefill, not speculation."""
    from specdeploy.data import chat_text, humaneval_prompts, sharegpt_prompts

    chats = sharegpt_prompts(per_category, split="heldout", max_chars=800)
    return ([Prompt("chat", p, chat_text(tokenizer, p)) for p in chats]
            + [Prompt("code", p, p) for p in humaneval_prompts(per_category)])


def autoregressive_twin(cpu_repo: Path, out: Path) -> Path:
    """A copy of the CPU repository whose deployment does not speculate (absolute paths)."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(cpu_repo, out, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    deployment_dir = (cpu_repo / DEPLOYMENT).parent.resolve()
    config = json.loads((cpu_repo / DEPLOYMENT).read_text())
    config["model_dir"] = str((deployment_dir / config["model_dir"]).resolve())
    config["spec"] = {"kind": "none"}
    atomic_write_json(out / DEPLOYMENT, config)
    return out


def _acceptance_length(tokens: int, perf: dict[str, float]) -> float:
    """Tokens per target forward: each forward yields its accepted drafts plus one token."""
    accepted = int(perf.get("total_accepted_draft_tokens", 0))
    return tokens / max(tokens - accepted, 1)


def _passes(result: ParityResult, exact: bool, near_tie: float) -> bool:
    if result.match:
        return True
    if exact or result.margin_at_divergence is None:
        return False
    return result.margin_at_divergence <= near_tie


def run_prompts(spec: TritonLLMClient, ar: TritonLLMClient | None, decoder: Any, prompts: list[Prompt],
                max_new_tokens: int) -> list[dict[str, Any]]:
    """Interleave speculative and autoregressive requests; compute each HF reference."""
    rows = []
    for client in filter(None, (spec, ar)):  # warm-up: first requests pay one-off costs
        client.generate(Request(prompts[0].text_input, max_tokens=4), stream=True)
    for i, (category, shown, prompt) in enumerate(tqdm(prompts, desc="verify", unit="prompt")):
        request = Request(prompt, max_tokens=max_new_tokens)
        baseline = ar.generate(request, stream=True) if ar and i % 2 else None  # alternate who goes first
        served = spec.generate(request, stream=True)
        if ar and not i % 2:
            baseline = ar.generate(request, stream=True)
        ids = torch.tensor([decoder.encode(prompt)])
        reference = hf_reference(decoder.target, decoder.tokenizer, ids, max_new_tokens)
        parity = compare(prompt, reference, served.text, decoder.tokenizer)
        tokens = len(reference.token_ids) if parity.match else len(decoder.tokenizer(served.text, add_special_tokens=False)["input_ids"])
        rows.append({
            "category": category, "shown": shown, **parity.as_dict(), "tokens": tokens, "perf": served.perf,
            "acceptance_length": _acceptance_length(tokens, served.perf),
            "latency_s": served.latency_s, "ttft_s": served.time_to_first_chunk_s,
            "ar_latency_s": baseline.latency_s if baseline else None,
            "ar_matches": baseline.text == served.text if baseline else None,
            "speedup": baseline.latency_s / served.latency_s if baseline and served.latency_s > 0 else None,
        })
    return rows


def parity_rule(dtype: str, quant: dict[str, Any]) -> str:
    """"exact" where speculative greedy decoding can equal the reference token for token."""
    from specdeploy.quantize import rounds_activations

    return "exact" if dtype == "float64" or (dtype == "float32" and not rounds_activations(quant)) else "near-tie"


def summarize(rows: list[dict[str, Any]], dtype: str, rule: str, near_tie: float) -> dict[str, Any]:
    exact = rule == "exact"
    passed = [_passes(ParityResult(**{k: r[k] for k in ParityResult.__dataclass_fields__}), exact, near_tie) for r in rows]
    speedups = [r["speedup"] for r in rows if r["speedup"]]
    summary = {
        "prompts": len(rows),
        "dtype": dtype,
        "parity_rule": "exact" if exact else f"near-tie (margin <= {near_tie})",
        "exact_match_rate": sum(r["match"] for r in rows) / len(rows),
        "parity_ok": all(passed),
        "divergences": [{"prompt": r["shown"][:80], "token": r["first_divergence_token"], "margin": r["margin_at_divergence"]}
                        for r in rows if not r["match"]],
        "acceptance_length": statistics.fmean(r["acceptance_length"] for r in rows),
        # total time over total time: one slow prompt weighs as much as its share of the work
        "speedup": sum(r["ar_latency_s"] for r in rows) / sum(r["latency_s"] for r in rows) if speedups else None,
        "speedup_min": min(speedups) if speedups else None,
        "served_tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["latency_s"] for r in rows),
        "ttft_s_median": statistics.median(r["ttft_s"] for r in rows),
    }
    for category in sorted({r["category"] for r in rows}):
        subset = [r for r in rows if r["category"] == category]
        summary[f"acceptance_length_{category}"] = statistics.fmean(r["acceptance_length"] for r in subset)
    return summary


def write_reports(out: Path, summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    atomic_write_json(out / "verify.json", {"summary": summary, "prompts": rows})
    lines = ["# specdeploy verify", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in summary.items() if k != "divergences"]
    lines += ["", "## Per prompt", "", "| category | match | first divergence | margin | accept len | speed-up |", "|---|---|---|---|---|---|"]
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        margin = f"{r['margin_at_divergence']:.3f}" if r["margin_at_divergence"] is not None else "-"
        lines.append(f"| {r['category']} | {r['match']} | {r['first_divergence_token'] or '-'} | {margin} | {r['acceptance_length']:.2f} | {speedup} |")
    atomic_write_text(out / "verify.md", "\n".join(lines) + "\n")
    _plots(out, rows)


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


def verify(build: BuildDir, *, per_category: int = 4, max_new_tokens: int = 64, url: str | None = None,
           near_tie: float = 1.0, baseline: bool = True) -> dict[str, Any]:
    """Run the checks; return the summary (also written to reports/)."""
    from specdeploy.runtime.deployment import load_decoder
    from specdeploy.triton.serve import TritonServer

    cpu_repo = build.path("triton_repo") / "cpu"
    if build.record("package") is None or not (cpu_repo / DEPLOYMENT).exists():
        raise SpecDeployError(f"no packaged repository in {build.root}", hint="run `make engine` (or `specdeploy package`) first")
    settings = {"per_category": per_category, "max_new_tokens": max_new_tokens, "url": url, "near_tie": near_tie}
    decoder = load_decoder(cpu_repo / DEPLOYMENT)
    prompts = load_prompts(per_category, decoder.tokenizer)
    dtype = json.loads((cpu_repo / DEPLOYMENT).read_text())["dtype"]
    with build.stage(STAGE, OUT, settings, consumes=("package",)) as tmp, ExitStack() as servers:
        if url is None:
            url = servers.enter_context(TritonServer(cpu_repo, log_path=tmp / "tritonserver.log")).grpc_url
        ar = None
        if baseline:
            twin = autoregressive_twin(cpu_repo, build.root / ".ar_repo")
            ar_server = servers.enter_context(TritonServer(twin, log_path=tmp / "tritonserver_ar.log"))
            ar = TritonLLMClient(ar_server.grpc_url)
            ar.wait_ready()
        spec = TritonLLMClient(url)
        spec.wait_ready()
        rows = run_prompts(spec, ar, decoder, prompts, max_new_tokens)
        summary = summarize(rows, dtype, parity_rule(dtype, getattr(decoder.target, "specdeploy_quant", {})), near_tie)
        write_reports(tmp, summary, rows)
    shutil.rmtree(build.root / ".ar_repo", ignore_errors=True)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    parser.add_argument("--url", help="use a running server (gRPC host:port) instead of starting one")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per category (chat, code); default 4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--near-tie", type=float, default=1.0,
                        help="where parity cannot be exact (bf16; fp32 with quantized activations): a divergence "
                             "passes when the reference's top-2 logit margin there is <= this")
    parser.add_argument("--no-baseline", action="store_true", help="skip the autoregressive twin (no speed-up figure)")
    parser.add_argument("--ar-lower-bound", type=float, help="fail when the mean acceptance length is below this")


def main(args: argparse.Namespace) -> int:
    build = build_from_args(args)
    summary = verify(build, per_category=args.prompts, max_new_tokens=args.max_new_tokens, url=args.url,
                     near_tie=args.near_tie, baseline=not args.no_baseline)
    for key, value in summary.items():
        if key != "divergences":
            print(f"{key:>28}: {value:.3f}" if isinstance(value, float) else f"{key:>28}: {value}")
    for d in summary["divergences"]:
        print(f"  divergence at token {d['token']} (margin {d['margin']}): {d['prompt']!r}")
    print(f"reports: {build.path(OUT)}/verify.json, verify.md, acceptance_length.png, speedup.png")
    if summary["parity_rule"] != "exact":
        print(f"note: {summary['dtype']} cannot be exact here, divergences judged by the near-tie rule; "
              "package with --dtype auto (float64 when activations or K/V are quantized) for the exact check")
    failed = not summary["parity_ok"]
    if args.ar_lower_bound is not None and summary["acceptance_length"] < args.ar_lower_bound:
        print(f"FAIL: acceptance length {summary['acceptance_length']:.2f} < --ar-lower-bound {args.ar_lower_bound}")
        failed = True
    if not summary["parity_ok"]:
        print("FAIL: served output differs from the Hugging Face reference (see divergences above)")
    return 1 if failed else 0
