"""EAGLE-3 proposer: the ModelOpt-trained eagle_module drafting from the target's own features
(rebuilt without ModelOpt: specdeploy.checkpoints.modules.eagle).

Each round the module first ingests the positions the target consumed since the last round
(fc(three target layers) paired with the embedding of the token that followed, kept in the
module's own KV cache), then drafts autoregressively from its own output features:

- chain:   greedy top-1, k tokens;
- static:  an eagle_choices tree (paths of top-k indices, like Medusa's);
- dynamic: EAGLE-2: expand the `width` most likely nodes per depth (cumulative draft
           probability), then keep the `max_tokens` most likely nodes overall.

Every depth is one small forward over that depth's expanded nodes with a tree mask over the
module's cache; draft entries are cropped from the cache before returning. An in-flight batch
drafts together (`propose_batch`): one forward ingests every request's new positions (rows padded
and masked, each request keeping its own cache; a request that just joined takes in its prompt
alone first, so the others are not padded to its length), chains then go depth by depth for the
whole batch; dynamic trees grow together too (each depth's expansions of every request in one forward);
static trees expand request by request.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from specdeploy.attention import use_cpu_sdpa
from specdeploy.choices import DEFAULT_TREE_10, ChoicesTree, validate_choices
from specdeploy.errors import SpecDeployError
from specdeploy.runtime.proposers.eagle_batch import MAX_DEPTH, _caught_up, _chains, _dynamic_trees, _ingest_many, _Node
from specdeploy.runtime.types import DraftShape, DraftTree, Proposer, TargetState, model_device

MODES = ("chain", "static", "dynamic")
TREE_BUDGETS = (4, 6, 8, 10, 12, 16)  # the dynamic tree sizes the planner weighs against chains
DEFAULT_BUDGET = 10  # dynamic tree nodes kept (bf16 verify of <= ~10 tokens ~ one decode step here)


class EagleProposer(Proposer):
    def __init__(
        self, module: Any, embed: Any, lm_head: Any, hidden_layers: tuple[int, ...], *, mode: str = "dynamic",
        choices: ChoicesTree | None = None, depth: int = 5, topk: int = 3, width: int = 3, chain_len: int = 4,
        budget: int = DEFAULT_BUDGET,
    ) -> None:
        self.module, self.embed = module, embed
        self._target_head = None if hasattr(module, "lm_head") else lm_head
        self.hidden_layers = hidden_layers
        self.mode, self.choices = mode, choices
        self.depth, self.topk, self.width, self.chain_len = depth, topk, width, chain_len
        self.budget = budget  # dynamic tree: nodes kept
        self.kind = "chain" if mode == "chain" else "tree"
        d2t = getattr(module, "d2t", None)
        # draft -> target id offsets, read once (an element read per drafted token would sync a GPU)
        self.d2t = None if d2t is None else d2t.tolist()
        self._d2t = d2t
        self.dtype = next(module.parameters()).dtype
        self.device = next(module.parameters()).device
        module._maybe_init_rope(device=self.device)
        self.reset()

    def draft_shapes(self, max_len: int) -> list[DraftShape]:
        """Chains up to the module's depth limit and EAGLE-2 dynamic trees of growing budgets."""
        chains = [DraftShape("chain", k) for k in range(1, min(max_len, MAX_DEPTH) + 1)]
        return chains + [DraftShape("tree", b) for b in TREE_BUDGETS if b <= max(max_len, DEFAULT_BUDGET)]

    def set_shape(self, shape: DraftShape) -> None:
        if shape.mode == "chain":
            self.mode, self.chain_len = "chain", shape.size
        else:
            self.mode, self.budget = "dynamic", shape.size
        self.kind = "chain" if self.mode == "chain" else "tree"

    def shape_options(self, shape: DraftShape) -> dict[str, Any]:
        size = {"chain_len": shape.size} if shape.mode == "chain" else {"budget": shape.size}
        return {"mode": "chain" if shape.mode == "chain" else "dynamic", **size, "max_draft_len": shape.size}

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.module.config)
        self.cache_len = 0  # entries of real (consumed) positions in the module cache
        self.fed_until = 0  # the next real position to feed

    # ------------------------------------------------------------------ module calls
    def _run(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
             cache: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One module forward over (rows, q) inputs; `allowed` (rows, q, cache + q) bool is the
        attention mask. The module's output features (its drafts' logits come from `_logp`) and
        its input-side features (its children's input)."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~allowed, torch.finfo(self.dtype).min)
        post, pre, _ = self.module(
            hidden.to(self.dtype), self.embed(tokens).to(self.dtype), attention_mask=mask[:, None],
            position_ids=positions, past_key_values=self.cache if cache is None else cache, use_cache=True,
        )
        return post, pre

    def _logp(self, post: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.lm_head(post).float(), dim=-1)

    @property
    def lm_head(self) -> Any:
        """Looked up on each call: the quantize stage may swap the module's Linears in place."""
        return self.module.lm_head if self._target_head is None else self._target_head

    def _ingest(self, state: TargetState) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Feed the newly consumed positions; the draft log-probs/feature after the pending token."""
        batch = _ingest_many([self], [state])
        return batch.logp[0], batch.h[0], batch.base[0]

    def _expand(self, nodes: list[_Node], ids: list[int], root_h: torch.Tensor, base_pos: int) -> None:
        """Run the module on nodes `ids` (their parents already expanded) and store their outputs."""
        if not ids:
            return
        cache_now = self.cache.get_seq_length()
        # rows built in Python and sent in one copy: element writes into a GPU tensor cost a launch each
        rows = []
        for row, i in enumerate(ids):
            allowed = [True] * self.cache_len + [False] * (cache_now - self.cache_len + len(ids))
            allowed[cache_now + row] = True
            parent = nodes[i].parent
            while parent >= 0:
                allowed[nodes[parent].col] = True
                parent = nodes[parent].parent
            rows.append(allowed)
        hidden = torch.stack([root_h if nodes[i].parent < 0 else nodes[nodes[i].parent].h for i in ids])
        tokens = torch.tensor([self._target_id(nodes[i].draft_id) for i in ids], device=self.device)
        positions = torch.tensor([base_pos + nodes[i].depth - 1 for i in ids], device=self.device)
        post, pre = self._run(hidden[None], tokens[None], positions[None],
                              torch.tensor(rows, dtype=torch.bool, device=self.device)[None])
        logp, pre = self._logp(post[0]), pre[0]
        for row, i in enumerate(ids):
            nodes[i].col, nodes[i].h, nodes[i].logp = cache_now + row, pre[row], logp[row]

    def _target_id(self, draft_id: int) -> int:
        return draft_id + self.d2t[draft_id] if self.d2t is not None else draft_id

    def _target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self._d2t.to(draft_ids.device)[draft_ids] if self._d2t is not None else draft_ids

    @staticmethod
    def _add_children(nodes: list[_Node], parent: int, logp: torch.Tensor, k: int) -> list[int]:
        values, indices = logp.topk(k)
        base = nodes[parent].score if parent >= 0 else 0.0
        added = []
        for v, d in zip(values.tolist(), indices.tolist()):
            nodes.append(_Node(draft_id=d, parent=parent, depth=1 if parent < 0 else nodes[parent].depth + 1, score=base + v))
            if parent >= 0:
                nodes[parent].children.append(len(nodes) - 1)
            added.append(len(nodes) - 1)
        return added

    # ------------------------------------------------------------------ tree shapes
    @torch.no_grad()
    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        return self.propose_batch([self], [state], [max_tokens])[0]

    @staticmethod
    @torch.no_grad()
    def propose_batch(proposers: list[Proposer], states: list[TargetState], max_tokens: list[int]) -> list[DraftTree]:
        """Every request's new positions go through the module in one forward; chains and dynamic
        trees then draft together (one forward per depth for all of them); static trees expand
        request by request."""
        trees = [DraftTree.empty(state.tokens.device) for state in states]
        rows = [i for i, (p, state, n) in enumerate(zip(proposers, states, max_tokens))
                if n > 0 and all(layer in state.hidden for layer in p.hidden_layers)]
        if not rows:
            return trees
        if any(proposers[i].module is not proposers[rows[0]].module for i in rows):
            return Proposer.propose_batch(proposers, states, max_tokens)  # not forks of one proposer
        drafting = [proposers[i] for i in rows]
        batch = _ingest_many(drafting, _caught_up(drafting, [states[i] for i in rows]))
        chains = [r for r, i in enumerate(rows) if proposers[i].mode == "chain"]
        if chains:
            lengths = [min(max_tokens[rows[r]], proposers[rows[r]].chain_len) for r in chains]
            for r, tree in zip(chains, _chains(proposers[rows[0]], batch, chains, lengths)):
                trees[rows[r]] = tree
        dynamic = [r for r, i in enumerate(rows) if proposers[i].mode == "dynamic"]
        if dynamic:
            sizes = [min(max_tokens[rows[r]], proposers[rows[r]].budget) for r in dynamic]
            for r, tree in zip(dynamic, _dynamic_trees([proposers[rows[r]] for r in dynamic], batch, dynamic, sizes)):
                trees[rows[r]] = tree
        for r, i in enumerate(rows):
            if proposers[i].mode == "static":
                trees[i] = proposers[i]._tree_from(batch.logp[r], batch.h[r], batch.base[r], max_tokens[i])
        return trees

    def _tree_from(self, logp: torch.Tensor, h: torch.Tensor, base_pos: int, max_tokens: int) -> DraftTree:
        """A static tree from the ingested root, drafted on this request's own cache."""
        try:
            nodes, keep = self._static(logp, h, base_pos, max_tokens)
        finally:
            self.cache.crop(self.cache_len)  # draft entries never outlive the round
        return self._tree(nodes, keep)

    def _static(self, logp: torch.Tensor, h: torch.Tensor, base_pos: int, max_tokens: int):
        paths = self.choices.paths[:max_tokens]
        index: dict[tuple[int, ...], int] = {}
        nodes: list[_Node] = []
        for depth in range(1, max(len(p) for p in paths) + 1):
            level = [p for p in paths if len(p) == depth]
            parents = sorted({index[p[:-1]] for p in level} if depth > 1 else set())
            self._expand(nodes, [i for i in parents if nodes[i].col < 0], h, base_pos)
            tops: dict[int, list[int]] = {}
            for p in level:
                parent = index[p[:-1]] if depth > 1 else -1
                if parent not in tops:
                    k = 1 + max(q[-1] for q in level if q[:-1] == p[:-1])
                    dist = logp if parent < 0 else nodes[parent].logp
                    values, ids = dist.topk(k)
                    tops[parent] = list(zip(ids.tolist(), values.tolist()))
                d, v = tops[parent][p[-1]]
                score = v + (nodes[parent].score if parent >= 0 else 0.0)
                nodes.append(_Node(draft_id=d, parent=parent, depth=depth, score=score))
                index[p] = len(nodes) - 1
        return nodes, list(range(len(nodes)))

    def _dynamic(self, logp: torch.Tensor, h: torch.Tensor, base_pos: int, max_tokens: int):
        """One request's dynamic tree grown node by node on its own cache: the reference that
        `_dynamic_trees` (what `propose` runs) is tested against."""
        steps = self._dynamic_steps(logp, max_tokens)
        while True:
            try:
                nodes, best = next(steps)
            except StopIteration as done:
                return done.value
            self._expand(nodes, best, h, base_pos)

    def _dynamic_steps(self, logp: torch.Tensor, max_tokens: int):
        """EAGLE-2's dynamic tree as a generator: at each depth it yields the nodes and the ids the
        caller must expand (run the module on), and it returns (nodes, kept ids)."""
        nodes: list[_Node] = []
        level = self._add_children(nodes, -1, logp, min(self.topk, max_tokens))
        for _ in range(1, self.depth):
            best = sorted(level, key=lambda i: -nodes[i].score)[: self.width]
            if len(nodes) >= max_tokens and nodes[best[0]].score <= sorted(n.score for n in nodes)[-max_tokens]:
                # a descendant scores no higher than its ancestor and ranks after shallower ties:
                # none could enter the kept set, so the rest of the depth calls would change nothing
                break
            yield nodes, best
            level = [c for i in best for c in self._add_children(nodes, i, nodes[i].logp, self.topk)]
        # the most likely nodes overall; a child never outscores its parent, so parents come first
        keep: list[int] = []
        chosen: set[int] = set()
        for i in sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth)):
            if len(keep) == max_tokens:
                break
            if nodes[i].parent < 0 or nodes[i].parent in chosen:
                keep.append(i)
                chosen.add(i)
        return nodes, sorted(keep, key=lambda i: (nodes[i].depth, i))

    def _tree(self, nodes: list[_Node], keep: list[int]) -> DraftTree:
        new_index = {old: new for new, old in enumerate(keep)}
        tokens = torch.tensor([self._target_id(nodes[i].draft_id) for i in keep], dtype=torch.long, device=self.device)
        parents = [-1 if nodes[i].parent < 0 else new_index[nodes[i].parent] for i in keep]
        return DraftTree(tokens=tokens, parents=parents)


def _module_from(target: Any, spec_dir: str | os.PathLike | None, draft_vocab: int | None, seed: int):
    from specdeploy.checkpoints.modules import eagle as eagle_spec
    from specdeploy.checkpoints.modules import load_module, read_spec_config

    if spec_dir is not None:
        config = read_spec_config(spec_dir)
        if config["kind"] != "eagle":
            raise SpecDeployError(f"{spec_dir} holds {config['kind']} heads, not an EAGLE module", hint="use --spec medusa")
        modelopt_config = config["modelopt_config"]
    else:
        config = {}
        modelopt_config = eagle_spec.modelopt_config(target.config, draft_vocab_size=draft_vocab or target.config.vocab_size)
    # beside the target's embeddings, which it reads every round; in the target's dtype
    module = load_module("eagle", target.config, modelopt_config, spec_dir, dtype=next(target.parameters()).dtype,
                         device=model_device(target), seed=seed)
    layers = config.get("hidden_layers") or eagle_spec.hidden_layers(target.config.num_hidden_layers)
    return use_cpu_sdpa(module), tuple(layers), config


def build(
    target: Any, *, spec_dir: str | os.PathLike | None = None, path: str | os.PathLike | None = None, mode: str | None = None,
    choices: list[list[int]] | str | None = None, depth: int = 5, topk: int = 3, width: int = 3,
    chain_len: int = 4, budget: int = DEFAULT_BUDGET, max_depth: int = MAX_DEPTH, max_draft_len: int | None = None,
    draft_vocab: int | None = None, seed: int = 0,
) -> EagleProposer:
    """An EAGLE proposer from a spec/ folder (trained) or a fresh module (tests).

    mode chain | static (choices: eagle_choices) | dynamic (EAGLE-2: depth, topk, width, budget); by
    default static when choices are given, else dynamic. `path` is an alias of spec_dir (the
    deployment.json spirit: {"kind", "path", "choices", ...}).
    """
    spec_dir = spec_dir if spec_dir is not None else path
    mode = mode or ("static" if choices is not None else "dynamic")
    if mode not in MODES:
        raise SpecDeployError(f"unknown EAGLE tree mode '{mode}'", hint=f"use one of: {', '.join(MODES)}")
    if choices is not None and mode != "static":
        raise SpecDeployError(f"EAGLE choices are a static tree; mode {mode!r} would ignore them",
                              hint="drop mode (or use mode static) to draft those choices, or drop choices")
    for name, value in (("depth", depth), ("topk", topk), ("width", width), ("chain_len", chain_len), ("budget", budget)):
        if value <= 0:
            raise SpecDeployError(f"EAGLE {name} must be positive, got {value}", hint=f"pass a positive {name}")
    if depth > max_depth or chain_len > max_depth:
        raise SpecDeployError(f"EAGLE draft depth {max(depth, chain_len)} exceeds {max_depth}", hint=f"use at most {max_depth}")
    module, layers, config = _module_from(target, spec_dir, draft_vocab, seed)
    tree = None
    if mode == "static":
        tree = validate_choices(
            choices if choices is not None else config.get("choices", DEFAULT_TREE_10),
            max_depth=max_depth, max_draft_len=max_draft_len, name="eagle_choices",
        )
    lm_head = module.lm_head if hasattr(module, "lm_head") else target.get_output_embeddings()
    return EagleProposer(
        module, target.get_input_embeddings(), lm_head, layers, mode=mode, choices=tree,
        depth=depth, topk=topk, width=width, chain_len=chain_len, budget=budget,
    )
