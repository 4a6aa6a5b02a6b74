"""verify's report a.: speculative vs plain greedy on the deployment loaded in float64."""

from __future__ import annotations

import pytest

from specdeploy.errors import SpecDeployError
from specdeploy.exactness import first_difference, speculative_exactness
from specdeploy.quantize.stage import check_deploy_dtype
from specdeploy.runtime import batch
from specdeploy.runtime.verify import Acceptance
from tests.test_runtime_deployment import write_deployment
from tests.test_runtime_helpers import PROMPTS, one_thread, tokenizer  # noqa: F401


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]


def test_a_self_draft_is_exact_with_long_accepted_paths(tmp_path, tiny_llama_dir, tokenizer):
    # the target drafting for itself: every draft is right, so whole 4-token paths are verified
    spec = {"kind": "draft", "max_draft_len": 4, "draft_model_dir": str(tiny_llama_dir)}
    report = speculative_exactness(write_deployment(tmp_path, tiny_llama_dir, spec), _prompts(tokenizer), 16)
    assert report["ok"] and report["identical"] == report["prompts"] == 3 and report["dtype"] == "float64"
    assert report["acceptance_length"] > 3.0
    assert all(r["first_difference"] is None and r["tokens"] == 16 for r in report["rows"])


def test_a_verifier_that_keeps_a_wrong_draft_is_caught(tmp_path, tiny_llama_dir, tiny_draft_dir, tokenizer, monkeypatch):
    def accept_everything(tree, logits, params, generator):  # the bug: no check against the target
        return Acceptance(list(range(len(tree))), int(logits[-1].argmax()))

    monkeypatch.setattr(batch, "accept", accept_everything)  # the in-flight batcher's verifier
    spec = {"kind": "draft", "max_draft_len": 4, "draft_model_dir": str(tiny_draft_dir)}
    report = speculative_exactness(write_deployment(tmp_path, tiny_llama_dir, spec), _prompts(tokenizer), 16)
    assert not report["ok"] and report["identical"] < report["prompts"]
    assert any(r["first_difference"] is not None for r in report["rows"])


def test_a_fault_the_speculative_and_plain_paths_share_is_caught(tmp_path, tiny_llama_dir, tiny_draft_dir, tokenizer,
                                                                  monkeypatch):
    """The batched forward that every round after the prefill runs, drafting or not, returns its
    logits negated: speculative and plain runtime decoding agree with each other, token for
    token; greedy decoding by its definition does not, from the first token after the prefill."""
    verify = batch.InflightBatcher._verify

    def negated(self, rows, trees):
        logits, hidden = verify(self, rows, trees)
        return -logits, hidden

    monkeypatch.setattr(batch.InflightBatcher, "_verify", negated)
    spec = {"kind": "draft", "max_draft_len": 4, "draft_model_dir": str(tiny_draft_dir)}
    report = speculative_exactness(write_deployment(tmp_path, tiny_llama_dir, spec), _prompts(tokenizer), 16)
    assert not report["ok"] and [r["first_difference"] for r in report["rows"]] == [1, 1, 1]


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early


def test_the_deployment_dtype_is_an_explicit_choice():
    check_deploy_dtype("bfloat16", "fp8", "fp8")
    check_deploy_dtype("float32", "none", "none")  # the original fp32 weights, unchanged
    with pytest.raises(SpecDeployError, match="float32 deploys unquantized weights"):
        check_deploy_dtype("float32", "fp8", "fp8")
    with pytest.raises(SpecDeployError, match="unknown deployment dtype"):
        check_deploy_dtype("int8", "none", "none")
