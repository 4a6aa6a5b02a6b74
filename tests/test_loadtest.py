"""`specdeploy loadtest`: the figures' arithmetic on hand-computed values, then one tiny sweep
(concurrency 1 and 2, both arms) against two real tritonservers on the tiny model's packaged
repository. The deployment drafts with the target itself, so drafts are accepted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from specdeploy import resolve
from specdeploy.cli import main as cli_main
from specdeploy.errors import SpecDeployError
from specdeploy.loadtest.command import parse_levels
from specdeploy.loadtest.display import control_cell, noise_summary, speedup_cell, suggestion
from specdeploy.loadtest.figures import chunk_tokens, count_tokens, inter_token_gaps
from specdeploy.loadtest.near_ties import disputed_outputs, judge_near_ties, verdict
from specdeploy.loadtest.report import AR, CONTROL, SPEC, build_report
from specdeploy.loadtest.sending import Sweep, Timed, arrival_times
from specdeploy.parity import NEAR_TIE, ROUNDING_CEILING, hf_reference
from specdeploy.stats import percentiles
from specdeploy.manifest import BuildDir
from specdeploy.runtime.load_plan import break_even, suggested_spec_off_above
from specdeploy.triton import stage as package_stage
from specdeploy.triton.serve import TritonServer
from specdeploy.runtime.decoding import eos_token_ids
from specdeploy.runtime.deployment import load_decoder
from specdeploy.runtime.types import SamplingParams
from specdeploy.verify.cpu_repository import DEPLOYMENT
from specdeploy.verify.reference import load_prompts, load_reference
from tests.tiny import make_llama

MAX_TOKENS = 8


# ---------------------------------------------------------------------------------------------
# the figures


def test_percentiles_interpolate_linearly():
    got = percentiles([4.0, 1.0, 3.0, 2.0])
    # sorted 1 2 3 4: p50 halfway between 2 and 3; p99 at rank 0.99 * 3 = 2.97, 3 + 0.97 * (4 - 3)
    assert got["p50"] == pytest.approx(2.5) and got["p99"] == pytest.approx(3.97) and got["mean"] == pytest.approx(2.5)
    assert percentiles([]) == {"p50": None, "p99": None, "mean": None}


def test_itl_spreads_a_chunk_gap_over_its_tokens():
    # first chunk (2 tokens) at 0.1 s is the TTFT; then 2 tokens 0.2 s later, 1 token 0.3 s later
    assert inter_token_gaps([0.1, 0.3, 0.6], [2, 2, 1]) == pytest.approx([0.1, 0.1, 0.3])
    # a chunk that adds no token (text that merges into the previous token) hands its gap on
    assert inter_token_gaps([0.1, 0.2, 0.5], [1, 0, 2]) == pytest.approx([0.2, 0.2])
    assert inter_token_gaps([0.1], [3]) == []


def test_chunk_tokens_sum_to_the_answers_token_count(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    chunks = ["def add(a", ", b):\n", "    return", " a + b\n"]
    counts = chunk_tokens(tokenizer, chunks)
    assert len(counts) == 4 and all(c > 0 for c in counts)
    assert sum(counts) == count_tokens(tokenizer, "".join(chunks))


def test_break_even_follows_the_last_paying_level():
    assert break_even([1, 2, 4, 8], [1.5, 1.1, 0.9, 0.8]) == 4
    assert break_even([1, 2, 4, 8], [1.5, 1.1, 0.9, 1.2]) is None  # 8 paid: the dip at 4 is noise
    assert break_even([1, 2, 4, 8], [1.20, 0.98, 1.11, 1.04]) is None  # a served sweep (2026-11-27)
    assert break_even([1, 2, 4], [1.4, 1.2, 1.01]) is None
    assert break_even([1, 2, 4], [0.9, 1.1, 0.95]) == 4
    assert break_even([1, 2], [None, 0.8]) == 2  # an unmeasured level is passed over
    assert break_even([1, 2, 4], [1.3, None, 0.8]) == 4


def test_spec_off_above_is_the_last_paying_level_before_break_even():
    assert suggested_spec_off_above([1, 2, 4, 8], [1.5, 1.1, 0.9, 0.95]) == 2
    assert suggested_spec_off_above([1, 2, 4, 8], [1.5, 1.1, 0.9, 1.2]) is None
    assert suggested_spec_off_above([1, 2, 4], [1.4, 1.2, 1.01]) is None  # pays everywhere: always speculate
    assert suggested_spec_off_above([1, 2, 4, 8], [0.7, 0.9, 0.8, 0.6]) == 0  # not even alone
    assert suggested_spec_off_above([1, 2, 3, 4], [1.3, 1.04, 1.09, 0.8], pays=1.05) == 3  # 2's gain within the margin is noise
    assert suggested_spec_off_above([1, 2, 3, 4], [1.3, 1.04, 1.02, 0.8], pays=1.05) == 1  # ... unless nothing above paid
    assert suggested_spec_off_above([1, 2, 4, 8], [1.2, None, None, 0.9]) == 1  # levels with errors measured nothing


def test_a_level_stops_paying_only_where_speculation_lost_in_every_pass(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = "def add(a, b):\n    return a + b\n"
    tokens = count_tokens(tokenizer, text)

    def level(walls: list[float]) -> tuple[list[Timed], list[float]]:  # 2 requests per pass
        return [Timed(0, 0.0, latency_s=0.5, chunk_s=[0.1], chunks=[text]) for _ in range(2 * len(walls))], walls

    # level 2: pooled 0.95x but the second pass won; level 4: lost in both passes
    results = {SPEC: {1: level([1.0, 1.0]), 2: level([1.15, 0.95]), 4: level([1.25, 1.2])},
               AR: {1: level([1.2, 1.2]), 2: level([1.0, 1.0]), 4: level([1.0, 1.0])}}
    report = build_report(results, tokenizer, [1, 2, 4], "exact")
    two = report["levels"][1]
    assert two["speedup"] == pytest.approx(2.0 / 2.1) and two["speedup"] < 1
    assert two["pass_speedups"] == pytest.approx([1 / 1.15, 1 / 0.95])
    assert two[SPEC]["pass_tokens_per_s"] == pytest.approx([2 * tokens / 1.15, 2 * tokens / 0.95])
    assert report["break_even_concurrency"] == 4 and report["spec_off_above"] == 2
    assert speedup_cell(two) == "0.95x (0.87-1.05)"
    # one pass alone: its loss is all there is to go by
    one_pass = {arm: {n: (timed[:2], walls[:1]) for n, (timed, walls) in by_level.items()} for arm, by_level in results.items()}
    report = build_report(one_pass, tokenizer, [1, 2, 4], "exact")
    assert report["break_even_concurrency"] == 2 and report["spec_off_above"] == 1
    assert speedup_cell(report["levels"][1]) == "0.87x"


def test_a_level_with_failed_requests_measures_no_speedup_and_moves_no_break_even(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = "def add(a, b):\n    return a + b\n"

    def level(walls: list[float], failed: int = 0) -> tuple[list[Timed], list[float]]:  # 2 requests per pass
        timed = [Timed(0, 0.0, latency_s=0.5, chunk_s=[0.1], chunks=[text]) for _ in range(2 * len(walls))]
        for request in timed[:failed]:
            request.error, request.chunks, request.chunk_s = "the server rejected the request", [], []
        return timed, walls

    results = {SPEC: {1: level([1.0]), 2: level([1.0]), 4: level([1.0], failed=2)},
               AR: {1: level([1.5]), 2: level([1.5]), 4: level([1.5])}}
    report = build_report(results, tokenizer, [1, 2, 4], "exact")
    four = report["levels"][2]
    assert four["speedup"] is None and four["pass_speedups"] is None and speedup_cell(four) == ""
    assert report["break_even_concurrency"] is None and report["spec_off_above"] is None  # 1 and 2 paid
    assert report["errors"] == 2 and not report["ok"]


def test_answers_short_of_a_fixed_length_are_counted_the_solo_pass_too(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = "def add(a, b):\n    return a + b\n"
    tokens = count_tokens(tokenizer, text)

    def answer(perf_tokens: int) -> Timed:  # the server's own count of what it emitted
        perf = {"total_generated_tokens": perf_tokens, "total_target_forwards": perf_tokens - 1}
        return Timed(0, 0.0, latency_s=0.5, chunk_s=[0.1], chunks=[text], perf=perf)

    solo = ([answer(tokens - 3)], [1.0])  # key 0: the solo pass, the outputs' reference
    results = {SPEC: {2: ([answer(tokens), answer(tokens - 1)], [1.0])}, AR: {0: solo, 2: ([answer(tokens)] * 2, [1.0])}}
    assert build_report(results, tokenizer, [2], "exact", fixed_lengths=[tokens])["short_answers"] == 2
    assert build_report(results, tokenizer, [2], "exact")["short_answers"] is None


def test_every_prompts_solo_output_comes_from_a_pass_of_its_own_where_concurrency_1_leaves_one_out(tiny_tokenizer_dir):
    prompts = [f"prompt {i}" for i in range(10)]
    assert Sweep(prompts, [1, 4], None, 8).needs_solo_pass()  # concurrency 1 sends 8 requests: prompts 0-7
    assert not Sweep(prompts[:8], [1, 4], None, 8).needs_solo_pass()
    assert not Sweep(prompts, [1, 4], 10, 8).needs_solo_pass()
    assert Sweep(prompts[:4], [2, 4], None, 8).needs_solo_pass()
    # an output whose prompt has no solo output is not a mismatch (a failed solo request is an error already)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    timed = [Timed(p, 0.0, latency_s=0.5, chunk_s=[0.1], chunks=["same"]) for p in (0, 1)]
    results = {SPEC: {1: ([timed[0]], [1.0]), 2: (timed, [1.0])}, AR: {1: ([timed[0]], [1.0]), 2: (timed, [1.0])}}
    report = build_report(results, tokenizer, [1, 2], "exact")
    assert report["levels"][1][SPEC]["compared"] == 1 and report["mismatches"] == 0 and report["ok"]


def test_levels_above_the_deployments_spec_off_above_say_nothing_of_speculating(tiny_tokenizer_dir):
    """Above its spec_off_above the deployment decodes plainly: a loss there (noise, or a round's
    bookkeeping) must not move the suggestion, nor a gain there lift the threshold."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = "def add(a, b):\n    return a + b\n"

    def level(walls: list[float]) -> tuple[list[Timed], list[float]]:  # 2 requests per pass
        return [Timed(0, 0.0, latency_s=0.5, chunk_s=[0.1], chunks=[text]) for _ in range(2 * len(walls))], walls

    # speculation paid at 1 and 2; at 4 it lost in both passes, at 8 it won one (a float32 sweep, 2026-11-27)
    results = {SPEC: {1: level([1.0, 1.0]), 2: level([1.0, 1.0]), 4: level([1.02, 1.12]), 8: level([0.91, 1.08])},
               AR: {1: level([1.2, 1.2]), 2: level([1.2, 1.2]), 4: level([1.0, 1.0]), 8: level([1.0, 1.0])}}
    alone = build_report(results, tokenizer, [1, 2, 4, 8], "exact")
    assert alone["break_even_concurrency"] is None and alone["spec_off_above"] is None  # 8 paid: 4's loss is noise
    assert suggestion(alone).startswith("no break-even at every level swept: speculation lost in every pass at "
                                        "concurrency 4, but paid at a higher level")
    assert "no spec_off_above" in suggestion(alone)
    report = build_report(results, tokenizer, [1, 2, 4, 8], "exact", spec_off_above=2)
    assert report["break_even_concurrency"] is None and report["spec_off_above"] == 2
    assert report["deployment_spec_off_above"] == 2 and "keep it" in suggestion(report)
    assert suggestion(report).startswith("speculation paid at every level up to the deployment's spec_off_above 2")
    # with the threshold at 4, 4 speculated and lost in both passes: a lower threshold
    report = build_report(results, tokenizer, [1, 2, 4, 8], "exact", spec_off_above=4)
    assert report["break_even_concurrency"] == 4 and report["spec_off_above"] == 2
    assert "suggested: spec_off_above 2" in suggestion(report)
    # nothing swept at or below the threshold: nothing to suggest
    above = {arm: {n: by_level[n] for n in (4, 8)} for arm, by_level in results.items()}
    report = build_report(above, tokenizer, [4, 8], "exact", spec_off_above=2)
    assert report["break_even_concurrency"] is None and report["spec_off_above"] == 2
    assert "suggests nothing" in suggestion(report)


def test_the_control_sweep_gives_each_level_a_noise_floor(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = "def add(a, b):\n    return a + b\n"

    def level(walls: list[float]) -> tuple[list[Timed], list[float]]:  # 2 requests per pass
        return [Timed(0, 0.0, latency_s=0.5, chunk_s=[0.1], chunks=[text]) for _ in range(2 * len(walls))], walls

    results = {SPEC: {1: level([1.0, 1.0]), 2: level([1.0, 1.2])}, AR: {1: level([1.1, 1.1]), 2: level([1.0, 1.0])}}
    # A/A: the copy ran 0.95x and 1.25x as fast as the twin at 2 (walls 1.0/0.95 and 1.0/1.25)
    control = {CONTROL: {1: level([1.0, 1.0]), 2: level([1.0 / 0.95, 1.0 / 1.25])}, AR: {1: level([1.0, 1.0]), 2: level([1.0, 1.0])}}
    report = build_report(results, tokenizer, [1, 2], "exact", control=control)
    one, two = report["control"]
    assert two["pass_ratios"] == pytest.approx([0.95, 1.25]) and one["pass_ratios"] == pytest.approx([1.0, 1.0])
    # the copies are interchangeable: 1.25 either way round is 0.8, the floor
    assert two["noise_floor"] == pytest.approx(0.8) and one["noise_floor"] == pytest.approx(1.0)
    # speculative passes at 2: 1.0 and 1/1.2 = 0.83, both above 0.8; at 1: 1.1, above 1.0
    assert report["levels"][1]["slower_than_noise"] == 0 and report["levels"][0]["slower_than_noise"] == 0
    assert control_cell(two) == "0.95-1.25" and "2: floor 0.80, 0/2 speculative passes below it" in noise_summary(report)
    control[CONTROL][2] = level([1.0 / 0.99, 1.0 / 1.01])  # a quieter host: 0.83 is now a loss beyond the noise
    report = build_report(results, tokenizer, [1, 2], "exact", control=control)
    assert report["control"][1]["noise_floor"] == pytest.approx(0.99) and report["levels"][1]["slower_than_noise"] == 1
    assert report["ok"] and report["errors"] == 0  # the copies' outputs were held to the rule too, and matched
    # the twin's passes are one sweep's, shared by both ratios: a failed request of the twin counts once
    failed = level([1.0, 1.0])
    failed[0][0].error = "ConnectionError: refused"
    results[AR][1] = control[AR][1] = failed
    assert build_report(results, tokenizer, [1, 2], "exact", control=control)["errors"] == 1


def test_the_steady_ttft_leaves_out_each_pass_cold_start(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = "def add(a, b):\n    return a + b\n"

    def one_pass(ttfts: list[float]) -> list[Timed]:  # concurrency 2: the first two requests are the cold start
        return [Timed(0, 0.0, latency_s=2.0, chunk_s=[t], chunks=[text], cold=i < 2) for i, t in enumerate(ttfts)]

    results = {AR: {2: (one_pass([0.9, 1.0, 0.2]) + one_pass([0.8, 1.1, 0.3]), [3.0, 3.0])}}
    level = build_report(results, tokenizer, [2], "exact")["levels"][0][AR]
    assert level["ttft_s"] == percentiles([0.9, 1.0, 0.2, 0.8, 1.1, 0.3])
    assert level["ttft_steady_s"] == percentiles([0.2, 0.3])
    alone = {AR: {2: (one_pass([0.9, 1.0]), [3.0])}}  # nothing past the cold start
    assert build_report(alone, tokenizer, [2], "exact")["levels"][0][AR]["ttft_steady_s"]["p99"] is None


def test_the_default_requests_go_past_each_clients_first():
    plan = Sweep(["a", "b", "c"], [1, 2, 4, 8], None, 32)
    assert [plan.requests_at(level) for level in plan.levels] == [8, 12, 24, 48]
    assert plan.order(4) == [0, 1, 2] * 8
    assert Sweep(["a"], [1, 8], 5, 32).requests_at(8) == 5  # asked for: as asked


def test_the_prompts_lengths_spread_around_the_mean_in_a_seeded_order():
    lengths = Sweep(list("abcdefgh"), [1], None, 32, seed=0, spread=0.5).lengths
    assert sorted(lengths) == [16, 21, 25, 30, 34, 39, 43, 48] and sum(lengths) == 8 * 32
    assert lengths != sorted(lengths) and lengths == Sweep(list("abcdefgh"), [1], None, 32, seed=0, spread=0.5).lengths
    assert Sweep(["a", "b"], [1], None, 8).lengths == [8, 8]  # no spread: all alike


def test_levels_parse_and_bad_levels_are_refused():
    assert parse_levels("8,1, 2,2") == [1, 2, 8]
    for bad in ("0,2", "a,b", ""):
        with pytest.raises(SpecDeployError, match="positive integers"):
            parse_levels(bad)


def test_poisson_arrivals_are_seeded_at_the_asked_rate():
    assert arrival_times(3, None) == [0.0, 0.0, 0.0]
    times = arrival_times(4001, 5.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times) and times == arrival_times(4001, 5.0, seed=1)
    assert (len(times) - 1) / times[-1] == pytest.approx(5.0, rel=0.1)


# ---------------------------------------------------------------------------------------------
# a real sweep


def test_the_outputs_disputed_are_those_that_differ_from_their_solo_run_and_those_solo_runs():
    expected = {0: "a b", 1: "c d"}
    figures = [{"per_request": [{"prompt": 0, "text": "a b", "error": None}, {"prompt": 1, "text": "c x", "error": None}]},
               {"per_request": [{"prompt": 1, "text": "c x", "error": None}, {"prompt": 0, "text": "", "error": "boom"}]}]
    assert disputed_outputs(figures, expected) == [(1, "c d"), (1, "c x")]
    assert disputed_outputs(figures[:1], {0: "a b", 1: "c x"}) == []


def test_the_near_tie_judge_passes_the_references_answer_and_fails_a_departure_above_the_margin(tiny_llama_dir):
    reference = load_reference(tiny_llama_dir, "float32", "cpu")
    prompts = ["def add(a, b):"]
    greedy = hf_reference(reference.model, reference.tokenizer, reference.ids(prompts[0]), 7)
    departs = reference.tokenizer.decode(greedy.token_ids[:3]) + "\x00zzz"
    strict = judge_near_ties([(0, greedy.text), (0, departs)], prompts, reference, [7], near_tie=0.0)
    assert (strict["outputs"], strict["passed"], strict["ok"]) == (2, 1, False)
    assert [r["first_divergence_token"] for r in strict["rows"]] == [None, 3]
    assert strict["largest_margin"] == pytest.approx(greedy.margins[3], rel=1e-4) and greedy.margins[3] > 0
    lenient = judge_near_ties([(0, departs)], prompts, reference, [7], near_tie=greedy.margins[3] + 1e-3)
    assert lenient["ok"] and lenient["passed"] == 1
    report = {"parity_rule": "near-tie", "mismatches": 5, "dtype": "bfloat16", "near_tie": strict}
    assert verdict(report).startswith("FAIL: 5 outputs differ") and "1/2 distinct outputs pass" in verdict(report)
    assert not verdict({**report, "near_tie": lenient}).startswith("FAIL")
    # by default the limit is measured on the served model (float32 here: shifts far under the floor)
    measured = judge_near_ties([(0, greedy.text)], prompts, reference, [7], near_tie=None, chunk=3)
    assert measured["near_tie"] == measured["measured"]["limit"] == NEAR_TIE and measured["measured"]["round_tokens"] == 3
    assert measured["measured"]["positions"] == len(greedy.token_ids) + 1 and measured["ok"]


def test_beyond_the_limit_the_judge_passes_rounding_only_where_the_deployment_is_exact_in_a_batch(tiny_llama_dir, monkeypatch):
    """An output parting beyond the near-tie limit and within the rounding ceiling passes where the
    deployment decodes its prompt float64-exactly in an in-flight batch (asked once, only then);
    not where that fails, nor beyond the ceiling."""
    reference = load_reference(tiny_llama_dir, "float32", "cpu")
    prompts = ["def add(a, b):"]
    greedy = hf_reference(reference.model, reference.tokenizer, reference.ids(prompts[0]), 7)
    departs = reference.tokenizer.decode(greedy.token_ids[:3]) + "\x00zzz"
    margin = greedy.margins[3]
    assert 0 < margin <= ROUNDING_CEILING
    asked = []

    def exact(answer: bool):
        return lambda: asked.append(answer) or [answer]

    passed = judge_near_ties([(0, departs)], prompts, reference, [7], near_tie=0.0, exact_in_batch=exact(True))
    assert passed["ok"] and passed["rounding"] == 1 and passed["rows"][0]["rounding"]
    report = {"parity_rule": "near-tie", "mismatches": 1, "dtype": "float32", "near_tie": passed}
    assert not verdict(report).startswith("FAIL") and "1 beyond it, up to 4, as the dtype's rounding" in verdict(report)
    failed = judge_near_ties([(0, departs)], prompts, reference, [7], near_tie=0.0, exact_in_batch=exact(False))
    assert not failed["ok"] and failed["rounding"] == 0
    within = judge_near_ties([(0, departs)], prompts, reference, [7], near_tie=margin + 1e-3, exact_in_batch=exact(True))
    assert within["ok"] and within["rounding"] == 0 and asked == [True, False]  # nothing beyond the limit: not asked
    monkeypatch.setattr("specdeploy.loadtest.near_ties.ROUNDING_CEILING", margin - 1e-3)  # the margin now beyond the ceiling
    beyond = judge_near_ties([(0, departs)], prompts, reference, [7], near_tie=0.0, exact_in_batch=exact(True))
    assert not beyond["ok"] and asked == [True, False]


def test_the_near_tie_judge_holds_off_the_end_as_fixed_length_requests_did(tiny_llama_dir):
    """Requests of a fixed length (min_tokens = max tokens) run past where the model ends (EOS at
    its 12th token here): the judge's reference holds its end off too, or it would call the served
    answer a departure at the EOS."""
    reference = load_reference(tiny_llama_dir, "float32", "cpu")
    prompts = ["def add(a, b):"]
    ids = reference.ids(prompts[0])
    out = reference.model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    served = reference.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert hf_reference(reference.model, reference.tokenizer, ids, 20).token_ids[-1] in eos_token_ids(reference.model)
    fixed = judge_near_ties([(0, served)], prompts, reference, [20], near_tie=0.0, fixed=True)
    assert fixed["ok"] and fixed["rows"][0]["match"]
    ending = judge_near_ties([(0, served)], prompts, reference, [20], near_tie=0.0, fixed=False)
    assert not ending["ok"] and ending["rows"][0]["first_divergence_token"] == 11


@pytest.fixture(scope="module")
def build(tmp_path_factory, tiny_tokenizer_dir) -> BuildDir:
    model = tmp_path_factory.mktemp("tiny_long")  # the held-out prompts in the tiny tokenizer exceed 256 tokens
    make_llama(model, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), context=2048, seed=3)
    build = BuildDir(tmp_path_factory.mktemp("loadtest") / "build")
    resolve.run(build, str(model))
    # float64: a batch of another shape rounds ~1e-16 apart, far below any logit margin: the exact rule
    package_stage.run(build, spec="draft", draft_model_dir=model, max_draft_len=4, dtype="float64")
    _end_early(build.path("triton_repo") / "cpu" / DEPLOYMENT)
    return build


def _end_early(deployment: Path) -> None:
    """The served model's end tokens: each load-test prompt's second greedy token, so that its answers
    end early unless min_tokens holds the end off."""
    decoder = load_decoder(deployment)
    answers = [decoder.generate_ids(decoder.encode(p.text_input, chat=False), SamplingParams(max_new_tokens=4)).token_ids
               for p in load_prompts(1, decoder.tokenizer)]
    config = decoder.target.generation_config
    config.eos_token_id = sorted({answer[1] for answer in answers} | eos_token_ids(decoder.target))
    config.save_pretrained(deployment.parent / json.loads(deployment.read_text())["model_dir"])


@pytest.fixture(scope="module")
def report(build) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "specdeploy", "loadtest", "--build-dir", str(build.root), "--concurrency", "1,2",
         "--requests-per-level", "2", "--passes", "2", "--max-tokens", str(MAX_TOKENS), "--prompts", "1", "--control"],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "break-even concurrency:" in done.stdout
    report = json.loads((build.path("loadtest") / "loadtest.json").read_text())
    report["stdout"] = done.stdout
    return report


def _figures(report: dict):
    for entry in report["levels"]:
        for arm in (SPEC, AR):
            yield entry["concurrency"], arm, entry[arm]


@pytest.mark.server
def test_sweep_reports_both_arms_at_every_level(report, build):
    assert [e["concurrency"] for e in report["levels"]] == [1, 2] and report["arms"] == [SPEC, AR]
    assert sorted(report["settings"]["max_tokens_per_prompt"]) == [MAX_TOKENS // 2, MAX_TOKENS * 3 // 2]  # spread 0.5
    assert report["ok"] and report["errors"] == 0 and report["settings"]["fixed_lengths"] and report["short_answers"] == 0
    for level, arm, f in _figures(report):
        assert f["requests"] == 4 and f["errors"] == 0, (level, arm, f["error_messages"])  # 2 passes of 2
        for name in ("ttft_s", "tpot_s", "itl_s", "latency_s"):
            assert 0 < f[name]["p50"] <= f[name]["p99"], (level, arm, name)
    for entry in report["levels"]:
        speedup = entry[SPEC]["output_tokens_per_s"] / entry[AR]["output_tokens_per_s"]
        assert entry["speedup"] == pytest.approx(speedup)
    # the target drafts for itself: drafts are accepted; the twin decodes one token per forward
    assert all(e[SPEC]["acceptance_length"] > 1.0 for e in report["levels"])
    assert all(e[AR]["acceptance_length"] == 1.0 for e in report["levels"])
    assert (build.path("loadtest") / "loadtest.png").stat().st_size > 5000


@pytest.mark.server
def test_passes_alternate_the_arms(report):
    # ABBA within a level, and the next level starts with the arm the last one ended with
    order = re.findall(r"concurrency (\d+), pass (\d)/2: (\w+) done", report["stdout"])
    # with the control, a third arm: the twin between the other two in every pass (ABBA for each pair)
    forward, back = [SPEC, AR, CONTROL], [CONTROL, AR, SPEC]
    passes = [("1", "1", forward), ("1", "2", back), ("2", "1", back), ("2", "2", forward)]
    assert order == [(level, n, arm) for level, n, arms in passes for arm in arms]


@pytest.mark.server
def test_the_control_is_a_second_autoregressive_deployment(report):
    assert report["settings"]["control"] and [c["concurrency"] for c in report["control"]] == [1, 2]
    for entry, pair in zip(report["levels"], report["control"]):
        for arm in (CONTROL, AR):
            # plain decoding, outputs equal to the main sweep's solo runs (float64: exact)
            assert pair[arm]["acceptance_length"] == 1.0 and pair[arm]["identical"] == pair[arm]["compared"] == 4
        ratios = [c / a for c, a in zip(pair[CONTROL]["pass_tokens_per_s"], pair[AR]["pass_tokens_per_s"])]
        assert pair["pass_ratios"] == pytest.approx(ratios) and pair["noise_floor"] == pytest.approx(min(min(r, 1 / r) for r in ratios))
        assert entry["slower_than_noise"] == sum(s < pair["noise_floor"] for s in entry["pass_speedups"])
    assert "A/A control" in report["stdout"] and "A/A" in report["stdout"].split("break-even")[0]


@pytest.mark.server
def test_figures_follow_from_the_requests(report, tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    for level, arm, f in _figures(report):
        rows = f["per_request"]
        lengths = report["settings"]["max_tokens_per_prompt"]
        for row in rows:  # tokens are the server's own count of what it emitted; the chunks are re-tokenized text
            assert row["tokens"] == lengths[row["prompt"]]  # min_tokens held off the early end tokens (_end_early)
            assert count_tokens(tokenizer, row["text"]) == sum(row["chunk_tokens"]) > 0
            assert len(row["itl_s"]) == sum(row["chunk_tokens"]) - row["chunk_tokens"][0]
            assert row["ttft_s"] == row["chunk_s"][0] <= row["latency_s"]
            assert row["start_s"] + row["latency_s"] <= f["wall_s"]
        # each streamed chunk carries at least one generated token (re-tokenized text can count more)
        assert all(len(row["chunk_s"]) <= lengths[row["prompt"]] for row in rows)
        per_pass = len(rows) // 2  # each pass's first `level` requests are its cold start
        assert [r["cold"] for r in rows] == ([True] * level + [False] * (per_pass - level)) * 2
        assert f["ttft_steady_s"] == percentiles([r["ttft_s"] for r in rows if not r["cold"]])
        assert f["output_tokens"] == sum(r["tokens"] for r in rows)
        assert f["output_tokens_per_s"] == pytest.approx(f["output_tokens"] / f["wall_s"])
        assert f["requests_per_s"] == pytest.approx(len(rows) / f["wall_s"])


@pytest.mark.server
def test_outputs_under_concurrency_equal_the_solo_runs(report):
    # float64: the exact rule, a changed output would fail the run
    assert report["dtype"] == "float64" and report["parity_rule"] == "exact"
    for level, arm, f in _figures(report):
        assert f["identical"] == f["compared"] == 4, (level, arm)
    assert report["mismatches"] == 0


def test_bad_arguments_are_clear_errors(build, capsys):
    assert cli_main(["loadtest", "--build-dir", str(build.root), "--url-ar", "127.0.0.1:1"]) == 2
    assert "--url-ar needs --url" in capsys.readouterr().err
    assert cli_main(["loadtest", "--build-dir", str(build.root), "--concurrency", "0"]) == 2
    assert "positive integers" in capsys.readouterr().err
    assert cli_main(["loadtest", "--build-dir", str(build.root), "--passes", "0"]) == 2
    assert "--passes" in capsys.readouterr().err
    assert cli_main(["loadtest", "--build-dir", str(build.root), "--requests-per-level", "0"]) == 2
    assert "--requests-per-level" in capsys.readouterr().err
    assert cli_main(["loadtest", "--build-dir", str(build.root), "--length-spread", "1"]) == 2
    assert "--length-spread 1.0 is not in [0, 1)" in capsys.readouterr().err
    assert cli_main(["loadtest", "--build-dir", str(build.root), "--url", "127.0.0.1:1", "--control"]) == 2
    assert "--control starts the build's servers" in capsys.readouterr().err


@pytest.mark.server
def test_a_running_server_alone_is_one_arm_checked_against_a_solo_pass(build):
    with TritonServer(build.path("triton_repo") / "cpu", log_path=build.root / "logs" / "loadtest-url.log", threads=1) as server:
        done = subprocess.run(
            [sys.executable, "-m", "specdeploy", "loadtest", "--build-dir", str(build.root), "--url", server.grpc_url,
             "--concurrency", "2", "--requests-per-level", "2", "--passes", "1", "--max-tokens", "4", "--prompts", "1",
             "--no-fixed-lengths"],
            capture_output=True, text=True, timeout=900,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((build.path("loadtest") / "loadtest.json").read_text())
    assert report["arms"] == [SPEC] and [e["concurrency"] for e in report["levels"]] == [2]
    # no concurrency 1 in the sweep: each prompt was first sent alone, as the outputs' reference
    assert sorted(r["prompt"] for r in report["solo_reference"]) == [0, 1]
    level = report["levels"][0]
    assert level["speedup"] is None and level[SPEC]["identical"] == level[SPEC]["compared"] == 2
    assert "break-even" not in done.stdout
    # answers left to end at EOS: the model's early end tokens cut some short of their length
    lengths = report["settings"]["max_tokens_per_prompt"]
    assert not report["settings"]["fixed_lengths"] and report["short_answers"] is None
    assert any(r["tokens"] < lengths[r["prompt"]] for r in report["solo_reference"] + level[SPEC]["per_request"])
