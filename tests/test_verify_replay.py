"""Report b.'s second look at a divergence beyond the near-tie limit: the deployment, in-process in
its served dtype, reproduces the served answer (rounding) or does not (a serving fault)."""

from __future__ import annotations

from specdeploy.parity import ROUNDING_CEILING
from specdeploy.runtime.deployment import load_decoder
from specdeploy.runtime.types import SamplingParams
from specdeploy.verify.replay import reproduces
from specdeploy.verify.summary import beyond_limit, headlines, may_be_rounding, summarize
from tests.test_runtime_deployment import write_deployment
from tests.test_runtime_helpers import PROMPTS, one_thread, tokenizer  # noqa: F401

MAX_NEW_TOKENS = 12


def _row(margin: float | None, match: bool = False) -> dict:
    return {"category": "chat", "shown": "a prompt", "prompt": "a prompt", "reference": "ref", "served": "served",
            "match": match, "first_divergence_token": None if match else 5, "margin_at_divergence": margin,
            "tokens": MAX_NEW_TOKENS, "perf": {}, "accepted_draft_tokens": 2, "target_forwards": 10,
            "acceptance_length": 1.2, "latency_s": 1.0, "ttft_s": 0.1, "ar_latency_s": None, "ar_tokens": None,
            "ar_matches": None, "speedup": None}


def test_only_a_reproduced_divergence_within_the_ceiling_and_float64_exact_passes():
    rows = [_row(None, match=True), _row(0.5), _row(3.125), _row(ROUNDING_CEILING + 1), _row(2.0)]
    exact = [{"identical": True}] * 4 + [{"identical": False}]
    beyond = beyond_limit(rows, "near-tie", 1.5)
    assert beyond == [2, 3, 4]
    assert [i for i in beyond if may_be_rounding(rows[i], exact[i])] == [2]  # 3: past the ceiling; 4: a. failed
    assert not summarize(rows, "bfloat16", "near-tie", 1.5)["parity_ok"]
    assert not summarize(rows, "bfloat16", "near-tie", 1.5, reproduced=[2])["parity_ok"]  # rows 3 and 4 still fail
    passing = summarize(rows[:3], "bfloat16", "near-tie", 1.5, reproduced=[2])
    assert passing["parity_ok"] and [d["reproduced_in_process"] for d in passing["divergences"]] == [False, True]
    assert "1 beyond the limit reproduced by the deployment in-process" in "\n".join(headlines(passing))
    assert not summarize(rows[:3], "bfloat16", "near-tie", 1.5)["parity_ok"]  # the same row, not reproduced


def test_the_deployment_reproduces_its_own_answer_and_not_a_changed_one(tmp_path, tiny_llama_dir, tiny_draft_dir,
                                                                        tokenizer):
    spec = {"kind": "draft", "max_draft_len": 3, "draft_model_dir": str(tiny_draft_dir)}
    deployment = write_deployment(tmp_path, tiny_llama_dir, spec)
    decoder = load_decoder(deployment)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    own = [decoder.decode(decoder.generate_ids(ids, SamplingParams(max_new_tokens=MAX_NEW_TOKENS)).token_ids)
           for ids in prompts]
    assert all(own)
    changed = own[1][:-1] + ("x" if own[1][-1] != "x" else "y")  # what a serving fault would send: one character off
    assert reproduces(deployment, prompts, [own[0], changed], MAX_NEW_TOKENS) == [True, False]
