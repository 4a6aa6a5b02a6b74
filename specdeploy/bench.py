"""`specdeploy bench` / `make bench`: the runtime's autoregressive and speculative decoding
against Hugging Face assisted generation, on the same model pair and prompts, in one run.

Methods are interleaved prompt by prompt (each prompt runs every method, in an order rotated per
prompt), so a noisy, shared machine slows all of them alike rather than whichever ran last.
Speculative rows are proposers of the runtime (SPEC_ROWS): a Medusa/EAGLE row takes the module
`make engine` trained for the model under --build-root, or one given with --spec-dir kind=path:

    make bench BENCH_ARGS="--model smollm2-135m --methods ar,ngram,hf-lookup,eagle --prompts sharegpt"
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specdeploy.device import add_device_arg, announce, fast_dtype, resolve_device
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json
from specdeploy.runtime.decoding import eos_token_ids, generate
from specdeploy.runtime.deployment import DRAFT_OPTIONS
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import SamplingParams, acceptance_length, model_device

# speculative row -> the HF method it is compared with (None: HF has no counterpart)
SPEC_ROWS: dict[str, str | None] = {"draft": "hf-assisted", "ngram": "hf-lookup", "medusa": None, "eagle": None,
                                    "dflash": None}
HF_ROWS = ("hf-assisted", "hf-lookup", "hf-ar")
MODULE_ROWS = ("medusa", "eagle", "dflash")  # the rows whose proposer is a trained module (--spec-dir)
DEFAULT_METHODS = "ar,draft,ngram,hf-assisted,hf-lookup"
ACCEPTANCE_LENGTH = ("acceptance length: (accepted draft tokens + 1 per target forward) / target forwards, "
                     "prefill not counted, summed over prompts (TensorRT-LLM's definition; 1.00 = plain decoding)")


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    target_forwards: int | None = None  # known for the runtime's own methods
    accepted_draft_tokens: int | None = None


@dataclass
class Bench:
    """Everything a method needs: loaded models and per-method settings."""

    target: Any
    draft: Any | None
    max_new_tokens: int
    draft_len: int | None = None
    spec_dirs: dict[str, str] = field(default_factory=dict)
    lookup_tokens: int = 10
    adaptive: bool = False  # the runtime's fallback to plain decoding; deployments speculate every step
    tokenizer: Any = None  # needed by draft_shape "auto" (its calibration prompts)
    draft_shape: str = "fixed"  # "auto": each speculative row drafts the shape the planner picks
    plans: dict[str, dict] = field(default_factory=dict)
    draft_options: dict[str, Any] = field(default_factory=dict)  # how the draft row drafts (proposers/draft.py)

    def __post_init__(self) -> None:
        from specdeploy.checkpoints import plain_greedy

        for model in (self.target, self.draft):  # Hugging Face's rows decode what the runtime's do: plain argmax
            if model is not None:
                plain_greedy(model)

    def runner(self, method: str) -> Callable[[list[int]], Run]:
        if method == "ar":
            return self._runtime(None, None)
        if method in SPEC_ROWS:
            return self._runtime(*self._shaped(method))
        if method in HF_ROWS:
            return self._hf(method)
        known = ", ".join(["ar", *SPEC_ROWS, *HF_ROWS])
        raise SpecDeployError(f"unknown bench method {method!r}", hint=f"methods: {known}")

    def _proposer(self, kind: str):
        if kind == "draft":
            return build_proposer("draft", self.target, draft_model=self._need_draft(), **self.draft_options)
        if kind == "ngram":
            return build_proposer("ngram", self.target)
        if kind not in self.spec_dirs:
            raise SpecDeployError(f"the {kind} row needs its trained module", hint=f"pass --spec-dir {kind}=PATH")
        return build_proposer(kind, self.target, spec_dir=self.spec_dirs[kind], max_draft_len=self.draft_len)

    def _shaped(self, kind: str) -> tuple[Any, int | None]:
        """The row's proposer and draft length: fixed, or the planner's choice for this machine
        (calibrated on held-out prompts, never the benchmark's own)."""
        proposer = self._proposer(kind)
        if self.draft_shape != "auto":
            return proposer, self.draft_len
        from specdeploy.runtime.decoding import DEFAULT_DRAFT_LEN
        from specdeploy.runtime.planner import calibration_prompts, choose_draft_shape, describe

        plan = choose_draft_shape(self.target, proposer, calibration_prompts(self.tokenizer),
                                  max_len=self.draft_len or DEFAULT_DRAFT_LEN)
        self.plans[kind] = plan.as_dict()
        _log(f"{kind}: {describe(plan)}")
        return (proposer, plan.shape.size) if plan.shape is not None else (None, None)

    def _need_draft(self) -> Any:
        if self.draft is None:
            raise SpecDeployError("this method needs a draft model", hint="pass --draft")
        return self.draft

    def _runtime(self, proposer, draft_len: int | None) -> Callable[[list[int]], Run]:
        params = SamplingParams(max_new_tokens=self.max_new_tokens)

        def run(ids: list[int]) -> Run:
            start = time.perf_counter()
            result = generate(self.target, ids, params, proposer, draft_len=draft_len, adaptive=self.adaptive)
            metrics = result.metrics
            return Run(result.token_ids, time.perf_counter() - start, metrics.target_forwards, metrics.accepted_draft_tokens)

        return run

    def _hf(self, method: str) -> Callable[[list[int]], Run]:
        from transformers import GenerationConfig

        # the models' own generation_config is plain (__post_init__): only what is set here applies
        config = GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(eos_token_ids(self.target)) or None,
            pad_token_id=self.target.config.pad_token_id or 0,
            prompt_lookup_num_tokens=self.lookup_tokens if method == "hf-lookup" else None,
        )
        extra = {"assistant_model": self._need_draft()} if method == "hf-assisted" else {}

        def run(ids: list[int]) -> Run:
            inputs = torch.tensor([ids], device=model_device(self.target))
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.target.generate(
                    inputs, attention_mask=torch.ones_like(inputs), generation_config=config, **extra
                )
            return Run(out[0, len(ids) :].tolist(), time.perf_counter() - start)

        return run


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def divergence(target: Any, ids: list[int], reference: list[int], other: list[int]) -> dict | None:
    """Where `other` first leaves the AR output, and the target's logit margin there between the
    two tokens (a plain forward, AR numerics): reduced-precision drift should sit at near-ties."""
    position = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if position is None:
        return None
    with torch.inference_mode():
        inputs = torch.tensor([ids + reference[:position]], device=model_device(target))
        logits = target(input_ids=inputs, logits_to_keep=1).logits[0, -1]
    margin = float(logits[reference[position]] - logits[other[position]])
    return {"position": position, "logit_margin": margin}


def _record(bench: Bench, index: int, ids: list[int], runs: dict[str, Run]) -> dict:
    ar = runs["ar"].tokens
    return {
        "prompt": index,
        "prompt_tokens": len(ids),
        "runs": {
            m: {
                "new_tokens": len(r.tokens),
                "seconds": r.seconds,
                "tokens_per_s": _rate(len(r.tokens), r.seconds),
                "target_forwards": r.target_forwards,
                "accepted_draft_tokens": r.accepted_draft_tokens,
                "same_as_ar": r.tokens == ar,
                "divergence": divergence(bench.target, ids, ar, r.tokens),
            }
            for m, r in runs.items()
        },
    }


def _log(message: str) -> None:
    print(message, flush=True)


def run_bench(bench: Bench, prompts: list[list[int]], methods: list[str], *, log: Callable[[str], None] = _log) -> dict:
    """Run every method on every prompt (interleaved); per-prompt records and per-method summary.
    Autoregressive decoding ("ar") always runs: every speed-up and match is relative to it."""
    methods = methods if "ar" in methods else ["ar", *methods]
    runners = {m: bench.runner(m) for m in methods}
    for method, run in runners.items():  # first calls pay for allocation and lazy imports
        log(f"warm-up: {method}")
        run(prompts[0][:16])
    records = []
    for i, ids in enumerate(prompts):
        order = methods[i % len(methods) :] + methods[: i % len(methods)]
        records.append(_record(bench, i, ids, {m: runners[m](ids) for m in order}))
        log(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{m} {records[-1]['runs'][m]['tokens_per_s']:.2f} tok/s" for m in order))
    return {"methods": summarize(records, methods), "prompts": records, "definitions": {"acceptance_length": ACCEPTANCE_LENGTH}}


def summarize(records: list[dict], methods: list[str]) -> dict[str, dict]:
    totals = {}
    for m in methods:
        tokens = sum(r["runs"][m]["new_tokens"] for r in records)
        seconds = sum(r["runs"][m]["seconds"] for r in records)
        forwards = [r["runs"][m]["target_forwards"] for r in records]
        accepted = [r["runs"][m]["accepted_draft_tokens"] for r in records]
        known = None not in forwards and None not in accepted  # the runtime's own rows
        totals[m] = {
            "tokens_per_s": _rate(tokens, seconds),
            "acceptance_length": acceptance_length(sum(accepted), sum(forwards)) if known else None,
        }
    for m in methods:
        summary = totals[m]
        if m != "ar":
            ratios = [r["runs"][m]["tokens_per_s"] / r["runs"]["ar"]["tokens_per_s"] for r in records]
            summary["speedup_vs_ar"] = summary["tokens_per_s"] / totals["ar"]["tokens_per_s"]
            summary["worst_prompt_vs_ar"] = min(ratios)
            summary["same_as_ar"] = sum(r["runs"][m]["same_as_ar"] for r in records) / len(records)
            margins = [abs(r["runs"][m]["divergence"]["logit_margin"]) for r in records if r["runs"][m]["divergence"]]
            summary["max_divergence_margin"] = max(margins, default=None)
        hf = SPEC_ROWS.get(m)
        if hf in totals:
            summary["speedup_vs_hf"] = summary["tokens_per_s"] / totals[hf]["tokens_per_s"]
    return totals


def print_table(summary: dict[str, dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    caption = f"accept len = {ACCEPTANCE_LENGTH}\nmax margin: largest target logit gap where an output left AR's (near 0: a tie)"
    table = Table(title=title, caption=caption)
    for column in ("method", "tok/s", "vs AR", "vs HF", "worst vs AR", "accept len", "= AR", "max margin"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for method, s in summary.items():
        table.add_row(
            method,
            fmt(s["tokens_per_s"], ".2f"),
            fmt(s.get("speedup_vs_ar"), ".2f") + ("x" if "speedup_vs_ar" in s else ""),
            fmt(s.get("speedup_vs_hf"), ".2f") + ("x" if "speedup_vs_hf" in s else ""),
            fmt(s.get("worst_prompt_vs_ar"), ".2f"),
            fmt(s.get("acceptance_length"), ".2f"),
            fmt(s.get("same_as_ar"), ".0%"),
            fmt(s.get("max_divergence_margin"), ".3f"),
        )
    Console().print(table)


def prompt_texts(source: str, n: int) -> list[str]:
    from specdeploy import data

    return data.humaneval_prompts(n) if source == "humaneval" else data.sharegpt_prompts(n, "heldout", max_chars=2000)


def load_prompts(source: str, n: int, tokenizer: Any, chat: bool) -> list[list[int]]:
    from specdeploy.prompts import chat_ids, text_ids

    return [chat_ids(tokenizer, t) if chat else text_ids(tokenizer, t) for t in prompt_texts(source, n)]


def trained_modules(build_root: Path, model: str) -> dict[str, str]:
    """kind -> spec/ folder of the Medusa/EAGLE modules `make engine` trained for `model` under
    build_root (the newest build per kind), so that their rows need no --spec-dir."""
    found = {}
    for manifest in sorted(build_root.glob("*/manifest.json"), key=lambda path: path.stat().st_mtime):
        stages = json.loads(manifest.read_text()).get("stages", {})
        config = manifest.parent / "spec" / "spec_config.json"
        if "spec" in stages and config.exists() and stages.get("resolve", {}).get("settings", {}).get("model") == model:
            found[json.loads(config.read_text())["kind"]] = str(config.parent)
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="target: HF folder, .gguf or bundled name")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model sharing the target's tokenizer")
    parser.add_argument("--dtype", default="native", choices=["native", "float32", "bfloat16", "float16"],
                        help="native (default): bfloat16 where the device computes it natively, else float32")
    parser.add_argument("--prompts", default="humaneval", choices=["humaneval", "sharegpt"])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap prompts in the chat template (default: for sharegpt only)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-len", type=int, help="most draft tokens per round (default: the runtime's)")
    parser.add_argument("--draft-shape", choices=["fixed", "auto"], default="fixed",
                        help="auto: each speculative row drafts the chain length / tree size the runtime's planner "
                             "picks for this machine (calibrated on held-out prompts before the run)")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help=f"comma-separated, from ar, {', '.join(SPEC_ROWS)}, {', '.join(HF_ROWS)}")
    parser.add_argument("--draft-option", action="append", default=[], metavar="KEY=VALUE",
                        help="how the runtime's draft row drafts, repeatable: head_rows=N (greedy top-1 over N common "
                             "ids + the request's own tokens), stop_below=P (end a draft at a token the draft gives "
                             "< P), draft_quant=int8 (dynamic int8 draft weights, CPU). Default: stop_below=0.4, "
                             "plus draft_quant=int8 on a CPU")
    parser.add_argument("--spec-dir", action="append", default=[], metavar="KIND=PATH",
                        help="trained module for a medusa/eagle row (repeatable; default: the newest one "
                             "`make engine` trained for --model under --build-root)")
    parser.add_argument("--adaptive", action="store_true",
                        help="let the runtime fall back to plain decoding while speculation does not pay "
                             "(default: speculate every step, as the deployments do)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    add_device_arg(parser)
    parser.add_argument("--build-root", default="build", help="results go to <build-root>/bench/ unless --out")
    parser.add_argument("--out", help="JSON results path")
    parser.add_argument("--served", metavar="BUILD_DIR",
                        help="instead: the packaged deployment of BUILD_DIR served by tritonserver (gRPC streaming) "
                             "vs the same deployment in-process, same prompts and thread count")


def default_draft_options(device: torch.device) -> dict[str, Any]:
    """The draft row's drafting unless --draft-option says: HF assisted generation's confidence
    stop (0.4), and on a CPU an int8 draft (a Qwen2.5-Coder 0.5B step ~3x faster than bf16 here;
    the target still verifies every token, so the output does not change)."""
    return {"stop_below": 0.4, **({"draft_quant": "int8"} if device.type == "cpu" else {})}


def draft_options(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE strings -> options (numbers parsed), checked against what the draft proposer takes."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in DRAFT_OPTIONS:
            raise SpecDeployError(f"bad --draft-option {item!r}", hint=f"use KEY=VALUE with KEY one of {', '.join(DRAFT_OPTIONS)}")
        for parse in (int, float, str):
            try:
                options[key] = parse(value)
                break
            except ValueError:
                continue
    return options


def given_modules(items: list[str]) -> dict[str, str]:
    """--spec-dir KIND=PATH strings -> kind -> folder."""
    modules = {}
    for item in items:
        kind, sep, path = item.partition("=")
        if not sep or kind not in MODULE_ROWS or not path:
            raise SpecDeployError(f"bad --spec-dir {item!r}", hint=f"use KIND=PATH with KIND one of {', '.join(MODULE_ROWS)}")
        modules[kind] = path
    return modules


def bench_served(args: argparse.Namespace) -> int:
    """Served rows: is Triton adding overhead to the runtime? (tokens/s, time to first token)."""
    from rich.console import Console
    from rich.table import Table

    from specdeploy.triton.measure import compare_served_inprocess

    build_dir = Path(args.served)
    repo = build_dir / "triton_repo" / "cpu"
    result = compare_served_inprocess(repo, prompt_texts(args.prompts, args.num_prompts), args.max_new_tokens, threads=args.threads)
    result["machine"] = {"cpu_count": os.cpu_count(), "loadavg_after": os.getloadavg()}
    out = Path(args.out) if args.out else Path(args.build_root) / "bench" / f"served-{build_dir.name}.json"
    atomic_write_json(out, result)
    table = Table(title=f"{build_dir.name}: served vs in-process, {args.num_prompts} {args.prompts} prompts, {args.threads} thread(s)")
    for column in ("row", "tok/s", "ttft median s", "latency median s"):
        table.add_column(column)
    for row in ("served", "inprocess"):
        r = result[row]
        table.add_row(row, f"{r['tokens_per_s']:.2f}", f"{r['ttft_median_s']:.3f}", f"{r['latency_median_s']:.3f}")
    Console().print(table)
    print(f"served / in-process tokens/s: {result['served_over_inprocess']:.2f}   results: {out}")
    return 0


def main(args: argparse.Namespace) -> int:
    from specdeploy.resolve import resolve_model_dir
    from specdeploy.runtime.deployment import load_model

    if args.num_prompts < 1:
        raise SpecDeployError(f"--num-prompts {args.num_prompts}: nothing to benchmark", hint="use 1 or more, e.g. 8")
    if args.served:
        return bench_served(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    options = draft_options(args.draft_option)  # bad input fails before any model loads
    spec_dirs = {**trained_modules(Path(args.build_root), args.model), **given_modules(args.spec_dir)}
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    args.dtype = fast_dtype(device) if args.dtype == "native" else args.dtype
    options = options if args.draft_option else default_draft_options(device)
    where = announce("bench", device)  # every row (the runtime's and Hugging Face's) runs there
    target, tokenizer = load_model(resolve_model_dir(args.model), args.dtype, device)
    needs_draft = {"draft", "hf-assisted"} & set(methods)
    draft = load_model(resolve_model_dir(args.draft), args.dtype, device)[0] if needs_draft else None
    chat = args.prompts == "sharegpt" if args.chat is None else args.chat
    prompts = load_prompts(args.prompts, args.num_prompts, tokenizer, chat)
    bench = Bench(target, draft, args.max_new_tokens, args.draft_len, spec_dirs, adaptive=args.adaptive,
                  tokenizer=tokenizer, draft_shape=args.draft_shape, draft_options=options)
    load_before = os.getloadavg()
    results = run_bench(bench, prompts, methods)
    results["plans"] = bench.plans
    results["settings"] = {**vars(args), "draft_options": options}
    results["machine"] = {"cpu_count": os.cpu_count(), "device": where, "loadavg_before": load_before,
                          "loadavg_after": os.getloadavg()}
    name = f"{Path(args.model).name}-{args.dtype}-{device.type}-{args.prompts}-{args.max_new_tokens}.json"
    out = Path(args.out) if args.out else Path(args.build_root) / "bench" / name
    atomic_write_json(out, results)
    pair = f"{args.model} + {args.draft}" if draft is not None else args.model
    if "draft" in methods and options:
        pair += " (draft row: " + ", ".join(f"{k}={v}" for k, v in options.items()) + ")"
    title = (f"{pair}, {args.dtype} on {where}, greedy, {len(prompts)} {args.prompts} prompts, {args.max_new_tokens} new tokens"
             + (", adaptive" if args.adaptive else "") + (", planned draft shapes" if args.draft_shape == "auto" else ""))
    print_table(results["methods"], title)
    print(f"results: {out}")
    return 0
