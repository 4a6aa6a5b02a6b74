"""The algorithm's proof: on the deployment's own weights, speculative greedy decoding equals plain
greedy decoding token for token.

The served deployment computes in bf16, where a k-token verify and a 1-token step round apart, so
served parity can only be judged by the near-tie rule. This check removes the rounding instead of
excusing it: the same deployment (weights, quantization numerics, proposer, draft shape) is loaded
in float64, in-process on `device`, and each prompt is decoded twice, with and without the
proposer. Any difference is a bug in speculation, never a near-tie, so 100% is required.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdeploy.runtime.decoding import generate
from specdeploy.runtime.types import SamplingParams, acceptance_length

EXACT_DTYPE = "float64"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def speculative_exactness(deployment: Path, prompts: list[list[int]], max_new_tokens: int,
                          device: str | None = None) -> dict[str, Any]:
    """Speculative vs plain greedy on the deployment loaded in float64; one row per prompt."""
    from specdeploy.runtime.deployment import load_decoder

    decoder = load_decoder(deployment, device=device, dtype=EXACT_DTYPE)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    rows = []
    for ids in tqdm(prompts, desc=f"exactness ({EXACT_DTYPE})", unit="prompt"):
        speculative = decoder.generate_ids(ids, params)
        plain = generate(decoder.target, ids, params, decode=decoder.decode)
        metrics = speculative.metrics
        rows.append({"identical": speculative.token_ids == plain.token_ids,
                     "first_difference": first_difference(speculative.token_ids, plain.token_ids),
                     "tokens": len(plain.token_ids), "accepted_draft_tokens": metrics.accepted_draft_tokens,
                     "target_forwards": metrics.target_forwards})
    accepted = sum(r["accepted_draft_tokens"] for r in rows)
    forwards = sum(r["target_forwards"] for r in rows)
    return {"dtype": EXACT_DTYPE, "prompts": len(rows), "identical": sum(r["identical"] for r in rows),
            "ok": all(r["identical"] for r in rows), "acceptance_length": acceptance_length(accepted, forwards),
            "rule": "speculative == plain greedy, token for token, on every prompt (100% required)", "rows": rows}
