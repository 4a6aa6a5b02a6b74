"""A request to the CPU `tensorrt_llm` model, read and checked as TensorRT-LLM reads it.

Requests mean what they mean to TensorRT-LLM's C++ backend (tensorrtllm_backend's utils.cc and
the top-k kernel it feeds): top_p <= 0 and top_k 0 are "off", neither on (or top_k 1) is greedy
whatever the temperature, the seed defaults to 0, temperature 1.0, an unset
exclude_input_in_output takes the config parameter, min_tokens holds the end tokens off (unset:
nothing, where TensorRT-LLM documents a default of 1), and knobs that only act in beam search
(length penalty, early stopping, diversity rate) change nothing at beam_width 1. Anything else
the runtime does not implement is refused with a clear error (BadRequest), never ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specdeploy.runtime.types import DraftTree, Proposer, SamplingParams, TargetState
from specdeploy.triton.serving.responses import Sink, Streamer
from specdeploy.triton.serving.stub import pb_utils


class BadRequest(ValueError):
    """A client error: reported on the request, the model keeps serving."""


# TensorRT-LLM features the specdeploy runtime does not implement: a request carrying one of these
# inputs is refused (its answer would silently differ from TensorRT-LLM's otherwise)
REFUSED = {
    **dict.fromkeys(("prompt_embedding_table", "prompt_vocab_size"), "prompt tuning"),
    **dict.fromkeys(("lora_task_id", "lora_weights", "lora_config"), "LoRA"),
    **dict.fromkeys(("encoder_input_features", "encoder_output_lengths", "cross_attention_mask",
                     "skip_cross_attn_blocks"), "encoder-decoder models"),
    **dict.fromkeys(("mrope_rotary_cos_sin", "mrope_position_deltas"), "multimodal rotary embeddings"),
    "context_phase_params": "disaggregated serving",
    **dict.fromkeys(("draft_logits", "draft_acceptance_threshold"), "draft logits (send draft_input_ids alone)"),
    **dict.fromkeys(("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size"),
                    "lookahead decoding"),
    **dict.fromkeys(("retention_token_range_starts", "retention_token_range_ends", "retention_token_range_priorities",
                     "retention_token_range_durations_ms", "retention_decode_priority",
                     "retention_decode_duration_ms"), "KV cache retention"),
    **dict.fromkeys(("guided_decoding_guide_type", "guided_decoding_guide"), "guided decoding"),
}
# knobs refused unless set to a value that leaves TensorRT-LLM's output unchanged (its defaults).
# Not listed, as they change nothing at beam_width 1 in TensorRT-LLM either: len_penalty,
# early_stopping, beam_search_diversity_rate; and runtime_top_p_min / runtime_top_p_reset_ids, which
# act only with a top-p decay; decoder_input_ids / prompt_table_extra_ids (encoder-decoder, prompt tuning)
NEUTRAL = {
    "beam_width": lambda v: v == 1, "num_return_sequences": lambda v: v == 1,
    "repetition_penalty": lambda v: v == 1.0, "presence_penalty": lambda v: v == 0.0,
    "frequency_penalty": lambda v: v == 0.0, "runtime_top_p_decay": lambda v: v == 1.0,
    "return_log_probs": lambda v: not v, "return_context_logits": lambda v: not v,
    "return_generation_logits": lambda v: not v,
}
NO_END_ID = -1  # TensorRT-LLM: never stop at an end token
STREAMING_NEEDS_DECOUPLED = ("Streaming is only supported if model is deployed using decoupled mode "
                             "(this repository was packaged with --no-stream); send stream=false")
BATCH_NEEDS_DECOUPLED = ("Batch size > 1 requires the tensorrt_llm backend to be using decoupled transaction policy "
                         "(this repository was packaged with --no-stream); send one prompt per request")


def rows(request) -> int:
    """The request's batch size: TensorRT-LLM serves each row as a request of its own."""
    ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
    return 1 if ids is None else int(ids.as_numpy().shape[0])


class Inputs:
    """The inputs of one batch row of a request (every input's first dimension is the batch)."""

    def __init__(self, request, row: int = 0) -> None:
        self.request, self.row = request, row

    def has(self, name: str) -> bool:
        return pb_utils.get_input_tensor_by_name(self.request, name) is not None

    def array(self, name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(self.request, name)
        return None if tensor is None else tensor.as_numpy()[self.row]  # Triton checked the batch sizes agree

    def scalar(self, name: str, default=None):
        array = self.array(name)
        if array is None:
            return default
        value = np.asarray(array).reshape(-1)
        if value.size != 1:
            raise BadRequest(f"{name} must hold one value per request, got {value.size}")
        item = value[0]
        if isinstance(item, bytes):
            return item.decode("utf-8", errors="replace")
        return item.item() if hasattr(item, "item") else item

    def words(self, name: str) -> list[list[int]]:
        """Undo TRT-LLM's [2, n] word-list layout (ids; exclusive end offsets padded with -1)."""
        array = self.array(name)
        if array is None:
            return []
        data = np.asarray(array)
        if data.size % 2:
            raise BadRequest(f"{name} must be [2, n]: the words' ids, then their end offsets (TensorRT-LLM's layout); "
                             f"got {data.size} values")
        data = data.reshape(2, -1)
        ids, ends = data[0].tolist(), [int(e) for e in data[1] if e >= 0]
        if ends != sorted(ends) or any(end > len(ids) for end in ends):
            raise BadRequest(f"{name}'s end offsets {ends} must rise and stay within its {len(ids)} ids "
                             "(TensorRT-LLM's to_word_list_format writes them)")
        return [ids[start:end] for start, end in zip([0] + ends[:-1], ends) if end > start]


@dataclass
class Entry:
    """One request from execute() to its final response."""

    sink: Sink
    prompt: list[int]
    params: SamplingParams
    request_id: str
    exclude_input: bool
    perf: bool
    counts: tuple[bool, bool]  # return_num_input_tokens, return_num_output_tokens
    arrival_ns: int
    draft: list[int] | None  # draft_input_ids: the client's own draft tokens
    batch_index: int | None  # the row of a batched request (None: a request of one row)
    seq: object = None  # the batcher's Sequence once admitted
    gone: bool = False  # the client cancelled: no one reads an answer
    stream: Streamer | None = None


class RequestReader:
    """Reads one batch row of a request into an Entry for the model served: its tokenizer and
    vocabulary, its context, whether it is decoupled, its exclude_input_in_output default."""

    def __init__(self, tokenizer, vocab: int, context: int, *, decoupled: bool, exclude_input: bool) -> None:
        self.tokenizer, self.vocab, self.context = tokenizer, vocab, context
        self.decoupled, self.exclude_input = decoupled, exclude_input

    def entry(self, inputs: Inputs, sink: Sink, arrival_ns: int, batch_index: int | None) -> Entry:
        streaming = bool(inputs.scalar("streaming", False))
        if streaming and not self.decoupled:
            raise BadRequest(STREAMING_NEEDS_DECOUPLED)
        prompt = self._prompt(inputs)
        params = self._params(inputs, len(prompt))
        entry = Entry(
            sink=sink, prompt=prompt, params=params, request_id=inputs.request.request_id(),
            exclude_input=bool(inputs.scalar("exclude_input_in_output", self.exclude_input)),
            perf=bool(inputs.scalar("return_perf_metrics", False)),
            counts=(bool(inputs.scalar("return_num_input_tokens", False)),
                    bool(inputs.scalar("return_num_output_tokens", False))),
            arrival_ns=arrival_ns,
            draft=self._draft(inputs), batch_index=batch_index,
        )
        entry.stream = Streamer(self.tokenizer, entry) if streaming else None
        return entry

    def _prompt(self, inputs: Inputs) -> list[int]:
        ids = inputs.array("input_ids")
        if ids is None:
            raise BadRequest("input_ids is required (the ensemble fills it from text_input)")
        ids = np.asarray(ids).reshape(-1)
        if not len(ids):
            raise BadRequest("input_ids is empty: send at least one prompt token")
        length = inputs.scalar("input_lengths", len(ids))
        if not 0 < length <= len(ids):
            raise BadRequest(f"input_lengths {length} does not match {len(ids)} input_ids: it counts the prompt's "
                             f"tokens, 1 to {len(ids)}")
        return self._token_ids([int(t) for t in ids[:length]], "input_ids")

    def _token_ids(self, ids: list[int], name: str) -> list[int]:
        outside = [t for t in ids if not 0 <= t < self.vocab]
        if outside:
            raise BadRequest(f"{name} hold {len(outside)} token ids outside the model's vocabulary of "
                             f"{self.vocab} (e.g. {outside[0]})")
        return ids

    def _draft(self, inputs: Inputs) -> list[int] | None:
        """TRT-LLM's draft_input_ids: tokens a client drafted (e.g. with a draft model) for the
        target to verify, as in its draft-target speculative decoding."""
        draft = inputs.array("draft_input_ids")
        if draft is None:
            return None
        return self._token_ids([int(t) for t in np.asarray(draft).reshape(-1)], "draft_input_ids")

    def _check_supported(self, inputs: Inputs) -> None:
        for name, feature in REFUSED.items():
            if inputs.has(name):
                raise BadRequest(f"{name}: {feature} is not supported by the specdeploy runtime")
        for name, neutral in NEUTRAL.items():
            value = inputs.scalar(name)
            if value is not None and not neutral(value):
                shown = f"{value:.6g}" if isinstance(value, float) else repr(value)  # FP32 inputs: 1.3, not 1.2999...
                raise BadRequest(f"{name}={shown} is not supported by the specdeploy runtime")
        if inputs.words("bad_words_list"):
            raise BadRequest("bad_words is not supported by the specdeploy runtime")
        bias = inputs.array("embedding_bias")
        if bias is not None and np.any(bias):
            raise BadRequest("embedding_bias is not supported by the specdeploy runtime")

    def _params(self, inputs: Inputs, prompt_len: int) -> SamplingParams:
        max_tokens = inputs.scalar("request_output_len")
        if max_tokens is None:
            raise BadRequest("max_tokens (tensorrt_llm's request_output_len) is required")
        if max_tokens <= 0:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens} (tensorrt_llm's request_output_len)")
        if prompt_len + max_tokens > self.context:
            raise BadRequest(
                f"max_tokens {max_tokens} + prompt {prompt_len} tokens exceed the model's context of "
                f"{self.context} tokens: ask for at most {max(self.context - prompt_len, 0)}"
            )
        self._check_supported(inputs)
        end_id = inputs.scalar("end_id")
        if end_id == NO_END_ID:
            raise BadRequest("end_id -1 (never stop at an end token) is not supported: the specdeploy runtime "
                             "always stops at the model's own end tokens; leave end_id out")
        end_id = self._token_id(end_id, "end_id")
        stop_ids, stop_strings = self._stops(inputs.words("stop_words_list"))
        params = SamplingParams(
            max_new_tokens=int(max_tokens),
            **sampling(inputs),
            seed=int(inputs.scalar("seed", 0)) & ((1 << 63) - 1),  # TRT-LLM's default seed is 0
            stop_token_ids=(() if end_id is None else (end_id,)) + stop_ids,
            stop_strings=stop_strings,
            # TensorRT-LLM's sampling parameters: "Values < 1 have no effect", and a C++ default of 1 (no end
            # token first); unset holds nothing off here, as verify's reference (generate()) does
            min_tokens=max(int(inputs.scalar("min_tokens", 0)), 0),
        )
        params.validate()  # SpecDeployError: a clear message for the client
        return params

    def _token_id(self, value, name: str) -> int | None:
        vocab = len(self.tokenizer)
        if value is not None and not 0 <= int(value) < vocab:
            raise BadRequest(f"{name} {value} is outside the model's vocabulary of {vocab} tokens")
        return None if value is None else int(value)

    def _stops(self, words: list[list[int]]) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Stop words as ids and strings: a single special token (<|im_end|>) stops on its id,
        since the text the runtime matches stop strings against is decoded without specials."""
        special = set(self.tokenizer.all_special_ids)
        for token in {t for word in words for t in word}:
            self._token_id(token, "a stop_words token id")
        for word in words:
            if len(word) > 1 and special.intersection(word):  # its text alone would stop where the special is absent
                raise BadRequest(f"stop word {self.tokenizer.decode(word)!r} mixes a special token with text: the "
                                 "specdeploy runtime stops on a special token only as a stop word of its own; send "
                                 "the special token and the text as two stop words")
        ids = tuple(w[0] for w in words if len(w) == 1 and w[0] in special)
        strings = (self.tokenizer.decode(w, skip_special_tokens=True) for w in words if not (len(w) == 1 and w[0] in special))
        return ids, tuple(s for s in strings if s)


def _finite(value, name: str, input_name: str | None = None) -> float:
    """`input_name`: tensorrt_llm's own input, where the ensemble's `name` differs (a client of
    tensorrt_llm reads the name it sent)."""
    if not math.isfinite(float(value)):
        raise BadRequest(f"{name} must be a finite number, got {value}" + (f" (tensorrt_llm's {input_name})" if input_name else ""))
    return float(value)


def sampling(inputs: Inputs) -> dict:
    """temperature / top_k / top_p as TensorRT-LLM reads them: top_p <= 0 is unset, top_k 0 is
    unset, and with neither set (or top_k 1) it decodes greedily whatever the temperature."""
    top_k = int(inputs.scalar("runtime_top_k", 0))
    top_p = _finite(inputs.scalar("runtime_top_p", 0.0), "top_p", "runtime_top_p")
    temperature = _finite(inputs.scalar("temperature", 1.0), "temperature")
    if top_k < 0:  # the checks TensorRT-LLM's SamplingConfig makes
        raise BadRequest(f"top_k must be >= 0 (0: unset), got {top_k} (tensorrt_llm's runtime_top_k)")
    if top_p > 1.0:
        raise BadRequest(f"top_p must be <= 1 (0 or less: unset), got {top_p:.6g} (tensorrt_llm's runtime_top_p)")
    if temperature < 0.0:
        raise BadRequest(f"temperature must be >= 0, got {temperature:.6g}")
    if top_k == 1 or (top_k == 0 and top_p <= 0.0):
        return {"temperature": 0.0}
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p if top_p > 0.0 else 1.0}


class ClientDraft(Proposer):
    """The draft tokens a client sent for one request (TRT-LLM's draft_input_ids): proposed as a
    chain while the output follows them, nothing once it parts from them (plain decoding)."""

    def __init__(self, prompt_len: int, draft: list[int]) -> None:
        self.prompt_len, self.draft = prompt_len, draft

    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        emitted = state.tokens[0, self.prompt_len:].tolist()
        rest = self.draft[len(emitted):] if self.draft[:len(emitted)] == emitted else []
        return DraftTree.chain(torch.tensor(rest[:max_tokens], dtype=torch.long, device=state.tokens.device))
