"""In-flight batching: every sequence of a running batch decodes exactly as it would alone.

Targets run in float64 here: a batched forward sums over padded, masked columns in another order
than a solo one, and float64 keeps those rounding differences far below any argmax gap, so
"equal to its solo generate()" is a test of the masks, positions and KV bookkeeping only."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdeploy.errors import SpecDeployError
from specdeploy.runtime.batch import InflightBatcher
from specdeploy.runtime.batch_requests import BatchRequest
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.deployment import load_decoder
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import DraftTree, Proposer, SamplingParams, TargetState, model_device
from tests.test_runtime_device import FactoryCalls
from tests.test_runtime_helpers import PROMPTS, OracleTreeProposer, one_thread, tokenizer  # noqa: F401

NEW = 24
MORE_PROMPTS = PROMPTS + ["for i in range(10):\n", "Speculative decoding proposes tokens", "The"]
# (step it is added at, prompt index, max_new_tokens): joins while others run, short ones leave
# early, and with max_batch_size 3 later ones wait for a free row
SCHEDULE = [(0, 0, NEW), (0, 1, 6), (1, 2, 20), (3, 3, 12), (3, 4, NEW), (4, 5, 16)]


@pytest.fixture(scope="module")
def target64(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def draft64(tiny_draft_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_draft_dir, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in MORE_PROMPTS]


class TruthTrees(OracleTreeProposer):
    """OracleTreeProposer for whichever known continuation the request is on: one proposer kind
    for a whole batch, whose trees get true paths accepted through wrong siblings."""

    def __init__(self, truths: list[list[int]], vocab: int) -> None:
        super().__init__(truths[0], vocab)
        self.truths = truths

    def propose(self, state, max_tokens):
        tokens = state.tokens[0].tolist()
        self.truth = next(truth for truth in self.truths if truth[: len(tokens)] == tokens)
        return super().propose(state, max_tokens)


def make_proposer(kind: str, target, draft, truths=None):
    return {
        "none": lambda: None,
        "ngram": lambda: build_proposer("ngram", target),
        "draft": lambda: build_proposer("draft", target, draft_model=draft),
        "draft-restricted": lambda: build_proposer("draft", target, draft_model=draft, head_rows=64, stop_below=0.3),
        # the target drafting for itself: long accepted groups
        "self-draft": lambda: build_proposer("draft", target, draft_model=target),
        "eagle-chain": lambda: build_proposer("eagle", target, mode="chain", chain_len=3),
        "eagle-tree": lambda: build_proposer("eagle", target, mode="dynamic", depth=3, draft_vocab=96),
        "medusa": lambda: build_proposer("medusa", target, choices=[[0], [1], [0, 0], [0, 0, 0]]),
        "dflash": lambda: build_proposer("dflash", target, block_size=4),
        "oracle-tree": lambda: TruthTrees(truths, vocab=target.config.vocab_size),
    }[kind]()


def check_cache(batcher: InflightBatcher) -> None:
    """The batch cache invariants: one row per active sequence, each row's valid columns are
    exactly its consumed tokens, and compaction keeps the masked columns under half."""
    if not batcher.active:
        assert batcher._cache is None
        return
    valid = batcher._valid
    assert batcher._cache.layers[0].keys.shape[0] == valid.shape[0] == batcher.active
    assert batcher._cache.get_seq_length() == valid.shape[1]
    counts = valid.sum(dim=1)
    assert counts.tolist() == [row.consumed for row in batcher._rows]
    assert valid.shape[1] < 2 * int(counts.max())


def run(batcher: InflightBatcher, requests: list[tuple[int, BatchRequest]]) -> tuple[list, int, bool]:
    """Add each request at its step, step until all are done: the sequences, the peak batch and
    whether a request ever waited for a row."""
    todo = sorted(enumerate(requests), key=lambda item: item[1][0])
    seqs, peak, waited, step = [None] * len(requests), 0, False, 0
    while todo or batcher.active or batcher.waiting:
        while todo and todo[0][1][0] <= step:
            index, (_, request) = todo.pop(0)
            seqs[index] = batcher.add(request)
        finished = batcher.step()
        assert all(seq.done for seq in finished)
        peak = max(peak, batcher.active + len(finished))
        waited = waited or batcher.waiting > 0
        assert batcher.active <= batcher.max_batch_size
        check_cache(batcher)
        step += 1
        assert step < 500, "the batch never drained"
    return seqs, peak, waited


def scheduled(prompts, params=lambda max_new: SamplingParams(max_new_tokens=max_new)):
    return [(step, BatchRequest(prompts[p], params(max_new))) for step, p, max_new in SCHEDULE]


def solo(target, request: BatchRequest, proposer) -> list[int]:
    return generate(target, request.prompt_ids, request.params, proposer, draft_len=4).token_ids


# ---------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("kind", ["none", "ngram", "draft", "draft-restricted", "self-draft", "eagle-chain",
                                  "eagle-tree", "medusa", "dflash", "oracle-tree"])
def test_batched_greedy_equals_solo(kind, target64, draft64, prompts):
    requests = scheduled(prompts)
    # a stop token (the 4th token of a solo run) ends one request early with "stop"
    first = solo(target64, requests[2][1], None)
    requests[2] = (1, BatchRequest(prompts[2], SamplingParams(max_new_tokens=20, stop_token_ids=(first[3],))))
    truths = [request.prompt_ids + solo(target64, request, None) for _, request in requests]
    base = make_proposer(kind, target64, draft64, truths)
    expected = [solo(target64, request, base) for _, request in requests]
    groups: list[list[int]] = []
    requests[0][1].on_tokens = groups.append
    # adaptive off: every round drafts its full shape, so the acceptance counts below do not depend on timing
    batcher = InflightBatcher(target64, base.fork if base else None, draft_len=4, max_batch_size=3, adaptive=False)
    seqs, peak, waited = run(batcher, requests)
    assert [seq.result.token_ids for seq in seqs] == expected
    assert [token for group in groups for token in group] == expected[0]
    assert peak == 3 and waited
    assert seqs[2].result.finish_reason == "stop" and seqs[0].result.finish_reason == "length"
    for seq in seqs:
        assert seq.error is None
        assert seq.arrival_ns <= seq.first_scheduled_ns <= seq.first_token_ns <= seq.last_token_ns
        assert seq.result.metrics.new_tokens == len(seq.result.token_ids)
    if kind != "none":
        assert batcher.stats.draft_tokens > 0, "speculation never ran"
        assert sum(seq.result.metrics.draft_tokens for seq in seqs) == batcher.stats.draft_tokens
    if kind in ("self-draft", "oracle-tree"):
        assert batcher.stats.accepted_draft_tokens >= NEW
        assert batcher.stats.accepted_at_position[0] <= batcher.stats.drafted_at_position[0]


def test_rows_do_not_leak_into_each_other(target64, prompts):
    """Two prompts that differ only in their first token, decoded side by side."""
    first = prompts[2]
    second = [first[0] + 1] + first[1:]
    requests = [(0, BatchRequest(ids, SamplingParams(max_new_tokens=NEW))) for ids in (first, second)]
    requests.append((2, BatchRequest(prompts[4], SamplingParams(max_new_tokens=NEW))))
    expected = [solo(target64, request, None) for _, request in requests]
    assert expected[0] != expected[1], "the test needs prompts the model tells apart"
    seqs, _, _ = run(InflightBatcher(target64, None), requests)
    assert [seq.result.token_ids for seq in seqs] == expected


def test_qwen2_batches_exactly(prompts):
    """Qwen2 (biased q/k/v projections, its own mask code path) honours the batch masks too."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3, eos_token_id=0)
    target = Qwen2ForCausalLM(config).to(torch.float64).eval()
    base = build_proposer("ngram", target)
    requests = scheduled(prompts)
    expected = [solo(target, request, base) for _, request in requests]
    seqs, _, _ = run(InflightBatcher(target, base.fork, draft_len=4, max_batch_size=3), requests)
    assert [seq.result.token_ids for seq in seqs] == expected


def test_fork_shares_weights_not_request_state(target64, draft64):
    restricted = make_proposer("draft-restricted", target64, draft64)
    twin = restricted.fork()
    assert twin.draft is restricted.draft and twin.head.weight is restricted.head.weight
    twin.head.see([300, 301])  # ids past the head's 64 common rows: this request's own
    assert twin.head.extra_ids == [300, 301] and restricted.head.extra_ids == []
    assert twin.cache is not restricted.cache
    eagle = make_proposer("eagle-tree", target64, None)
    assert eagle.fork().module is eagle.module and eagle.fork().cache is not eagle.cache


def test_medusa_drafts_a_batch_as_each_request_alone(target64):
    """One head call for the whole batch: each row gets the tree its own hidden state gives."""
    base = make_proposer("medusa", target64, None)
    gen = torch.Generator().manual_seed(0)
    width = target64.config.hidden_size
    states = [TargetState(tokens=torch.tensor([[1, 2 + i]]),
                          hidden={-1: 4 * torch.randn(1, 1 + i, width, generator=gen, dtype=torch.float64)}) for i in range(3)]
    states.append(TargetState(tokens=torch.tensor([[1]])))  # no target states yet: nothing to draft from
    forks, asks = [base.fork() for _ in states], [4, 2, 3, 4]
    batched = base.propose_batch(forks, states, asks)
    alone = [fork.propose(state, n) for fork, state, n in zip(forks, states, asks)]
    assert [(t.tokens.tolist(), t.parents) for t in batched] == [(t.tokens.tolist(), t.parents) for t in alone]
    assert [len(t) for t in batched] == [4, 2, 3, 0]
    assert len({tuple(t.tokens[:2].tolist()) for t in batched[:3]}) == 3  # the rows' own drafts, not one row's


def test_a_request_with_its_own_proposer_drafts_beside_the_deployments(target64, prompts):
    """A request may bring its own proposer (a client's draft tokens): the rows of each proposer
    class draft together, so the deployment's Medusa heads do not draft (nothing) for it."""
    mine = BatchRequest(prompts[2], SamplingParams(max_new_tokens=NEW))
    truth = prompts[2] + solo(target64, mine, None)
    mine.proposer = OracleTreeProposer(truth, target64.config.vocab_size)
    batcher = InflightBatcher(target64, make_proposer("medusa", target64, None).fork, draft_len=4, adaptive=False)
    seqs, peak, _ = run(batcher, [(0, BatchRequest(prompts[0], SamplingParams(max_new_tokens=NEW))), (0, mine)])
    assert peak == 2 and seqs[1].result.token_ids == truth[len(prompts[2]):]
    assert seqs[1].result.metrics.accepted_draft_tokens > 0  # its own drafts reached the verify
    assert seqs[0].result.metrics.draft_tokens > 0  # and Medusa drafted for the other


# ---------------------------------------------------------------------------------- leaving early


def test_cancel_frees_the_row_and_the_others_continue(target64, draft64, prompts):
    base = make_proposer("draft", target64, draft64)
    requests = [BatchRequest(prompts[i], SamplingParams(max_new_tokens=NEW)) for i in range(4)]
    expected = [solo(target64, request, base) for request in requests]
    batcher = InflightBatcher(target64, base.fork, draft_len=4, max_batch_size=3)
    seqs = [batcher.add(request) for request in requests]
    for _ in range(3):
        assert batcher.step() == []
    assert (batcher.active, batcher.waiting) == (3, 1)
    batcher.cancel(seqs[1])
    batcher.cancel(seqs[3])  # still waiting: never scheduled
    assert not seqs[1].done  # cancelled at the step boundary, not before
    finished = batcher.step()
    assert seqs[1] in finished and seqs[3] in finished
    assert batcher.active == 2 and batcher._cache.layers[0].keys.shape[0] == 2
    partial = seqs[1].result
    assert partial.finish_reason == "cancelled" and 0 < len(partial.token_ids) < NEW
    assert partial.token_ids == expected[1][: len(partial.token_ids)]
    assert seqs[3].result.token_ids == [] and seqs[3].first_scheduled_ns is None
    while batcher.active:
        batcher.step()
    assert [seqs[i].result.token_ids for i in (0, 2)] == [expected[0], expected[2]]
    assert all(seq.error is None for seq in seqs)


def test_a_raising_on_tokens_ends_only_its_sequence(target64, prompts):
    calls = []

    def hang_up(tokens):
        calls.append(tokens)
        if len(calls) == 3:
            raise ConnectionResetError("client went away")

    requests = [BatchRequest(prompts[i], SamplingParams(max_new_tokens=NEW)) for i in range(3)]
    expected = [solo(target64, request, None) for request in requests]
    requests[1].on_tokens = hang_up
    batcher = InflightBatcher(target64, None)
    seqs, _, _ = run(batcher, [(0, request) for request in requests])
    assert isinstance(seqs[1].error, ConnectionResetError) and seqs[1].done
    assert seqs[1].result.finish_reason == "cancelled" and seqs[1].result.token_ids == expected[1][:3]
    assert [seqs[i].result.token_ids for i in (0, 2)] == [expected[0], expected[2]]
    assert seqs[0].error is None and seqs[2].error is None


class FailsOnPrompt(Proposer):
    """An EAGLE chain proposer that raises on one request (by its prompt): a drafting failure."""

    def __init__(self, inner, bad_prompt: list[int]) -> None:
        self.inner, self.bad_prompt = inner, bad_prompt
        self.kind, self.hidden_layers = inner.kind, inner.hidden_layers

    def fork(self):
        return FailsOnPrompt(self.inner.fork(), self.bad_prompt)

    def propose(self, state, max_tokens):
        tokens = state.tokens[0].tolist()
        if tokens[: len(self.bad_prompt)] == self.bad_prompt and len(tokens) > len(self.bad_prompt) + 4:
            raise RuntimeError("the draft failed")
        return self.inner.propose(state, max_tokens)


def test_a_failing_proposer_ends_only_its_sequence(target64, prompts):
    """The batch drafts together; when that raises, it drafts row by row to find whose proposer
    failed, ends that sequence with the error and goes on with the others."""
    requests = [BatchRequest(prompts[i], SamplingParams(max_new_tokens=NEW)) for i in (0, 2, 3)]
    expected = [solo(target64, request, None) for request in requests]
    base = FailsOnPrompt(make_proposer("eagle-chain", target64, None), prompts[2])
    seqs, _, _ = run(InflightBatcher(target64, base.fork, draft_len=4), [(0, request) for request in requests])
    assert isinstance(seqs[1].error, RuntimeError) and seqs[1].result.finish_reason == "cancelled"
    assert seqs[1].result.token_ids == expected[1][: len(seqs[1].result.token_ids)]
    assert 4 <= len(seqs[1].result.token_ids) < NEW
    assert [seqs[i].result.token_ids for i in (0, 2)] == [expected[0], expected[2]]
    assert seqs[0].error is None and seqs[2].error is None


class DraftsBadly(Proposer):
    """A request's own proposer whose draft the target cannot run."""

    kind = "chain"

    def __init__(self, tree):
        self.tree = tree

    def propose(self, state, max_tokens):
        return self.tree


@pytest.mark.parametrize(("tree", "what"), [
    (lambda vocab: DraftTree.chain(torch.tensor([vocab + 5])), "a token outside the vocabulary"),
    (lambda vocab: DraftTree(torch.tensor([3, 4]), [1, -1]), "a node whose parent does not precede it"),
])
def test_a_draft_the_target_cannot_run_ends_only_its_sequence(target64, prompts, tree, what):
    """It failed the batch's shared forward: every request of the batch ended with an IndexError."""
    requests = [BatchRequest(prompts[i], SamplingParams(max_new_tokens=NEW)) for i in (0, 2)]
    expected = [solo(target64, request, None) for request in requests]
    bad = BatchRequest(prompts[3], SamplingParams(max_new_tokens=NEW), proposer=DraftsBadly(tree(target64.config.vocab_size)))
    seqs, _, _ = run(InflightBatcher(target64, None), [(0, requests[0]), (0, bad), (0, requests[1])])
    assert isinstance(seqs[1].error, SpecDeployError) and what in str(seqs[1].error)
    assert seqs[1].result.finish_reason == "cancelled"
    assert [seqs[i].result.token_ids for i in (0, 2)] == expected and seqs[0].error is None and seqs[2].error is None


class UpdateFailsOnPrompt(FailsOnPrompt):
    """Drafts as its inner proposer; taking in one request's verification result raises."""

    def fork(self):
        return UpdateFailsOnPrompt(self.inner.fork(), self.bad_prompt)

    def propose(self, state, max_tokens):
        self.tokens = state.tokens[0].tolist()
        return self.inner.propose(state, max_tokens)

    def update(self, accepted, proposed):
        if self.tokens[: len(self.bad_prompt)] == self.bad_prompt and len(self.tokens) > len(self.bad_prompt) + 4:
            raise RuntimeError("the update failed")
        self.inner.update(accepted, proposed)


def test_a_row_failing_after_the_forward_ends_only_its_sequence(target64, prompts):
    """A failure while a row takes in the round (its proposer's update, its sampling) comes after
    the forward appended the round's columns: that row ends with the error, the others go on."""
    requests = [BatchRequest(prompts[i], SamplingParams(max_new_tokens=NEW)) for i in (0, 2, 3)]
    expected = [solo(target64, request, None) for request in requests]
    base = UpdateFailsOnPrompt(make_proposer("eagle-chain", target64, None), prompts[2])
    seqs, _, _ = run(InflightBatcher(target64, base.fork, draft_len=4), [(0, request) for request in requests])
    assert str(seqs[1].error) == "the update failed" and seqs[1].result.finish_reason == "cancelled"
    assert [seqs[i].result.token_ids for i in (0, 2)] == [expected[0], expected[2]]
    assert seqs[0].error is None and seqs[2].error is None


# ---------------------------------------------------------------------------------- spec_off_above


def test_spec_off_above_decodes_large_batches_plainly(target64, prompts):
    base = make_proposer("self-draft", target64, None)
    requests = [BatchRequest(prompts[i], SamplingParams(max_new_tokens=n)) for i, n in enumerate((4, 8, NEW, NEW))]
    expected = [solo(target64, request, base) for request in requests]
    batcher = InflightBatcher(target64, base.fork, draft_len=4, spec_off_above=2, adaptive=False)
    seqs = [batcher.add(request) for request in requests]
    plain_rounds = spec_rounds = 0
    while batcher.active or batcher.waiting:
        drafted = batcher.stats.draft_tokens
        finished = batcher.step()
        in_round = batcher.active + len(finished)  # all admitted at the first step
        if in_round > 2:
            assert batcher.stats.draft_tokens == drafted, f"drafted in a round of {in_round}"
            plain_rounds += 1
        else:
            spec_rounds += batcher.stats.draft_tokens > drafted
    assert plain_rounds >= 3 and spec_rounds >= 1
    assert [seq.result.token_ids for seq in seqs] == expected

    never = InflightBatcher(target64, base.fork, draft_len=4, spec_off_above=0)
    seqs, _, _ = run(never, [(0, request) for request in requests[:2]])
    assert never.stats.draft_tokens == 0 and never.stats.rounds > 0
    assert [seq.result.token_ids for seq in seqs] == expected[:2]


# ---------------------------------------------------------------------------------- sampling


def test_seeded_sampling_in_a_batch_is_reproducible(target64, draft64, prompts):
    """Per-sequence generators: a seed gives the same tokens in any batch, and as alone."""
    base = make_proposer("draft", target64, draft64)

    def params(max_new: int, seed: int | None) -> SamplingParams:
        greedy = seed is None
        return SamplingParams(max_new_tokens=max_new, temperature=0.0 if greedy else 0.9, top_k=50, seed=seed)

    seeds = [1, 2, None, 3, 1, 4]  # a greedy row among sampled ones; seed 1 twice, other prompts
    requests = [(step, BatchRequest(prompts[p], params(n, seed))) for (step, p, n), seed in zip(SCHEDULE, seeds)]
    runs = [run(InflightBatcher(target64, base.fork, draft_len=4, max_batch_size=3), requests)[0] for _ in range(2)]
    first, second = ([seq.result.token_ids for seq in seqs] for seqs in runs)
    assert first == second
    assert first == [solo(target64, request, base) for _, request in requests]
    reseeded = BatchRequest(prompts[0], params(NEW, 7))
    other, _, _ = run(InflightBatcher(target64, base.fork, draft_len=4), [(0, reseeded)])
    assert other[0].result.token_ids != first[0]


# ---------------------------------------------------------------------------------- errors, device


def test_add_validates_at_once(target64):
    batcher = InflightBatcher(target64, None)
    context = target64.config.max_position_embeddings
    cases = [
        (BatchRequest([], SamplingParams()), "the prompt is empty", "at least one token"),
        (BatchRequest(list(range(context)), SamplingParams()), "context is 256", "shorten the prompt"),
        (BatchRequest([1, 2], SamplingParams(max_new_tokens=0)), "max_new_tokens", "at least one"),
        (BatchRequest([1, 2], SamplingParams(stop_strings=("x",))), "need the tokenizer", "decode="),
        (BatchRequest([1, 2], SamplingParams(stop_strings=("",))), "a stop string is empty", "leave it out"),
        (BatchRequest([1, 2], SamplingParams(temperature=float("nan"))), "temperature must be a finite", "greedy"),
    ]
    for request, message, hint in cases:
        with pytest.raises(SpecDeployError, match=message) as err:
            batcher.add(request)
        assert hint in err.value.hint
    assert batcher.waiting == 0 and batcher.step() == []
    with pytest.raises(SpecDeployError, match="max_batch_size"):
        InflightBatcher(target64, None, max_batch_size=0)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["draft", "eagle-tree", "dflash"])
def test_every_batch_tensor_is_made_on_the_target_device(kind, temperature, target64, draft64, prompts):
    base = make_proposer(kind, target64, draft64)
    requests = [(step, BatchRequest(prompts[p], SamplingParams(max_new_tokens=n, temperature=temperature, seed=3)))
                for step, p, n in SCHEDULE[:4]]
    with FactoryCalls() as watch:
        seqs, _, _ = run(InflightBatcher(target64, base.fork, draft_len=4, max_batch_size=3), requests)
    assert all(seq.result.token_ids for seq in seqs)
    assert any("batch.py" in where for where, _, _ in watch.calls), "the watcher did not see the batcher"
    assert watch.undirected() == [], "tensor factories without device= in the runtime"
    assert watch.made_on() == {model_device(target64)}


# ---------------------------------------------------------------------------------- deployment.json


def test_deployment_spec_off_above_reaches_the_batcher(tmp_path, tiny_llama_dir, prompts):
    path = tmp_path / "deployment.json"
    config = {"model_dir": str(tiny_llama_dir), "dtype": "float64", "spec_off_above": 1,
              "spec": {"kind": "ngram", "max_draft_len": 4}}
    path.write_text(json.dumps(config))
    decoder = load_decoder(path)
    assert decoder.spec_off_above == 1
    batcher = decoder.batcher(max_batch_size=2)
    assert (batcher.spec_off_above, batcher.max_batch_size, batcher.draft_len) == (1, 2, 4)
    assert decoder.batcher(spec_off_above=3).spec_off_above == 3
    requests = [BatchRequest(prompts[i], SamplingParams(max_new_tokens=16)) for i in (0, 3)]
    seqs, _, _ = run(batcher, [(0, request) for request in requests])
    assert [seq.result.token_ids for seq in seqs] == [decoder.generate_ids(r.prompt_ids, r.params).token_ids
                                                      for r in requests]
    for bad in ("4", -1, True):
        path.write_text(json.dumps({**config, "spec_off_above": bad}))
        with pytest.raises(SpecDeployError, match="spec_off_above must be a non-negative integer") as err:
            load_decoder(path)
        assert "omit it" in err.value.hint


# ---------------------------------------------------------------------------------- stops


def test_a_stop_inside_an_accepted_draft_counts_only_what_was_emitted(target64, prompts):
    """The batch's counters (the sequence's metrics, BatchStats and its per-position counts) count
    accepted draft tokens up to the stop that ended the sequence, not the round's dropped tail."""
    base = make_proposer("self-draft", target64, None)  # every draft accepted: rounds of 4 + 1 tokens
    ref = solo(target64, BatchRequest(prompts[1], SamplingParams(max_new_tokens=30)), None)
    stop_at = next(i for i in range(6, 30) if (i - 1) % 5 < 3 and ref[i] not in ref[:i])
    rounds, drafts_emitted = (stop_at - 1) // 5 + 1, (stop_at - 1) % 5 + 1
    request = BatchRequest(prompts[1], SamplingParams(max_new_tokens=40, stop_token_ids=(ref[stop_at],)))
    batcher = InflightBatcher(target64, base.fork, draft_len=4, adaptive=False)
    (seq,), _, _ = run(batcher, [(0, request)])
    assert seq.result.token_ids == ref[: stop_at + 1] and seq.result.finish_reason == "stop"
    accepted = 4 * (rounds - 1) + drafts_emitted
    metrics = seq.result.metrics
    assert (metrics.target_forwards, metrics.draft_tokens, metrics.accepted_draft_tokens) == (rounds, 4 * rounds, accepted)
    assert (batcher.stats.draft_tokens, batcher.stats.accepted_draft_tokens) == (4 * rounds, accepted)
    assert batcher.stats.drafted_at_position == [rounds] * 4
    assert batcher.stats.accepted_at_position == [rounds] * drafts_emitted + [rounds - 1] * (4 - drafts_emitted)


# ---------------------------------------------------------------------------------- module context


def randomized(proposer: Proposer) -> Proposer:
    """A fresh module's attention adds nothing (zero-initialized output): random weights make its
    context matter, so a draft shows whether the module saw every earlier position."""
    torch.manual_seed(0)
    module = proposer.module
    with torch.no_grad():
        for weight in module.parameters():
            weight.normal_(0.0, 0.3)
    return proposer


class FailsOnce(Proposer):
    """Wraps a proposer; the `at`-th draft made by any of its forks raises (a transient failure:
    the batch's row-by-row retry succeeds)."""

    def __init__(self, inner: Proposer, at: int, calls: list[int] | None = None) -> None:
        self.inner, self.at, self.calls = inner, at, calls if calls is not None else [0]
        self.kind, self.hidden_layers = inner.kind, inner.hidden_layers

    def fork(self) -> Proposer:
        return FailsOnce(self.inner.fork(), self.at, self.calls)

    def propose(self, state, max_tokens):
        self.calls[0] += 1
        if self.calls[0] == self.at:
            raise RuntimeError("the draft failed once")
        return self.inner.propose(state, max_tokens)

    def update(self, num_accepted, num_proposed):
        self.inner.update(num_accepted, num_proposed)


@pytest.mark.parametrize(("kind", "where"), [("eagle-chain", "one proposer"), ("dflash", "one proposer"),
                                             ("eagle-chain", "batch draft"), ("eagle-tree", "batch draft")])
def test_a_failed_batch_draft_keeps_every_module_context(kind, where, target64, prompts, monkeypatch):
    """After a batch draft raises, each row drafts alone; a row whose proposer had already taken in
    this round's positions must keep its module context: every draft equals the one the same batch
    drafts without the failure (float64)."""
    from specdeploy.runtime import batch as batch_module
    from specdeploy.runtime.proposers import eagle

    base = randomized(make_proposer(kind, target64, None))
    requests = [BatchRequest(prompts[i], SamplingParams(max_new_tokens=16)) for i in (0, 2, 3)]

    def drafts(fail_at: int) -> tuple[list, list]:
        """The answers and every draft the batch verified, with the `fail_at`-th draft (or batch draft) failing."""
        seen = []
        with monkeypatch.context() as patch:
            patch.setattr(batch_module, "prune", lambda tree, *a: seen.append((tree.tokens.tolist(), tree.parents))
                          or prune(tree, *a))
            if where == "one proposer":
                factory = FailsOnce(base, fail_at).fork
            else:  # the batch's drafting after the shared ingest raises
                name = "_chains" if kind == "eagle-chain" else "_dynamic_trees"
                real, calls = getattr(eagle, name), [0]

                def failing(*a, **k):
                    calls[0] += 1
                    if calls[0] == fail_at:
                        raise RuntimeError("the batch draft failed once")
                    return real(*a, **k)

                patch.setattr(eagle, name, failing)
                factory = base.fork
            seqs, _, _ = run(InflightBatcher(target64, factory, draft_len=4, adaptive=False), [(0, r) for r in requests])
        assert all(seq.error is None for seq in seqs)
        return [seq.result.token_ids for seq in seqs], seen

    prune = batch_module.prune
    clean_out, clean = drafts(fail_at=10**9)
    # the second row's draft in round 3 (the first row's already took its positions in), or round 3's batch draft
    failed_out, retried = drafts(fail_at=8 if where == "one proposer" else 3)
    assert failed_out == clean_out == [solo(target64, request, None) for request in requests]
    assert sum(len(tokens) for tokens, _ in clean) > 0
    assert retried == clean


class Recorder(Proposer):
    """Wraps a proposer, drafting through its own propose_batch; keeps (tokens, max_tokens, tree)
    of every draft."""

    def __init__(self, inner: Proposer, log: list | None = None) -> None:
        self.inner, self.log = inner, log if log is not None else []
        self.kind, self.hidden_layers = inner.kind, inner.hidden_layers

    def fork(self) -> Proposer:
        return Recorder(self.inner.fork(), self.log)

    def propose(self, state, max_tokens):
        return self.propose_batch([self], [state], [max_tokens])[0]

    @staticmethod
    def propose_batch(proposers, states, max_tokens):
        trees = type(proposers[0].inner).propose_batch([p.inner for p in proposers], states, max_tokens)
        for p, state, n, tree in zip(proposers, states, max_tokens, trees):
            p.log.append((state.tokens.clone(), n, tree))
        return trees

    def update(self, num_accepted, num_proposed):
        self.inner.update(num_accepted, num_proposed)


@pytest.mark.parametrize("kind", ["eagle-chain", "eagle-tree", "dflash", "medusa"])
def test_speculation_off_costs_a_plain_step_and_resumes_with_the_whole_context(kind, target64, prompts):
    """Rounds above spec_off_above ask the target for no hidden states and hand the proposers
    none; when speculation resumes, the positions consumed meanwhile are run once more for their
    states (one extra forward), so every draft equals the draft of a proposer given the whole
    context (float64), and the output equals the request's solo output."""
    inner = make_proposer(kind, target64, None)
    base = Recorder(randomized(inner) if kind != "medusa" else inner)
    requests = [BatchRequest(prompts[i], SamplingParams(max_new_tokens=n)) for i, n in ((0, 6), (3, 10), (2, 30))]
    calls = []  # (kind of forward, rows, asked for hidden states)
    hooks = [target64.register_forward_pre_hook(
                 lambda m, a, k: calls.append(("round" if "position_ids" in k else "prefill", k["input_ids"].shape[0],
                                               bool(k.get("output_hidden_states")))), with_kwargs=True),
             target64.model.register_forward_pre_hook(lambda m, a, k: calls.append(("decoder", k["input_ids"].shape[1], None)),
                                                      with_kwargs=True)]
    batcher = InflightBatcher(target64, base.fork, draft_len=4, spec_off_above=1, adaptive=False)
    try:
        seqs = [batcher.add(request) for request in requests]
        batcher.step()  # admits all three: rounds of three decode plainly
        held = {row.seq.id: {layer: h.shape[1] for layer, h in row.unseen.items()} for row in batcher._rows}
        off_rounds = 1
        while batcher.active > 1:
            assert batcher.stats.draft_tokens == 0
            for row in batcher._rows:  # what prefill handed over waits; nothing is added to it
                assert {layer: h.shape[1] for layer, h in row.unseen.items()} == held[row.seq.id]
            batcher.step()
            off_rounds += 1
        while batcher.active:
            batcher.step()
    finally:
        for hook in hooks:
            hook.remove()
    rounds = [c for c in calls if c[0] == "round"]
    assert all(not hidden for _, rows, hidden in rounds if rows > 1)  # no states while off
    assert all(hidden for _, rows, hidden in rounds if rows == 1)  # ... and again once it speculates
    # every target forward runs its decoder; one decoder call more: the positions consumed while off, once
    assert len([c for c in calls if c[0] == "decoder"]) == len([c for c in calls if c[0] != "decoder"]) + 1
    assert batcher.stats.draft_tokens > 0 and base.log
    layers = inner.hidden_layers
    for tokens, n, tree in base.log:  # the module saw every earlier position, in order
        with torch.no_grad():
            hidden = target64(tokens[:, :-1], output_hidden_states=True).hidden_states
        again = inner.fork().propose(TargetState(tokens=tokens, hidden={layer: hidden[layer] for layer in layers}), n)
        assert (again.tokens.tolist(), again.parents) == (tree.tokens.tolist(), tree.parents)
    assert [seq.result.token_ids for seq in seqs] == [solo(target64, request, None) for request in requests]
    assert off_rounds >= 6


def test_a_row_near_its_end_is_not_caught_up_when_speculation_resumes(target64, prompts):
    """When speculation resumes, a row with more positions missed than tokens left decodes plainly
    to its end (no catch-up for it, no draft), while a row with most of its answer to come is caught
    up and drafts, in the same rounds; both answers equal their solo ones (float64)."""
    base = make_proposer("eagle-chain", target64, None)
    # four rows decode plainly; once the two short ones end, two remain and speculation resumes
    lengths = {"short": 4, "short2": 5, "long": 40, "ending": 8}
    requests = {name: BatchRequest(prompts[i], SamplingParams(max_new_tokens=n))
                for i, (name, n) in enumerate(lengths.items())}
    caught_up = []  # rows in each catch-up forward that had missed positions
    batcher = InflightBatcher(target64, base.fork, draft_len=4, spec_off_above=2, adaptive=False)
    original = batcher._catch_up
    batcher._catch_up = lambda rows: (caught_up.append([r.seq.id for r in rows if batcher._worth_catching_up(r)]),
                                      original(rows))
    seqs = {name: batcher.add(request) for name, request in requests.items()}
    while batcher.active or batcher.waiting:
        batcher.step()
    results = {name: seq.result for name, seq in seqs.items()}
    assert {name: len(r.token_ids) for name, r in results.items()} == lengths  # no answer ended early: the case holds
    assert [ids for ids in caught_up if ids] == [[seqs["long"].id]]  # caught up once, alone
    assert results["long"].metrics.draft_tokens > 0 and results["ending"].metrics.draft_tokens == 0
    assert {name: r.token_ids for name, r in results.items()} == {
        name: solo(target64, request, None) for name, request in requests.items()}
