"""specdeploy postprocessing: token ids -> text with the model's HF tokenizer (Python backend).

TOKENS_BATCH is [batch, beam, tokens] and SEQUENCE_LENGTH [batch, beam], as TensorRT-LLM's
tensorrt_llm model emits them; OUTPUT is [batch * beam], as TensorRT-LLM's postprocessing returns
it. In streaming it runs once per response (one accepted group).

A group is decoded after a fixed context token and that token's text is cut off again: decoded
alone, a SentencePiece (Metaspace) group would lose its leading space, so the streamed pieces
would not concatenate to the non-streamed text. Only a sequence that starts with a special
token (the prompt echoed with its BOS: exclude_input_in_output false) is decoded as a whole text.
"""

from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


def _param(config: dict, key: str, default: str = "") -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", default)
    return default if value.startswith("${") else value


def tokenizer_dir(args: dict, config: dict) -> str:
    """tokenizer_dir as written, or relative to this model's folder (how specdeploy package
    writes it for the CPU repository, so the build can move)."""
    return os.path.join(args["model_repository"], _param(config, "tokenizer_dir"))


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(args, config))
        self.skip_special = _param(config, "skip_special_tokens", "true").lower() in ("true", "1")
        self.context = self.tokenizer.encode("a", add_special_tokens=False)[-1:]
        self.context_text = self.tokenizer.decode(self.context, skip_special_tokens=self.skip_special)
        self.special = set(self.tokenizer.all_special_ids)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._postprocess(request))
            except Exception as err:  # one bad request must not take the others' answers with it
                pb_utils.Logger.log_error(f"specdeploy postprocessing: {type(err).__name__}: {err}")
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"postprocessing failed: {type(err).__name__}: {err}")))
        return responses

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` as a continuation (see the module docstring)."""
        if not ids or ids[0] in self.special:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
        text = self.tokenizer.decode(self.context + ids, skip_special_tokens=self.skip_special)
        if text.startswith(self.context_text):
            return text[len(self.context_text):]
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _postprocess(self, request):
        """OUTPUT holds one text per sequence, batch-major, as a 1-D array ([1] for one request
        with one beam): the shape TensorRT-LLM's postprocessing returns, which its clients index
        as output[0]."""
        tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
        if tokens.ndim == 2:  # no beam dimension
            tokens = tokens[:, None, :]
        lengths = lengths.reshape(tokens.shape[:2])
        texts = [self.decode(tokens[b, k, : int(lengths[b, k])].tolist()).encode("utf-8")
                 for b in range(tokens.shape[0]) for k in range(tokens.shape[1])]
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", np.array(texts, dtype=object))])
