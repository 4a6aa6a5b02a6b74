"""specdeploy preprocessing: text -> token ids with the model's HF tokenizer (Python backend).

Tensor names and layouts follow TensorRT-LLM's inflight_batcher_llm preprocessing, so it serves
the C++ tensorrtllm backend and specdeploy's CPU model alike. Bad requests fail here with a
message naming the client-facing input (text_input, max_tokens, stop_words, ...). The prompt is
encoded as everywhere in specdeploy (specdeploy_prompts.py beside this file: a copy of
specdeploy/prompts.py that `specdeploy package` writes here, since NVIDIA's container runs this
model without specdeploy installed; the template folder has none).
"""

from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from specdeploy_prompts import text_ids  # Triton puts this model's folder on sys.path
from transformers import AutoTokenizer


class BadRequest(ValueError):
    """A client error: reported as the request's Triton error, the model keeps serving."""


def _param(config: dict, key: str, default: str = "") -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", default)
    return default if value.startswith("${") else value


def tokenizer_dir(args: dict, config: dict) -> str:
    """tokenizer_dir as written, or relative to this model's folder (how specdeploy package
    writes it for the CPU repository, so the build can move)."""
    return os.path.join(args["model_repository"], _param(config, "tokenizer_dir"))


def _optional(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _text(raw, what: str) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"{what} is not valid UTF-8 ({err.reason} at byte {err.start})") from err


def word_list(rows, tokenizer, what: str) -> np.ndarray:
    """TRT-LLM's [batch, 2, n] word-list layout: row 0 the concatenated ids of every word,
    row 1 the exclusive end offset of each word, both padded (ids with 0, offsets with -1)."""
    flat_ids, offsets = [], []
    for row in rows:
        ids: list[int] = []
        ends: list[int] = []
        for word in np.asarray(row).reshape(-1):
            text = _text(word, what)
            if not text:
                continue
            ids += tokenizer.encode(text, add_special_tokens=False)
            ends.append(len(ids))
        flat_ids.append(ids)
        offsets.append(ends)
    width = max(1, max(len(i) for i in flat_ids), max(len(o) for o in offsets))
    out = np.zeros((len(rows), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for b, (ids, ends) in enumerate(zip(flat_ids, offsets)):
        out[b, 0, : len(ids)] = ids
        out[b, 1, : len(ends)] = ends
    return out


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(args, config))
        self.add_special_tokens = _param(config, "add_special_tokens", "false").lower() in ("true", "1")
        self.max_input_len = int(_param(config, "max_input_len", "0") or 0)
        self.max_output_len = int(_param(config, "max_output_len", "0") or 0)
        self.end_id = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.pad_id = self.end_id if pad is None else pad

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._preprocess(request)))
            except BadRequest as err:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err))))
            except Exception as err:  # one bad request must not take the others' answers with it
                pb_utils.Logger.log_error(f"specdeploy preprocessing: {type(err).__name__}: {err}")
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"preprocessing failed: {type(err).__name__}: {err}")))
        return responses

    def _encode(self, queries) -> tuple[np.ndarray, np.ndarray]:
        rows = []
        for query in np.asarray(queries).reshape(len(queries), -1)[:, 0]:
            text = _text(query, "text_input")
            if not text:
                raise BadRequest("text_input is empty: send the prompt text")
            ids = text_ids(self.tokenizer, text, self.add_special_tokens)
            if self.max_input_len and len(ids) > self.max_input_len:
                raise BadRequest(
                    f"text_input is {len(ids)} tokens, beyond the model's context of {self.max_input_len} tokens"
                )
            rows.append(ids)
        lengths = np.array([[len(r)] for r in rows], dtype=np.int32)
        ids = np.full((len(rows), int(lengths.max())), self.pad_id, dtype=np.int32)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = row
        return ids, lengths

    def _check_output_len(self, output_len: np.ndarray, input_len: np.ndarray) -> None:
        for out_len, in_len in zip(output_len.reshape(-1), input_len.reshape(-1)):
            if out_len <= 0:
                raise BadRequest(f"max_tokens must be at least 1, got {int(out_len)}")
            if self.max_output_len and in_len + out_len > self.max_output_len:
                raise BadRequest(
                    f"max_tokens {int(out_len)} + prompt {int(in_len)} tokens exceed the model's context of "
                    f"{self.max_output_len} tokens: ask for at most {max(self.max_output_len - int(in_len), 0)}"
                )

    def _ids_or_default(self, request, name: str, default: int, batch: int) -> np.ndarray:
        given = _optional(request, name)
        if given is None:
            return np.full((batch, 1), default, dtype=np.int32)
        return given.astype(np.int32).reshape(batch, 1)

    def _preprocess(self, request) -> list:
        queries = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy()
        batch = queries.shape[0]
        input_ids, input_len = self._encode(queries)
        output_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy().astype(np.int32)
        self._check_output_len(output_len, input_len)
        pad_id = self._ids_or_default(request, "PAD_ID", self.pad_id, batch)
        stop = _optional(request, "STOP_WORDS_DICT")
        bad = _optional(request, "BAD_WORDS_DICT")
        empty = [[] for _ in range(batch)]
        tensors = {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": input_len,
            # decoder-only models: the encoder-decoder inputs carry one pad token, as in TRT-LLM
            "DECODER_INPUT_ID": pad_id.copy(),
            "REQUEST_DECODER_INPUT_LEN": np.ones((batch, 1), dtype=np.int32),
            "REQUEST_OUTPUT_LEN": output_len.reshape(batch, -1),
            "STOP_WORDS_IDS": word_list(empty if stop is None else stop, self.tokenizer, "stop_words"),
            "BAD_WORDS_IDS": word_list(empty if bad is None else bad, self.tokenizer, "bad_words"),
            "EMBEDDING_BIAS": np.zeros((batch, 0), dtype=np.float32),
            "OUT_END_ID": self._ids_or_default(request, "END_ID", self.end_id, batch),
            "OUT_PAD_ID": pad_id,
        }
        bias_words = _optional(request, "EMBEDDING_BIAS_WORDS")
        if bias_words is not None and bias_words.size:  # an empty list biases nothing (NVIDIA's clients send one)
            raise BadRequest("embedding_bias_words is not supported by this deployment")
        return [pb_utils.Tensor(name, value) for name, value in tensors.items()]
