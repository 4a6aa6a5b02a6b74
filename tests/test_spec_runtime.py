"""Medusa and EAGLE proposers on the tiny Llama: greedy exactness against plain decoding for every
tree kind, the EAGLE tree/cache mechanics against path-by-path recomputation, choices errors."""

from __future__ import annotations

import pytest
import torch

from specdeploy.errors import SpecDeployError
from specdeploy.checkpoints import load_causal_lm
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import SamplingParams, TargetState

PROMPTS = [[5, 17, 33, 90, 4, 8, 9], [100, 101, 102, 7], [3, 60, 61, 62, 63, 64, 65, 66, 67, 12, 13]]
CASES = [
    ("medusa", {}),
    ("medusa", {"choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}),
    ("eagle", {"mode": "chain", "chain_len": 3}),
    ("eagle", {"mode": "static", "choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}),
    ("eagle", {"mode": "dynamic", "depth": 4, "topk": 3, "width": 2}),
    ("eagle", {"mode": "dynamic", "draft_vocab": 96}),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: a second thread only adds synchronisation on busy shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_causal_lm(tiny_llama_dir)


class Recorder:
    """Wraps a proposer; keeps every (state, tree) the verifier saw."""

    def __init__(self, inner):
        self.inner, self.rounds = inner, []
        self.kind, self.hidden_layers = inner.kind, inner.hidden_layers

    def reset(self):
        self.inner.reset()

    def update(self, accepted, proposed):
        self.inner.update(accepted, proposed)

    def propose(self, state, max_tokens):
        tree = self.inner.propose(state, max_tokens)
        self.rounds.append((state.tokens.clone(), tree))
        return tree


@pytest.mark.parametrize("kind,options", CASES, ids=[f"{k}-{o.get('mode', 'tree')}-{i}" for i, (k, o) in enumerate(CASES)])
def test_greedy_speculative_equals_plain(target, kind, options):
    params = SamplingParams(max_new_tokens=30)
    proposer = build_proposer(kind, target, **options)
    drafted = 0
    for prompt in PROMPTS:
        plain = generate(target, prompt, params)
        spec = generate(target, prompt, params, proposer, adaptive=False)
        assert spec.token_ids == plain.token_ids
        assert spec.metrics.target_forwards <= len(plain.token_ids)
        drafted += spec.metrics.draft_tokens
    assert drafted > 0  # speculation really ran


def test_medusa_accepts_when_heads_are_right(target):
    """Heads replaced by an oracle of the plain greedy output: every tree path [0, 0, ...] is accepted."""
    params = SamplingParams(max_new_tokens=24)
    prompt = PROMPTS[0]
    plain = generate(target, prompt, params).token_ids
    proposer = build_proposer("medusa", target, choices=[[0], [1], [0, 0], [0, 0, 0]])
    full = prompt + plain

    def oracle(state, max_tokens):
        n = state.tokens.shape[1]
        want = full[n:n + 3]
        heads_top = [torch.tensor([t, (t + 1) % 300]) for t in want] + [torch.tensor([0, 1])] * (3 - len(want))
        tokens = torch.stack([heads_top[len(p) - 1][p[-1]] for p in proposer.choices.paths]).long()
        from specdeploy.runtime.types import DraftTree

        return DraftTree(tokens=tokens[:max_tokens], parents=proposer.parents[:max_tokens])

    proposer.propose = oracle
    spec = generate(target, prompt, params, proposer, adaptive=False)
    assert spec.token_ids == plain
    assert spec.metrics.acceptance_length > 3.0  # 3 accepted + 1 bonus per round, save the tail


def _full_state(target, tokens, layers):
    with torch.no_grad():
        out = target(tokens[:, :-1], output_hidden_states=True)
    return TargetState(tokens=tokens, hidden={layer: out.hidden_states[layer] for layer in layers})


@pytest.mark.parametrize("mode", ["chain", "static", "dynamic"])
def test_eagle_incremental_cache_matches_fresh_recompute(target, mode):
    """Every round's tree equals what a fresh proposer drafts from the whole context at once:
    the module cache keeps exactly the consumed positions, draft entries never leak."""
    options = {"mode": mode, "depth": 3, "width": 2, **({"choices": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]} if mode == "static" else {})}
    recorder = Recorder(build_proposer("eagle", target, **options))
    generate(target, PROMPTS[2], SamplingParams(max_new_tokens=20), recorder, adaptive=False)
    assert len(recorder.rounds) >= 3
    for tokens, tree in recorder.rounds[1:]:
        fresh = build_proposer("eagle", target, **options)
        again = fresh.propose(_full_state(target, tokens, fresh.hidden_layers), 16)
        assert again.parents == tree.parents
        assert torch.equal(again.tokens, tree.tokens)


def test_eagle_tree_nodes_match_path_by_path(target):
    """A node's children in the tree (one forward per depth, tree mask) equal a plain chain run
    along that node's path alone."""
    proposer = build_proposer("eagle", target, mode="static", choices=[[0], [1], [2], [0, 0], [1, 0], [2, 0], [1, 0, 0]])
    state = _full_state(target, torch.tensor([PROMPTS[0]]), proposer.hidden_layers)
    root_logp, root_h, pos = proposer._ingest(state)
    nodes, _ = proposer._static(root_logp, root_h, pos, 16)
    proposer.cache.crop(proposer.cache_len)
    for i, node in enumerate(nodes):
        if node.logp is None:
            continue
        path = [i]
        while nodes[path[0]].parent >= 0:
            path.insert(0, nodes[path[0]].parent)
        chain = [type(node)(draft_id=nodes[j].draft_id, parent=k - 1, depth=k + 1, score=0.0) for k, j in enumerate(path)]
        for k in range(len(chain)):
            proposer._expand(chain, [k], root_h, pos)
        proposer.cache.crop(proposer.cache_len)
        torch.testing.assert_close(chain[-1].logp, node.logp, atol=1e-4, rtol=1e-4)


BATCH_CASES = [{"mode": "chain", "chain_len": 3}, {"mode": "dynamic", "depth": 5, "draft_vocab": 96},
               {"mode": "static", "choices": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}]


@pytest.mark.parametrize("options", BATCH_CASES, ids=[case["mode"] for case in BATCH_CASES])
def test_eagle_batched_drafts_equal_solo_drafts(tiny_llama_dir, options, monkeypatch):
    """In-flight batching drafts every request's EAGLE rounds in shared module forwards (ragged new
    positions, a request sitting a round out, dynamic trees stopping at different depths): each
    draft equals the one its request drafts alone (float64, so padding cannot round a near-tie
    apart), in fewer module calls."""
    from transformers import AutoModelForCausalLM

    from specdeploy.runtime.proposers.eagle import EagleProposer

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64).eval()
    base = build_proposer("eagle", target, **options)
    torch.manual_seed(0)
    with torch.no_grad():  # a fresh module's attention adds nothing (zero-initialized output): make it matter
        for weight in base.module.parameters():
            weight.normal_(0.0, 0.3)
    full = [torch.tensor([p + generate(target, p, SamplingParams(max_new_tokens=12)).token_ids]) for p in PROMPTS]
    with torch.no_grad():
        hidden = [target(tokens[:, :-1], output_hidden_states=True).hidden_states for tokens in full]
    solo, batched = [base.fork() for _ in PROMPTS], [base.fork() for _ in PROMPTS]
    trees_nodes = []  # every tree's nodes: the module outputs behind the drafts, compared too
    tree_of = EagleProposer._tree
    monkeypatch.setattr(EagleProposer, "_tree",
                        lambda self, nodes, keep: trees_nodes.append(nodes) or tree_of(self, nodes, keep))
    calls = []
    forward = base.module.forward
    base.module.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    consumed, fed = [len(p) for p in PROMPTS], [0] * len(PROMPTS)
    # per round: tokens each request accepted since the last, and the draft sizes asked (0: sits out)
    for advance, asks in [([0, 0, 0], [6, 6, 6]), ([1, 3, 2], [6, 6, 6]), ([2, 1, 4], [6, 0, 6]),
                          ([1, 2, 1], [2, 6, 3])]:
        consumed = [c + a for c, a in zip(consumed, advance)]
        states = [TargetState(tokens=tokens[:, : c + 1], hidden={layer: h[layer][:, f:c] for layer in base.hidden_layers})
                  for tokens, h, c, f in zip(full, hidden, consumed, fed)]
        calls.clear()
        alone = [_alone(p, state, n) for p, state, n in zip(solo, states, asks)]
        alone_calls = len(calls)
        alone_nodes, trees_nodes[:] = list(trees_nodes), []
        calls.clear()
        together = base.propose_batch(batched, states, asks)
        assert [(t.tokens.tolist(), t.parents) for t in together] == [(t.tokens.tolist(), t.parents) for t in alone]
        assert len(trees_nodes) == len(alone_nodes)
        for mine, theirs in zip(trees_nodes, alone_nodes):
            for a, b in zip(mine, theirs):
                assert (a.logp is None) == (b.logp is None)
                if a.logp is not None:
                    torch.testing.assert_close(a.logp, b.logp, rtol=0, atol=1e-9)
        trees_nodes.clear()
        assert sum(len(t) for t in together) > 0
        if options["mode"] == "chain":
            assert len(calls) == options["chain_len"], "one forward to ingest, one per further depth"
        elif options["mode"] == "dynamic":  # one forward to ingest, at most one per further depth
            assert 2 <= len(calls) <= options["depth"] < alone_calls
        else:
            assert len(calls) == alone_calls - (sum(1 for n in asks if n) - 1), "one ingest forward for all"
        fed = [c if n else f for c, f, n in zip(consumed, fed, asks)]


@pytest.mark.parametrize("options", BATCH_CASES[:2], ids=[case["mode"] for case in BATCH_CASES[:2]])
def test_a_request_joining_a_batch_takes_in_its_prompt_alone(tiny_llama_dir, options):
    """A request that joins a running batch with a long prompt feeds it in a forward of its own, so
    the batch's forward is not padded to the prompt for every row; every draft still equals its
    request's solo draft (float64)."""
    from transformers import AutoModelForCausalLM

    from specdeploy.runtime.proposers.eagle_batch import CATCH_UP

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64).eval()
    base = build_proposer("eagle", target, **options)
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in base.module.parameters():
            weight.normal_(0.0, 0.3)
    prompts = [PROMPTS[0], PROMPTS[1], (PROMPTS[2] * 4)[: CATCH_UP + 12]]
    full = [torch.tensor([p + generate(target, p, SamplingParams(max_new_tokens=6)).token_ids]) for p in prompts]
    with torch.no_grad():
        hidden = [target(tokens[:, :-1], output_hidden_states=True).hidden_states for tokens in full]

    def state(i: int, consumed: int, fed: int) -> TargetState:
        return TargetState(tokens=full[i][:, : consumed + 1],
                           hidden={layer: hidden[i][layer][:, fed:consumed] for layer in base.hidden_layers})

    solo, batched = [base.fork() for _ in prompts], [base.fork() for _ in prompts]
    first = [state(0, len(prompts[0]), 0), state(1, len(prompts[1]), 0)]
    base.propose_batch(batched[:2], first, [6, 6])
    for p, s in zip(solo, first):
        _alone(p, s, 6)
    # the first two accepted 1 and 2 tokens; the third joins with its whole prompt
    states = [state(0, len(prompts[0]) + 1, len(prompts[0])), state(1, len(prompts[1]) + 2, len(prompts[1])),
              state(2, len(prompts[2]), 0)]
    forwards = []  # (rows, new positions) of each module forward
    forward = base.module.forward
    base.module.forward = lambda hidden, *a, **k: forwards.append(tuple(hidden.shape[:2])) or forward(hidden, *a, **k)
    together = base.propose_batch(batched, states, [6, 6, 6])
    base.module.forward = forward
    alone = [_alone(p, s, 6) for p, s in zip(solo, states)]
    assert [(t.tokens.tolist(), t.parents) for t in together] == [(t.tokens.tolist(), t.parents) for t in alone]
    assert sum(len(t) for t in together) > 0
    assert (1, len(prompts[2]) - 1) in forwards  # the joining prompt, alone
    assert all(q <= CATCH_UP for rows, q in forwards if rows > 1), forwards


def _alone(proposer, state, max_tokens):
    """One request's draft; a dynamic tree grown node by node on its own cache (`_expand`), the
    path the batched one must agree with."""
    if proposer.mode != "dynamic" or max_tokens == 0:
        return proposer.propose(state, max_tokens)
    logp, h, pos = proposer._ingest(state)
    try:
        nodes, keep = proposer._dynamic(logp, h, pos, min(max_tokens, proposer.budget))
    finally:
        proposer.cache.crop(proposer.cache_len)
    return proposer._tree(nodes, keep)


def test_static_tree_first_path_is_the_chain(target):
    state = _full_state(target, torch.tensor([PROMPTS[1]]), (1, 2))
    chain = build_proposer("eagle", target, mode="chain", chain_len=3).propose(state, 3)
    tree = build_proposer("eagle", target, mode="static", choices=[[0], [1], [0, 0], [0, 0, 0]]).propose(state, 8)
    assert tree.parents == [-1, -1, 0, 2]
    assert tree.tokens[[0, 2, 3]].tolist() == chain.tokens.tolist()


def test_dynamic_tree_respects_budget_and_order(target):
    proposer = build_proposer("eagle", target, mode="dynamic", depth=4, topk=4, width=3)
    state = _full_state(target, torch.tensor([PROMPTS[0]]), proposer.hidden_layers)
    tree = proposer.propose(state, 7)
    assert len(tree) == 7
    assert all(p < i for i, p in enumerate(tree.parents))  # topological
    assert max(tree.depths()) <= 4


@pytest.mark.parametrize(
    "kind,options,message",
    [
        ("medusa", {"num_heads": 2, "choices": [[0], [0, 0], [0, 0, 0]]}, "only 2 heads"),
        ("medusa", {"choices": []}, "empty"),
        ("medusa", {"choices": [[0], [0]]}, "appears twice"),
        ("eagle", {"mode": "static", "choices": [[0], [1, 0]]}, "no parent [1]"),
        ("eagle", {"mode": "static", "choices": [[0], [0, 0]], "max_draft_len": 1}, "exceed max_draft_len 1"),
        ("eagle", {"mode": "static", "choices": [[0]] + [[0] * d for d in range(2, 11)]}, "heads/layers"),
        ("eagle", {"mode": "sideways"}, "unknown EAGLE tree mode"),
    ],
)
def test_choices_errors_surface_at_construction(target, kind, options, message):
    with pytest.raises(SpecDeployError) as err:
        build_proposer(kind, target, **options)
    assert message in str(err.value)


def test_medusa_reduced_vocabulary_proposes_only_inside_it(target):
    from specdeploy.runtime.proposers.medusa import MedusaProposer

    full = build_proposer("medusa", target, choices=[[0], [1], [0, 0], [0, 0, 0]])
    vocab = torch.arange(0, 384, 3)
    reduced = MedusaProposer(full.heads, full.choices, vocab)
    state = _full_state(target, torch.tensor([PROMPTS[0]]), (-1,))
    tree = reduced.propose(state, 8)
    assert len(tree) == 4 and set(tree.tokens.tolist()) <= set(vocab.tolist())
    params = SamplingParams(max_new_tokens=20)
    assert generate(target, PROMPTS[0], params, reduced, adaptive=False).token_ids == generate(target, PROMPTS[0], params).token_ids


def _exhaustive_dynamic(proposer, logp, h, pos, max_tokens):
    """EAGLE-2's dynamic tree expanded to full depth, no early exit: the reference."""
    nodes = []
    level = proposer._add_children(nodes, -1, logp, min(proposer.topk, max_tokens))
    for _ in range(1, proposer.depth):
        best = sorted(level, key=lambda i: -nodes[i].score)[: proposer.width]
        proposer._expand(nodes, best, h, pos)
        level = [c for i in best for c in proposer._add_children(nodes, i, nodes[i].logp, proposer.topk)]
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth))[:max_tokens]
    return [(nodes[i].draft_id, nodes[i].depth) for i in sorted(order, key=lambda i: (nodes[i].depth, i))]


@pytest.mark.parametrize("budget", [3, 5, 10])
def test_dynamic_early_exit_keeps_the_same_tree(target, budget):
    """Stopping the depth loop once no descendant can enter the kept set drafts exactly the tree
    that full-depth expansion keeps, with fewer module calls."""
    recorder = Recorder(build_proposer("eagle", target, mode="dynamic", depth=5, topk=3, width=2, budget=budget))
    for prompt in PROMPTS:
        generate(target, prompt, SamplingParams(max_new_tokens=16), recorder, adaptive=False)
    calls = 0
    for tokens, _ in recorder.rounds:
        proposer = build_proposer("eagle", target, mode="dynamic", depth=5, topk=3, width=2, budget=budget)
        state = _full_state(target, tokens, proposer.hidden_layers)
        forward, counted = proposer.module.forward, []
        proposer.module.forward = lambda *a, **k: counted.append(1) or forward(*a, **k)
        with torch.inference_mode():
            logp, h, pos = proposer._ingest(state)
            counted.clear()
            nodes, keep = proposer._dynamic(logp, h, pos, budget)
            calls += len(counted)
            proposer.cache.crop(proposer.cache_len)
            reference = _exhaustive_dynamic(proposer, logp, h, pos, budget)
        assert [(nodes[i].draft_id, nodes[i].depth) for i in keep] == reference
    assert calls < (proposer.depth - 1) * len(recorder.rounds)  # some rounds stopped early


def _validate_args(*flags: str):
    import argparse

    from specdeploy.speculator import commands

    parser = argparse.ArgumentParser()
    commands.add_arguments(parser)
    return parser.parse_args(["validate", *flags])


@pytest.mark.parametrize(("kind", "flags", "named"), [
    ("medusa", ["--tree", "chain"], "--tree"),
    ("medusa", ["--width", "2", "--topk", "2"], "--topk, --width"),
    ("dflash", ["--depth", "3", "--budget", "6"], "--depth, --budget"),
    ("dflash", ["--choices", "[[0], [1]]"], "--choices"),
])
def test_spec_validate_refuses_tree_options_its_module_does_not_take(kind, flags, named):
    from specdeploy.speculator.commands import _proposer_options

    with pytest.raises(SpecDeployError, match=f"{named} .*not .*{kind}") as err:
        _proposer_options(_validate_args(*flags), kind)
    assert "--draft-len" in err.value.hint


def test_spec_validate_passes_the_eagle_options_given():
    from specdeploy.speculator.commands import _proposer_options

    assert _proposer_options(_validate_args("--tree", "chain", "--draft-len", "3"), "eagle") == {"mode": "chain", "chain_len": 3}
    assert _proposer_options(_validate_args("--depth", "4", "--budget", "8"), "eagle") == {"depth": 4, "budget": 8}
    assert _proposer_options(_validate_args("--choices", "[[0], [1]]"), "medusa") == {"choices": [[0], [1]]}
    assert _proposer_options(_validate_args("--draft-len", "2"), "dflash") == {}  # a chain cap: the runtime's
