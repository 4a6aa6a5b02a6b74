"""Report b.'s judgement and counts: the near-tie limit is one that a real divergence fails,
acceptance comes from the server's own counters, and a run with no prompts is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from specdeploy.client import Completion
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from specdeploy.checkpoints import load_causal_lm
from specdeploy.verify.cpu_server import verify
from specdeploy.verify.reference import Prompt, Reference, near_tie_limit
from specdeploy.verify.served import run_prompts
from specdeploy.verify.summary import headlines, summarize

PROMPT = "The quick brown fox"
MAX_NEW_TOKENS = 12
# the default FP8 build's measured shifts, in shape: the bulk small, a p99 near 2, one at 6.77
FP8_SHIFTS = [0.25] * 370 + [1.97] * 4 + [6.77]


def _reference(model_dir, margin_at: int | None = None, margin: float = 2.0) -> Reference:
    """The tiny model in float32; with `margin_at`, its final norm scaled so that the reference's
    top-2 margin at that answer position is `margin` (logits scale with it, the greedy answer stays)."""
    reference = Reference(load_causal_lm(model_dir), AutoTokenizer.from_pretrained(model_dir))
    if margin_at is not None:
        ref, _ = reference.check(PROMPT, "", MAX_NEW_TOKENS)
        with torch.no_grad():
            reference.model.model.norm.weight.mul_(margin / ref.margins[margin_at])
    return reference


def _row(parity, category: str = "chat") -> dict:
    return {"category": category, "shown": PROMPT, **parity.as_dict(), "tokens": MAX_NEW_TOKENS, "perf": {},
            "accepted_draft_tokens": 0, "target_forwards": MAX_NEW_TOKENS - 1, "acceptance_length": 1.0,
            "latency_s": 1.0, "ttft_s": 0.1, "ar_latency_s": None, "ar_tokens": None, "ar_matches": None, "speedup": None}


def _planted(reference: Reference, at: int):
    """The reference's answer up to `at`, then elsewhere: a served answer that parts at `at`."""
    ref, _ = reference.check(PROMPT, "", MAX_NEW_TOKENS)
    served = reference.tokenizer.decode(ref.token_ids[:at], skip_special_tokens=True) + "\x00zzz"
    return reference.check(PROMPT, served, MAX_NEW_TOKENS)[1]


@pytest.mark.parametrize("margin, passes", [(2.0, False), (0.84, True)])
def test_a_divergence_at_margin_2_fails_under_the_fp8_builds_shifts(tiny_llama_dir, monkeypatch, margin, passes):
    """A divergence planted where the reference preferred its token by 2 logits fails report b.,
    although the served model's own rounding moved some margin by 6.77 (the largest shift that used
    to be the limit); one at 0.84 (the largest margin of the divergences the default build showed)
    passes."""
    reference = _reference(tiny_llama_dir, margin_at=3, margin=margin)
    parity = _planted(reference, 3)
    assert parity.first_divergence_token == 3 and parity.margin_at_divergence == pytest.approx(margin, rel=1e-4)
    monkeypatch.setattr("specdeploy.verify.reference.margin_shift", lambda *args: FP8_SHIFTS)
    limit, measured = near_tie_limit(reference, [(PROMPT, parity.served)], MAX_NEW_TOKENS, 4, given=None)
    summary = summarize([_row(parity)], "bfloat16", "near-tie", limit, measured=measured)
    assert summary["parity_ok"] is passes
    assert measured["largest_shift"] == 6.77 and measured["p99_shift"] == pytest.approx(1.97) and limit < 2.0
    assert summary["divergences"][0]["margin"] == pytest.approx(margin, rel=1e-4)
    lines = "\n".join(headlines(summary))
    assert f"parity {'PASS' if passes else 'FAIL'}" in lines and "p99" in lines and f"{margin:.2f}" in lines


class _Server:
    """A served arm answering with fixed text and perf counters."""

    def __init__(self, text: str, perf: dict[str, float]) -> None:
        self.text, self.perf = text, perf

    def generate(self, request, stream=False) -> Completion:
        return Completion(self.text, [self.text], dict(self.perf), 1.0, 0.1)


def test_served_counts_come_from_the_server_not_the_text(tiny_llama_dir):
    """The server emitted 12 tokens in 4 forwards after the prefill, so its acceptance length is
    (12 - 1) / 4, whatever its draft counter says (a stopped round's unsent tail is no accepted
    token) and whatever the text re-tokenizes to; the AR twin's tokens are its own count too."""
    reference = _reference(tiny_llama_dir)
    answer = reference.check(PROMPT, "", MAX_NEW_TOKENS)[0].text
    spec = _Server(answer, {"total_generated_tokens": 12, "total_target_forwards": 4, "total_accepted_draft_tokens": 9,
                            "total_draft_tokens": 12})
    twin = _Server(answer + " more", {"total_generated_tokens": 12, "total_target_forwards": 11})
    prompt = Prompt("chat", PROMPT, PROMPT)
    row = run_prompts(spec, twin, reference, [prompt, prompt], MAX_NEW_TOKENS)[0]
    assert (row["tokens"], row["target_forwards"], row["accepted_draft_tokens"]) == (12, 4, 7)
    assert row["acceptance_length"] == pytest.approx(11 / 4) and row["ar_tokens"] == 12


@pytest.mark.parametrize("server", ["cpu", "trtllm"])
@pytest.mark.parametrize("given", [{"per_category": 0}, {"max_new_tokens": 0}])
def test_verify_refuses_nothing_to_ask(tmp_path, server, given):
    with pytest.raises(SpecDeployError, match="--prompts|--max-new-tokens"):
        verify(BuildDir(tmp_path / "build"), server=server, url="127.0.0.1:9", **given)


@pytest.mark.server
def test_the_server_counts_reach_verifys_client_through_the_ensemble_and_the_bls(tmp_path, tiny_llama_dir):
    """What verify reads, as it reads it: the emitted tokens and target forwards of the request,
    the runtime's own (the tiny model drafting for itself, so rounds accept several tokens)."""
    from specdeploy import resolve
    from specdeploy.client import Request, TritonLLMClient
    from specdeploy.prompts import text_ids
    from specdeploy.runtime.deployment import load_decoder
    from specdeploy.runtime.types import SamplingParams
    from specdeploy.triton import stage as package_stage
    from specdeploy.triton.serve import TritonServer

    build = BuildDir(tmp_path / "build")
    resolve.run(build, str(tiny_llama_dir))
    repo = package_stage.run(build, spec="draft", draft_model_dir=tiny_llama_dir, max_draft_len=4, dtype="float32") / "cpu"
    decoder = load_decoder(repo / "tensorrt_llm" / "1" / "deployment.json")
    served_end = (decoder.tokenizer.eos_token_id,)  # the preprocessing's default end_id
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=served_end)
    expected = decoder.generate_ids(text_ids(decoder.tokenizer, PROMPT), params).metrics
    assert expected.accepted_draft_tokens > 0
    with TritonServer(repo, log_path=tmp_path / "server.log", threads=1) as server:
        for model in ("ensemble", "tensorrt_llm_bls"):
            client = TritonLLMClient(server.grpc_url, model=model)
            client.wait_ready()
            for stream in (True, False):
                perf = client.generate(Request(PROMPT, max_tokens=MAX_NEW_TOKENS), stream=stream).perf
                assert (perf["total_generated_tokens"], perf["total_target_forwards"]) == \
                    (expected.new_tokens, expected.target_forwards), (model, stream)
