"""What one transformers installation reads from Hugging Face folders: run as a script, by
tests/test_release_transformers.py, once with the project's venv and once in each oracle venv
(the transformers a TensorRT-LLM release pins). It imports only torch, transformers and the
standard library, so it runs under transformers 4.56, 4.57 and 5.x alike.

    python release_probe.py REQUEST.json RESULT.json
REQUEST: {"configs": {name: folder}, "tokenizers": {name: folder}, "forwards": {name: folder},
          "prompts": [str], "messages": [{"role", "content"}], "forward_ids": [int]}
RESULT: the same keys, each folder's read given as its values or as {"error": "..."}.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from typing import Any, Callable

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

# Config attributes whose meaning TensorRT-LLM and the forward depend on, read even when config.json
# leaves them to the class default (a default that differs between versions shows up here).
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
          "hidden_act", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id",
          "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "model_type", "architectures")
# How each version spells RoPE and dtype differs by design: compared through "rope" and "dtype" below.
SPELLINGS = {"rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "dtype", "torch_dtype",
             "transformers_version", "_name_or_path"}


def jsonable(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE as one dict: 5.x's rope_parameters, or what 4.x uses, rope_theta + rope_scaling (4.x
    keeps a rope_parameters key of config.json as an attribute it never reads)."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        params = dict(config.rope_parameters)
    else:
        params = {"rope_theta": config.rope_theta, **(config.rope_scaling or {"rope_type": "default"})}
    params.setdefault("rope_type", params.pop("type", "default"))
    if getattr(config, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    return jsonable(params)


def rotary(config: Any) -> dict[str, Any]:
    """The inverse frequencies and attention scaling the architecture's own rotary embedding computes."""
    name = type(config).__name__.removesuffix("Config")
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    embedding = getattr(module, f"{name}RotaryEmbedding")(config=config)
    return {"inv_freq": embedding.inv_freq.tolist(), "attention_scaling": float(embedding.attention_scaling)}


def read_config(folder: str) -> dict[str, Any]:
    config = AutoConfig.from_pretrained(folder)
    with open(f"{folder}/config.json") as handle:
        keys = set(json.load(handle)) - SPELLINGS
    values = {key: jsonable(getattr(config, key, None)) for key in sorted(keys | set(FIELDS))}
    return {**values, "dtype": jsonable(config.dtype), "rope": rope_parameters(config), "rotary": rotary(config)}


def read_tokenizer(folder: str, prompts: list[str], messages: list[dict[str, str]]) -> dict[str, Any]:
    """What the GPU side's tokenizer users call: encode (preprocessing: add_special_tokens as
    configured), decode (postprocessing: after a context token, skipping specials or not), the
    special tokens, the chat template."""
    tok = AutoTokenizer.from_pretrained(folder)
    ids = [tok.encode(p, add_special_tokens=True) for p in prompts]
    context = tok.encode("a", add_special_tokens=False)[-1:]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) if tok.chat_template else None
    return {
        "ids": ids,
        "ids_plain": [tok.encode(p, add_special_tokens=False) for p in prompts],
        "decoded": [tok.decode(i, skip_special_tokens=False) for i in ids],
        "decoded_skip": [tok.decode(context + i, skip_special_tokens=True) for i in ids],
        "special": {role: [getattr(tok, f"{role}_token"), getattr(tok, f"{role}_token_id")]
                    for role in ("bos", "eos", "pad", "unk")},
        "all_special_ids": sorted(tok.all_special_ids),
        "size": len(tok),
        "chat_template": tok.chat_template,
        "chat": rendered,
        "chat_ids": tok.encode(rendered, add_special_tokens=False) if rendered else None,
    }


def forward(folder: str, ids: list[int]) -> dict[str, Any]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return {"logits": logits.tolist()}


def each(folders: dict[str, str], read: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """Every folder's read; a failure is reported as that folder's result, not the whole probe's."""
    out = {}
    for name, folder in folders.items():
        try:
            out[name] = read(folder)
        except Exception as err:  # noqa: BLE001 - the error is the finding
            out[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}
    return out


def main() -> None:
    with open(sys.argv[1]) as handle:
        request = json.load(handle)
    torch.set_num_threads(1)
    result = {
        "transformers": transformers.__version__,
        "configs": each(request["configs"], read_config),
        "tokenizers": each(request["tokenizers"], lambda f: read_tokenizer(f, request["prompts"], request["messages"])),
        "forwards": each(request["forwards"], lambda f: forward(f, request["forward_ids"])),
    }
    with open(sys.argv[2], "w") as handle:  # not stdout: libraries print there
        json.dump(result, handle)


if __name__ == "__main__":
    main()
