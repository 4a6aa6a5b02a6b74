"""A Hugging Face causal LM folder and its tokenizer, loaded for computing (any stage, the runtime)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def load_tokenizer(path: str | os.PathLike, *, trust_remote_code: bool = False) -> Any:
    """The folder's tokenizer; a folder without a readable one is a clear error, not transformers'
    traceback (a weights-only folder passes resolve: a draft model may share its target's)."""
    from transformers import AutoTokenizer

    from specdeploy.errors import SpecDeployError

    try:
        return AutoTokenizer.from_pretrained(Path(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise SpecDeployError(f"{path} has no tokenizer transformers can load ({type(err).__name__}: {str(err)[:200]})",
                              hint="put the model's tokenizer files (tokenizer.json / tokenizer.model and "
                                   "tokenizer_config.json) in the model folder and resolve it again") from err


def checkpoint_dtype(model_dir: str | os.PathLike) -> str:
    """The dtype a Hugging Face checkpoint was saved in (config.json), float32 when unstated."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return dtype if dtype in ("float32", "bfloat16", "float16", "float64") else "float32"


def load_causal_lm(path: str | os.PathLike, dtype: str = "float32", *, device: "str | torch.device" = "cpu",
                   device_map: str | dict[str, Any] | None = None, trust_remote_code: bool = False) -> Any:
    """An HF causal LM in eval mode with sdpa attention, its weights loaded straight onto `device`
    (auto|cpu|cuda|cuda:N), or spread by accelerate with `device_map` ("auto": over every visible
    GPU, for a model that does not fit one; the caller decides from the memory preflight).
    A quantize-stage checkpoint (hf_quant_config.json) loads fake-quantized, with the numerics it
    was calibrated with, the same way."""
    from transformers import AutoModelForCausalLM

    from specdeploy.device import resolve_device
    from specdeploy.checkpoints.quantized import load_quantized, torch_dtype

    path = Path(path)
    if (path / "hf_quant_config.json").is_file():
        return load_quantized(path, dtype, device=device, device_map=device_map, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(dtype), attn_implementation="sdpa", trust_remote_code=trust_remote_code,
        device_map=device_map or {"": resolve_device(device)})
    return model.eval()


def plain_greedy(model: Any) -> Any:
    """`model`, its `generate(do_sample=False)` made the plain argmax the served runtime decodes:
    its generation_config (an instruct model's repetition_penalty, no_repeat_ngram_size, num_beams,
    suppress_tokens, ...) would shape every answer, since transformers 5 fills each field a call
    leaves unset, even of a GenerationConfig passed in, from it. It keeps only the special tokens."""
    from transformers import GenerationConfig

    own = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=own.eos_token_id,
                                               pad_token_id=own.pad_token_id)
    return model
