"""Choosing the draft shape from measurement instead of a fixed tree.

A round drafts a shape (a chain of k tokens or a tree of n nodes), verifies it in one target
forward over n + 1 tokens and emits 1 + accepted tokens, so

    tokens/s(shape) = (1 + E[accepted | shape]) / (draft_s(shape) + verify_s(n + 1))

against plain decoding's 1 / verify_s(1). Three measurements feed it:
- verify_s(k): the target's forward over k new tokens after a prefix, on this machine, measured
  once per (model structure, dtype, device, threads) and cached under $SPECDEPLOY_CACHE;
- E[accepted]: greedy calibration on held-out prompts, each round drafting the next shape in
  turn. A chain's first i tokens do not depend on its length, so the reach of position i,
  P(accepted >= i), pools every round of a chain of >= i tokens;
- draft_s(shape): the proposer's time for a round of that shape, in the same calibration.
Both times are medians (over repeats, over rounds): robust to the odd disturbed run on a shared
machine, representative of a draft whose cost varies by round (a dynamic tree stops early when
no deeper node can be kept), and both sides of the ratio are taken the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, cache_dir
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.types import DraftShape, DraftTree, Proposer, SamplingParams, TargetState, model_device

PLAN_VERSION = 2  # bump when what a cached cost curve means changes


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- verify costs


def measure_verify_costs(
    target: Any, max_tokens: int, *, hidden_layers: tuple[int, ...] = (), prefix: int = 256, repeats: int = 5
) -> list[float]:
    """Seconds of one target forward over k = 1..max_tokens new tokens after `prefix` cached ones
    (entry k - 1), the sizes interleaved within each repeat, median over repeats."""
    device = model_device(target)
    prefix = max(1, min(prefix, target.config.max_position_embeddings - max_tokens))
    generator = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, prefix + max_tokens), generator=generator, device=device)
    times: list[list[float]] = [[] for _ in range(max_tokens)]
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True)
        for repeat in range(repeats + 1):  # the first pass warms allocations up and is not kept
            for k in range(1, max_tokens + 1):
                _synchronize(device)
                start = time.perf_counter()
                target(input_ids=ids[:, prefix : prefix + k], past_key_values=cache, use_cache=True,
                       output_hidden_states=bool(hidden_layers))
                _synchronize(device)
                if repeat:
                    times[k - 1].append(time.perf_counter() - start)
                cache.crop(prefix)
    return [statistics.median(t) for t in times]


def _cost_key(target: Any, max_tokens: int, hidden: bool, prefix: int) -> str:
    """What a forward's cost depends on: the model's structure (config, module types: a
    fake-quantized checkpoint runs extra ops per Linear), dtype, device, threads, MKL's code path
    (device.tune_cpu_blas: it changes the curve's shape on an AMD CPU)."""
    device = model_device(target)
    parts = {
        "config": target.config.to_dict(),
        "modules": sorted({type(m).__name__ for m in target.modules()}),
        "dtype": str(next(target.parameters()).dtype),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "mkl_cbwr": os.environ.get("MKL_CBWR") if device.type == "cpu" else None,
        "torch": torch.__version__,
        "max_tokens": max_tokens, "hidden": hidden, "prefix": prefix, "version": PLAN_VERSION,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def verify_costs(target: Any, max_tokens: int, *, hidden_layers: tuple[int, ...] = (), prefix: int = 256,
                 cached: bool = True) -> list[float]:
    """`measure_verify_costs`, remembered per model structure/dtype/device/threads."""
    path = cache_dir() / "verify_costs" / f"{_cost_key(target, max_tokens, bool(hidden_layers), prefix)}.json"
    if cached and path.is_file():
        return json.loads(path.read_text())["seconds"]
    seconds = measure_verify_costs(target, max_tokens, hidden_layers=hidden_layers, prefix=prefix)
    atomic_write_json(path, {"seconds": seconds, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return seconds


# ---------------------------------------------------------------------- acceptance


@dataclass
class ShapeStats:
    rounds: int = 0
    accepted: int = 0
    draft_times: list[float] = field(default_factory=list)  # seconds of each round's proposal
    # chains: reached[i] / drafted[i] = P(accepted >= i + 1), over rounds of shapes >= i + 1
    reached: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)

    @property
    def draft_s(self) -> float:
        return statistics.median(self.draft_times) if self.draft_times else float("inf")


class _Rotation(Proposer):
    """Drafts the next shape in turn each round and records what each shape accepted and cost.
    A request's first round is not timed: it also ingests the whole prompt (a draft model's
    prefill, EAGLE's and DFlash's first context)."""

    kind = "tree"  # the verifier passes the whole budget; the shape decides what is drafted

    def __init__(self, inner: Proposer, shapes: list[DraftShape]) -> None:
        self.inner, self.shapes = inner, shapes
        self.hidden_layers = inner.hidden_layers
        self.stats: dict[DraftShape, ShapeStats] = {shape: ShapeStats() for shape in shapes}
        self.turn = 0
        self.current = shapes[0]
        self.first = True
        self.returned = 0  # tokens the proposer drafted this round, before the verifier's cut

    def reset(self) -> None:
        self.inner.reset()
        self.first = True

    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        self.current = self.shapes[self.turn % len(self.shapes)]
        self.turn += 1
        self.inner.set_shape(self.current)
        device = state.tokens.device
        _synchronize(device)
        start = time.perf_counter()
        tree = self.inner.propose(state, self.current.size)
        _synchronize(device)
        if not self.first:
            self.stats[self.current].draft_times.append(time.perf_counter() - start)
        self.first = False
        self.returned = len(tree)
        return tree

    def update(self, num_accepted: int, num_proposed: int) -> None:
        self.inner.update(num_accepted, num_proposed)
        stats = self.stats[self.current]
        stats.rounds += 1
        stats.accepted += num_accepted
        if self.current.mode == "chain":
            # over the positions the shape asks for: a draft that stops early (a confidence stop)
            # reaches fewer of them, and that is what drafting this shape yields; a draft the
            # verifier cut (the answer's end was near) says nothing about the positions cut
            stats.drafted = stats.drafted or [0] * self.current.size
            stats.reached = stats.reached or [0] * self.current.size
            for i in range(self.current.size if num_proposed == self.returned else num_proposed):
                stats.drafted[i] += 1
                stats.reached[i] += int(num_accepted > i)

    def short_of(self, min_rounds: int) -> bool:
        return any(len(s.draft_times) < min_rounds for s in self.stats.values())


def calibrate(
    target: Any, proposer: Proposer, prompts: list[list[int]], shapes: list[DraftShape], *, max_new_tokens: int = 48,
    min_rounds: int = 8, passes: int = 3,
) -> dict[DraftShape, ShapeStats]:
    """Greedy generation on `prompts`, the rounds cycling through `shapes`; the prompts again
    (up to `passes` times) until every shape has `min_rounds` timed rounds."""
    rotation = _Rotation(proposer, shapes)
    budget = max(shape.size for shape in shapes)
    for _ in range(passes):
        for ids in prompts:
            generate(target, ids, SamplingParams(max_new_tokens=max_new_tokens), rotation, draft_len=budget, adaptive=False)
        if not rotation.short_of(min_rounds):
            break
    return rotation.stats


def chain_reach(stats: dict[DraftShape, ShapeStats]) -> list[float]:
    """P(accepted >= i), i = 1, 2, ..., pooled over the rounds of every chain of >= i tokens."""
    reached: list[int] = []
    drafted: list[int] = []
    for shape, s in stats.items():
        if shape.mode != "chain":
            continue
        for i in range(len(s.drafted)):
            if i == len(drafted):
                reached.append(0)
                drafted.append(0)
            reached[i] += s.reached[i]
            drafted[i] += s.drafted[i]
    return [r / d for r, d in zip(reached, drafted) if d > 0]


# ---------------------------------------------------------------------- the plan


@dataclass
class ShapeEstimate:
    shape: DraftShape
    tokens_per_round: float
    draft_s: float
    verify_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_round / (self.draft_s + self.verify_s)


@dataclass
class Plan:
    """The shape that maximizes expected tokens/s; None when plain decoding is faster."""

    shape: DraftShape | None
    ar_tokens_per_s: float
    estimates: list[ShapeEstimate]
    reach: list[float] = field(default_factory=list)  # chains: P(accepted >= i), i = 1, 2, ...
    verify_s: list[float] = field(default_factory=list)  # the verify-cost curve used (k = 1, 2, ...)

    @property
    def expected_speedup(self) -> float:
        best = max((e.tokens_per_s for e in self.estimates), default=0.0)
        return max(best, self.ar_tokens_per_s) / self.ar_tokens_per_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "shape": None if self.shape is None else {"mode": self.shape.mode, "size": self.shape.size},
            "ar_tokens_per_s": self.ar_tokens_per_s,
            "expected_speedup": self.expected_speedup,
            "reach": self.reach,
            "verify_s": self.verify_s,
            "estimates": [{"shape": str(e.shape), "tokens_per_round": e.tokens_per_round, "draft_s": e.draft_s,
                           "verify_s": e.verify_s, "tokens_per_s": e.tokens_per_s} for e in self.estimates],
        }


def plan(stats: dict[DraftShape, ShapeStats], verify_s: list[float]) -> Plan:
    """The best shape for measured acceptance `stats` and verify costs (entry k - 1: k tokens)."""
    reach = chain_reach(stats)
    estimates = []
    for shape, s in sorted(stats.items(), key=lambda item: (item[0].mode, item[0].size)):
        if shape.size + 1 > len(verify_s) or s.rounds == 0:
            continue
        if shape.mode == "chain":
            if shape.size > len(reach):
                continue
            tokens = 1.0 + sum(reach[: shape.size])
        else:
            tokens = 1.0 + s.accepted / s.rounds
        estimates.append(ShapeEstimate(shape, tokens, s.draft_s, verify_s[shape.size]))
    ar = 1.0 / verify_s[0]
    best = max(estimates, key=lambda e: e.tokens_per_s, default=None)
    return Plan(best.shape if best and best.tokens_per_s > ar else None, ar, estimates, reach, list(verify_s))


def choose_draft_shape(
    target: Any, proposer: Proposer, prompts: list[list[int]], *, max_len: int = 8, max_new_tokens: int = 48,
    cached_costs: bool = True,
) -> Plan:
    """Calibrate `proposer` on held-out `prompts` (token ids) and pick the draft shape that
    maximizes expected tokens/s on this machine (what `--draft-shape auto` and the package stage
    call). The proposer is left set to the chosen shape (draft `plan.shape.size` tokens a round);
    `proposer.shape_options(plan.shape)` gives the deployment spec options that serve it. With
    `plan.shape` None, plain decoding is the faster choice."""
    shapes = proposer.draft_shapes(max_len)
    if not shapes:
        raise SpecDeployError(f"{type(proposer).__name__} drafts one fixed tree: there is no shape to choose",
                              hint="use --draft-shape fixed for it (Medusa, static EAGLE choices)")
    if not prompts:
        raise SpecDeployError("choosing a draft shape needs calibration prompts", hint="pass at least one prompt")
    costs = verify_costs(target, max(s.size for s in shapes) + 1, hidden_layers=proposer.hidden_layers,
                         cached=cached_costs)
    chosen = plan(calibrate(target, proposer, prompts, shapes, max_new_tokens=max_new_tokens), costs)
    if chosen.shape is not None:
        proposer.set_shape(chosen.shape)
    return chosen


def calibration_prompts(tokenizer: Any, n: int = 4) -> list[list[int]]:
    """Held-out prompts the benchmarks do not use: half chat (the held-out ShareGPT prompts from
    the end of their order, chat template applied), half code (the last HumanEval problems)."""
    from specdeploy import data

    chats = data.sharegpt_prompts(None, "heldout", max_chars=1000)[-(n - n // 2):]
    codes = data.humaneval_prompts()[-(n // 2):] if n // 2 else []
    texts = [data.chat_text(tokenizer, text) for text in chats]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] + [tokenizer(t)["input_ids"] for t in codes]


def describe(plan: Plan) -> str:
    """One line for a log: the chosen shape and the expected speed against plain decoding."""
    rows = ", ".join(f"{e.shape}: {e.tokens_per_round:.2f} tok/round {e.tokens_per_s:.1f} tok/s" for e in plan.estimates)
    chosen = "plain decoding (no shape beats it)" if plan.shape is None else str(plan.shape)
    return (f"draft shape: {chosen}, expected {plan.expected_speedup:.2f}x over plain decoding "
            f"({plan.ar_tokens_per_s:.1f} tok/s); measured {rows}")
