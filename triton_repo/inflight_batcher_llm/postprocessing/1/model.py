"""specdeploy postprocessing: token ids -> text with the model's HF tokenizer (Python backend).

TOKENS_BATCH is [batch, beam, tokens] and SEQUENCE_LENGTH [batch, beam], as TensorRT-LLM's
tensorrt_llm model emits them; in streaming it runs once per response (one accepted group).
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

    def execute(self, requests):
        return [self._postprocess(request) for request in requests]

    def _postprocess(self, request):
        tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
        if tokens.ndim == 2:  # no beam dimension
            tokens = tokens[:, None, :]
        lengths = lengths.reshape(tokens.shape[:2])
        texts = np.empty(lengths.shape, dtype=object)
        for b in range(tokens.shape[0]):
            for k in range(tokens.shape[1]):
                ids = tokens[b, k, : int(lengths[b, k])].tolist()
                texts[b, k] = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special).encode("utf-8")
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", texts)])
