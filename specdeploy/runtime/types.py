"""The shapes every part of the runtime agrees on: sampling parameters, a draft tree, the
proposer interface, and a generation's result and metrics.

The proposer/verifier split follows transformers' candidate generator: a proposer only proposes
(`propose`) and learns from what was accepted (`update`); the verify loop never knows which
proposer it is talking to.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from specdeploy.errors import SpecDeployError


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. temperature 0 means greedy (exact)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    # TensorRT-LLM's min_tokens (transformers' min_new_tokens): no token that would end the answer by id
    # can be chosen before it has this many; 0 holds nothing off
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            raise SpecDeployError(
                f"max_new_tokens must be positive, got {self.max_new_tokens}",
                hint="ask for at least one new token",
            )
        if not self.temperature >= 0 or self.temperature == float("inf"):  # NaN fails every comparison
            raise SpecDeployError(f"temperature must be a finite number >= 0, got {self.temperature}", hint="use 0 for greedy")
        if self.top_k < 0:
            raise SpecDeployError(f"top_k must be >= 0, got {self.top_k}", hint="use 0 to disable top-k")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecDeployError(f"top_p must be in (0, 1], got {self.top_p}", hint="use 1.0 to disable top-p")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise SpecDeployError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
                                  hint="0 leaves the answer's length to its end token")
        if "" in self.stop_strings:  # every text contains "": the answer would stop at its first token
            raise SpecDeployError("a stop string is empty", hint="leave it out")


@dataclass
class DraftTree:
    """Candidate tokens proposed to follow the last accepted token (the tree's implicit root).

    Nodes are in topological order. `parents[i]` is the index of node i's parent, or -1 when
    node i follows the root directly. A chain of k tokens has parents [-1, 0, 1, ..., k-2].
    `probs[i]` is the distribution node i's token was sampled from (q in the rejection rule);
    None means the proposal is a deterministic function of the context (n-gram, top-k trees),
    which the acceptance rule treats as a one-hot q.
    """

    tokens: torch.Tensor  # (n,) int64
    parents: list[int]
    probs: torch.Tensor | None = None  # (n, vocab) float32

    def __len__(self) -> int:
        return len(self.parents)

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> "DraftTree":
        return cls(tokens=torch.empty(0, dtype=torch.long, device=device), parents=[])

    @classmethod
    def chain(cls, tokens: torch.Tensor, probs: torch.Tensor | None = None) -> "DraftTree":
        return cls(tokens=tokens, parents=list(range(-1, len(tokens) - 1)), probs=probs)

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth


@dataclass
class TargetState:
    """What the verifier hands a proposer each round.

    `tokens` is the whole sequence so far, prompt included, ending with the pending token (the
    last accepted one, not yet run through the target). `hidden` maps a target layer index (as
    in `output_hidden_states`, 0 = embeddings, -1 = last) to that layer's states for the tokens
    the target consumed since the previous round, shape (1, n_new, hidden); it holds only the
    layers the proposer asked for in `hidden_layers`.
    """

    tokens: torch.Tensor  # (1, seq) int64, on the target's device (proposers create theirs there)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    # how the request samples: a sampling proposer draws from the same warped distribution
    # with the request's generator and returns it as DraftTree.probs
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None


def model_device(model: Any) -> torch.device:
    """Where a model's inputs go: its input embeddings' device (the first device when accelerate
    spread the model with device_map; its hooks move activations between devices)."""
    return model.get_input_embeddings().weight.device


@dataclass(frozen=True)
class DraftShape:
    """What a proposer drafts each round: a chain of `size` tokens or a tree of <= `size` nodes."""

    mode: str  # "chain" | "tree"
    size: int

    def __str__(self) -> str:
        return f"{self.mode} {self.size}"


class Proposer(ABC):
    """Proposes candidate continuations. One instance serves one request at a time."""

    #: target layers whose hidden states `propose` reads (Medusa: (-1,), EAGLE-3: three layers)
    hidden_layers: tuple[int, ...] = ()
    #: 'chain' proposers get a draft length; 'tree' proposers bring their own shape
    kind: str = "chain"
    #: attributes holding helpers with per-request state of their own, which `fork` copies
    per_request: tuple[str, ...] = ()

    def reset(self) -> None:
        """Forget any per-request state; called before each new request."""

    def fork(self) -> "Proposer":
        """A proposer for one more concurrent request (in-flight batching): the same weights,
        its own per-request state (`reset` rebinds it; the helpers named in `per_request` are copied)."""
        twin = copy.copy(self)
        for name in self.per_request:
            setattr(twin, name, copy.copy(getattr(self, name)))
        twin.reset()
        return twin

    @abstractmethod
    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        """Up to `max_tokens` candidate tokens after `state.tokens`."""

    @staticmethod
    def propose_batch(proposers: list["Proposer"], states: list[TargetState], max_tokens: list[int]) -> list[DraftTree]:
        """Drafts for several requests at once (in-flight batching), one proposer (a fork) per
        request. One by one here; a proposer whose forks can share forwards (EAGLE, Medusa) overrides it."""
        return [proposer.propose(state, n) for proposer, state, n in zip(proposers, states, max_tokens)]

    def update(self, num_accepted: int, num_proposed: int) -> None:
        """Called after each verification with how many proposed tokens were accepted."""

    def draft_shapes(self, max_len: int) -> list[DraftShape]:
        """The shapes `set_shape` can switch between (the planner's candidates). A chain proposer
        takes its length each round: every length up to `max_len`; a fixed tree: none."""
        return [DraftShape("chain", k) for k in range(1, max_len + 1)] if self.kind == "chain" else []

    def set_shape(self, shape: DraftShape) -> None:
        """Draft `shape` from now on (a chain proposer's length comes with each round)."""

    def shape_options(self, shape: DraftShape) -> dict[str, Any]:
        """The deployment spec options (build_proposer options + max_draft_len) that serve `shape`."""
        return {"max_draft_len": shape.size}


def acceptance_length(accepted_draft_tokens: int, target_forwards: int) -> float:
    """The project's one definition, TensorRT-LLM's: (accepted draft tokens + 1 per target
    forward) / target forwards, the prefill not counted. 1.0 = plain decoding. Aggregates sum
    both counts over requests first (a mean of per-request ratios weighs short answers up)."""
    if target_forwards <= 0:
        return 1.0
    return (accepted_draft_tokens + target_forwards) / target_forwards


@dataclass
class GenerationMetrics:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # verify/decode forwards after prefill
    draft_tokens: int = 0  # proposed tokens sent to verification
    accepted_draft_tokens: int = 0  # accepted and emitted: a stop inside an accepted path drops its tail
    elapsed_s: float = 0.0
    time_to_first_token_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """TensorRT-LLM's acceptance length (see `acceptance_length`)."""
        return acceptance_length(self.accepted_draft_tokens, self.target_forwards)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            **self.__dict__,
            "acceptance_length": self.acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_s": self.tokens_per_s,
        }


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    finish_reason: str  # "length" | "stop" | "cancelled" (in-flight batching)
    metrics: GenerationMetrics
