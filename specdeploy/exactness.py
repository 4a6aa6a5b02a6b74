"""The algorithm's proof: on the deployment's own weights, speculative greedy decoding equals plain
greedy decoding token for token.

The served deployment computes in bf16, where a k-token verify and a 1-token step round apart, so
served parity can only be judged by the near-tie rule. This check removes the rounding instead of
excusing it: the same deployment (weights, quantization numerics, proposer, draft shape) is loaded
in float64, in-process on `device`, and the prompts are decoded twice, with and without the
proposer, each time together in one in-flight batch as the server runs them. Any difference is a
bug in speculation, never a near-tie, so 100% is required.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdeploy.runtime.batch import BatchRequest, InflightBatcher
from specdeploy.runtime.types import GenerationResult, SamplingParams, acceptance_length

EXACT_DTYPE = "float64"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_together(batcher: InflightBatcher, prompts: list[list[int]], params: SamplingParams,
                    desc: str) -> list[GenerationResult]:
    """Every prompt in one in-flight batch, to the end; a sequence's own failure is raised."""
    sequences = [batcher.add(BatchRequest(ids, params)) for ids in prompts]
    with tqdm(total=len(sequences), desc=desc, unit="prompt") as bar:
        while batcher.active or batcher.waiting:
            bar.update(len(batcher.step()))
    for seq in sequences:
        if seq.error is not None:
            raise seq.error
    return [seq.result for seq in sequences]


def speculative_exactness(deployment: Path, prompts: list[list[int]], max_new_tokens: int,
                          device: str | None = None) -> dict[str, Any]:
    """Speculative vs plain greedy on the deployment loaded in float64; one row per prompt. Each
    arm decodes all prompts in one in-flight batch, as served (in float64 a batch's shape moves
    logits by ~1e-16, far below any margin); the speculative one drafts in every round, whatever
    the deployment's spec_off_above."""
    from specdeploy.runtime.deployment import load_decoder

    decoder = load_decoder(deployment, device=device, dtype=EXACT_DTYPE)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    every_round = decoder.batcher(max_batch_size=len(prompts), spec_off_above=len(prompts))  # never above it
    speculative = decode_together(every_round, prompts, params, f"exactness ({EXACT_DTYPE}, speculative)")
    plain = decode_together(InflightBatcher(decoder.target, None, max_batch_size=len(prompts), decode=decoder.decode),
                            prompts, params, f"exactness ({EXACT_DTYPE}, plain)")
    rows = []
    for spec, ref in zip(speculative, plain):
        rows.append({"identical": spec.token_ids == ref.token_ids,
                     "first_difference": first_difference(spec.token_ids, ref.token_ids),
                     "tokens": len(ref.token_ids), "accepted_draft_tokens": spec.metrics.accepted_draft_tokens,
                     "target_forwards": spec.metrics.target_forwards})
    accepted = sum(r["accepted_draft_tokens"] for r in rows)
    forwards = sum(r["target_forwards"] for r in rows)
    return {"dtype": EXACT_DTYPE, "prompts": len(rows), "identical": sum(r["identical"] for r in rows),
            "ok": all(r["identical"] for r in rows), "acceptance_length": acceptance_length(accepted, forwards),
            "rule": "speculative == plain greedy, token for token, on every prompt (100% required)", "rows": rows}
