"""The draft-shape planner: its arithmetic on known inputs, calibration on the tiny Llama, the
cached verify-cost curve, and `--draft-shape auto` on generate and bench."""

from __future__ import annotations

import json

import pytest

from specdeploy.bench import Bench, run_bench
from specdeploy.cli import main as cli_main
from specdeploy.errors import SpecDeployError
from specdeploy.runtime import planner
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.planner import ShapeStats, calibrate, chain_reach, choose_draft_shape, plan, verify_costs
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import DraftShape, SamplingParams
from tests.test_runtime_helpers import PROMPTS, draft, one_thread, target, tokenizer  # noqa: F401


def chain(k: int) -> DraftShape:
    return DraftShape("chain", k)


def stats_for(reach: list[float], draft_s: dict[int, float], rounds: int = 100) -> dict[DraftShape, ShapeStats]:
    """Chain statistics whose pooled reach is exactly `reach` (every chain length drafted fully)."""
    out = {}
    for k, seconds in draft_s.items():
        s = ShapeStats(rounds=rounds, draft_times=[seconds])
        s.drafted = [rounds] * k
        s.reached = [round(rounds * r) for r in reach[:k]]
        out[chain(k)] = s
    return out


def test_plan_picks_the_fastest_expected_chain():
    # verify: 1 token 10 ms, growing 1 ms per extra token; drafting 2 ms per token
    verify = [0.010 + 0.001 * i for i in range(9)]
    stats = stats_for([0.9, 0.85, 0.7, 0.2, 0.1], {k: 0.002 * k for k in range(1, 6)})
    assert chain_reach(stats) == pytest.approx([0.9, 0.85, 0.7, 0.2, 0.1])
    chosen = plan(stats, verify)
    by_shape = {e.shape: e for e in chosen.estimates}
    assert by_shape[chain(3)].tokens_per_round == pytest.approx(1 + 0.9 + 0.85 + 0.7)
    assert by_shape[chain(3)].tokens_per_s == pytest.approx(3.45 / (0.006 + 0.013))
    best = max(chosen.estimates, key=lambda e: e.tokens_per_s)
    assert chosen.shape == best.shape == chain(3)  # 182 tok/s: chain 2 gives 172, chain 4 166
    assert chosen.expected_speedup == pytest.approx(best.tokens_per_s * 0.010)


def test_plan_prefers_plain_decoding_when_nothing_pays():
    verify = [0.010 + 0.005 * i for i in range(5)]  # verify grows fast (fp32 on this CPU)
    chosen = plan(stats_for([0.2, 0.05, 0.01], {1: 0.004, 2: 0.008, 3: 0.012}), verify)
    assert chosen.shape is None and chosen.expected_speedup == 1.0
    assert all(e.tokens_per_s < 100 for e in chosen.estimates)


def test_trees_are_weighed_by_their_own_rounds():
    verify = [0.010] * 12  # a flat verify curve: a bigger tree costs nothing more to check
    stats = stats_for([0.5], {1: 0.003})
    tree = ShapeStats(rounds=10, accepted=15, draft_times=[0.004, 0.003, 0.009])  # median 4 ms
    stats[DraftShape("tree", 10)] = tree
    chosen = plan(stats, verify)
    assert chosen.shape == DraftShape("tree", 10)  # 2.5 tokens / 14 ms beats 1.5 / 13 ms


def test_calibration_of_a_perfect_draft_reaches_every_position(target):
    proposer = build_proposer("draft", target, draft_model=target)  # the target drafting itself
    shapes = proposer.draft_shapes(4)
    assert shapes == [chain(1), chain(2), chain(3), chain(4)]
    stats = calibrate(target, proposer, [[5, 17, 33, 90], [100, 101, 102, 7]], shapes, max_new_tokens=40, min_rounds=3)
    assert set(stats) == set(shapes)
    assert all(len(s.draft_times) >= 3 and 0 < s.draft_s < 1 for s in stats.values())  # the prompts ran again
    assert chain_reach(stats) == [1.0, 1.0, 1.0, 1.0]  # rounds the answer's end cut count only what they drafted


def test_calibration_counts_what_was_accepted(target, draft):
    """Pooled reach from the rotation equals what single-shape runs of each chain length accept."""
    prompts = [[5, 17, 33, 90], [3, 60, 61, 62, 63]]
    proposer = build_proposer("draft", target, draft_model=draft)
    stats = calibrate(target, proposer, prompts, [chain(3)], max_new_tokens=30, min_rounds=0)
    accepted = proposer_rounds = 0
    for ids in prompts:
        metrics = generate(target, ids, SamplingParams(max_new_tokens=30), proposer, draft_len=3, adaptive=False).metrics
        accepted, proposer_rounds = accepted + metrics.accepted_draft_tokens, proposer_rounds + metrics.target_forwards
    s = stats[chain(3)]
    assert s.accepted == accepted and sum(s.reached) == accepted
    assert s.rounds <= proposer_rounds and s.drafted[0] == s.rounds
    assert len(s.draft_times) <= s.rounds - 1  # each request's first round (the prompt's ingest) is not timed


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


def test_choose_sets_the_shape_and_keeps_greedy_exact(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    proposer = build_proposer("eagle", target, mode="chain", chain_len=2)
    seen = []

    def measured(target, proposer, prompts, shapes, max_new_tokens):  # noqa: ARG001
        seen.extend(shapes)  # calibration asks for every shape; here its result is given
        stats = stats_for([0.5], {1: 0.001})
        stats[DraftShape("tree", 6)] = ShapeStats(rounds=10, accepted=30, draft_times=[0.002])
        return stats

    monkeypatch.setattr(planner, "calibrate", measured)
    monkeypatch.setattr(planner, "measure_verify_costs", lambda *a, **k: [0.01] * 20)
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


def test_verify_costs_are_measured_once_and_cached(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    first = verify_costs(target, 3, prefix=16)
    assert len(first) == 3 and all(s > 0 for s in first)
    files = list((tmp_path / "verify_costs").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["seconds"] == first

    def never(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(planner, "measure_verify_costs", never)
    assert verify_costs(target, 3, prefix=16) == first
    with pytest.raises(AssertionError, match="measured again"):
        verify_costs(target, 4, prefix=16)  # another curve: another key


def test_bench_rows_take_planned_shapes(target, draft, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    bench = Bench(target, draft, max_new_tokens=12, draft_len=4, tokenizer=tokenizer, draft_shape="auto")
    results = run_bench(bench, prompts, ["ar", "ngram", "draft"], log=lambda _: None)
    assert set(bench.plans) == {"ngram", "draft"}
    for kind, chosen in bench.plans.items():
        assert len(chosen["estimates"]) == 4  # chains of 1..draft_len
        assert chosen["shape"] is None or chosen["shape"]["size"] <= 4
        assert results["methods"][kind]["same_as_ar"] == 1.0


def test_generate_command_draft_shape_auto(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    argv = ["generate", PROMPTS[1], "--model", str(tiny_llama_dir), "--spec", "ngram", "--max-new-tokens", "6",
            "--no-stream", "--device", "cpu", "--draft-shape", "auto", "--draft-len", "3"]
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert "draft shape:" in err and "chain 3:" in err and "over plain decoding" in err
