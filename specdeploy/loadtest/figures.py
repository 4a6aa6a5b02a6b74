"""The load test's figures: each figure's definition, the tokens of a streamed answer and its
inter-token gaps, a request's row (timings and counts) and one arm's figures at one level
(throughput, TTFT / TPOT / ITL percentiles, acceptance length, errors, identical outputs)."""

from __future__ import annotations

from typing import Any

from specdeploy.loadtest.sending import Timed
from specdeploy.runtime.types import acceptance_length
from specdeploy.stats import percentiles
from specdeploy.verify.served import served_counts

DEFINITIONS = {
    "tokens": "output tokens of a request: its served text re-tokenized (no special tokens), as verify counts them",
    "output_tokens_per_s": ("output tokens of the level's successful requests / the level's wall time (first send to last "
                            "answer, summed over the level's passes)"),
    "ttft_s": "time to first token: request sent -> first streamed chunk with text",
    "ttft_steady_s": ("the same over the requests after each pass's first `concurrency` (every client's first request, "
                      "all sent into an empty server at once in the closed loop: the cold start), as GenAI-Perf and "
                      "perf_analyzer leave warm-up requests out; null where a pass sent no more"),
    "tpot_s": "time per output token after the first: (latency - TTFT) / (tokens - 1), requests with > 1 token",
    "itl_s": ("inter-token latency, one sample per token after the first chunk: a chunk of k tokens arriving g s after "
              "the previous chunk counts as k gaps of g/k (vLLM instead counts one gap per chunk)"),
    "acceptance_length": ("TensorRT-LLM's: (accepted draft tokens + 1 per target forward) / target forwards, prefill not "
                          "counted, summed over the level's requests, from the server's total_accepted_draft_tokens"),
    "speedup": "speculative output tokens/s / autoregressive output tokens/s at the same concurrency",
    "pass_speedups": "the same ratio in each pass (the two arms ran back to back in every pass)",
    "break_even_concurrency": ("the level after the last one where speculation paid in some pass: from there on it lost in "
                               "every pass (one pass's loss is within a host's noise, and a losing level below a "
                               "paying one too); null: the last level paid. Levels above deployment_spec_off_above "
                               "do not count"),
    "spec_off_above": ("the deployment setting the curve suggests: the last level before break-even (0 when speculation "
                       "does not pay at the first level; when it pays at every level it ran at, the deployment's own: "
                       "null, or deployment_spec_off_above): larger in-flight batches then decode plainly"),
    "deployment_spec_off_above": ("the served deployment's spec_off_above (null: it always speculates); levels above it "
                                  "decode plainly, so break-even and the suggestion count only the levels at or below it"),
}


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def chunk_tokens(tokenizer: Any, chunks: list[str]) -> list[int]:
    """Tokens each streamed chunk adds: differences of the growing text's token counts (a chunk
    alone can tokenize differently from inside the answer), so they sum to the answer's count."""
    counts, text, before = [], "", 0
    for chunk in chunks:
        text += chunk
        now = count_tokens(tokenizer, text)
        counts.append(now - before)
        before = now
    return counts


def inter_token_gaps(chunk_s: list[float], counts: list[int]) -> list[float]:
    """ITL samples, one per token after the first chunk: a chunk of k tokens g s after the previous
    chunk gives k gaps of g/k; a chunk that adds no token passes its gap on to the next one."""
    gaps: list[float] = []
    waited, pending = 0.0, 0
    for before, at, tokens in zip(chunk_s, chunk_s[1:], counts[1:]):
        waited, pending = waited + at - before, pending + tokens
        if pending > 0:
            gaps += [waited / pending] * pending
            waited, pending = 0.0, 0
    return gaps


def measure(timed: Timed, tokenizer: Any) -> dict[str, Any]:
    """A request's row: its timings and token counts."""
    row: dict[str, Any] = {"prompt": timed.prompt, "start_s": timed.start_s, "cold": timed.cold, "error": timed.error}
    if timed.error:
        return row
    counts = chunk_tokens(tokenizer, timed.chunks)
    tokens, accepted, forwards = served_counts(timed.perf, sum(counts))  # the server's own counters where it has them
    ttft = timed.chunk_s[0] if timed.chunk_s else timed.latency_s
    return {
        **row, "latency_s": timed.latency_s, "ttft_s": ttft, "tokens": tokens,
        "tpot_s": (timed.latency_s - ttft) / (tokens - 1) if tokens > 1 else None,
        "itl_s": inter_token_gaps(timed.chunk_s, counts), "chunk_s": timed.chunk_s, "chunk_tokens": counts,
        "accepted_draft_tokens": accepted, "target_forwards": forwards,
        "text": "".join(timed.chunks),
    }


def summarize_level(rows: list[dict[str, Any]], walls: list[float], expected: dict[int, str]) -> dict[str, Any]:
    """One arm at one level (`rows` pass after pass, a wall time per pass). `identical`: outputs
    equal to their prompt's solo output."""
    ok = [r for r in rows if r["error"] is None]
    tokens, wall_s = sum(r["tokens"] for r in ok), sum(walls)
    per_pass = len(rows) // len(walls)
    return {
        "requests": len(rows), "errors": len(rows) - len(ok), "error_messages": [r["error"] for r in rows if r["error"]][:10],
        "wall_s": wall_s, "output_tokens": tokens, "output_tokens_per_s": tokens / wall_s, "requests_per_s": len(ok) / wall_s,
        "pass_tokens_per_s": [sum(r["tokens"] for r in rows[i * per_pass:(i + 1) * per_pass] if r["error"] is None) / wall
                              for i, wall in enumerate(walls)],
        "ttft_s": percentiles([r["ttft_s"] for r in ok]),
        "ttft_steady_s": percentiles([r["ttft_s"] for r in ok if not r["cold"]]),
        "tpot_s": percentiles([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
        "itl_s": percentiles([gap for r in ok for gap in r["itl_s"]]),
        "latency_s": percentiles([r["latency_s"] for r in ok]),
        "acceptance_length": acceptance_length(sum(r["accepted_draft_tokens"] for r in ok), sum(r["target_forwards"] for r in ok)),
        # compared with the prompt's solo output where there is one (a solo request that failed is an error already)
        "identical": sum(r["text"] == expected.get(r["prompt"]) for r in ok),
        "compared": sum(r["prompt"] in expected for r in ok),
        "per_request": rows,
    }
