"""EAGLE drafting for an in-flight batch: one module forward ingests every request's new positions
(rows padded and masked, each request keeping its own cache columns), then chains and dynamic trees
grow depth by depth for the whole batch. EagleProposer.propose and propose_batch run these; the
tree node (`_Node`) is shared with the proposer's one-request reference paths."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F

from specdeploy.runtime.kv_cache import cache_layers
from specdeploy.runtime.types import DraftTree, TargetState

if TYPE_CHECKING:
    from specdeploy.runtime.proposers.eagle import EagleProposer

MAX_DEPTH = 8
# new positions above which a request in a batch takes them in alone first: a round adds at most
# MAX_DEPTH + 1, a prompt (a request joining a running batch) usually far more
CATCH_UP = 2 * (MAX_DEPTH + 1)


@dataclass
class _Node:
    draft_id: int
    parent: int  # -1: child of the pending token
    depth: int
    score: float  # log of the cumulative draft probability of the path
    col: int = -1  # column of this node's entry in the module cache, once expanded
    h: torch.Tensor | None = None  # the module's output feature at this node (its children's input)
    logp: torch.Tensor | None = None  # draft log-probs of this node's children
    children: list[int] = field(default_factory=list)


@dataclass
class _Batch:
    """Requests' module state after ingesting, stacked: the cache of them all (rows padded to
    the longest, `valid` marks each row's own columns), each root's draft log-probs and feature
    (what follows the pending token) and the position of its pending token."""

    cache: Any
    valid: torch.Tensor  # (rows, columns) bool
    logp: torch.Tensor  # (rows, draft vocab)
    h: torch.Tensor  # (rows, hidden)
    base: list[int]

    def take(self, rows: list[int], config: Any) -> "_Batch":
        """Rows `rows` alone (the cache itself when that is every row: its owner drafts on it)."""
        if rows == list(range(len(self.base))):
            return self
        index = torch.tensor(rows, device=self.valid.device)
        return _Batch(_select_rows(self.cache, index, config), self.valid[index], self.logp[index], self.h[index],
                      [self.base[r] for r in rows])


class _Feed(NamedTuple):
    """One request's new positions: target features (n, 3 * hidden), the tokens that followed
    them, and the span [start, consumed) they hold."""

    aux: torch.Tensor
    tokens: torch.Tensor
    start: int
    consumed: int


def _new_positions(p: EagleProposer, state: TargetState) -> int:
    """Positions the target consumed whose states `state` hands over (at most all but the pending token)."""
    return min(state.hidden[p.hidden_layers[0]].shape[1], state.tokens.shape[1] - 1)


def _first_to_feed(p: EagleProposer, state: TargetState) -> int:
    """The first position of `state` the module must take in. Positions before the first handed
    over that it never saw stay out of its cache (a gap). A failed batch draft retried row by row
    hands over positions it already took in: it goes on from where it stopped, taking its last one
    in again (the draft grows from that position's output)."""
    consumed = state.tokens.shape[1] - 1
    start = consumed - _new_positions(p, state)
    return start if p.fed_until > consumed else max(start, min(p.fed_until, consumed - 1))


def _feed(p: EagleProposer, state: TargetState) -> _Feed:
    tokens = state.tokens[0]
    consumed = len(tokens) - 1
    aux = torch.cat([state.hidden[layer][0].to(p.device) for layer in p.hidden_layers], dim=-1)
    begin = _first_to_feed(p, state)
    if p.fed_until > consumed:  # states from before what it took in: another request's
        p.reset()
    p.cache_len -= max(0, p.fed_until - begin)  # a retried position's entry is made again
    p.cache.crop(p.cache_len)
    return _Feed(aux[begin - consumed:], tokens[begin + 1: consumed + 1].to(p.device), begin, consumed)


def _ingest_many(proposers: list[EagleProposer], states: list[TargetState]) -> _Batch:
    """Feed each request the positions its target consumed since it last proposed, all in one
    module forward; each request's own cache keeps its real positions (padding never does)."""
    lead, device = proposers[0], proposers[0].device
    feeds = [_feed(p, state) for p, state in zip(proposers, states)]
    q = max(len(feed.tokens) for feed in feeds)
    cache, valid = _stacked_caches(proposers)
    lengths = torch.tensor([len(feed.tokens) for feed in feeds], device=device)
    new = torch.arange(q, device=device)
    # causal over each row's own new positions; padding queries see only themselves
    block = (new[None, :, None] >= new[None, None, :]) & (new[None, None, :] < lengths[:, None, None])
    block = block | torch.eye(q, dtype=torch.bool, device=device)
    allowed = torch.cat([valid[:, None, :].expand(-1, q, -1), block], dim=2)
    aux = torch.stack([F.pad(feed.aux, (0, 0, 0, q - len(feed.tokens))) for feed in feeds])
    tokens = torch.stack([F.pad(feed.tokens, (0, q - len(feed.tokens))) for feed in feeds])
    positions = torch.stack([F.pad(torch.arange(feed.start, feed.consumed, device=device),
                                   (0, q - len(feed.tokens)), value=feed.consumed) for feed in feeds])
    post, pre = lead._run(lead.module.fc(aux.to(lead.dtype)), tokens, positions, allowed, cache)
    _keep_own_columns(proposers, feeds, cache, valid.shape[1])
    last, every = lengths - 1, torch.arange(len(feeds), device=device)
    valid = torch.cat([valid, block[every, last]], dim=1)
    return _Batch(cache, valid, lead._logp(post[every, last]), pre[every, last], [feed.consumed for feed in feeds])


def _caught_up(proposers: list[EagleProposer], states: list[TargetState]) -> list[TargetState]:
    """In a batch, a request with more than CATCH_UP new positions feeds all but its last alone
    (one forward of its own), so the batch's forward is not padded to a prompt's length for every
    row: at concurrency 8 a request joins every few rounds. The states left for the batch."""
    if len(proposers) == 1:
        return states
    left = []
    for p, state in zip(proposers, states):
        if state.tokens.shape[1] - 1 - _first_to_feed(p, state) > CATCH_UP:
            _ingest_many([p], [replace(state, tokens=state.tokens[:, :-1],
                                       hidden={layer: h[:, :-1] for layer, h in state.hidden.items()})])
            state = replace(state, hidden={layer: h[:, -1:] for layer, h in state.hidden.items()})
        left.append(state)
    return left


def _stacked_caches(proposers: list[EagleProposer]) -> tuple[Any, torch.Tensor]:
    """The requests' module caches as rows of one, padded to the longest; which columns are real."""
    from transformers import DynamicCache

    device, past = proposers[0].device, max(p.cache_len for p in proposers)
    cache = DynamicCache(config=proposers[0].module.config)
    template = next((cache_layers(p.cache) for p in proposers if p.cache_len), [])
    for index, layer in enumerate(template):  # none when no request has a past yet
        rows = [cache_layers(p.cache)[index] if p.cache_len else None for p in proposers]
        keys = [_padded(row.keys if row else layer.keys[..., :0, :], past) for row in rows]
        values = [_padded(row.values if row else layer.values[..., :0, :], past) for row in rows]
        cache.update(torch.cat(keys), torch.cat(values), index)
    lengths = torch.tensor([p.cache_len for p in proposers], device=device)
    return cache, torch.arange(past, device=device)[None] < lengths[:, None]


def _keep_own_columns(proposers: list[EagleProposer], feeds: list[_Feed], cache: Any, past: int) -> None:
    """Each request's cache becomes its past plus its new positions, taken from the batch's."""
    from transformers import DynamicCache

    for row, (p, feed) in enumerate(zip(proposers, feeds)):
        own = torch.cat([torch.arange(p.cache_len, device=p.device),
                         torch.arange(past, past + len(feed.tokens), device=p.device)])
        p.cache = DynamicCache(config=p.module.config)
        for index, layer in enumerate(cache_layers(cache)):
            p.cache.update(layer.keys[row: row + 1, :, own], layer.values[row: row + 1, :, own], index)
        p.cache_len += len(feed.tokens)
        p.fed_until = feed.consumed


def _chains(lead: EagleProposer, batch: _Batch, rows: list[int], lengths: list[int]) -> list[DraftTree]:
    """Greedy top-1 chains for batch rows `rows`, one module forward per depth for them all (rows
    wanting fewer tokens draft along and are cut: a row's draft never depends on the others)."""
    batch = batch.take(rows, lead.module.config)
    logp, h, valid, cache = batch.logp, batch.h, batch.valid, batch.cache
    base = torch.tensor(batch.base, device=lead.device)
    own = torch.ones(len(rows), 1, dtype=torch.bool, device=lead.device)
    drafted = []
    for depth in range(1, max(lengths) + 1):
        drafted.append(logp.topk(1).indices[:, 0])
        if depth == max(lengths):
            break
        allowed = torch.cat([valid, own], dim=1)[:, None]
        post, pre = lead._run(h[:, None], lead._target_ids(drafted[-1])[:, None], (base + depth - 1)[:, None],
                              allowed, cache)
        logp, h, valid = lead._logp(post[:, 0]), pre[:, 0], torch.cat([valid, own], dim=1)
    tokens = lead._target_ids(torch.stack(drafted, dim=1))
    return [DraftTree.chain(tokens[r, :n]) for r, n in enumerate(lengths)]


def _dynamic_trees(proposers: list[EagleProposer], batch: _Batch, rows: list[int], sizes: list[int]) -> list[DraftTree]:
    """EAGLE-2 dynamic trees for batch rows `rows`: each request's tree grows as it would alone
    (`_dynamic_steps`), and each depth's expansions of all of them run in one module forward
    (a request that stopped early, or expands fewer nodes, rides along as padding)."""
    lead = proposers[0]
    batch = batch.take(rows, lead.module.config)
    cache, valid = batch.cache, batch.valid
    steps = [p._dynamic_steps(logp, n) for p, logp, n in zip(proposers, batch.logp, sizes)]
    expanding: list[tuple[list[_Node], list[int]] | None] = [None] * len(rows)
    done: list[tuple[list[_Node], list[int]] | None] = [None] * len(rows)

    def advance(k: int) -> None:
        try:
            expanding[k] = next(steps[k])
        except StopIteration as finished:
            expanding[k], done[k] = None, finished.value

    for k in range(len(rows)):
        advance(k)
    while any(expanding):
        columns = valid.shape[1]
        _expand_together(lead, expanding, batch.h, batch.base, valid, cache)
        valid = F.pad(valid, (0, cache.get_seq_length() - columns))  # draft columns are nobody's past
        for k, step in enumerate(expanding):
            if step is not None:
                advance(k)
    return [p._tree(*result) for p, result in zip(proposers, done)]


def _expand_together(lead: EagleProposer, expanding: list, roots: torch.Tensor, bases: list[int], valid: torch.Tensor,
                     cache: Any) -> None:
    """One module forward over every row's nodes to expand (rows padded to the most); each node
    sees its row's past, its ancestors and itself, and gets its cache column, feature and log-probs."""
    device, columns = lead.device, valid.shape[1]
    q = max(len(step[1]) for step in expanding if step is not None)
    padding = torch.zeros_like(roots[0])
    hidden = [[padding] * q for _ in expanding]  # stacked once: element writes cost a GPU launch each
    tokens = [[0] * q for _ in expanding]
    positions = [[base] * q for base in bases]
    allowed = torch.cat([valid[:, None, :].expand(-1, q, -1), torch.eye(q, dtype=torch.bool, device=device)
                         .expand(len(expanding), -1, -1)], dim=2)
    seen = []  # (row, query, column) of each ancestor a node attends to
    for k, step in enumerate(expanding):
        if step is None:
            continue
        nodes, ids = step
        for j, i in enumerate(ids):
            parent = nodes[i].parent
            hidden[k][j] = roots[k] if parent < 0 else nodes[parent].h
            tokens[k][j] = lead._target_id(nodes[i].draft_id)
            positions[k][j] = bases[k] + nodes[i].depth - 1
            while parent >= 0:
                seen.append((k, j, nodes[parent].col))
                parent = nodes[parent].parent
    if seen:
        allowed[tuple(torch.tensor(seen, device=device).T)] = True
    post, pre = lead._run(torch.stack([torch.stack(row) for row in hidden]), torch.tensor(tokens, device=device),
                          torch.tensor(positions, device=device), allowed, cache)
    logp = lead._logp(post)
    for k, step in enumerate(expanding):
        if step is None:
            continue
        nodes, ids = step
        for j, i in enumerate(ids):
            nodes[i].col, nodes[i].h, nodes[i].logp = columns + j, pre[k, j], logp[k, j]


def _padded(kv: torch.Tensor, columns: int) -> torch.Tensor:
    return F.pad(kv, (0, 0, 0, columns - kv.shape[-2]))


def _select_rows(cache: Any, index: torch.Tensor, config: Any) -> Any:
    from transformers import DynamicCache

    chosen = DynamicCache(config=config)
    for i, layer in enumerate(cache_layers(cache)):
        chosen.update(layer.keys.index_select(0, index), layer.values.index_select(0, index), i)
    return chosen
