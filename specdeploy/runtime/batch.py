"""In-flight batching: requests join and leave a running batch between rounds.

Each `step()` admits waiting requests (each prefilled alone, then joined to the batch), runs one
round for every active sequence, and retires the finished ones. A round is one batched target
forward: every sequence feeds its pending token plus its own draft (a chain, a tree, or nothing),
padded to the longest, and accepts its own path, exactly as `decoding.speculative_decode` does
for one request. Proposers draft for the whole batch where they can (`Proposer.propose_batch`).

All rows share one KV cache whose columns each row masks for itself (batch_cache.py); a row's
own decoding state, and what `add` takes and returns, are in batch_requests.py.

A round that does not speculate (more rows than `spec_off_above`) costs what a plain deployment's
step costs: it asks the target for no hidden states and hands the proposers nothing. When
speculation resumes, the positions consumed meanwhile are run through the target once more, in one
batched forward whose cache columns are dropped after (`_catch_up`), so each proposer's context is
whole again before it drafts. A row whose answer has fewer tokens left than it missed is not caught
up: it decodes plainly to its end (`_worth_catching_up`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specdeploy.errors import SpecDeployError
from specdeploy.runtime import batch_cache
from specdeploy.runtime.batch_requests import BatchRequest, BatchStats, Row, Sequence
from specdeploy.runtime.decoding import Hidden, _prompt_tensor, draft_budget, eos_token_ids, prefill, prune
from specdeploy.runtime.kv_cache import check_full_attention, crop
from specdeploy.runtime.sampling import next_token
from specdeploy.runtime.types import DraftTree, Proposer, model_device
from specdeploy.runtime.verify import accept, ancestry


class InflightBatcher:
    """Serves many requests at once; `add`/`cancel` may be called from any thread, `step` from one.

    `spec_off_above`: rounds with more active sequences than that decode plainly (one batched
    token each), as Arctic's disable_by_batch_size; None always speculates. Other arguments as
    `decoding.generate`; `proposer_factory` gives each sequence its own proposer (e.g. a built
    proposer's `fork`), None decodes plainly.
    """

    def __init__(self, target, proposer_factory: Callable[[], Proposer] | None, *, draft_len: int | None = None,
                 max_batch_size: int = 8, spec_off_above: int | None = None, decode=None,
                 context_length: int | None = None, adaptive: bool = True) -> None:
        if max_batch_size < 1:
            raise SpecDeployError(f"max_batch_size must be >= 1, got {max_batch_size}", hint="use 1 or more")
        if spec_off_above is not None and spec_off_above < 0:
            raise SpecDeployError(f"spec_off_above must be >= 0, got {spec_off_above}",
                                  hint="leave it unset to always speculate, 0 never speculates")
        draft_budget(draft_len, chain=True)  # refused now, not at each request
        check_full_attention(target.config, "in-flight batching (serving, the load plan)",
                             hint="serve it with TensorRT-LLM on a GPU host; in-process, `specdeploy generate --spec none` "
                                  "decodes it one request at a time")
        self.target, self.proposer_factory = target, proposer_factory
        self.draft_len, self.max_batch_size, self.spec_off_above = draft_len, max_batch_size, spec_off_above
        self.decode, self.adaptive = decode, adaptive
        self.context_length = context_length or target.config.max_position_embeddings
        self.device = model_device(target)
        self.vocab = target.get_input_embeddings().num_embeddings
        self.eos = eos_token_ids(target)
        self.stats = BatchStats()
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards _waiting and _cancel (add/cancel come from other threads)
        self._waiting: deque[Row] = deque()
        self._cancel: set[int] = set()
        self._rows: list[Row] = []  # row i of the batch cache
        self._cache: DynamicCache | None = None
        self._valid: torch.Tensor | None = None  # (rows, columns) bool: the columns holding a row's tokens
        self._finished: list[Sequence] = []

    @property
    def active(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ requests
    def add(self, request: BatchRequest) -> Sequence:
        """Validate a request now (SpecDeployError); it is admitted at the next step with room."""
        request.params.validate()
        prompt = _prompt_tensor(request.prompt_ids, self.context_length, self.device)
        if request.params.stop_strings and self.decode is None:
            raise SpecDeployError("stop strings need the tokenizer", hint="pass decode=tokenizer.decode")
        proposer = request.proposer or (self.proposer_factory() if self.proposer_factory else None)
        seq = Sequence(id=next(self._ids), arrival_ns=time.time_ns())
        row = Row(seq, request, prompt, proposer, draft_len=self.draft_len, adaptive=self.adaptive, device=self.device,
                  context_length=self.context_length, eos=self.eos, decode=self.decode)
        with self._lock:
            self._waiting.append(row)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Finish `seq` as cancelled at the next step (its KV freed then)."""
        with self._lock:
            self._cancel.add(seq.id)

    def step(self) -> list[Sequence]:
        """Admit waiting requests, run one round for all active ones; the sequences that finished
        in this step (cancelled ones included)."""
        self._finished = []
        with torch.inference_mode():
            self._cancel_requested()
            self._admit()
            if self._rows:
                self._round()
                self._retire()
        return self._finished

    # ------------------------------------------------------------------ lifecycle
    def _finish(self, row: Row, reason: str | None = None, error: Exception | None = None) -> None:
        row.seq.error = error
        row.seq.result = row.result(reason or row.output.finish_reason or "length")
        row.seq.done = True
        self._finished.append(row.seq)

    def _cancel_requested(self) -> None:
        with self._lock:
            cancel, self._cancel = self._cancel, set()
            waiting = [row for row in self._waiting if row.seq.id in cancel]
            for row in waiting:
                self._waiting.remove(row)
        for row in waiting + [row for row in self._rows if row.seq.id in cancel and not row.seq.done]:
            self._finish(row, "cancelled")
        if cancel:
            self._retire()

    def _admit(self) -> None:
        while len(self._rows) < self.max_batch_size:
            with self._lock:
                if not self._waiting:
                    return
                row = self._waiting.popleft()
            self._prefill(row)

    def _prefill(self, row: Row) -> None:
        """Prefill a request alone and join it to the batch (unless its first token ends it)."""
        row.seq.first_scheduled_ns = time.time_ns()
        row.start = time.perf_counter()
        try:
            cache = DynamicCache(config=self.target.config)
            logits, row.unseen = prefill(self.target, row.prompt, cache, row.hidden_layers)
            row.metrics.time_to_first_token_s = time.perf_counter() - row.start
            first = next_token(row.output.hold_off_end(logits[None], [0])[0], row.params, row.generator)
            if row.emit(row.output.take([first])):
                self._finish(row)
                return
        except Exception as err:  # this request's failure (its on_tokens, say): the batch goes on
            self._finish(row, "cancelled", err)
            return
        self._cache, self._valid = batch_cache.join(self._cache, self._valid, cache, self.device)
        self._rows.append(row)

    def _retire(self) -> None:
        """Drop finished rows from the batch (their KV with them), compact when worth it."""
        keep = [i for i, row in enumerate(self._rows) if not row.seq.done]
        if not keep:
            self._rows, self._cache, self._valid = [], None, None
            return
        if len(keep) < len(self._rows):
            self._rows = [self._rows[i] for i in keep]
            self._valid = batch_cache.keep_rows(self._cache, self._valid, keep)
        self._valid = batch_cache.compact(self._cache, self._valid)

    # ------------------------------------------------------------------ one round
    def _round(self) -> None:
        rows = self._rows
        speculate = self._speculates(rows)
        try:
            if speculate:
                self._catch_up(rows)
        except Exception as err:
            self._fail(rows, err)
            return
        start = time.perf_counter()  # after the catch-up: a resumption's one-off is no round's cost
        trees = self._draft(rows, speculate)
        try:
            logits, hidden = self._verify(rows, trees)
        except Exception as err:
            self._fail(rows, err)
            return
        self.stats.rounds += 1
        seconds = time.perf_counter() - start
        kept = [self._advance_or_finish(i, row, tree, logits, hidden, seconds if speculate else None)
                for i, (row, tree) in enumerate(zip(rows, trees))]
        self._valid = torch.cat([self._valid, torch.tensor(kept, dtype=torch.bool, device=self.device)], dim=1)

    def _speculates(self, rows: list[Row]) -> bool:
        return self.spec_off_above is None or len(rows) <= self.spec_off_above

    def _fail(self, rows: list[Row], err: Exception) -> None:
        """A batch forward failed: the cache is no longer whole, so every row ends with the error."""
        for row in rows:
            if not row.seq.done:
                self._finish(row, "cancelled", err)

    def _catch_up(self, rows: list[Row]) -> None:
        """Hand each proposer the target states of the positions consumed while speculation was
        off: they run through the target once more, all rows in one forward over the batch cache,
        each query seeing its row's cached positions before its own (which hold exactly what the
        first run saw) and itself; the columns this appends are dropped again."""
        behind = [row.consumed - row.captured if self._worth_catching_up(row) else 0 for row in rows]
        if not any(behind):
            return
        width, columns = max(behind), self._valid.shape[1]
        ids, positions = [], []
        for row, n in zip(rows, behind):
            ids.append(row.tokens()[0, row.captured: row.captured + n].tolist() + [row.pending] * (width - n))
            positions.append(list(range(row.captured, row.captured + n)) + [row.consumed] * (width - n))
        position = torch.tensor(positions, dtype=torch.long, device=self.device)
        past = batch_cache.seen_before(self._valid, position)
        itself = torch.eye(width, dtype=torch.bool, device=self.device).expand(len(rows), -1, -1)
        out = self.target.get_decoder()(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            position_ids=position,
            attention_mask=batch_cache.additive_mask(torch.cat([past, itself], dim=2), self.target.dtype),
            past_key_values=self._cache,
            use_cache=True,
            output_hidden_states=True,
        )
        crop(self._cache, columns)
        for i, (row, n) in enumerate(zip(rows, behind)):
            if n:
                row.see({layer: out.hidden_states[layer][i : i + 1, :n] for layer in row.hidden_layers})
                row.captured = row.consumed

    @staticmethod
    def _worth_catching_up(row: Row) -> bool:
        """Whether a row's proposer should be handed the states it missed while speculation was off.
        Catching up n positions costs a forward over n tokens; the gain is a fraction of each token
        still to come. A row with fewer tokens left (by its max_new_tokens) than it missed, as when
        a busy spell's last answers shrink the batch, stays plain to its end: in-process, the load
        test's closed loop at concurrency 8 with spec_off_above 4 ran at 0.977 of the plain twin
        catching every row up, 0.987 with this rule, 0.997 catching none up (docs/measurements.md,
        2026-11-27); a row with most of a long answer to come is still caught up and speculates."""
        missed = row.consumed - row.captured
        return bool(row.hidden_layers) and 0 < missed <= row.max_new - len(row.output.tokens)

    @staticmethod
    def _in_step(row: Row) -> bool:
        """Whether the row's proposer holds every position's states (or needs none): only then may it draft."""
        return not row.hidden_layers or row.captured == row.consumed

    def _draft(self, rows: list[Row], speculate: bool) -> list[DraftTree]:
        """This round's draft for each row (empty: a plain step), proposed together where the
        proposer can (`Proposer.propose_batch`)."""
        lengths = [row.controller.next_length() if speculate and row.proposer is not None and self._in_step(row) else 0
                   for row in rows]
        asks = {row: length if row.chain else row.max_draft for row, length in zip(rows, lengths) if length}
        # rows of one proposer class draft together (a request may bring its own proposer: a client's draft)
        groups: dict[type, list[Row]] = {}
        for row in asks:
            groups.setdefault(type(row.proposer), []).append(row)
        trees = {row: DraftTree.empty(self.device) for row in rows}
        for group in groups.values():
            try:
                drafts = group[0].proposer.propose_batch([row.proposer for row in group], [row.state() for row in group],
                                                         [asks[row] for row in group])
            except Exception:  # one row's proposer failed: draft row by row to find whose
                drafts = [self._propose_alone(row, asks[row]) for row in group]
            for row, tree in zip(group, drafts):
                row.unseen = {}
                trees[row] = prune(self._checked(row, tree), row.max_draft, row.max_new - len(row.output.tokens) - 1)
        return [trees[row] for row in rows]

    def _checked(self, row: Row, tree: DraftTree) -> DraftTree:
        """A row's draft, or none (the row ends with the error) where it would fail the batch's shared
        forward: a token outside the target's vocabulary, a node whose parent does not come before it."""
        lowest, highest = torch.stack(tree.tokens.aminmax()).tolist() if len(tree) else (0, 0)  # one device sync
        bad = ("a token outside the vocabulary" if not 0 <= lowest <= highest < self.vocab
               else "a node whose parent does not precede it" if any(not -1 <= p < i for i, p in enumerate(tree.parents))
               else None)
        if bad is None:
            return tree
        self._finish(row, "cancelled", SpecDeployError(f"the proposer ({type(row.proposer).__name__}) drafted {bad}",
                                                       hint="a bug in that proposer: the request ended, the batch went on"))
        return DraftTree.empty(self.device)

    def _propose_alone(self, row: Row, max_tokens: int) -> DraftTree:
        try:
            return row.proposer.propose(row.state(), max_tokens)
        except Exception as err:  # its proposer's failure: the row rides along padded, then leaves
            self._finish(row, "cancelled", err)
            return DraftTree.empty(self.device)

    def _verify(self, rows: list[Row], trees: list[DraftTree]) -> tuple[torch.Tensor, Hidden]:
        """One target forward over every row's [pending] + draft, padded to the longest: logits
        (rows, width, vocab) and, in a round that speculates, the hidden states the proposers asked for."""
        width = 1 + max(len(tree) for tree in trees)
        ids, positions, blocks = [], [], []
        for row, tree in zip(rows, trees):
            pad = width - 1 - len(tree)
            ids.append([row.pending] + tree.tokens.tolist() + [row.pending] * pad)
            positions.append([row.consumed + depth for depth in [0] + tree.depths()] + [row.consumed] * pad)
            blocks.append(F.pad(ancestry(tree.parents, self.device), (0, pad, 0, pad)))
        # padding queries see only themselves; no real query ever sees a padding column
        new = torch.stack(blocks) | torch.eye(width, dtype=torch.bool, device=self.device)
        allowed = torch.cat([self._valid[:, None, :].expand(-1, width, -1), new], dim=2)
        speculating = [row for row in rows if self._in_step(row)] if self._speculates(rows) else []
        layers = sorted({layer for row in speculating for layer in row.hidden_layers})
        out = self.target(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            position_ids=torch.tensor(positions, dtype=torch.long, device=self.device),
            attention_mask=batch_cache.additive_mask(allowed, self.target.dtype),
            past_key_values=self._cache,
            use_cache=True,
            output_hidden_states=bool(layers),
        )
        return out.logits, {layer: out.hidden_states[layer] for layer in layers}

    def _advance_or_finish(self, i: int, row: Row, tree: DraftTree, logits: torch.Tensor, hidden: Hidden,
                           seconds: float | None) -> list[bool]:
        """`_advance`, where a failure (its sampling, its proposer's update) ends this row alone: the
        cache already holds the round's columns, so every row must still say which it keeps."""
        try:
            return self._advance(i, row, tree, logits, hidden, seconds)
        except Exception as err:
            if not row.seq.done:
                self._finish(row, "cancelled", err)
            return [False] * logits.shape[1]

    def _advance(self, i: int, row: Row, tree: DraftTree, logits: torch.Tensor, hidden: Hidden,
                 seconds: float | None) -> list[bool]:
        """Accept row i's path and emit it; which of the round's columns the row keeps.
        `seconds` None: a round forced plain by spec_off_above, which says nothing to the controller."""
        width = logits.shape[1]
        if row.seq.done:  # failed while drafting: leaves at the end of the step
            return [False] * width
        group, path = self._accept(i, row, tree, logits)
        columns = [0] + [node + 1 for node in path]
        if row.hidden_layers and hidden and self._in_step(row):  # a round that speculates hands the proposer its states
            index = torch.tensor(columns, dtype=torch.long, device=self.device)
            row.see({layer: hidden[layer][i : i + 1].index_select(1, index.to(hidden[layer].device))
                     for layer in row.hidden_layers})
            row.captured = row.consumed + len(columns)
        if seconds is not None:
            row.controller.record(len(path), len(tree), seconds)
        taken = row.output.take(group)
        emitted = min(len(path), len(taken))  # a stop inside the path: its tail is never emitted
        self._count(row, tree, emitted)
        row.consumed += len(columns)
        try:
            if row.emit(taken):
                self._finish(row)
        except Exception as err:  # its on_tokens raised: only this sequence ends
            self._finish(row, "cancelled", err)
        return [column in columns for column in range(width)]

    def _accept(self, i: int, row: Row, tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Row i's accepted tokens and the draft nodes on their path (none for a plain step)."""
        if not len(tree):
            return [next_token(row.output.hold_off_end(logits[i, :1], [0])[0], row.params, row.generator)], []
        rows = row.output.hold_off_end(logits[i, : 1 + len(tree)], [0] + tree.depths())
        acceptance = accept(tree, rows, row.params, row.generator)
        group, path = acceptance.tokens(tree), acceptance.path
        row.proposer.update(len(path), len(tree))
        return group, path

    def _count(self, row: Row, tree: DraftTree, emitted: int) -> None:
        """One verification in the batcher's counters and the sequence's."""
        self.stats.record(max(tree.depths(), default=0), emitted, len(tree))
        row.metrics.target_forwards += 1
        row.metrics.draft_tokens += len(tree)
        row.metrics.accepted_draft_tokens += emitted
