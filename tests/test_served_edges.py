"""The edges of a real tokenizer served, and the server's own faults (issue 15, items 4, 6, 7).

One module-scoped tritonserver serves a tiny Llama whose tokenizer is SentencePiece-like
(Metaspace: a leading "▁" that decoding drops at the start of a text; a BOS added by
add_special_tokens), drafting with itself so accepted groups hold several tokens. One generated
token is marked special so a stop word that is a special token can be seen to fire."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from tritonclient.utils import InferenceServerException

from specdeploy import resolve
from specdeploy.client import Request, TritonLLMClient
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from specdeploy.runtime.batch import InflightBatcher
from specdeploy.runtime.deployment import load_decoder
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import SamplingParams
from specdeploy.triton import stage
from specdeploy.triton.serve import SHM_PREFIX, TritonServer, free_ports, shm_regions
from tests.test_served_batching import (DEADLINE_S, assert_cancelled_early, finished, generated, in_flight, scrape,
                                        wait_for, wait_idle)
from tests.test_triton_server import http_post
from tests.tiny import CORPUS, make_llama
from tests.triton_raw import StreamClient

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox"
STOP_AT = 3  # the generated token (by position) made special, to be the special stop word
LONG = 900  # tokens: a request that runs for seconds, to be cancelled


def metaspace_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = sorted(set("".join(CORPUS)) | {"▁"})
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=alphabet))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(out)
    return fast


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model; its STOP_AT-th greedy token is then declared a special token (same id)."""
    out = tmp_path_factory.mktemp("metaspace_llama")
    tokenizer = metaspace_tokenizer(out)
    model = make_llama(out, tokenizer, hidden=128, layers=4, context=1024, seed=1)
    # the runtime always stops at the model's EOS: make it BOS (never generated) so that a request
    # with end_id=BOS runs to max_tokens (the cancellation test needs a long one)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.bos_token_id
    model.save_pretrained(out)
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=STOP_AT + 1, do_sample=False)[0, ids.shape[1]:].tolist()
    word = tokenizer.convert_ids_to_tokens(new[STOP_AT])
    tokenizer.add_special_tokens({"additional_special_tokens": [word]})
    assert tokenizer.convert_tokens_to_ids(word) == new[STOP_AT] and len(tokenizer) == model.config.vocab_size
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def build_root(tmp_path_factory, model_dir) -> Path:
    root = tmp_path_factory.mktemp("edges") / "build"
    build = BuildDir(root)
    resolve.run(build, str(model_dir))
    stage.run(build, spec="draft", draft_model_dir=model_dir, max_draft_len=4, dtype="float32")  # exact on any CPU
    return root


@pytest.fixture(scope="module")
def server(build_root):
    with TritonServer(build_root / "triton_repo" / "cpu", log_path=build_root / "logs" / "edges.log", threads=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def decoder(build_root):
    return load_decoder(build_root / "triton_repo" / "cpu" / "tensorrt_llm" / "1" / "deployment.json")


@pytest.fixture()
def stream(server):
    with StreamClient(server.grpc_url) as client:
        yield client


def _answers_next_request(server) -> None:
    status, body = http_post(server, "/v2/models/ensemble/generate", {"text_input": PROMPT, "max_tokens": 4})
    assert status == 200 and json.loads(body)["text_output"], body


# ---------------------------------------------------------------------------------------------
# item 6: the tokenizer's edges


def test_streamed_pieces_concatenate_to_the_non_streamed_text(stream, decoder):
    streamed = stream.generate(PROMPT, 40)
    whole = stream.generate(PROMPT, 40, stream=False).text
    assert streamed.text == whole
    # the case that used to break: a later group whose first token carries the "▁" of a word
    assert any(p.startswith(" ") for p in streamed.pieces[1:]), streamed.pieces
    served_end = (decoder.tokenizer.eos_token_id,)  # the preprocessing's default end_id
    ids = decoder.generate_ids(decoder.encode(PROMPT), SamplingParams(max_new_tokens=40, stop_token_ids=served_end)).token_ids
    assert whole.strip() == decoder.decode(ids).strip()


def test_min_tokens_holds_off_the_end_id(stream, decoder):
    """TensorRT-LLM's min_tokens reaches the runtime: with end_id a token of the greedy answer, the
    answer stops there; with min_tokens past it, it has as many tokens as the runtime gives in-process
    (whose min_tokens tests/test_runtime_stream.py holds to transformers' min_new_tokens)."""
    ids = decoder.encode(PROMPT)
    greedy = decoder.generate_ids(ids, SamplingParams(max_new_tokens=30)).token_ids
    at = next(i for i in range(4, 30) if greedy[i] not in greedy[:i])  # the answer's first stop at it is there
    end = greedy[at]
    short = stream.generate(PROMPT, 30, stream=False, end_id=end).text
    held = stream.generate(PROMPT, 30, stream=False, end_id=end, min_tokens=at + 8).text
    expected = decoder.generate_ids(ids, SamplingParams(max_new_tokens=30, stop_token_ids=(end,), min_tokens=at + 8))
    assert len(expected.token_ids) >= at + 8 and expected.token_ids[:at] == greedy[:at] and expected.token_ids[at] != end
    assert held.strip() == decoder.decode(expected.token_ids).strip()
    assert short.strip() == decoder.decode(greedy[:at + 1]).strip() and len(short) < len(held)


def _preprocess(server, text: str) -> list[int]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, array, dtype in (("QUERY", np.array([[text.encode()]], dtype=object), "BYTES"),
                               ("REQUEST_OUTPUT_LEN", np.array([[4]], dtype=np.int32), "INT32")):
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return client.infer("preprocessing", inputs).as_numpy("INPUT_ID").reshape(-1).tolist()


def test_a_prompt_that_starts_with_bos_gets_no_second_one(server, decoder):
    bos = decoder.tokenizer.bos_token_id
    plain = _preprocess(server, PROMPT)
    assert plain[0] == bos and plain[1] != bos
    templated = _preprocess(server, "<s>" + PROMPT)
    # as training tokenized apply_chat_template's text: no extra BOS
    assert templated == decoder.tokenizer("<s>" + PROMPT, add_special_tokens=False)["input_ids"]
    assert templated.count(bos) == 1, "a chat-template prompt (its own BOS) must not get a second BOS"


def test_a_special_token_stop_word_fires(decoder, stream, model_dir):
    ids = decoder.generate_ids(decoder.encode(PROMPT), SamplingParams(max_new_tokens=12)).token_ids
    assert ids[STOP_AT] in AutoTokenizer.from_pretrained(model_dir).all_special_ids
    word = decoder.tokenizer.convert_ids_to_tokens(ids[STOP_AT])
    full = stream.generate(PROMPT, 12, stream=False).text
    stopped = stream.generate(PROMPT, 12, stream=False, stop_words=np.array([[word.encode()]], dtype=object)).text
    assert stopped.lstrip() == decoder.decode(ids[:STOP_AT]), (stopped, full)  # served text keeps the word's space
    assert len(stopped) < len(full)


def test_a_sliding_window_model_is_refused_at_load(tmp_path, tiny_tokenizer_dir):
    from transformers import MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, sliding_window=16)
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    tokenizer.save_pretrained(tmp_path / "mistral")
    deployment = tmp_path / "deployment.json"
    deployment.write_text(json.dumps({"model_dir": "mistral", "device": "cpu", "spec": {"kind": "ngram"}}))
    with pytest.raises(SpecDeployError, match=r"sliding-window attention \(sliding_window=16, context 256\)"):
        load_decoder(deployment)
    deployment.write_text(json.dumps({"model_dir": "mistral", "device": "cpu", "spec": {"kind": "none"}}))
    decoder = load_decoder(deployment)
    assert decoder.proposer is None  # plain decoding stays possible, one request at a time
    # serving batches requests, which a sliding-window cache cannot do: refused when the batcher is made
    with pytest.raises(SpecDeployError, match=r"does not support for in-flight batching") as err:
        InflightBatcher(decoder.target, None)
    assert "generate --spec none" in err.value.hint
    with pytest.raises(SpecDeployError, match=r"does not support for a draft model"):  # nor as another's draft
        build_proposer("draft", decoder.target, draft_model=decoder.target)


# ---------------------------------------------------------------------------------------------
# item 7: clear client errors, and the server answers the next request


BAD_GRPC = [
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"end_id": 10_000_000}, "end_id 10000000 is outside the model's vocabulary"),
    ({"end_id": -5}, "end_id -5 is outside the model's vocabulary"),
    ({"stop_words": np.array([[b"\xff\xfe"]], dtype=object)}, "stop_words is not valid UTF-8"),
    ({"stop_words": np.array([[b"</s>:"]], dtype=object)}, "stop word '</s>:' mixes a special token with text"),
]


def test_a_word_list_sent_to_tensorrt_llm_is_read_in_its_layout_or_refused_by_name(monkeypatch):
    """TensorRT-LLM's [2, n] word lists (ids, then each word's end offset, -1 padded), as a client
    calling tensorrt_llm directly sends them (to_word_list_format)."""
    import types

    from specdeploy.triton.serving.requests import BadRequest, Inputs

    sent: dict = {}
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.SimpleNamespace(
        get_input_tensor_by_name=lambda request, name: types.SimpleNamespace(as_numpy=lambda: sent[name])))
    sent["stop_words_list"] = np.array([[[5, 6, 7, 0], [2, 3, -1, -1]]])
    assert Inputs(None).words("stop_words_list") == [[5, 6], [7]]
    sent["stop_words_list"] = np.array([[[5, 6, 0, 0], [2, 9, -1, -1]]])
    with pytest.raises(BadRequest, match=r"end offsets \[2, 9\] must rise and stay within its 4 ids"):
        Inputs(None).words("stop_words_list")
    sent["stop_words_list"] = np.array([[5, 6, 7]])
    with pytest.raises(BadRequest, match=r"stop_words_list must be \[2, n\]"):
        Inputs(None).words("stop_words_list")


@pytest.mark.parametrize("extra,message", BAD_GRPC, ids=[m[:30] for _, m in BAD_GRPC])
def test_bad_sampling_inputs_get_a_clear_error(server, stream, extra, message):
    with pytest.raises(InferenceServerException, match=message) as err:
        stream.generate(PROMPT, 4, **extra)
    assert "internal error" not in str(err.value)
    _answers_next_request(server)


def test_a_stream_request_without_a_prompt_gets_an_error(server, stream):
    """Both checked by Triton's own frontend before any model runs: a clear error, no empty answer."""
    with pytest.raises(InferenceServerException, match=r"unexpected shape for input 'text_input'.*got \[1,0\]"):
        stream.generate("", 4, text_input=np.zeros((1, 0), dtype=object))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    max_tokens.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    client.async_stream_infer("ensemble", [max_tokens], enable_empty_final_response=True)
    _, error = answers.get(timeout=60)
    client.stop_stream()
    assert error is not None and "missing required input(s) ['text_input']" in error.message()
    _answers_next_request(server)


# ---------------------------------------------------------------------------------------------
# item 4, client side: a timeout cancels the request


def test_client_timeout_cancels_and_returns_promptly(server, decoder):
    long = Request(PROMPT, max_tokens=LONG, end_id=decoder.tokenizer.bos_token_id)  # BOS: the model emits it only late
    full = TritonLLMClient(server.grpc_url, "grpc", timeout_s=300)
    started = time.perf_counter()
    done = full.generate(long)
    generation_s = time.perf_counter() - started  # sizes the short timeout, never asserted on
    assert len(done.text) > 1000, "the request must be long for the timeout to fall inside it"
    short = TritonLLMClient(server.grpc_url, "grpc", timeout_s=0.2 * generation_s)
    wait_idle(server)
    before = finished(scrape(server))
    with pytest.raises(SpecDeployError, match="request cancelled"):
        short.generate(long)
    # promptly: it gave up while the server was still generating the answer, not once it was done
    assert finished(scrape(server)) == before
    # through the ensemble, this Triton does not pass the cancellation on to the tensorrt_llm step
    # already running (it skips only steps not yet scheduled), so the next request may wait
    _answers_next_request(server)


def test_a_cancelled_tensorrt_llm_request_stops_generating(server, decoder):
    """Called directly (no ensemble), the model sees is_cancelled() between rounds and stops: the
    request, sent again and cancelled while it runs, is recorded cancelled with fewer tokens than
    it generates uncancelled, and the server answers the next request."""
    ids = decoder.encode(PROMPT)

    def one(name, array, dtype):
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        return tensor

    inputs = [one("input_ids", np.array([ids], dtype=np.int32), "INT32"),
              one("input_lengths", np.array([[len(ids)]], dtype=np.int32), "INT32"),
              one("request_output_len", np.array([[LONG]], dtype=np.int32), "INT32"),
              one("end_id", np.array([[decoder.tokenizer.bos_token_id]], dtype=np.int32), "INT32")]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    wait_idle(server)
    before = scrape(server)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer("tensorrt_llm", inputs, enable_empty_final_response=True)
    _, error = answers.get(timeout=DEADLINE_S)
    client.stop_stream()
    assert error is None, error
    after = scrape(server)
    assert finished(after) == finished(before) + 1
    whole = generated(before, after)
    assert whole > 100, "the request must be long for its cancellation to fall inside it"
    before = after
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer("tensorrt_llm", inputs, enable_empty_final_response=True)
    wait_for(lambda: in_flight(server) == 1, DEADLINE_S, "the request is in the batch")  # cancelled while it runs
    client.stop_stream(cancel_requests=True)
    assert_cancelled_early(server, before, whole)
    _answers_next_request(server)


# ---------------------------------------------------------------------------------------------
# `specdeploy serve` stops promptly when interrupted while the model loads


SLOW_MODEL = """
import time
from pathlib import Path


class TritonPythonModel:
    def initialize(self, args):
        Path({marker!r}).with_suffix(".loading").touch()
        time.sleep({load_s})
        Path({marker!r}).with_suffix(".loaded").touch()

    def execute(self, requests):
        return []
"""
SLOW_LOAD_S = 120
SLOW_CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def test_serve_stops_on_sigint_while_loading(tmp_path):
    repo = tmp_path / "repo"
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    marker = tmp_path / "slow"  # the stub touches slow.loading as it starts loading, slow.loaded once done
    (repo / "slow" / "1" / "model.py").write_text(SLOW_MODEL.format(marker=str(marker), load_s=SLOW_LOAD_S))
    ports = [str(port) for port in free_ports(3)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdeploy", "serve", "--build-dir", str(tmp_path / "build"), "--repo", str(repo),
         "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    prefix = f"{SHM_PREFIX}specdeploy_{proc.pid}_"
    try:
        deadline = time.monotonic() + 60
        while not marker.with_suffix(".loading").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.with_suffix(".loading").exists(), "the server never started loading"
        assert shm_regions(prefix)
        proc.send_signal(signal.SIGINT)
        # a deadline past the load: whether it waited for the model is told by the marker, not the clock
        assert proc.wait(SLOW_LOAD_S + 60) == 0
        assert not marker.with_suffix(".loaded").exists(), "it waited for the model to load"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopped before it was ready (SIGINT)" in proc.stdout.read()
    assert not shm_regions(prefix)
