"""Parity bookkeeping: exact matches, the first divergence and the margin there, and which rule applies."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdeploy.parity import Reference as Greedy
from specdeploy.parity import compare, hf_reference, parity_holds
from specdeploy.checkpoints.quantized import parity_dtype
from specdeploy.runtime.types import acceptance_length
from specdeploy.verify.reports import write_reports
from specdeploy.verify.served import served_forwards
from specdeploy.verify.summary import ACCEPTANCE_DEFINITION, SPEEDUP_DEFINITION, _speedup, parity_rule, summarize
from specdeploy.verify.trtllm_server import trtllm_target


def test_reference_match_and_divergence(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompt_ids = tokenizer("def add(a, b):", return_tensors="pt").input_ids
    ref = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=12)
    assert len(ref.token_ids) == len(ref.margins) == 12
    # each token is the argmax and each margin its top-2 gap at the same position, recomputed in one
    # forward over prompt + answer (a margin taken one position off would differ by whole logits)
    ids = torch.cat([prompt_ids, torch.tensor([ref.token_ids])], dim=1)
    logits = model(ids).logits[0, prompt_ids.shape[1] - 1:-1]
    top2 = logits.topk(2, dim=-1).values
    assert logits.argmax(-1).tolist() == ref.token_ids
    assert ref.margins == pytest.approx((top2[:, 0] - top2[:, 1]).tolist(), rel=1e-4, abs=1e-5)

    same = compare("p", ref, ref.text, tokenizer)
    assert same.match and same.first_divergence_token is None

    # keep the first 5 reference tokens, then go elsewhere: divergence is at token 5
    kept = tokenizer.decode(ref.token_ids[:5], skip_special_tokens=True)
    other = compare("p", ref, kept + "\x00zzz", tokenizer)
    assert not other.match
    assert other.first_divergence_token == 5
    assert other.margin_at_divergence == ref.margins[5]


def test_an_answer_that_goes_on_where_the_reference_stopped_parts_at_the_eos(tiny_llama_dir):
    """The reference ends with EOS at position k; the served answer goes on there (a near-tie):
    the divergence is k, judged by the margin at k (the EOS's), not past the reference's end."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    words = tokenizer("def add", add_special_tokens=False)["input_ids"]
    ids = words + [tokenizer.eos_token_id]
    margins = [5.0] * len(words) + [0.25]
    ref = Greedy(ids, tokenizer.decode(ids, skip_special_tokens=True), margins)
    result = compare("p", ref, ref.text + "(a, b)", tokenizer)
    assert (result.match, result.first_divergence_token, result.margin_at_divergence) == (False, len(words), 0.25)
    assert parity_holds(result, exact=False, near_tie=1.0) and not parity_holds(result, exact=True, near_tie=1.0)


def _forwards(model) -> list[int]:
    """A counter of the model's forward calls."""
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    return calls


def _tiny(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    return model, tokenizer, tokenizer("def add(a, b):", return_tensors="pt").input_ids


def test_a_right_guess_is_checked_in_one_forward_and_gives_generates_reference(tiny_llama_dir):
    model, tokenizer, prompt_ids = _tiny(tiny_llama_dir)
    generated = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=7)
    calls = _forwards(model)
    checked = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=7, guess=generated.text)
    assert len(calls) == 1 and checked.token_ids == generated.token_ids and checked.text == generated.text
    assert checked.margins == pytest.approx(generated.margins, rel=1e-4, abs=1e-5)


def test_a_guess_that_does_not_retokenize_to_the_served_tokens_still_gives_generates_reference(tiny_llama_dir):
    """The tiny model's 12 tokens end in an EOS after byte tokens that decode to U+FFFD: the
    text re-tokenizes differently, so the check parts early and generate() finishes the job."""
    model, tokenizer, prompt_ids = _tiny(tiny_llama_dir)
    generated = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=12)
    assert generated.token_ids[-1] == model.generation_config.eos_token_id
    assert tokenizer(generated.text, add_special_tokens=False)["input_ids"] != generated.token_ids[:-1]
    checked = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=12, guess=generated.text)
    assert checked.token_ids == generated.token_ids and compare("p", checked, generated.text, tokenizer).match
    # stopped where the two part (the load test's near-tie judge, verify's fidelity): the reference's
    # own tokens write the guess's text, so the check follows the text on, and nothing parts
    stopped = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=12, guess=generated.text, complete=False)
    assert stopped.token_ids == generated.token_ids and compare("p", stopped, generated.text, tokenizer).match


@pytest.mark.parametrize("min_tokens", [12, 20])
@pytest.mark.parametrize("guessed", [False, True])
def test_min_tokens_holds_the_reference_as_generates_min_new_tokens(tiny_llama_dir, guessed, min_tokens):
    """The tiny model ends at its 12th token (EOS); asked for min_tokens 12 or 20, the reference is
    generate()'s with that min_new_tokens, margins taken as its scores are (the EOS held off), whether
    generated or checked along the served text, which then matches."""
    model, tokenizer, prompt_ids = _tiny(tiny_llama_dir)
    eos = model.generation_config.eos_token_id
    assert hf_reference(model, tokenizer, prompt_ids, max_new_tokens=24).token_ids.index(eos) == 11
    out = model.generate(prompt_ids, max_new_tokens=24, min_new_tokens=min_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    expected = out.sequences[0, prompt_ids.shape[1]:].tolist()
    assert len(expected) > min_tokens and eos not in expected[:min_tokens]
    text = tokenizer.decode(expected, skip_special_tokens=True)
    ref = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=24, guess=text if guessed else None,
                       min_tokens=min_tokens)
    assert ref.token_ids == expected and compare("p", ref, text, tokenizer).match
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values  # one forward against cached steps: float32 rounding
    assert ref.margins == pytest.approx((top2[:, 0] - top2[:, 1]).tolist(), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("served_tokens", [0, 3, 6])
def test_a_wrong_or_short_guess_gives_generates_reference_and_the_same_divergence(tiny_llama_dir, served_tokens):
    """The served answer leaves the reference after `served_tokens` (wrong text, or it stopped):
    completed, the reference is generate()'s; stopped at the parting, it places the divergence
    (and its margin) where generate()'s does, in one forward."""
    model, tokenizer, prompt_ids = _tiny(tiny_llama_dir)
    generated = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=7)
    kept = tokenizer.decode(generated.token_ids[:served_tokens], skip_special_tokens=True)
    for served in (kept, kept + "\x00zzz"):
        expected = compare("p", generated, served, tokenizer)
        assert not expected.match
        complete = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=7, guess=served)
        assert complete.token_ids == generated.token_ids
        calls = _forwards(model)
        placed = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=7, guess=served, complete=False)
        assert len(calls) == 1 and len(placed.token_ids) == served_tokens + 1
        found = compare("p", placed, served, tokenizer)
        assert (found.match, found.first_divergence_token) == (False, expected.first_divergence_token)
        assert found.margin_at_divergence == pytest.approx(expected.margin_at_divergence, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("dtype, quant, rule", [
    ("float64", {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, "exact"),
    ("float32", {}, "exact"),
    ("float32", {"quant_algo": "W4A16_AWQ"}, "exact"),  # weight-only: activations are not rounded
    ("float32", {"quant_algo": "FP8"}, "near-tie"),
    ("float32", {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": "FP8"}, "near-tie"),
    ("bfloat16", {}, "near-tie"),
])
def test_parity_is_exact_only_where_the_runtime_can_be(dtype, quant, rule):
    assert parity_rule(dtype, quant) == rule


def test_a_divergence_fails_the_exact_rule_and_passes_near_tie_only_when_small():
    row = {"prompt": "<|im_start|>system\nYou are a helpful AI assistant", "shown": "Why is the sky blue?", "reference": "ab", "served": "ac", "match": False, "first_divergence_token": 1,
           "margin_at_divergence": 0.3, "tokens": 2, "accepted_draft_tokens": 0, "target_forwards": 1,
           "acceptance_length": 1.0, "latency_s": 1.0, "ttft_s": 0.1,
           "speedup": None, "ar_latency_s": None, "category": "chat"}
    exact = summarize([row], "float64", "exact", near_tie=1.0)
    assert not exact["parity_ok"] and exact["divergences"][0]["prompt"] == "Why is the sky blue?"  # not the template
    assert summarize([row], "bfloat16", "near-tie", near_tie=1.0)["parity_ok"]
    assert not summarize([row], "bfloat16", "near-tie", near_tie=0.1)["parity_ok"]


def test_parity_dtype_follows_the_quantized_checkpoint(tmp_path):
    assert parity_dtype(tmp_path) == "float32"  # not quantized
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    assert parity_dtype(tmp_path) == "float64"


def _row(category: str, tokens: int, accepted: int) -> dict:
    forwards = served_forwards(tokens, accepted)
    return {"category": category, "shown": "p", "prompt": "p", "reference": "a", "served": "a", "match": True,
            "first_divergence_token": None, "margin_at_divergence": None, "tokens": tokens, "perf": {},
            "accepted_draft_tokens": accepted, "target_forwards": forwards,
            "acceptance_length": acceptance_length(accepted, forwards), "latency_s": 1.0, "ttft_s": 0.1,
            "speedup": None, "ar_latency_s": None}


def test_acceptance_length_is_trtllms_summed_over_prompts(tmp_path):
    """The prefill yields the first token; each later forward its accepted drafts + 1. The
    aggregate sums both counts: a short answer does not weigh like a long one."""
    assert served_forwards(tokens=10, accepted=0) == 9  # plain decoding: 1 token per forward
    assert served_forwards(tokens=64, accepted=42) == 21
    rows = [_row("chat", 64, 42), _row("code", 4, 0)]
    summary = summarize(rows, "float32", "exact", near_tie=1.0)
    assert summary["acceptance_length"] == pytest.approx((42 + 21 + 3) / (21 + 3))
    assert summary["acceptance_length"] != pytest.approx((rows[0]["acceptance_length"] + rows[1]["acceptance_length"]) / 2)
    assert summary["acceptance_length_chat"] == pytest.approx(63 / 21) and summary["acceptance_length_code"] == 1.0
    assert summary["acceptance_length_definition"] == ACCEPTANCE_DEFINITION
    write_reports(tmp_path, summary, rows)
    assert f"Acceptance length: {ACCEPTANCE_DEFINITION}" in (tmp_path / "verify.md").read_text()


def test_a_divergence_at_the_first_token_shows_its_index_in_verify_md(tmp_path):
    first = {**_row("chat", 8, 2), "match": False, "first_divergence_token": 0, "margin_at_divergence": 3.2}
    write_reports(tmp_path, summarize([first, _row("code", 8, 2)], "bfloat16", "near-tie", near_tie=1.0), [first])
    row = next(line for line in (tmp_path / "verify.md").read_text().splitlines() if line.startswith("| chat"))
    assert row.split("|")[3].strip() == "0" and row.split("|")[4].strip() == "3.200"


def test_speedup_is_tokens_per_s_of_each_arm_on_its_own_output():
    """Outside float64 the speculative answer can part from the AR twin's at a near-tie and stop
    early: 14 tokens in 1.4 s against 64 in 6.4 s is the same 10 tokens/s, not a 4x latency win."""
    early = {**_row("chat", 14, 4), "latency_s": 1.4, "ar_latency_s": 6.4, "ar_tokens": 64, "speedup": 1.0}
    same = {**_row("code", 64, 20), "latency_s": 4.0, "ar_latency_s": 6.0, "ar_tokens": 64, "speedup": 1.5}
    for row in (early, same):
        row["speedup"] = _speedup([(row["tokens"], row["latency_s"], row["ar_tokens"], row["ar_latency_s"])])
    assert early["speedup"] == pytest.approx(1.0) and same["speedup"] == pytest.approx(1.5)
    summary = summarize([early, same], "float32", "near-tie", near_tie=1.0)
    assert summary["speedup"] == pytest.approx((78 / 5.4) / (128 / 12.4))
    assert summary["speedup_chat"] == pytest.approx(1.0) and summary["speedup_min"] == pytest.approx(1.0)
    assert summary["speedup_definition"] == SPEEDUP_DEFINITION
    assert _speedup([(10, 1.0, None, None)]) is None  # no AR twin asked
    # a row without a speed-up (the twin made no tokens for it) leaves its category's minimum to the others
    lone = {**_row("chat", 8, 2), "ar_tokens": 0, "ar_latency_s": 1.0}
    mixed = summarize([lone, early, same], "float32", "near-tie", near_tie=1.0)
    assert mixed["speedup_min_chat"] == pytest.approx(1.0) and mixed["speedup_min_code"] == pytest.approx(1.5)
    assert summarize([lone, same], "float32", "near-tie", near_tie=1.0)["speedup_min_chat"] is None


def test_a_trtllm_route_is_asked_in_its_own_input_names():
    routes = {"recommended": "llmapi", "routes": {
        "llmapi": {"model": "tensorrt_llm", "inputs": "llmapi", "stream": True, "request": {}},
        "engine": {"model": "tensorrt_llm_bls", "inputs": "ensemble", "stream": False, "request": {"num_draft_tokens": 3}}}}
    llm = trtllm_target(routes, None)
    sent = llm.request("hi", 8).tensors(stream=llm.stream)
    # NVIDIA's llmapi model streams the cumulative text in every response: verify asks for it once
    assert llm.model == "tensorrt_llm" and not llm.stream
    assert sent["sampling_param_max_tokens"] == 8 and sent["streaming"] is False and "max_tokens" not in sent
    assert sent["sampling_param_return_perf_metrics"] is True and sent["sampling_param_exclude_input_from_output"] is True
    bls = trtllm_target(routes, "engine")
    sent = bls.request("hi", 8).tensors(stream=bls.stream)
    assert (bls.model, bls.stream, sent["num_draft_tokens"], sent["max_tokens"], sent["stream"]) == ("tensorrt_llm_bls", False, 3, 8, False)
    with pytest.raises(Exception, match="no GPU route 'x'"):
        trtllm_target(routes, "x")


@pytest.mark.parametrize("chunk", [1, 3])
def test_the_margin_shift_is_nothing_in_float64_and_rounding_in_bf16(tiny_llama_dir, chunk):
    """One forward against rounds of `chunk` through the cache, position by position: in float64
    the same numbers (a misaligned position would differ by whole logits), in bf16 a rounding
    (how much depends on the CPU's bf16 kernels: none at all on some)."""
    from specdeploy.checkpoints import load_causal_lm
    from specdeploy.parity import margin_shift

    model, tokenizer, prompt_ids = _tiny(tiny_llama_dir)
    answer = hf_reference(model, tokenizer, prompt_ids, max_new_tokens=12).token_ids
    exact = margin_shift(load_causal_lm(tiny_llama_dir, "float64"), prompt_ids, answer, chunk)
    assert len(exact) == len(answer) + 1 and max(exact) < 1e-9
    rounded = margin_shift(load_causal_lm(tiny_llama_dir, "bfloat16"), prompt_ids, answer, chunk)
    assert len(rounded) == len(answer) + 1 and max(rounded) < 0.5


def test_the_measured_near_tie_limit_is_the_p99_shift_between_the_floor_and_the_cap(tiny_llama_dir, monkeypatch):
    from specdeploy.checkpoints import load_causal_lm
    from specdeploy.parity import NEAR_TIE, NEAR_TIE_CAP
    from specdeploy.verify.reference import Reference, measured_near_tie

    model, tokenizer, _ = _tiny(tiny_llama_dir)
    reference = Reference(load_causal_lm(tiny_llama_dir, "float64"), tokenizer)
    answers = [("def add(a, b):", " return a + b"), ("def sub(a, b):", "")]  # an empty answer: nothing to measure
    exact = measured_near_tie(reference, answers, 8, chunk=2)
    assert exact["limit"] == NEAR_TIE and exact["largest_shift"] < 1e-9 and exact["positions"] > 1
    shifts = [0.25] * 98 + [1.25, 1.25, 4.0]  # p99 (stats.percentiles: linear) 1.25, under the cap
    monkeypatch.setattr("specdeploy.verify.reference.margin_shift", lambda *args: shifts)
    noisy = measured_near_tie(reference, answers, 8, chunk=2)
    assert noisy["limit"] == noisy["p99_shift"] == 1.25 and noisy["largest_shift"] == 4.0
    assert noisy["positions"] == 101 and noisy["round_tokens"] == 2
    shifts[-3:] = [2.5, 2.5, 6.77]  # a p99 past the cap
    assert measured_near_tie(reference, answers, 8, chunk=2)["limit"] == NEAR_TIE_CAP
    row = {"prompt": "p", "reference": "a", "served": "b", "match": False, "first_divergence_token": 3,
           "margin_at_divergence": 1.125, "speedup": None, "tokens": 4, "latency_s": 1.0, "ttft_s": 0.1,
           "accepted_draft_tokens": 0, "target_forwards": 4, "category": "code", "shown": "p"}
    assert not summarize([row], "bfloat16", "near-tie", NEAR_TIE)["parity_ok"]
    measured = summarize([row], "bfloat16", "near-tie", noisy["limit"], measured=noisy)
    assert measured["parity_ok"] and measured["parity_rule"] == "near-tie (margin <= 1.25, measured)"


def test_an_answer_that_holds_the_reference_token_in_a_longer_one_parts_there(tiny_llama_dir):
    """The reference's last token (its own choice where it parted from the served answer) is a
    prefix of the served answer's token there (" a" against " ab", "\\n" against "\\n\\n"): as text
    the served answer goes on past the reference, as tokens they part at that position, judged by
    its margin (seen in a load test: one output failed with no margin)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    words = tokenizer("def add", add_special_tokens=False)["input_ids"]
    prefix = tokenizer.decode(words)
    pair = None
    for short in range(len(tokenizer)):
        piece = tokenizer.decode([short])
        if not piece.strip() or tokenizer(prefix + piece, add_special_tokens=False)["input_ids"] != words + [short]:
            continue
        for long in range(len(tokenizer)):
            text = tokenizer.decode([long])
            if long != short and text.startswith(piece) and len(text) > len(piece) and \
                    tokenizer(prefix + text, add_special_tokens=False)["input_ids"] == words + [long]:
                pair = short, long
                break
        if pair:
            break
    assert pair is not None, "the tiny tokenizer has no token that extends another"
    short, long = pair
    ids = words + [short]
    ref = Greedy(ids, tokenizer.decode(ids, skip_special_tokens=True), [5.0] * len(words) + [0.25])
    served = tokenizer.decode(words + [long])
    result = compare("p", ref, served, tokenizer)
    assert (result.match, result.first_divergence_token, result.margin_at_divergence) == (False, len(words), 0.25)
    assert parity_holds(result, exact=False, near_tie=1.0)


@pytest.mark.parametrize("served, divergence, at", [
    ("x = 'é' + z", 10, 10),  # the two agree through "é" (two byte tokens) and part at "y"
    ("x = 'è' + y", 5, 6),  # they part inside the character: at its first token, by its largest margin
])
@pytest.mark.parametrize("margin", [0.1, 8.0])
def test_a_character_written_in_byte_tokens_parts_as_a_whole(tiny_tokenizer_dir, served, divergence, at, margin):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    ids = tokenizer("x = 'é' + y", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids[:6]).endswith("\ufffd")  # "é" is two byte tokens here
    margins = [5.0] * len(ids)
    margins[5] = 0.05  # the character's first byte token: a near-tie that is not where "é" and "y" part
    margins[at] = margin
    result = compare("p", Greedy(ids, tokenizer.decode(ids, skip_special_tokens=True), margins), served, tokenizer)
    assert result.first_divergence_token == divergence and result.margin_at_divergence == margin
    assert parity_holds(result, False, 1.0) == (margin <= 1.0)


def test_a_trtllm_answer_takes_the_same_tokens_whether_or_not_it_matches(tiny_tokenizer_dir):
    """Without the server's own counts, an answer that stopped short of max_new_tokens took its
    end token too (its text does not show it), as the reference's tokens count it on a match."""
    from specdeploy.verify.trtllm_server import _trtllm_row

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text_ids = tokenizer("def add", add_special_tokens=False)["input_ids"]

    class Stub:  # a reference that answers `ids`
        def __init__(self, ids):
            self.ids, self.tokenizer = ids, tokenizer

        def check(self, prompt, served, max_new_tokens, complete=True):
            greedy = Greedy(self.ids, tokenizer.decode(self.ids, skip_special_tokens=True), [5.0] * len(self.ids))
            return greedy, compare(prompt, greedy, served, tokenizer)

    answer = {"category": "code", "shown": "p", "text_input": "p", "served": tokenizer.decode(text_ids),
              "perf": {"total_accepted_draft_tokens": 1}, "latency_s": 1.0, "ttft_s": 0.1}
    longer = text_ids + tokenizer("(a", add_special_tokens=False)["input_ids"]
    rows = [_trtllm_row(Stub(ids + [tokenizer.eos_token_id]), answer, 64) for ids in (text_ids, longer)]
    assert rows[0]["match"] and not rows[1]["match"]
    assert [(r["tokens"], r["target_forwards"]) for r in rows] == [(len(text_ids) + 1, len(text_ids) - 1)] * 2
    cut = _trtllm_row(Stub(longer), answer, len(text_ids))  # cut at max_new_tokens: no end token
    assert cut["tokens"] == len(text_ids)


def test_a_replacement_character_both_wrote_is_text_not_a_character_begun():
    """U+FFFD the model wrote (an invalid byte sequence), which the served answer holds too: the
    divergence after it is where they part, judged by the margin there."""
    vocab = {0: "a", 1: "b", 2: "\ufffd", 3: "c", 9: ""}

    class Tokenizer:  # one token a character
        def decode(self, ids, skip_special_tokens=True):
            return "".join(vocab[i] for i in ids)

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [{v: k for k, v in vocab.items() if v}[c] for c in text]}

    result = compare("p", Greedy([0, 2, 1, 9], "a\ufffdb", [5.0, 6.0, 0.2, 3.0]), "a\ufffdc", Tokenizer())
    assert (result.first_divergence_token, result.margin_at_divergence) == (2, 0.2)


def test_every_hugging_face_generate_decodes_plain_argmax_whatever_the_generation_config(tiny_llama_dir, tmp_path):
    """An instruct model's generation_config.json (Qwen2.5's repetition_penalty 1.05, ...) fills every
    field a generate() call leaves unset in transformers 5, a GenerationConfig passed in too: verify's
    reference, the distillation's answers and bench's Hugging Face rows would then not be the plain
    argmax the served runtime decodes."""
    import shutil

    from specdeploy.bench import Bench
    from specdeploy.checkpoints import load_causal_lm
    from specdeploy.runtime.decoding import generate
    from specdeploy.runtime.types import SamplingParams
    from specdeploy.speculator.distill import distillation_model, generate as distill_answers
    from specdeploy.verify.reference import load_reference

    penalised = tmp_path / "penalised"
    shutil.copytree(tiny_llama_dir, penalised)
    config = json.loads((penalised / "generation_config.json").read_text())
    (penalised / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 5.0, "no_repeat_ngram_size": 1}))
    tokenizer = AutoTokenizer.from_pretrained(penalised)
    prompt, n = "abc", 24
    ids = tokenizer(prompt).input_ids
    plain = generate(load_causal_lm(penalised), ids, SamplingParams(max_new_tokens=n)).token_ids
    own = load_causal_lm(penalised).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    assert own != plain  # the settings above change a generate() left to the model's own config

    reference = load_reference(penalised, "float32", "cpu")
    assert hf_reference(reference.model, tokenizer, reference.ids(prompt), n).token_ids == plain
    base = distillation_model(penalised, "float32", device=torch.device("cpu"))
    data = distill_answers(base, tokenizer, [prompt], max_new_tokens=n, layers=[1], chat=False)
    assert data.tokens[len(ids):].tolist() == plain
    bench = Bench(load_causal_lm(penalised), load_causal_lm(penalised), max_new_tokens=n)
    assert bench.runner("hf-assisted")(ids).tokens == plain
