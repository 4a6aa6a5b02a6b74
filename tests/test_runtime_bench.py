"""The bench on tiny models: every row runs, the summary holds what the table and JSON report."""

from __future__ import annotations

import json

import pytest

from specdeploy.bench import ACCEPTANCE_LENGTH, DEFAULT_METHODS, Bench, divergence, run_bench
from specdeploy.cli import main as cli_main
from specdeploy.errors import SpecDeployError
from specdeploy.runtime.types import acceptance_length
from tests.test_runtime_helpers import PROMPTS, draft, hf_greedy, one_thread, target, tokenizer  # noqa: F401


def test_bench_rows(target, draft, tokenizer):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    methods = DEFAULT_METHODS.split(",") + ["hf-ar"]
    results = run_bench(Bench(target, draft, max_new_tokens=12, draft_len=4), prompts, methods, log=lambda _: None)
    summary = results["methods"]
    assert set(summary) == set(methods)
    assert [r["runs"].keys() for r in results["prompts"]] == [set(methods)] * 2
    rate = {m: summary[m]["tokens_per_s"] for m in methods}
    for method, hf in (("draft", "hf-assisted"), ("ngram", "hf-lookup")):
        runs = [r["runs"][method] for r in results["prompts"]]
        assert summary[method]["same_as_ar"] == 1.0  # fp32 greedy: exact
        assert summary[method]["speedup_vs_ar"] == pytest.approx(rate[method] / rate["ar"])
        assert summary[method]["speedup_vs_hf"] == pytest.approx(rate[method] / rate[hf])
        assert summary[method]["worst_prompt_vs_ar"] == pytest.approx(
            min(r["runs"][method]["tokens_per_s"] / r["runs"]["ar"]["tokens_per_s"] for r in results["prompts"]))
        # the one definition, from the summed counts of every prompt
        accepted, forwards = sum(r["accepted_draft_tokens"] for r in runs), sum(r["target_forwards"] for r in runs)
        assert summary[method]["acceptance_length"] == pytest.approx(acceptance_length(accepted, forwards))
    assert summary["ar"]["acceptance_length"] == 1.0  # plain decoding accepts nothing
    assert summary["hf-ar"]["same_as_ar"] == 1.0  # the runtime's own AR equals transformers
    assert summary["hf-assisted"]["acceptance_length"] is None
    assert "accepted draft tokens + 1 per target forward" in results["definitions"]["acceptance_length"]


def test_bench_acceptance_length_of_a_perfect_draft(target, tokenizer):
    """The target drafting for itself: every draft accepted, so about draft_len + 1 tokens per forward."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    summary = run_bench(Bench(target, target, max_new_tokens=21, draft_len=4), prompts, ["draft"], log=lambda _: None)["methods"]
    assert summary["draft"]["same_as_ar"] == 1.0
    # 21 tokens: 1 from the prefill, then rounds of 4 accepted + 1 (the EOS may cut one short)
    assert 3.0 < summary["draft"]["acceptance_length"] <= 5.0
    assert summary["draft"]["max_divergence_margin"] is None  # nothing diverged


def test_divergence_margin(target, tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    ref = hf_greedy(target, ids, 6)
    other = ref[:3] + [(ref[3] + 1) % target.config.vocab_size] + ref[4:]
    found = divergence(target, ids, ref, other)
    assert found["position"] == 3 and found["logit_margin"] > 0  # AR took the argmax
    assert divergence(target, ids, ref, list(ref)) is None


def test_bench_needs_module_for_medusa(target):
    with pytest.raises(SpecDeployError, match="--spec-dir medusa"):
        Bench(target, None, 8).runner("medusa")


def test_bench_command(tiny_llama_dir, tiny_draft_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("specdeploy.bench.load_prompts", lambda source, n, tok, chat: [tok(p)["input_ids"] for p in PROMPTS[:n]])
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tiny_llama_dir), "--draft", str(tiny_draft_dir), "--dtype", "float32"]
    argv += ["--num-prompts", "2", "--max-new-tokens", "6", "--methods", "draft,ngram,hf-lookup", "--threads", "1",
             "--out", str(out), "--device", "cpu"]
    assert cli_main(argv) == 0
    results = json.loads(out.read_text())
    assert set(results["methods"]) == {"ar", "draft", "ngram", "hf-lookup"}
    assert results["settings"]["max_new_tokens"] == 6 and len(results["prompts"]) == 2
    assert results["settings"]["device"] == "cpu" and results["machine"]["device"].startswith("cpu (")
    assert ACCEPTANCE_LENGTH == results["definitions"]["acceptance_length"]
    # the draft row's default drafting on a CPU: an int8 draft that stops at unsure tokens, still exact
    assert results["settings"]["draft_options"] == {"stop_below": 0.4, "draft_quant": "int8"}
    assert results["methods"]["draft"]["same_as_ar"] == 1.0


def test_bench_finds_the_modules_make_engine_trained_for_the_model(tmp_path):
    from specdeploy.bench import trained_modules

    def build(name: str, model: str, kind: str | None) -> None:
        stages = {"resolve": {"settings": {"model": model}}}
        if kind:
            stages["spec"] = {"settings": {"kind": kind}}
            (tmp_path / name / "spec").mkdir(parents=True)
            (tmp_path / name / "spec" / "spec_config.json").write_text(json.dumps({"kind": kind}))
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "manifest.json").write_text(json.dumps({"stages": stages}))

    build("m-eagle-fp8", "m", "eagle")
    build("m-medusa-none", "m", "medusa")
    build("m-ngram-fp8", "m", None)
    build("other-eagle-fp8", "other", "eagle")
    assert trained_modules(tmp_path, "m") == {"eagle": str(tmp_path / "m-eagle-fp8" / "spec"),
                                              "medusa": str(tmp_path / "m-medusa-none" / "spec")}
    assert trained_modules(tmp_path, "nothing") == {}


@pytest.mark.parametrize("adaptive", [False, True])
def test_bench_speculates_every_step_unless_adaptive(target, tokenizer, monkeypatch, adaptive):
    """Like the deployments: the module's own acceptance unless --adaptive asks for the fallback."""
    import specdeploy.bench as bench_module

    seen = []
    real = bench_module.generate

    def spy(*args, **kwargs):
        seen.append(kwargs.get("adaptive"))
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_module, "generate", spy)
    Bench(target, None, 4, adaptive=adaptive).runner("ngram")(tokenizer(PROMPTS[0])["input_ids"])
    assert seen == [adaptive]


def test_draft_options_are_parsed_and_checked():
    from specdeploy.bench import draft_options

    assert draft_options(["head_rows=32768", "stop_below=0.4", "draft_quant=int8"]) == {
        "head_rows": 32768, "stop_below": 0.4, "draft_quant": "int8"}
    for bad in (["head_rows"], ["width=3"]):
        with pytest.raises(SpecDeployError, match="bad --draft-option"):
            draft_options(bad)


def test_bad_spec_dirs_and_no_prompts_are_clear_errors(capsys):
    from specdeploy.bench import given_modules

    assert given_modules(["eagle=/m/eagle", "medusa=/m/medusa"]) == {"eagle": "/m/eagle", "medusa": "/m/medusa"}
    for bad in (["medusa"], ["ngram=/m"], ["eagle="]):
        with pytest.raises(SpecDeployError, match="bad --spec-dir"):
            given_modules(bad)
    assert cli_main(["bench", "--num-prompts", "0"]) == 2  # refused before any model loads
    assert "--num-prompts 0: nothing to benchmark" in capsys.readouterr().err
