"""Choosing the draft shape, and the load up to which to speculate, from measurement.

A round drafts a shape (a chain of k tokens or a tree of n nodes), verifies it in one target
forward over n + 1 tokens and emits 1 + accepted tokens, so

    tokens/s(shape) = (1 + E[accepted | shape]) / round_s(shape)

against plain decoding's 1 / step_s. Both come from one greedy calibration on held-out prompts:
- each prompt is generated twice, once with the rounds drafting the shapes in turn and once
  plainly, so every shape's rounds and the plain steps are timed side by side (a shared machine's
  slow minute slows them all alike); a round lasts from its draft to the next round's (the draft,
  the verify, the acceptance), and round_s is a shape's expected round: a draft that comes back
  empty (n-gram finds no match) makes a plain step, so drafted and empty rounds are timed apart
  and their medians weighed by how often each came; step_s is the plain steps' median;
- E[accepted]: a chain's first i tokens do not depend on its length, so the reach of position i,
  P(accepted >= i), pools every round of a chain of >= i tokens; a larger dynamic tree keeps the
  smaller one's nodes, so tree acceptance is made non-decreasing in size by pooling neighbours
  that measured otherwise (few rounds each: noise). An empty draft is a round that accepted nothing.

The load up to which to speculate is measured in load_plan.py.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specdeploy.errors import SpecDeployError
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.types import DraftShape, DraftTree, Proposer, SamplingParams, TargetState


# Acceptance falls along an answer (docs/measurements.md, 2026-11-25: verify's prompts, chain 3, 1.64 tokens
# per round over an answer's first 16 tokens, 1.21-1.23 past its 48th), so the shape planner measures over
# answers of CALIBRATION_TOKENS: calibrated on 48-token answers, it expected 1.37x where `make verify` served
# 0.99x. (The load plan, load_plan.py, times answers of the load test's lengths: it predicts that test.)
CALIBRATION_TOKENS = 128

# A deeper draft's extra acceptance is the part that varies most from prompt to prompt (2026-11-25:
# a tree of 4 made 1.81 tokens per round on the calibration prompts and 1.51-1.64 on verify's, a
# chain of 1 1.35 and ~1.30), and a deeper draft costs more every round it fails. So among the
# shapes expected within SHAPE_MARGIN of the fastest, the plan takes the one whose round is
# cheapest: on verify's prompts in-process, the chain of 1 (expected 0.95x the tree's speed) ran
# 1.13x plain decoding, the tree 1.01x.
SHAPE_MARGIN = 0.10


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it times that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(times: list[float]) -> float:
    return statistics.median(times) if times else float("inf")


# ---------------------------------------------------------------------- calibration


@dataclass
class ShapeStats:
    rounds: int = 0  # empty drafts included
    accepted: int = 0
    round_times: list[float] = field(default_factory=list)  # seconds of each timed round, draft to next draft
    empty_times: list[float] = field(default_factory=list)  # the same for rounds whose draft came back empty
    # chains: reached[i] / drafted[i] = P(accepted >= i + 1), over rounds of shapes >= i + 1
    reached: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)

    @property
    def round_s(self) -> float:
        """The expected round: drafted and empty rounds, each by its median, weighed by their counts."""
        timed = len(self.round_times) + len(self.empty_times)
        if not timed:
            return float("inf")
        return sum(len(times) * _median(times) for times in (self.round_times, self.empty_times) if times) / timed


@dataclass
class Calibration:
    shapes: dict[DraftShape, ShapeStats]
    step_times: list[float] = field(default_factory=list)  # plain decoding: seconds per token, one per prompt run

    @property
    def step_s(self) -> float:
        return _median(self.step_times)


class _Rotation(Proposer):
    """Drafts the next shape in turn each round and records what each shape accepted and how long
    its round took (until the next round's draft begins). A request's first round is not timed:
    it also ingests the whole prompt (a draft model's prefill, EAGLE's and DFlash's first
    context); nor is its last (no next draft ends it). An empty draft is verified by no one (the
    round is a plain step), so it is counted here, as a round of its shape that accepted nothing."""

    kind = "tree"  # the verifier passes the whole budget; the shape decides what is drafted

    def __init__(self, inner: Proposer, shapes: list[DraftShape]) -> None:
        self.inner, self.shapes = inner, shapes
        self.hidden_layers = inner.hidden_layers
        self.stats: dict[DraftShape, ShapeStats] = {shape: ShapeStats() for shape in shapes}
        self.turn = 0
        self.current = shapes[0]
        self.open: float | None = None  # when the current round's draft began (None: untimed)
        self.times: list[float] = []  # where the current round's time goes: its shape's drafted or empty rounds
        self.first = True
        self.returned = 0  # tokens the proposer drafted this round, before the verifier's cut

    def reset(self) -> None:
        self.inner.reset()
        self.first, self.open = True, None

    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        synchronize(state.tokens.device)
        now = time.perf_counter()
        if self.open is not None:
            self.times.append(now - self.open)
        self.current = self.shapes[self.turn % len(self.shapes)]
        self.turn += 1
        self.open = None if self.first else now
        self.first = False
        self.inner.set_shape(self.current)
        tree = self.inner.propose(state, self.current.size)
        self.returned = len(tree)
        stats = self.stats[self.current]
        self.times = stats.round_times if len(tree) else stats.empty_times
        if not len(tree):
            self._count(0, 0)
        return tree

    def update(self, num_accepted: int, num_proposed: int) -> None:
        self.inner.update(num_accepted, num_proposed)
        self._count(num_accepted, num_proposed)

    def _count(self, accepted: int, proposed: int) -> None:
        stats = self.stats[self.current]
        stats.rounds += 1
        stats.accepted += accepted
        if self.current.mode == "chain":
            # over the positions the shape asks for: a draft that stops early (a confidence stop, or
            # nothing found) reaches fewer of them, and that is what drafting this shape yields; a
            # draft the verifier cut (the answer's end was near) says nothing about the positions cut
            stats.drafted = stats.drafted or [0] * self.current.size
            stats.reached = stats.reached or [0] * self.current.size
            for i in range(self.current.size if proposed == self.returned else proposed):
                stats.drafted[i] += 1
                stats.reached[i] += int(accepted > i)

    def short_of(self, min_rounds: int) -> bool:
        return any(len(s.round_times) + len(s.empty_times) < min_rounds for s in self.stats.values())


def calibrate(
    target: Any, proposer: Proposer, prompts: list[list[int]], shapes: list[DraftShape], *,
    max_new_tokens: int = CALIBRATION_TOKENS, min_rounds: int = 12, passes: int = 4,
) -> Calibration:
    """Greedy generation on `prompts`, the rounds cycling through `shapes`, each prompt then
    plainly; the prompts again (up to `passes` times) until every shape has `min_rounds` timed rounds."""
    rotation = _Rotation(proposer, shapes)
    budget = max(shape.size for shape in shapes)
    step_times = []
    for _ in range(passes):
        for ids in prompts:
            generate(target, ids, SamplingParams(max_new_tokens=max_new_tokens), rotation, draft_len=budget, adaptive=False)
            plain = generate(target, ids, SamplingParams(max_new_tokens=max_new_tokens)).metrics
            if plain.new_tokens > 1:
                step_times.append((plain.elapsed_s - plain.time_to_first_token_s) / (plain.new_tokens - 1))
        if not rotation.short_of(min_rounds):
            break
    return Calibration(rotation.stats, step_times)


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


def tree_acceptance(stats: dict[DraftShape, ShapeStats]) -> dict[DraftShape, float]:
    """E[accepted] per tree size, made non-decreasing in size (pool-adjacent-violators, weighted
    by rounds): a larger dynamic tree holds the smaller one's nodes, so it cannot accept less."""
    blocks: list[list] = []  # [accepted, rounds, shapes]
    for shape, s in sorted(((k, v) for k, v in stats.items() if k.mode != "chain" and v.rounds), key=lambda kv: kv[0].size):
        blocks.append([s.accepted, s.rounds, [shape]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            accepted, rounds, shapes = blocks.pop()
            blocks[-1] = [blocks[-1][0] + accepted, blocks[-1][1] + rounds, blocks[-1][2] + shapes]
    return {shape: accepted / rounds for accepted, rounds, shapes in blocks for shape in shapes}


# ---------------------------------------------------------------------- the plan


@dataclass
class ShapeEstimate:
    shape: DraftShape
    tokens_per_round: float
    round_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_round / self.round_s


@dataclass
class Plan:
    """The chosen shape (`plan`); None when plain decoding is faster."""

    shape: DraftShape | None
    ar_tokens_per_s: float
    estimates: list[ShapeEstimate]
    reach: list[float] = field(default_factory=list)  # chains: P(accepted >= i), i = 1, 2, ...

    @property
    def expected_speedup(self) -> float:
        chosen = next((e.tokens_per_s for e in self.estimates if e.shape == self.shape), self.ar_tokens_per_s)
        return chosen / self.ar_tokens_per_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "shape": None if self.shape is None else {"mode": self.shape.mode, "size": self.shape.size},
            "ar_tokens_per_s": self.ar_tokens_per_s,
            "expected_speedup": self.expected_speedup,
            "reach": self.reach,
            "estimates": [{"shape": str(e.shape), "tokens_per_round": e.tokens_per_round, "round_s": e.round_s,
                           "tokens_per_s": e.tokens_per_s} for e in self.estimates],
        }


def plan(calibration: Calibration) -> Plan:
    """The shape for a calibration's acceptance and round times: of those expected faster than
    plain decoding and within SHAPE_MARGIN of the fastest, the one with the cheapest round. A shape
    that accepted nothing emits a token a round, as a plain step does, at a round's cost: it never
    pays (a round measured faster than a plain step is noise)."""
    hint = "calibrate on prompts with longer answers, or draft a fixed shape (--draft-shape fixed)"
    if not calibration.step_times:
        raise SpecDeployError("the calibration timed no plain decoding step: every plain answer ended at its first token",
                              hint=hint)
    stats = calibration.shapes
    reach = chain_reach(stats)
    trees = tree_acceptance(stats)
    estimates = []
    for shape, s in sorted(stats.items(), key=lambda item: (item[0].mode, item[0].size)):
        timed = s.round_times or s.empty_times
        if not timed or s.rounds == 0 or (shape.mode == "chain" and shape.size > len(reach)):
            continue
        accepted = sum(reach[: shape.size]) if shape.mode == "chain" else trees[shape]
        estimates.append(ShapeEstimate(shape, 1.0 + accepted, s.round_s))
    if not estimates:
        raise SpecDeployError("the calibration timed no round of any shape: every answer ended within two rounds",
                              hint=hint)
    ar = 1.0 / calibration.step_s
    paying = [e for e in estimates if e.tokens_per_round > 1.0 and e.tokens_per_s > ar]
    fastest = max((e.tokens_per_s for e in paying), default=0.0)
    near = [e for e in paying if e.tokens_per_s >= (1 - SHAPE_MARGIN) * fastest]
    chosen = min(near, key=lambda e: e.round_s, default=None)
    return Plan(chosen.shape if chosen else None, ar, estimates, reach)


def choose_draft_shape(
    target: Any, proposer: Proposer, prompts: list[list[int]], *, max_len: int = 8,
    max_new_tokens: int = CALIBRATION_TOKENS,
) -> Plan:
    """Calibrate `proposer` on held-out `prompts` (token ids) and pick the draft shape (`plan`:
    the cheapest round among those expected near the fastest on this machine; what `--draft-shape
    auto` and the package stage call). The proposer is left set to the chosen shape (draft
    `plan.shape.size` tokens a round); `proposer.shape_options(plan.shape)` gives the deployment
    spec options that serve it. With `plan.shape` None, plain decoding is the faster choice."""
    shapes = proposer.draft_shapes(max_len)
    if not shapes:
        raise SpecDeployError(f"{type(proposer).__name__} drafts one fixed tree: there is no shape to choose",
                              hint="use --draft-shape fixed for it (Medusa, static EAGLE choices)")
    if not prompts:
        raise SpecDeployError("choosing a draft shape needs calibration prompts", hint="pass at least one prompt")
    chosen = plan(calibrate(target, proposer, prompts, shapes, max_new_tokens=max_new_tokens))
    if chosen.shape is not None:
        proposer.set_shape(chosen.shape)
    return chosen


def calibration_prompts(tokenizer: Any, n: int = 4) -> list[list[int]]:
    """Held-out prompts the benchmarks do not use: half chat (the held-out ShareGPT prompts from
    the end of their order, chat template applied), half code (the last HumanEval problems)."""
    from specdeploy import data
    from specdeploy.prompts import chat_ids, text_ids

    chats = data.sharegpt_prompts(None, "heldout", max_chars=1000)[-(n - n // 2):]
    codes = data.humaneval_prompts()[-(n // 2):] if n // 2 else []
    return [chat_ids(tokenizer, text) for text in chats] + [text_ids(tokenizer, text) for text in codes]


def describe(plan: Plan) -> str:
    """One line for a log: the chosen shape and the expected speed against plain decoding."""
    rows = ", ".join(f"{e.shape}: {e.tokens_per_round:.2f} tok/round {e.tokens_per_s:.1f} tok/s" for e in plan.estimates)
    chosen = "plain decoding (no shape beats it)" if plan.shape is None else str(plan.shape)
    return (f"draft shape: {chosen}, expected {plan.expected_speedup:.2f}x over plain decoding "
            f"({plan.ar_tokens_per_s:.1f} tok/s); measured {rows}")
