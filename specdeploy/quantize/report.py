"""The quality report (quantized/quantize.json + quantize.md): quantized vs unquantized on held-out
ShareGPT (never seen in calibration): perplexity, greedy agreement, and the speculative module's
acceptance length on the quantized base. Both models and the runtime run on the stage's device."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdeploy.prompts import chat_ids
from specdeploy.quantize.export import load_base
from specdeploy.checkpoints.quant_algos import FP4_ALGOS
from specdeploy.checkpoints.quantized import load_quantized, read_quant_config
from specdeploy.quantize.placement import Placement
from specdeploy.runtime.types import acceptance_length, model_device

CPU = Placement(torch.device("cpu"))


def report_prompts(tokenizer: Any, prompts: int, seed: int = 0) -> list[list[int]]:
    """The held-out prompts the greedy agreement and the acceptance length are measured on."""
    from specdeploy.data import sharegpt_prompts

    return [chat_ids(tokenizer, p) for p in sharegpt_prompts(prompts, split="heldout", seed=seed, max_chars=400)]


def greedy_tokens(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, proposer: Any = None) -> tuple[list[int], Any]:
    """Greedy continuation with the project's runtime; a proposer drafts every step (not
    adaptive), so the acceptance measured is the module's own."""
    from specdeploy.runtime.decoding import generate
    from specdeploy.runtime.types import SamplingParams

    result = generate(model, prompt_ids, SamplingParams(max_new_tokens=max_new_tokens), proposer, adaptive=False)
    return list(result.token_ids), result.metrics


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def perplexity(model: nn.Module, token_lists: list[list[int]]) -> float:
    """exp(mean next-token NLL) over all predicted tokens of the texts."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in token_lists:
            x = torch.tensor([ids], device=model_device(model))
            logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
            total += nn.functional.cross_entropy(logits, x[0, 1:].to(logits.device), reduction="sum").item()
            count += len(ids) - 1
    return math.exp(total / max(count, 1))


def token_agreement(base_answers: list[list[int]], quant_answers: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """How far the quantized model's greedy answers follow the base's, prompt by prompt."""
    rows = []
    for a, b in zip(base_answers, quant_answers):
        same = sum(x == y for x, y in zip(a, b))
        rows.append({"first_divergence": first_divergence(a, b), "length": min(len(a), len(b)),
                     "identical": a == b, "positional_match": same / max(min(len(a), len(b)), 1)})
    n = max(len(rows), 1)
    return {
        "prompts": len(rows),
        "max_new_tokens": max_new_tokens,
        "mean_first_divergence": sum(r["first_divergence"] for r in rows) / n,
        "identical_fraction": sum(r["identical"] for r in rows) / n,
        "mean_positional_match": sum(r["positional_match"] for r in rows) / n,
        "per_prompt": rows,
    }


def speculative_answers(target: nn.Module, spec_dir: Path | None, prompts: list[list[int]], max_new_tokens: int,
                        quant_spec_dir: Path | None = None, desc: str = "greedy answers") -> tuple[list[list[int]], dict[str, int]]:
    """Greedy answers of `target` with the module in spec_dir proposing (with the FP8 numerics of
    quant_spec_dir's module when given; n-gram lookup without a module), and its counts summed over
    the prompts: target forwards, draft tokens, accepted draft tokens. The answers are the target's
    greedy ones (speculation changes no token but at a near-tie of the verify's numerics), so one
    run gives both the agreement and the acceptance."""
    from tqdm import tqdm

    from specdeploy.checkpoints.modules import read_spec_config
    from specdeploy.quantize.spec_module import apply_spec_quantization
    from specdeploy.runtime.proposers import build_proposer

    if spec_dir is None:
        proposer = build_proposer("ngram", target)
    else:
        proposer = build_proposer(read_spec_config(spec_dir)["kind"], target, spec_dir=spec_dir)
    if quant_spec_dir is not None:
        apply_spec_quantization(proposer, quant_spec_dir)
    answers, counts = [], {"target_forwards": 0, "draft_tokens": 0, "accepted_draft_tokens": 0}
    for ids in tqdm(prompts, desc=desc, unit="prompt", leave=False):
        tokens, metrics = greedy_tokens(target, ids, max_new_tokens, proposer)
        answers.append(tokens)
        for key in counts:
            counts[key] += getattr(metrics, key)
    return answers, counts


def quality_report(base_dir: Path, quant_dir: Path, *, dtype: str = "bfloat16", prompts: int = 8,
                   max_new_tokens: int = 32, ppl_texts: int = 16, ppl_seq_len: int = 256,
                   spec_dir: Path | None = None, quant_spec_dir: Path | None = None, seed: int = 0,
                   placement: Placement = CPU, trust_remote_code: bool = False) -> dict[str, Any]:
    """Quantized vs unquantized on held-out ShareGPT (never seen in calibration), both in `dtype`
    where `placement` says."""
    from specdeploy.data import heldout_texts
    from specdeploy.checkpoints import load_tokenizer

    quant = read_quant_config(quant_dir)
    report: dict[str, Any] = {"quant_algo": quant.get("quant_algo"), "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
                              "dtype": dtype, "data": "sharegpt heldout split"}
    if quant.get("quant_algo") in FP4_ALGOS:
        report["skipped"] = (f"{quant['quant_algo']} is not served by specdeploy's fake-quant loader (dynamic FP4 block "
                             "quantization; ModelOpt's own needs CUDA): no quality figures")
        return report
    tokenizer = load_tokenizer(base_dir, trust_remote_code=trust_remote_code)
    prompt_ids = report_prompts(tokenizer, prompts, seed)
    texts = [tokenizer(t, add_special_tokens=False)["input_ids"][:ppl_seq_len] for t in heldout_texts(ppl_texts, seed=seed)]
    base = load_base(base_dir, dtype, placement, trust_remote_code)
    quantized = load_quantized(quant_dir, dtype, device=placement.device, device_map=placement.device_map,
                               trust_remote_code=trust_remote_code)
    started = time.time()
    ppl_base, ppl_quant = perplexity(base, texts), perplexity(quantized, texts)
    report["perplexity"] = {"base": ppl_base, "quantized": ppl_quant, "relative_change": ppl_quant / ppl_base - 1,
                            "texts": len(texts), "tokens": sum(len(t) - 1 for t in texts)}
    if spec_dir is not None and not (spec_dir / "spec_config.json").is_file():
        spec_dir = None  # a draft-model or n-gram build: measure with n-gram lookup
    base_answers, unquantized = speculative_answers(base, spec_dir, prompt_ids, max_new_tokens, desc="unquantized")
    quant_answers, on_quantized = speculative_answers(quantized, spec_dir, prompt_ids, max_new_tokens, quant_spec_dir,
                                                      desc="quantized")
    report["greedy_agreement"] = token_agreement(base_answers, quant_answers, max_new_tokens)
    report["acceptance_length"] = _acceptance_report(unquantized, on_quantized, spec_dir, quant_spec_dir)
    report["seconds"] = round(time.time() - started, 1)
    return report


def _acceptance_report(unquantized: dict[str, int], on_quantized: dict[str, int], spec_dir: Path | None,
                       quant_spec_dir: Path | None) -> dict[str, Any]:
    if spec_dir is None:
        proposer = "ngram (no Medusa/EAGLE module in this build)"
    else:
        proposer = f"{_spec_kind(spec_dir)} module ({'FP8' if quant_spec_dir else 'unquantized'} on the quantized base)"
    # runtime.types.acceptance_length: the project's one definition, from the summed counts
    before, after = (acceptance_length(c["accepted_draft_tokens"], c["target_forwards"]) for c in (unquantized, on_quantized))
    # the module's recorded draft shape; the package stage picks the shape the deployment serves
    per_round = unquantized["draft_tokens"] / max(unquantized["target_forwards"], 1)
    return {"unquantized_pair": before, "quantized_base": after, "proposer": proposer,
            "module": "quantized" if quant_spec_dir else "unquantized", "relative_change": after / before - 1,
            "draft_tokens_per_round": per_round,
            "definition": "(accepted draft tokens + target forwards) / target forwards, prefill not counted (TensorRT-LLM's)",
            "counts": {"unquantized_pair": unquantized, "quantized_base": on_quantized}}


def _spec_kind(spec_dir: Path) -> str:
    from specdeploy.checkpoints.modules import read_spec_config

    return read_spec_config(spec_dir)["kind"]


def report_markdown(report: dict[str, Any], settings: dict[str, Any]) -> str:
    lines = [f"# Quantization report: {settings.get('qformat')} (KV cache {settings.get('kv_cache')})", ""]
    if "skipped" in report:
        return "\n".join(lines + [f"Quality not measured: {report['skipped']}", ""])
    ppl, agree = report["perplexity"], report["greedy_agreement"]
    lines += [
        f"Calibration: {settings.get('calib_size')} ShareGPT train conversations x {settings.get('calib_seq_len')} tokens; "
        f"evaluation on the held-out split in {report['dtype']}.",
        *([f"Mixed precision: Linears matching {', '.join(settings['exclude'])} stay in {settings.get('dtype')} (--exclude)."]
          if settings.get("exclude") else []),
        "",
        "| metric | unquantized | quantized | change |",
        "|---|---|---|---|",
        f"| perplexity ({ppl['texts']} texts, {ppl['tokens']} tokens) | {ppl['base']:.3f} | {ppl['quantized']:.3f} | {100 * ppl['relative_change']:+.2f}% |",
        f"| greedy answers (as decoded with the module): mean first divergence ({agree['prompts']} prompts x {agree['max_new_tokens']} tokens) | - | {agree['mean_first_divergence']:.1f} | identical {100 * agree['identical_fraction']:.0f}% |",
    ]
    acc = report["acceptance_length"]
    shape = f"{acc['draft_tokens_per_round']:.1f} draft tokens a round: the module's recorded shape, not the served one"
    lines.append(f"| acceptance length ({acc['proposer']}; {shape}) | {acc['unquantized_pair']:.3f} | "
                 f"{acc['quantized_base']:.3f} | {100 * acc['relative_change']:+.2f}% |")
    return "\n".join(lines) + "\n"
