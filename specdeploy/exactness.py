"""The algorithm's proof: on the deployment's own weights, speculative greedy decoding equals plain
greedy decoding token for token.

The served deployment computes in bf16, where a k-token verify and a 1-token step round apart, so
served parity can only be judged by the near-tie rule. This check removes the rounding instead of
excusing it: the same deployment (weights, quantization numerics, proposer, draft shape) is loaded
in float64, in-process on `device`, and the prompts are decoded with the proposer, together in one
in-flight batch as the server runs them. Each answer is then checked against greedy decoding by
its definition (every token the model's argmax given the ones before it), in one forward pass of
the same float64 model over the prompt and the answer: outside the runtime, so a fault it shares
between its speculative and plain paths cannot hide. Any difference is a bug in speculation,
never a near-tie, so 100% is required.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdeploy.parity import greedy_path
from specdeploy.runtime.batch import InflightBatcher
from specdeploy.runtime.batch_requests import BatchRequest
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
    """Speculative greedy decoding on the deployment loaded in float64 (all prompts in one
    in-flight batch, as served, drafting in every round whatever the deployment's spec_off_above)
    against plain greedy decoding of the same model; one row per prompt. In float64 a batch's
    shape or a forward's length moves logits by ~1e-16, far below any margin."""
    from specdeploy.runtime.decoding import eos_token_ids
    from specdeploy.runtime.deployment import load_decoder

    decoder = load_decoder(deployment, device=device, dtype=EXACT_DTYPE)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    every_round = decoder.batcher(max_batch_size=len(prompts), spec_off_above=len(prompts))  # never above it
    speculative = decode_together(every_round, prompts, params, f"exactness ({EXACT_DTYPE}, speculative)")
    eos = eos_token_ids(decoder.target)
    plain = []
    for ids, spec in zip(tqdm(prompts, desc=f"exactness ({EXACT_DTYPE}, plain greedy check)", unit="prompt"), speculative):
        path, _ = greedy_path(decoder.target, torch.tensor([ids], device=decoder.device), spec.token_ids, eos)
        plain.append(path[:max_new_tokens])  # plain greedy's answer, up to its first difference from `spec`
    rows = []
    for spec, ref in zip(speculative, plain):
        rows.append({"identical": spec.token_ids == ref, "first_difference": first_difference(spec.token_ids, ref),
                     "tokens": len(spec.token_ids), "accepted_draft_tokens": spec.metrics.accepted_draft_tokens,
                     "target_forwards": spec.metrics.target_forwards})
    accepted = sum(r["accepted_draft_tokens"] for r in rows)
    forwards = sum(r["target_forwards"] for r in rows)
    return {"dtype": EXACT_DTYPE, "prompts": len(rows), "identical": sum(r["identical"] for r in rows),
            "ok": all(r["identical"] for r in rows), "acceptance_length": acceptance_length(accepted, forwards),
            "rule": "speculative == plain greedy, token for token, on every prompt (100% required)", "rows": rows}
