"""The planner: its arithmetic on known inputs, calibration on the tiny Llama, the in-flight
load curve, and `--draft-shape auto` on generate and bench."""

from __future__ import annotations

from collections import Counter

import pytest

from specdeploy import bench as bench_module
from specdeploy.bench import Bench, run_bench
from specdeploy.cli import main as cli_main
from specdeploy.errors import SpecDeployError
from specdeploy.runtime import load_plan, planner
from specdeploy.runtime.batch import InflightBatcher
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.load_plan import measure_load_curve, suggested_spec_off_above
from specdeploy.runtime.planner import Calibration, ShapeStats, calibrate, chain_reach, choose_draft_shape, plan, tree_acceptance
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import DraftShape, DraftTree, Proposer, SamplingParams
from tests.test_runtime_helpers import PROMPTS, draft, one_thread, target, tokenizer  # noqa: F401


def chain(k: int) -> DraftShape:
    return DraftShape("chain", k)


class Clock:
    """The planner's time.perf_counter, faked: it moves by `tick` per read and by what a `Paced`
    draft adds, so what the planner times does not depend on the host's speed or load."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now, self.tick = 0.0, tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now


class Paced(Proposer):
    """Wraps a proposer: each draft moves `clock` by `seconds(tree)` (what the round it opens costs);
    every `empty_every`-th draft is empty. Counts its drafts, empty drafts and verified rounds."""

    def __init__(self, inner: Proposer, clock: Clock, seconds, empty_every: int = 0) -> None:
        self.inner, self.clock, self.seconds, self.empty_every = inner, clock, seconds, empty_every
        self.kind, self.hidden_layers = inner.kind, inner.hidden_layers
        self.calls = self.empties = self.verified = 0

    def reset(self) -> None:
        self.inner.reset()

    def fork(self) -> Proposer:
        return Paced(self.inner.fork(), self.clock, self.seconds, self.empty_every)

    def draft_shapes(self, max_len):
        return self.inner.draft_shapes(max_len)

    def set_shape(self, shape) -> None:
        self.inner.set_shape(shape)

    def propose(self, state, max_tokens):
        self.calls += 1
        empty = self.empty_every and self.calls % self.empty_every == 0
        tree = DraftTree.empty(state.tokens.device) if empty else self.inner.propose(state, max_tokens)
        self.empties += not len(tree)
        self.clock.now += self.seconds(tree)
        return tree

    def update(self, num_accepted, num_proposed):
        self.verified += 1
        self.inner.update(num_accepted, num_proposed)


def stats_for(reach: list[float], round_s: dict[int, float], rounds: int = 100) -> dict[DraftShape, ShapeStats]:
    """Chain statistics whose pooled reach is exactly `reach` (every chain length drafted fully)."""
    out = {}
    for k, seconds in round_s.items():
        s = ShapeStats(rounds=rounds, round_times=[seconds])
        s.drafted = [rounds] * k
        s.reached = [round(rounds * r) for r in reach[:k]]
        out[chain(k)] = s
    return out


def test_plan_takes_the_cheapest_round_near_the_fastest_expected_chain(monkeypatch):
    # a plain step 10 ms; a round of chain k: verify 10 ms + 1 ms per drafted token, drafting 2 ms per token
    stats = stats_for([0.9, 0.85, 0.7, 0.2, 0.1], {k: 0.010 + 0.003 * k for k in range(1, 6)})
    assert chain_reach(stats) == pytest.approx([0.9, 0.85, 0.7, 0.2, 0.1])
    chosen = plan(Calibration(stats, [0.011, 0.010, 0.009]))  # median 10 ms
    by_shape = {e.shape: e for e in chosen.estimates}
    assert by_shape[chain(3)].tokens_per_round == pytest.approx(1 + 0.9 + 0.85 + 0.7)
    assert by_shape[chain(3)].tokens_per_s == pytest.approx(3.45 / 0.019)
    best = max(chosen.estimates, key=lambda e: e.tokens_per_s)
    assert best.shape == chain(3)  # 182 tok/s: chain 2 gives 172, chain 4 166, chain 1 146
    # chain 2 is within SHAPE_MARGIN (10%) of the fastest and its round is cheaper: it is taken
    assert chosen.shape == chain(2)
    assert chosen.expected_speedup == pytest.approx(by_shape[chain(2)].tokens_per_s * 0.010)
    # with no margin the fastest expected shape wins
    monkeypatch.setattr(planner, "SHAPE_MARGIN", 0.0)
    assert plan(Calibration(stats, [0.010])).shape == chain(3)


def test_plan_prefers_plain_decoding_when_nothing_pays():
    # verify grows 5 ms per token (fp32 on this CPU), drafting 4 ms per token
    chosen = plan(Calibration(stats_for([0.2, 0.05, 0.01], {1: 0.019, 2: 0.028, 3: 0.037}), [0.010]))
    assert chosen.shape is None and chosen.expected_speedup == 1.0
    assert all(e.tokens_per_s < 100 for e in chosen.estimates)


def test_trees_are_weighed_by_their_own_rounds():
    stats = stats_for([0.5], {1: 0.013})
    tree = ShapeStats(rounds=10, accepted=15, round_times=[0.014, 0.013, 0.019])  # median 14 ms
    stats[DraftShape("tree", 10)] = tree
    chosen = plan(Calibration(stats, [0.010]))
    assert chosen.shape == DraftShape("tree", 10)  # 2.5 tokens / 14 ms beats 1.5 / 13 ms


def test_tree_acceptance_never_falls_with_size():
    measured = {4: (10, 12), 6: (10, 20), 8: (10, 15), 10: (10, 13)}  # rounds, accepted: noise after 6 nodes
    stats = {DraftShape("tree", n): ShapeStats(rounds=r, accepted=a, round_times=[0.01]) for n, (r, a) in measured.items()}
    stats[chain(1)] = ShapeStats(rounds=10, accepted=9, round_times=[0.01])  # chains are pooled by reach instead
    pooled = tree_acceptance(stats)
    assert pooled == {DraftShape("tree", 4): 1.2, **{DraftShape("tree", n): pytest.approx(48 / 30) for n in (6, 8, 10)}}


def test_calibration_of_a_perfect_draft_reaches_every_position(target, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(planner, "time", clock)
    # the target drafting itself; a round of k drafted tokens costs (10 + k) ms on the planner's clock
    proposer = Paced(build_proposer("draft", target, draft_model=target), clock, lambda tree: 0.010 + 0.001 * len(tree))
    shapes = proposer.draft_shapes(4)
    assert shapes == [chain(1), chain(2), chain(3), chain(4)]
    prompts = [[5, 17, 33, 90], [100, 101, 102, 7]]
    calibration = calibrate(target, proposer, prompts, shapes, max_new_tokens=40, min_rounds=3)
    stats = calibration.shapes
    assert set(stats) == set(shapes)
    for shape, s in stats.items():  # each round's time went to the shape it drafted; the prompts ran again
        assert len(s.round_times) >= 3 and s.round_s == pytest.approx(0.010 + 0.001 * shape.size)
    # each prompt decoded plainly too, once per pass over the prompts
    assert len(calibration.step_times) % len(prompts) == 0 and len(calibration.step_times) >= len(prompts)
    assert all(t > 0 for t in calibration.step_times)
    assert chain_reach(stats) == [1.0, 1.0, 1.0, 1.0]  # rounds the answer's end cut count only what they drafted


def test_calibration_counts_what_was_accepted(target, draft):
    """Pooled reach from the rotation equals what single-shape runs of each chain length accept."""
    prompts = [[5, 17, 33, 90], [3, 60, 61, 62, 63]]
    proposer = build_proposer("draft", target, draft_model=draft)
    stats = calibrate(target, proposer, prompts, [chain(3)], max_new_tokens=30, min_rounds=0).shapes
    accepted = proposer_rounds = 0
    for ids in prompts:
        metrics = generate(target, ids, SamplingParams(max_new_tokens=30), proposer, draft_len=3, adaptive=False).metrics
        accepted, proposer_rounds = accepted + metrics.accepted_draft_tokens, proposer_rounds + metrics.target_forwards
    s = stats[chain(3)]
    assert s.accepted == accepted and sum(s.reached) == accepted
    assert s.rounds <= proposer_rounds and s.drafted[0] == s.rounds
    # neither a request's first round (the prompt's ingest) nor its last (no next draft ends it) is timed
    assert len(s.round_times) <= s.rounds - len(prompts)


def test_an_empty_draft_is_a_round_of_its_shape(target, monkeypatch):
    """An empty draft (n-gram finds no match) is a plain step taken while drafting that shape: it
    counts as one of the shape's rounds, accepting nothing, and is timed apart from the drafted
    rounds; the shape's round time weighs both by how often they happened."""
    clock = Clock()
    monkeypatch.setattr(planner, "time", clock)
    # every third draft is empty and its round takes 10 ms; a drafted round 30 ms
    proposer = Paced(build_proposer("draft", target, draft_model=target), clock,
                     lambda tree: 0.030 if len(tree) else 0.010, empty_every=3)
    shapes = [chain(1), chain(2)]
    stats = calibrate(target, proposer, [[5, 17, 33, 90], [100, 101, 102, 7]], shapes, max_new_tokens=30,
                      min_rounds=3).shapes
    assert proposer.empties > 0
    assert sum(s.rounds for s in stats.values()) == proposer.verified + proposer.empties
    for s in stats.values():
        assert s.drafted[0] == s.rounds  # an empty draft drafted the shape's positions and reached none
        assert s.empty_times and s.empty_times == pytest.approx([0.010] * len(s.empty_times))
        assert s.round_times and s.round_times == pytest.approx([0.030] * len(s.round_times))
        empty = len(s.empty_times) / (len(s.empty_times) + len(s.round_times))
        assert s.round_s == pytest.approx(0.010 * empty + 0.030 * (1 - empty))


class NoDraft(Proposer):
    """Never finds anything to propose (an n-gram lookup on text that never repeats)."""

    def propose(self, state, max_tokens):
        return DraftTree.empty(state.tokens.device)


def test_a_calibration_where_every_draft_is_empty_plans_plain_decoding(target):
    chosen = choose_draft_shape(target, NoDraft(), [[5, 17, 33, 90], [100, 101, 102, 7]], max_len=3, max_new_tokens=12)
    assert [e.shape for e in chosen.estimates] == [chain(1), chain(2), chain(3)]  # each shape measured
    assert all(e.tokens_per_round == 1.0 for e in chosen.estimates)
    assert chosen.shape is None and chosen.expected_speedup == 1.0
    assert max(chosen.estimates, key=lambda e: e.tokens_per_s)  # what package serves when none pays


def test_a_shape_that_accepted_nothing_never_pays():
    # a round measured a little faster than the plain step: noise, as it emits one token a round too
    stats = {chain(1): ShapeStats(rounds=20, accepted=0, round_times=[0.009])}
    stats[chain(1)].drafted, stats[chain(1)].reached = [20], [0]
    assert plan(Calibration(stats, [0.010])).shape is None


def test_a_calibration_without_plain_steps_is_refused():
    stats = stats_for([0.9], {1: 0.011})
    with pytest.raises(SpecDeployError, match="no plain decoding step") as err:
        plan(Calibration(stats, []))
    assert "longer answers" in err.value.hint
    with pytest.raises(SpecDeployError, match="no round of any shape"):
        plan(Calibration({chain(1): ShapeStats()}, [0.010]))


def test_eagle_shapes_and_options(target):
    proposer = build_proposer("eagle", target, mode="dynamic", depth=3)
    shapes = proposer.draft_shapes(6)
    assert chain(6) in shapes and DraftShape("tree", 6) in shapes and chain(7) not in shapes
    proposer.set_shape(chain(3))
    assert (proposer.mode, proposer.chain_len, proposer.kind) == ("chain", 3, "chain")
    assert proposer.shape_options(chain(3)) == {"mode": "chain", "chain_len": 3, "max_draft_len": 3}
    proposer.set_shape(DraftShape("tree", 8))
    assert (proposer.mode, proposer.budget, proposer.kind) == ("dynamic", 8, "tree")
    assert proposer.shape_options(DraftShape("tree", 8)) == {"mode": "dynamic", "budget": 8, "max_draft_len": 8}


def test_choose_sets_the_shape_and_keeps_greedy_exact(target, monkeypatch):
    proposer = build_proposer("eagle", target, mode="chain", chain_len=2)
    seen = []

    def measured(target, proposer, prompts, shapes, max_new_tokens):  # noqa: ARG001
        seen.extend(shapes)  # calibration asks for every shape; here its result is given
        stats = stats_for([0.5], {1: 0.011})
        stats[DraftShape("tree", 6)] = ShapeStats(rounds=10, accepted=30, round_times=[0.012])
        return Calibration(stats, [0.010])

    monkeypatch.setattr(planner, "calibrate", measured)
    chosen = choose_draft_shape(target, proposer, [[5, 17, 33, 90]], max_len=6)
    assert seen == proposer.draft_shapes(6)
    assert chosen.shape == DraftShape("tree", 6)
    assert (proposer.mode, proposer.budget, proposer.kind) == ("dynamic", 6, "tree")
    params = SamplingParams(max_new_tokens=20)
    assert generate(target, [3, 60, 61], params, proposer, adaptive=False).token_ids == generate(target, [3, 60, 61], params).token_ids


def test_fixed_trees_cannot_be_planned(target):
    proposer = build_proposer("medusa", target)
    with pytest.raises(SpecDeployError, match="one fixed tree"):
        choose_draft_shape(target, proposer, [[1, 2, 3]])


def test_bench_rows_take_planned_shapes(target, draft, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    runs = []  # (proposer class, draft_len) of every bench run (the planner's calibration is not one)
    real = bench_module.generate
    monkeypatch.setattr(bench_module, "generate", lambda target, ids, params, proposer=None, **kw:
                        runs.append((type(proposer).__name__, kw["draft_len"])) or real(target, ids, params, proposer, **kw))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    bench = Bench(target, draft, max_new_tokens=12, draft_len=4, tokenizer=tokenizer, draft_shape="auto")
    results = run_bench(bench, prompts, ["ar", "ngram", "draft"], log=lambda _: None)
    assert set(bench.plans) == {"ngram", "draft"}
    classes = {"ngram": "NgramProposer", "draft": "DraftModelProposer"}
    expected = Counter({("NoneType", None): 1})  # the ar row
    for kind, chosen in bench.plans.items():
        assert len(chosen["estimates"]) == 4  # chains of 1..draft_len
        shape = chosen["shape"]  # a row runs its planned chain, or plain decoding when none pays
        expected[("NoneType", None) if shape is None else (classes[kind], shape["size"])] += 1
        assert results["methods"][kind]["same_as_ar"] == 1.0
    per_row = 1 + len(prompts)  # a warm-up run, then each prompt
    assert Counter(runs) == Counter({key: n * per_row for key, n in expected.items()})


def test_generate_command_draft_shape_auto(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    argv = ["generate", PROMPTS[1], "--model", str(tiny_llama_dir), "--spec", "ngram", "--max-new-tokens", "6",
            "--no-stream", "--device", "cpu", "--draft-shape", "auto", "--draft-len", "3"]
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert "draft shape:" in err and "chain 3:" in err and "over plain decoding" in err


def batcher_of(target, proposer, draft_len):
    return lambda size: InflightBatcher(target, proposer.fork, draft_len=draft_len, max_batch_size=size, adaptive=False)


PLAN_PROMPTS = [[5, 17, 33, 90], [100, 101, 102, 7]]


def recording(monkeypatch):
    """Every batcher measure_load_curve makes (the deployment's, then its plain twin), each with the
    largest number of requests it held at once; and at each step, the arm that stepped and every
    arm's (tokens so far, done) just before."""
    made, steps, loops = [], [], []
    twin_of, side_by_side = load_plan._plain_twin, load_plan._side_by_side
    arm_step, batcher_step = load_plan._ClosedLoop.step, InflightBatcher.step

    def record_arm_step(arm):
        steps.append((arm, {other: (other.tokens, other.done) for other in loops[-1]}))
        arm_step(arm)

    def record_batcher_step(batcher):
        batcher.most = max(getattr(batcher, "most", 0), batcher.active + batcher.waiting)
        return batcher_step(batcher)

    monkeypatch.setattr(load_plan, "_plain_twin", lambda batcher: made.append(twin_of(batcher)) or made[-1])
    monkeypatch.setattr(load_plan, "_side_by_side", lambda arms: loops.append(arms) or side_by_side(arms))
    monkeypatch.setattr(load_plan._ClosedLoop, "step", record_arm_step)
    monkeypatch.setattr(InflightBatcher, "step", record_batcher_step)
    return made, steps


def test_load_curve_runs_the_load_tests_closed_loop_on_both_arms(target, monkeypatch):
    """Each size: that many clients, the prompts in turn (3 requests per client, every prompt at
    least once), every answer exactly its length, on the deployment and on its plain twin."""
    perfect = build_proposer("draft", target, draft_model=target)  # every draft accepted
    made, _ = recording(monkeypatch)

    def make(size):
        made.append(batcher_of(target, perfect, 3)(size))
        return made[-1]

    points = measure_load_curve(make, PLAN_PROMPTS, [1, 2, 3], lengths=[5, 9])
    assert [p.batch for p in points] == [1, 2, 3]
    for point, requests, (spec, twin) in zip(points, [3, 6, 9], zip(made[::2], made[1::2])):
        tokens = sum([5, 9][i % 2] for i in range(requests))
        assert point.spec_tokens == point.plain_tokens == tokens
        assert spec.most == twin.most == point.batch  # the clients kept that many requests in flight
        assert twin.proposer_factory is None and twin.stats.draft_tokens == 0
        assert spec.stats.rounds < twin.stats.rounds  # 4 tokens a speculative round, 1 a plain one
        assert point.spec_s > 0 and point.plain_s > 0


def test_load_curve_sends_every_prompt_and_asks_for_the_load_tests_lengths(target, monkeypatch):
    perfect = build_proposer("draft", target, draft_model=target)
    sent = []
    add = InflightBatcher.add
    monkeypatch.setattr(InflightBatcher, "add", lambda self, request: sent.append((self, request)) or add(self, request))
    prompts = [[5, 17, 33, 90], [100, 101, 102, 7], [9, 8, 7], [1, 2, 3, 4, 5]]
    (point,) = measure_load_curve(batcher_of(target, perfect, 3), prompts, [1])
    lengths = load_plan.answer_lengths(4, load_plan.LOAD_ANSWER_TOKENS, load_plan.LOAD_ANSWER_SPREAD)
    assert sorted(lengths) == [16, 27, 37, 48]  # make loadtest's defaults: 32 tokens, spread 0.5
    # one client: 3 requests would leave a prompt out; each arm sends each prompt once
    arms = {batcher for batcher, _ in sent}
    assert len(arms) == 2
    for arm in arms:
        requests = [request for batcher, request in sent if batcher is arm]
        assert [r.prompt_ids for r in requests] == prompts
        assert [(r.params.max_new_tokens, r.params.min_tokens) for r in requests] == [(n, n) for n in lengths]
    assert point.spec_tokens == point.plain_tokens == sum(lengths)


def test_load_curve_leaves_out_a_prompt_without_room_for_its_answer(target):
    perfect = build_proposer("draft", target, draft_model=target)
    context = target.config.max_position_embeddings
    sent = []
    make = batcher_of(target, perfect, 3)
    long_prompt = [7] * (context - 10)  # 10 tokens of room, its answer asks for 12

    def recording_make(size):
        batcher = make(size)
        add = batcher.add
        batcher.add = lambda request: sent.append(request.prompt_ids) or add(request)
        return batcher

    (point,) = measure_load_curve(recording_make, [[5, 17, 33, 90], long_prompt], [1], lengths=[4, 12])
    assert sent == [[5, 17, 33, 90]] * 3 and point.spec_tokens == 3 * 4
    with pytest.raises(SpecDeployError, match="no load-plan prompt leaves room for its answer"):
        measure_load_curve(make, [long_prompt], [1], lengths=[12])


def test_load_curve_steps_the_arm_behind(target, monkeypatch):
    """The arms go through their requests together: the next step is always the one of the arm
    with fewer tokens so far, so a slow spell of the host falls on both."""
    perfect = build_proposer("draft", target, draft_model=target)
    _, steps = recording(monkeypatch)
    measure_load_curve(batcher_of(target, perfect, 3), PLAN_PROMPTS, [2], lengths=[12, 20])
    for arm, before in steps:
        tokens, _ = before[arm]
        assert all(tokens <= other_tokens for other_tokens, done in before.values() if not done)
    # the plain arm (1 token a row and round) takes several steps to each speculative one (4), all along
    order = ["plain" if arm.batcher.proposer_factory is None else "spec" for arm, _ in steps]
    half = len(order) // 2
    assert order[:half].count("spec") > 0 and order[half:].count("spec") > 0
    assert order.count("plain") > 2 * order.count("spec")


def test_load_curve_drafts_with_a_module_that_reads_the_targets_states(target):
    """EAGLE reads the target's states: it drafts in the closed loop's rounds from each request's
    prefill on."""
    eagle = build_proposer("eagle", target, mode="chain", chain_len=1)
    made = []

    def make(size):
        made.append(batcher_of(target, eagle, 1)(size))
        return made[-1]

    (point,) = measure_load_curve(make, PLAN_PROMPTS, [2], lengths=[6, 6])
    (batcher,) = made
    assert batcher.stats.draft_tokens >= batcher.stats.rounds > 0  # every round drafted
    assert point.spec_tokens == point.plain_tokens == 6 * 6


def test_load_curve_of_a_draft_too_slow_to_pay_turns_speculation_off(target, monkeypatch):
    clock = Clock(tick=0.001)  # a round without a draft takes 1 ms on the planner's clock, a draft 1 s more
    monkeypatch.setattr(load_plan, "time", clock)
    slow = Paced(build_proposer("draft", target, draft_model=target), clock, lambda tree: 1.0)
    points = measure_load_curve(batcher_of(target, slow, 2), [[5, 17, 33, 90]], [1, 2], lengths=[6])
    assert all(p.speedup < 1 for p in points)
    assert suggested_spec_off_above([p.batch for p in points], [p.speedup for p in points]) == 0
