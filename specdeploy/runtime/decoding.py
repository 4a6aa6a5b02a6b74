"""The decoding loop, gpt-fast style: prefill, decode one token, one speculative round, generate.

Invariant between rounds: the KV cache holds every token of the sequence except the last one,
the *pending* token, which has already been emitted but not yet run through the target. A plain
step runs the pending token and samples the next; a speculative round runs the pending token
plus a draft tree in one forward, accepts a path, and keeps only that path in the cache.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from specdeploy.errors import SpecDeployError
from specdeploy.runtime.adaptive import AdaptiveDraftLength
from specdeploy.runtime.kv_cache import keep_path
from specdeploy.runtime.sampling import make_generator, next_token
from specdeploy.runtime.types import (
    DraftTree,
    GenerationMetrics,
    GenerationResult,
    Proposer,
    SamplingParams,
    TargetState,
    model_device,
)
from specdeploy.runtime.verify import Acceptance, accept, is_chain, tree_attention_mask, tree_position_ids

Hidden = dict[int, torch.Tensor]
# (logits of the answer's next positions, each row's depth past the next token) -> the logits to choose from
HoldOff = Callable[[torch.Tensor, list[int]], torch.Tensor]

# Chains: verifying up to ~8 tokens costs about one bf16 decode step on a CPU with native bf16; 1.2-1.4
# float32 steps on an AVX2-only AMD CPU with MKL_CBWR=AVX2 (docs/measurements.md, 2026-11-22 and
# 2026-11-23). The planner measures it.
DEFAULT_DRAFT_LEN = 8
# Trees bring their own shape; Medusa's default tree has 63 nodes.
DEFAULT_TREE_SIZE = 64


def draft_budget(draft_len: int | None, chain: bool) -> int:
    """The most draft tokens a round verifies: `draft_len` (max_draft_len), else the default of a
    chain or a tree. 0 or less is refused: it would speculate at the default, or never."""
    if draft_len is None:
        return DEFAULT_DRAFT_LEN if chain else DEFAULT_TREE_SIZE
    if isinstance(draft_len, bool) or not isinstance(draft_len, int) or draft_len < 1:
        raise SpecDeployError(f"max_draft_len must be a positive integer, got {draft_len!r}",
                              hint="e.g. 4, or leave it unset for the default")
    return draft_len


def _forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    hidden_layers: tuple[int, ...],
    **kwargs,
) -> tuple[torch.Tensor, Hidden]:
    out = model(
        input_ids=input_ids,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=bool(hidden_layers),
        **kwargs,
    )
    hidden = {layer: out.hidden_states[layer] for layer in hidden_layers}
    return out.logits[0], hidden


def prefill(
    model: PreTrainedModel, prompt: torch.Tensor, cache: DynamicCache, hidden_layers: tuple[int, ...] = ()
) -> tuple[torch.Tensor, Hidden]:
    """Run the prompt (1, seq) into the cache; the logits (vocab,) of the first new token."""
    logits, hidden = _forward(model, prompt, cache, hidden_layers, logits_to_keep=1)
    return logits[-1], hidden


def decode_one_token(
    model: PreTrainedModel,
    token: int,
    cache: DynamicCache,
    params: SamplingParams,
    generator: torch.Generator | None,
    hidden_layers: tuple[int, ...] = (),
    hold_off: HoldOff | None = None,
) -> tuple[int, Hidden]:
    """Run the pending token; the next token (`hold_off`: _Output.hold_off_end, for min_tokens)."""
    logits, hidden = _forward(model, torch.tensor([[token]], device=model_device(model)), cache, hidden_layers)
    logits = logits[-1:] if hold_off is None else hold_off(logits[-1:], [0])
    return next_token(logits[0], params, generator), hidden


def speculative_decode(
    model: PreTrainedModel,
    token: int,
    tree: DraftTree,
    cache: DynamicCache,
    params: SamplingParams,
    generator: torch.Generator | None,
    hidden_layers: tuple[int, ...] = (),
    hold_off: HoldOff | None = None,
) -> tuple[Acceptance, Hidden]:
    """One round: verify the pending token + `tree` in one forward, accept a path, trim the cache."""
    prefix_len = cache.get_seq_length()
    device = model_device(model)
    input_ids = torch.cat([torch.tensor([token], device=device), tree.tokens.to(device=device, dtype=torch.long)])[None]
    if is_chain(tree.parents):
        # a chain is causal: the model's own mask and positions are the tree mask
        logits, hidden = _forward(model, input_ids, cache, hidden_layers)
    else:
        mask = tree_attention_mask(tree.parents, prefix_len, model.dtype, device)
        positions = tree_position_ids(tree, prefix_len, device)
        logits, hidden = _forward(model, input_ids, cache, hidden_layers, attention_mask=mask, position_ids=positions)
    if hold_off is not None:
        logits = hold_off(logits, [0] + tree.depths())
    acceptance = accept(tree, logits, params, generator)
    keep_path(cache, prefix_len, acceptance.path)
    rows = [0] + [node + 1 for node in acceptance.path]
    return acceptance, {layer: states[:, torch.tensor(rows, device=states.device)] for layer, states in hidden.items()}


def prune(tree: DraftTree, max_nodes: int, max_depth: int) -> DraftTree:
    """The first `max_nodes` nodes of depth <= `max_depth` (still a valid, ordered tree)."""
    depths = tree.depths()
    keep = [i for i in range(len(tree)) if depths[i] <= max_depth][:max_nodes]
    if len(keep) == len(tree):
        return tree
    new_index = {old: new for new, old in enumerate(keep)}
    parents = [-1 if tree.parents[i] < 0 else new_index[tree.parents[i]] for i in keep]
    probs = None if tree.probs is None else tree.probs[keep]
    return DraftTree(tokens=tree.tokens[keep], parents=parents, probs=probs)


class _Output:
    """Collects emitted tokens: stops on EOS / stop ids / stop strings / length, streams groups."""

    def __init__(
        self,
        max_new_tokens: int,
        stop_ids: set[int],
        stop_strings: tuple[str, ...],
        decode: Callable[[list[int]], str] | None,
        on_tokens: Callable[[list[int]], None] | None,
        min_tokens: int = 0,
    ) -> None:
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.max_new_tokens = max_new_tokens
        self.min_tokens = min_tokens
        self.stop_ids = stop_ids
        self.stop_strings = stop_strings
        self.decode = decode
        self.on_tokens = on_tokens
        # a stop string ends in the newest token and spans at most one token per byte
        self.window = max((len(s.encode()) for s in stop_strings), default=0) + 1

    def _hit_stop_string(self) -> bool:
        if not self.stop_strings:
            return False
        tail = self.decode(self.tokens[-self.window :])
        return any(s in tail for s in self.stop_strings)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def hold_off_end(self, logits: torch.Tensor, depths: list[int]) -> torch.Tensor:
        """`logits` (rows, vocab) of the answer's next positions (row r: `depths[r]` tokens after the
        next one) with the stop ids' logits at -inf where fewer than min_tokens tokens come before it;
        the same tensor where none do."""
        short = [row for row, depth in enumerate(depths) if len(self.tokens) + depth < self.min_tokens]
        ids = sorted(i for i in self.stop_ids if 0 <= i < logits.shape[-1]) if short else []
        if not ids:
            return logits
        held = logits.clone()
        held[torch.tensor(short, device=logits.device)[:, None], torch.tensor(ids, device=logits.device)] = float("-inf")
        return held

    def take(self, group: list[int]) -> list[int]:
        """Append `group` up to its first stop (which ends generation); the tokens taken. A round's
        counters are updated between `take` and `send`: what on_tokens reports includes its group."""
        taken: list[int] = []
        for token in group:
            taken.append(token)
            self.tokens.append(token)
            if token in self.stop_ids or self._hit_stop_string():
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return taken

    def send(self, taken: list[int]) -> None:
        """Stream the tokens `take` returned."""
        if self.on_tokens and taken:
            self.on_tokens(taken)

    def extend(self, group: list[int]) -> bool:
        """Emit `group` up to the first stop; True when generation is finished."""
        self.send(self.take(group))
        return self.done


def _prompt_tensor(prompt_ids: torch.Tensor | list[int], context_length: int, device: torch.device) -> torch.Tensor:
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() != 1:
        raise SpecDeployError(
            f"expected one prompt of token ids, got a tensor of shape {tuple(prompt.shape)}",
            hint="pass a list of ints or a (1, seq) tensor; the runtime serves one request at a time",
        )
    if prompt.numel() == 0:
        raise SpecDeployError("the prompt is empty", hint="give at least one token (a BOS token will do)")
    if prompt.numel() >= context_length:
        raise SpecDeployError(
            f"the prompt has {prompt.numel()} tokens but the model's context is {context_length}",
            hint=f"shorten the prompt to fewer than {context_length} tokens to leave room for new ones",
        )
    return prompt[None]


def eos_token_ids(model: PreTrainedModel) -> set[int]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def generate(
    target: PreTrainedModel,
    prompt_ids: torch.Tensor | list[int],
    params: SamplingParams,
    proposer: Proposer | None = None,
    *,
    on_tokens: Callable[[list[int]], None] | None = None,
    draft_len: int | None = None,
    context_length: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    adaptive: bool = True,
) -> GenerationResult:
    """Generate for one prompt, speculatively when a proposer is given.

    `draft_len` caps the draft per round (chains: adaptive up to it unless `adaptive` is False;
    trees: their node budget). `decode` (token ids -> text) is needed for `params.stop_strings`.
    """
    params.validate()
    context_length = context_length or target.config.max_position_embeddings
    device = model_device(target)  # every tensor of the request lives there
    prompt = _prompt_tensor(prompt_ids, context_length, device)
    if params.stop_strings and decode is None:
        raise SpecDeployError("stop strings need the tokenizer", hint="pass decode=tokenizer.decode")
    chain = proposer is None or proposer.kind == "chain"
    max_draft = draft_budget(draft_len, chain)
    # seeded sampling must not depend on timing (see adaptive.py); greedy output cannot
    timed = params.greedy or params.seed is None
    controller = AdaptiveDraftLength(max_draft, adaptive=adaptive and proposer is not None, timed=timed)
    hidden_layers = proposer.hidden_layers if proposer else ()
    generator = make_generator(params.seed, device)
    stop_ids = eos_token_ids(target) | set(params.stop_token_ids)
    max_new = min(params.max_new_tokens, context_length - prompt.shape[1])
    output = _Output(max_new, stop_ids, params.stop_strings, decode, on_tokens, params.min_tokens)
    metrics = GenerationMetrics(prompt_tokens=prompt.shape[1])
    if proposer is not None:
        proposer.reset()

    start = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        logits, unseen = prefill(target, prompt, cache, hidden_layers)
        pending = next_token(output.hold_off_end(logits[None], [0])[0], params, generator)
        metrics.time_to_first_token_s = time.perf_counter() - start
        done = output.extend([pending])
        while not done:
            round_start = time.perf_counter()
            tree = DraftTree.empty(device)
            length = controller.next_length() if proposer is not None else 0
            if length > 0:
                tokens = torch.cat([prompt, torch.tensor([output.tokens], device=device)], dim=1)
                state = TargetState(tokens=tokens, hidden=unseen, params=params, generator=generator)
                tree = proposer.propose(state, length if chain else max_draft)
                tree = prune(tree, max_draft, max_new - len(output.tokens) - 1)
                unseen = {}
            if len(tree):
                acceptance, hidden = speculative_decode(target, pending, tree, cache, params, generator, hidden_layers,
                                                        output.hold_off_end)
                group, accepted = acceptance.tokens(tree), len(acceptance.path)
                proposer.update(accepted, len(tree))
            else:
                token, hidden = decode_one_token(target, pending, cache, params, generator, hidden_layers, output.hold_off_end)
                group, accepted = [token], 0
            # a proposer sees the states of every token consumed since it last proposed
            unseen = {layer: torch.cat([unseen[layer], h], dim=1) if layer in unseen else h for layer, h in hidden.items()}
            controller.record(accepted, len(tree), time.perf_counter() - round_start)
            taken = output.take(group)
            metrics.target_forwards += 1
            metrics.draft_tokens += len(tree)
            # a stop inside the accepted path ends the answer there: the path's tail is never emitted
            metrics.accepted_draft_tokens += min(accepted, len(taken))
            pending = group[-1]
            output.send(taken)
            done = output.done
    metrics.elapsed_s = time.perf_counter() - start
    metrics.new_tokens = len(output.tokens)
    return GenerationResult(token_ids=output.tokens, finish_reason=output.finish_reason or "length", metrics=metrics)
