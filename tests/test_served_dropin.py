"""The CPU deployment as a drop-in for TensorRT-LLM's Triton interface: requests shaped as
NVIDIA's own tensorrtllm_backend clients send them (inflight_batcher_llm/client, tools/) get
what TensorRT-LLM's backend would answer, streaming or not.

- shapes: text_output is one text per request ([1], indexed output[0] by NVIDIA's clients),
  output_ids [1, 1, n], sequence_length and every perf output [1, 1];
- TensorRT-LLM's sampling rules: top_p <= 0 and top_k 0 are unset, neither (or top_k 1) is greedy
  whatever the temperature, seed 0 by default; knobs the runtime lacks are refused, never ignored;
- decoupled_mode chosen at package time: a `--no-stream` repository answers plain infer requests;
- the perf outputs on every response, from the runtime's own counters;
- draft_input_ids (client-side draft-target speculation) verified as drafts.

Two tritonservers on the tiny model drafting with itself (every draft it makes is accepted), one
per decoupled mode, started once each."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from specdeploy import resolve
from specdeploy.client import Request, TritonLLMClient
from specdeploy.manifest import BuildDir
from specdeploy.runtime.deployment import load_decoder
from specdeploy.runtime.types import SamplingParams
from specdeploy.triton import stage
from specdeploy.triton.serve import TritonServer
from tests.overlap import until_overlapping
from tests.tiny import without_eos

pytestmark = pytest.mark.server

PROMPT = "def add(a, b):"
MAX_TOKENS = 12
PERF = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
        "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate",
        "total_accepted_draft_tokens", "total_draft_tokens")
# what tools/utils/utils.py prepare_inputs and inflight_batcher_llm_client.py send besides the prompt
NVIDIA_DEFAULTS = {
    "beam_width": np.int32(1), "temperature": np.float32(1.0), "runtime_top_k": np.int32(1),
    "runtime_top_p": np.float32(0.0), "len_penalty": np.float32(1.0), "repetition_penalty": np.float32(1.0),
    "min_tokens": np.int32(1), "presence_penalty": np.float32(0.0), "frequency_penalty": np.float32(0.0),
    "seed": np.uint64(0), "streaming": np.bool_(False),
}


# ---------------------------------------------------------------------------------------------
# servers and the in-process reference


def _build(root: Path, model: Path, decoupled: bool) -> Path:
    build = BuildDir(root)
    resolve.run(build, str(model))
    return stage.run(build, spec="draft", draft_model_dir=model, max_draft_len=4, decoupled=decoupled)


@pytest.fixture(scope="module")
def repos(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    """The tiny model without an EOS, so that a request of 200 tokens with another end_id runs long
    enough for a second to arrive while it does, on any CPU (`without_eos`)."""
    root = tmp_path_factory.mktemp("dropin")
    model = without_eos(tiny_llama_dir, root / "model")
    return {mode: _build(root / mode, model, mode == "streaming") / "cpu" for mode in ("streaming", "plain")}


def _serve(repo: Path):
    server = TritonServer(repo, log_path=repo.parent / f"{repo.parent.parent.name}.log", threads=1)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(repos):
    """The default package: decoupled (streaming)."""
    yield from _serve(repos["streaming"])


@pytest.fixture(scope="module")
def plain_server(repos):
    """`specdeploy package --no-stream`: not decoupled."""
    yield from _serve(repos["plain"])


@pytest.fixture(scope="module")
def decoder(repos):
    return load_decoder(repos["streaming"] / "tensorrt_llm" / "1" / "deployment.json")


@pytest.fixture(scope="module")
def greedy(decoder) -> list[int]:
    return decoder.generate(PROMPT, SamplingParams(max_new_tokens=MAX_TOKENS))[1].token_ids


# ---------------------------------------------------------------------------------------------
# requests as NVIDIA's clients build them


def tensors(protocol=grpcclient, **arrays) -> list:
    """InferInputs from numpy values, shaped [1, ...] as NVIDIA's prepare_tensor sends them."""
    out = []
    for name, value in arrays.items():
        array = np.asarray(value)
        array = array.reshape(1, 1) if array.ndim == 0 else array
        tensor = protocol.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def text_request(prompt: str = PROMPT, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    """The ensemble's inputs as end_to_end_grpc_client.py prepares them (its defaults)."""
    return {"text_input": np.array([[prompt]], dtype=object), "max_tokens": np.int32(max_tokens),
            "stream": np.bool_(False), "beam_width": np.int32(1), "temperature": np.float32(1.0),
            "exclude_input_in_output": np.bool_(True), **extra}


def ids_request(ids: list[int], max_tokens: int = MAX_TOKENS, **extra) -> dict:
    """tensorrt_llm's inputs as inflight_batcher_llm_client.py prepares them (its defaults)."""
    return {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": np.array([[len(ids)]], dtype=np.int32),
            "request_output_len": np.int32(max_tokens), "end_id": np.int32(0), "pad_id": np.int32(0),
            **NVIDIA_DEFAULTS, **extra}


def stream(server: TritonServer, model: str, arrays: dict, request_id: str = "") -> list:
    """Every response of one request over a gRPC stream, as NVIDIA's clients collect them
    (start_stream, async_stream_infer, stop_stream, then drain); an error raises."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put(error or result))
    client.async_stream_infer(model, tensors(**arrays), request_id=request_id)
    client.stop_stream()
    results = [got.get() for _ in range(got.qsize())]
    for result in results:
        if isinstance(result, InferenceServerException):
            raise result
    return results


def prompt_ids(decoder) -> list[int]:
    return decoder.encode(PROMPT)


# ---------------------------------------------------------------------------------------------
# shapes


def test_text_output_is_one_text_per_response_as_trtllm_returns_it(server, decoder, greedy):
    """end_to_end_grpc_client.py reads output[0].decode() of every response, streamed or not."""
    expected = decoder.decode(greedy)
    for model in ("ensemble", "tensorrt_llm_bls"):
        whole = stream(server, model, text_request())
        assert [r.as_numpy("text_output").shape for r in whole] == [(1,)]
        assert whole[0].as_numpy("text_output")[0].decode() == expected
        pieces = stream(server, model, text_request(stream=np.bool_(True)))
        assert len(pieces) > 2 and all(r.as_numpy("text_output").shape == (1,) for r in pieces)
        assert "".join(r.as_numpy("text_output")[0].decode() for r in pieces) == expected


def test_perf_outputs_ride_on_every_response_with_the_runtime_counts(server, decoder, greedy):
    """Every streamed response carries the ten perf outputs, [1, 1] each (both NVIDIA clients
    index them [0][0] on each response); counts only grow and end at the request's own."""
    ids = prompt_ids(decoder)
    responses = stream(server, "tensorrt_llm", ids_request(ids, streaming=np.bool_(True),
                                                           return_perf_metrics=np.bool_(True)))
    generated = 0
    drafted = []
    for result in responses:
        assert result.as_numpy("output_ids").shape[:2] == (1, 1)
        assert result.as_numpy("sequence_length").shape == (1, 1)
        perf = {name: result.as_numpy(name) for name in PERF}
        assert all(value is not None and value.shape == (1, 1) for value in perf.values()), perf
        perf = {name: value[0][0].item() for name, value in perf.items()}
        generated += int(result.as_numpy("sequence_length")[0][0])
        assert perf["kv_cache_alloc_total_blocks"] == perf["kv_cache_alloc_new_blocks"] == len(ids) + generated
        assert perf["kv_cache_reused_blocks"] == 0
        assert perf["arrival_time_ns"] <= perf["first_scheduled_time_ns"] <= perf["first_token_time_ns"] \
            <= perf["last_token_time_ns"]
        drafted.append((perf["total_draft_tokens"], perf["total_accepted_draft_tokens"], perf["acceptance_rate"]))
    assert generated == len(greedy)
    assert drafted == sorted(drafted, key=lambda d: d[:2])
    total, accepted, rate = drafted[-1]
    assert total >= accepted > 0 and rate == pytest.approx(accepted / total)


def test_token_counts_are_returned_as_trtllm_counts_them(server, decoder, greedy):
    """return_num_input_tokens / return_num_output_tokens (what Triton's OpenAI frontend asks for its
    usage): the prompt's tokens, and the token ids of each response, on that response only when asked."""
    ids = prompt_ids(decoder)
    counts = {"return_num_input_tokens": np.bool_(True), "return_num_output_tokens": np.bool_(True)}

    def count(result, name: str) -> int:
        value = result.as_numpy(name)
        assert value is not None and value.shape == (1, 1), (name, value)
        return int(value[0][0])

    responses = stream(server, "tensorrt_llm", ids_request(ids, streaming=np.bool_(True), **counts))
    assert all(count(r, "num_input_tokens") == len(ids) for r in responses)
    assert [count(r, "num_output_tokens") for r in responses] == [int(r.as_numpy("sequence_length")[0][0]) for r in responses]
    assert sum(count(r, "num_output_tokens") for r in responses) == len(greedy)
    whole = stream(server, "tensorrt_llm", ids_request(ids, **counts))[-1]  # the prompt is repeated: counted too
    assert count(whole, "num_output_tokens") == len(ids) + len(greedy)
    for model in ("ensemble", "tensorrt_llm_bls"):
        answer = stream(server, model, text_request(**counts))[-1]
        assert (count(answer, "num_input_tokens"), count(answer, "num_output_tokens")) == (len(ids), len(greedy)), model
        plain = stream(server, model, text_request())[-1]
        assert plain.as_numpy("num_input_tokens") is None and plain.as_numpy("num_output_tokens") is None


# ---------------------------------------------------------------------------------------------
# TensorRT-LLM's request semantics


def test_nvidia_client_defaults_decode_greedily_and_keep_the_prompt(server, decoder, greedy):
    """inflight_batcher_llm_client.py's request (top_k 1, top_p 0.0, temperature 1.0, min_tokens 1,
    seed 0, no exclude_input_in_output): the prompt then the greedy tokens, as TRT-LLM answers."""
    ids = prompt_ids(decoder)
    result = stream(server, "tensorrt_llm", ids_request(ids))[-1]
    assert result.as_numpy("output_ids")[0][0].tolist() == ids + greedy
    assert result.as_numpy("sequence_length")[0][0] == len(ids) + len(greedy)


@pytest.mark.parametrize("sampling", [
    {"temperature": np.float32(1.0)},  # end_to_end_grpc_client.py's default: neither top_k nor top_p
    {"temperature": np.float32(0.7), "top_k": np.int32(0), "top_p": np.float32(0.0)},
    {"temperature": np.float32(0.7), "top_k": np.int32(1), "top_p": np.float32(0.9)},
    {"temperature": np.float32(0.7), "top_p": np.float32(-1.0)},
], ids=["temperature-only", "both-unset", "top-k-1", "negative-top-p"])
def test_sampling_is_off_unless_top_k_or_top_p_turns_it_on(server, decoder, greedy, sampling):
    got = stream(server, "ensemble", text_request(**sampling))[-1].as_numpy("text_output")[0].decode()
    assert got == decoder.decode(greedy)


def test_sampling_without_a_seed_repeats_as_trtllm_default_seed_does(server):
    sampled = text_request(temperature=np.float32(1.5), top_k=np.int32(50), top_p=np.float32(0.0))
    first, second = (stream(server, "ensemble", sampled)[-1].as_numpy("text_output")[0] for _ in range(2))
    assert first == second


@pytest.mark.parametrize("extra,message", [
    ({"len_penalty": np.float32(0.0)}, None), ({"early_stopping": np.bool_(False)}, None),
    ({"beam_search_diversity_rate": np.float32(0.5)}, None), ({"runtime_top_p_min": np.float32(0.1)}, None),
    ({"decoder_input_ids": np.array([[0]], dtype=np.int32)}, None),
    ({"repetition_penalty": np.float32(1.3)}, "repetition_penalty=1.3"),
    ({"beam_width": np.int32(2)}, "beam_width=2"),
    ({"return_log_probs": np.bool_(True)}, "return_log_probs=True"),
    ({"runtime_top_p_decay": np.float32(0.5)}, "runtime_top_p_decay=0.5"),
    ({"runtime_top_p": np.float32(1.5)}, "top_p must be <= 1 .*got 1.5 \\(tensorrt_llm's runtime_top_p\\)"),
    ({"runtime_top_k": np.int32(-2)}, "top_k must be >= 0 .*got -2 \\(tensorrt_llm's runtime_top_k\\)"),
    ({"request_output_len": np.int32(0)}, "got 0 \\(tensorrt_llm's request_output_len\\)"),
    ({"end_id": np.int32(-1)}, "end_id -1"),
    ({"embedding_bias": np.ones((1, 8), dtype=np.float32)}, "embedding_bias is not supported"),
    ({"draft_logits": np.zeros((1, 2, 8), dtype=np.float32)}, "draft_logits: draft logits"),
    ({"lookahead_window_size": np.array([[3]], dtype=np.int32)}, "lookahead decoding"),
    ({"lora_task_id": np.uint64(7)}, "lora_task_id: LoRA"),
    ({"retention_decode_priority": np.array([[50]], dtype=np.int32)}, "KV cache retention"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else str(v))
def test_knobs_without_effect_pass_and_unsupported_ones_are_refused(server, decoder, greedy, extra, message):
    """Beam-search-only knobs change nothing at beam_width 1 (as in TRT-LLM); anything the runtime
    cannot honour is a clear error, and the server answers the next request."""
    ids = prompt_ids(decoder)
    if message is None:
        assert stream(server, "tensorrt_llm", ids_request(ids, **extra))[-1].as_numpy("output_ids")[0][0].tolist() \
            == ids + greedy
        return
    with pytest.raises(InferenceServerException, match=message) as err:
        stream(server, "tensorrt_llm", ids_request(ids, **extra))
    assert "internal error" not in str(err.value)
    assert stream(server, "tensorrt_llm", ids_request(ids))[-1].as_numpy("output_ids")[0][0].tolist() == ids + greedy


def test_empty_word_lists_change_nothing(server, decoder, greedy):
    """end_to_end_test.py sends bad_words/stop_words [[""]], speculative_decoding_test.py empty
    embedding-bias lists: nothing to ban, stop at or bias, as in TRT-LLM."""
    empty = {"bad_words": np.array([[""]], dtype=object), "stop_words": np.array([[""]], dtype=object),
             "embedding_bias_words": np.zeros((1, 0), dtype=object),
             "embedding_bias_weights": np.zeros((1, 0), dtype=np.float32)}
    for model in ("ensemble", "tensorrt_llm_bls"):
        got = stream(server, model, text_request(**empty))[-1].as_numpy("text_output")[0].decode()
        assert got == decoder.decode(greedy)


def test_bls_draft_target_inputs_get_trtllm_error_without_a_draft_model(server):
    """speculative_decoding_test.py --execute-bls-speculative-decoding sends num_draft_tokens and
    use_draft_logits to tensorrt_llm_bls: TRT-LLM's BLS without a draft model refuses it, so does this one."""
    with pytest.raises(InferenceServerException, match="cannot perform speculative decoding without draft model"):
        stream(server, "tensorrt_llm_bls", text_request(num_draft_tokens=np.int32(4), use_draft_logits=np.bool_(False)))
    assert stream(server, "tensorrt_llm_bls", text_request(num_draft_tokens=np.int32(0)))[-1].as_numpy("text_output")


def test_draft_input_ids_are_verified_like_trtllm_drafts(server, decoder, greedy):
    """e2e_grpc_speculative_decoding_client.py's target call: the client's drafts are what the
    target verifies (a wrong draft is rejected; the answer is the greedy one either way)."""
    ids = prompt_ids(decoder)
    wrong = greedy[:2] + [greedy[2] + 1] + greedy[3:4]
    # the first draft token is checked against the prefill's token; the rest go to verification
    for draft, drafted, accepted in ((greedy[:4], 3, 3), (wrong, 3, 1), ([greedy[0] + 1] + greedy[1:4], 0, 0)):
        result = stream(server, "tensorrt_llm", ids_request(ids, 5, draft_input_ids=np.array([draft], dtype=np.int32),
                                                             return_perf_metrics=np.bool_(True)))[-1]
        assert result.as_numpy("output_ids")[0][0].tolist() == ids + greedy[:5]
        assert result.as_numpy("total_draft_tokens")[0][0] == drafted
        assert result.as_numpy("total_accepted_draft_tokens")[0][0] == accepted


# ---------------------------------------------------------------------------------------------
# decoupled_mode false: plain infer requests


def test_a_no_stream_package_is_not_decoupled(repos):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    def decoupled(mode: str, model: str) -> bool:
        text = (repos[mode] / model / "config.pbtxt").read_text()
        return text_format.Parse(text, model_config_pb2.ModelConfig()).model_transaction_policy.decoupled

    for model in ("tensorrt_llm", "tensorrt_llm_bls"):
        assert decoupled("streaming", model) and not decoupled("plain", model)


def test_plain_infer_requests_get_one_answer(plain_server, decoder, greedy):
    """end_to_end_test.py and benchmark_core_model.py send client.infer over gRPC and HTTP."""
    expected = decoder.decode(greedy)
    grpc = grpcclient.InferenceServerClient(plain_server.grpc_url)
    http = httpclient.InferenceServerClient(plain_server.http_url)
    for model in ("ensemble", "tensorrt_llm_bls"):
        assert grpc.infer(model, tensors(**text_request())).as_numpy("text_output")[0].decode() == expected
        assert http.infer(model, tensors(httpclient, **text_request())).as_numpy("text_output")[0].decode() == expected
    ids = prompt_ids(decoder)
    answer = grpc.infer("tensorrt_llm", tensors(**ids_request(ids)))
    assert answer.as_numpy("output_ids")[0][0].tolist() == ids + greedy


def _one_after_another(server: TritonServer, ids: list[int], end_id: int) -> tuple[dict, dict]:
    """Two requests of 200 tokens, the second sent 50 ms after the first (so that Triton hands it to
    its own execute() call, not to the first's batch); the server's timestamps of each, earlier arrival first."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    request = ids_request(ids, 200, end_id=np.int32(end_id), return_perf_metrics=np.bool_(True))
    for pause in (0.0, 0.05):
        time.sleep(pause)
        client.async_infer("tensorrt_llm", tensors(**request), callback=lambda result, error: answers.put(error or result))
    times = [{name: int(answer.as_numpy(name)[0][0]) for name in PERF if name.endswith("_ns")}
             for answer in (answers.get(timeout=300) for _ in range(2))]
    first, second = sorted(times, key=lambda t: t["arrival_time_ns"])
    return first, second


def test_plain_infer_requests_are_batched_in_flight(plain_server, decoder):
    """execute() returns at once and answers through the response sender: a request that arrives
    while another is generating is scheduled before that one ends (a blocking execute() would take
    the second only once the first ended: no overlap in any try)."""
    end_id = decoder.tokenizer.convert_tokens_to_ids("<|im_end|>")  # not in the answer's first 200 tokens (bf16, float32)
    first, second = until_overlapping(lambda: _one_after_another(plain_server, prompt_ids(decoder), end_id))
    assert second["first_scheduled_time_ns"] < first["last_token_time_ns"]


def test_streaming_on_a_no_stream_package_is_refused(plain_server, decoder):
    with pytest.raises(InferenceServerException, match="Streaming is only supported if model is deployed using decoupled"):
        stream(plain_server, "tensorrt_llm", ids_request(prompt_ids(decoder), streaming=np.bool_(True)))
    with pytest.raises(InferenceServerException, match="decoupled"):
        stream(plain_server, "ensemble", text_request(stream=np.bool_(True)))


def test_specdeploy_client_works_on_both_packages(server, plain_server, decoder, greedy):
    expected = decoder.decode(greedy)
    for name, srv, streams in (("streaming", server, (True, False)), ("plain", plain_server, (False,))):
        for protocol, url in (("grpc", srv.grpc_url), ("http", srv.http_url)):
            client = TritonLLMClient(url, protocol)
            for on in streams:
                completion = client.generate(Request(PROMPT, max_tokens=MAX_TOKENS), stream=on)
                assert completion.text == expected, (name, protocol, on)
                assert completion.perf["total_draft_tokens"] >= completion.perf["total_accepted_draft_tokens"] > 0


def test_http_generate_keeps_the_prompt_unless_told_not_to(server, decoder, greedy):
    """The generate endpoint with TRT-LLM's default (prompt kept) and with exclude_input_in_output."""
    import urllib.request

    def generate(body: dict) -> str:
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())["text_output"]

    body = {"text_input": PROMPT, "max_tokens": MAX_TOKENS}
    assert generate({**body, "exclude_input_in_output": True}) == decoder.decode(greedy)
    assert generate(body) == decoder.decode(prompt_ids(decoder) + greedy)


def test_a_batched_request_gets_one_response_per_row(server, plain_server, decoder):
    """end_to_end_grpc_client.py --batch-inputs: the rows stacked into one request, each answered
    on its own with its batch_index (decoupled only, as in TRT-LLM)."""
    prompts = [PROMPT, "The quick brown fox"]
    expected = [decoder.generate(p, SamplingParams(max_new_tokens=8))[0] for p in prompts]
    rows = [text_request(p, 8) for p in prompts]
    batched = {name: np.concatenate([np.asarray(row[name]).reshape(1, 1) for row in rows]) for name in rows[0]}
    for streaming in (False, True):
        batched["stream"] = np.array([[streaming]] * 2)
        got = ["", ""]
        for result in stream(server, "ensemble", batched):
            got[result.as_numpy("batch_index")[0][0]] += result.as_numpy("text_output")[0].decode()
        assert got == expected
    batched["stream"] = np.array([[False]] * 2)
    with pytest.raises(InferenceServerException, match="Batch size > 1 requires .* decoupled"):
        stream(plain_server, "ensemble", batched)


def test_concurrent_nvidia_style_streams_get_their_own_answers(server, decoder):
    prompts = [PROMPT, "The quick brown fox", "for i in range(10):"]
    expected = [decoder.decode(decoder.generate(p, SamplingParams(max_new_tokens=8))[1].token_ids)
                for p in prompts]
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        pieces = stream(server, "ensemble", text_request(prompts[i], 8, stream=np.bool_(True)))
        got[i] = "".join(r.as_numpy("text_output")[0].decode() for r in pieces)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert [got.get(i) for i in range(len(prompts))] == expected
