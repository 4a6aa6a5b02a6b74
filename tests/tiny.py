"""Tiny models built from a config, with a small byte-level BPE tokenizer trained on the fly:
fast enough for every test, real enough to exercise the same code paths as a pretrained model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding proposes tokens and verifies them in one forward pass.",
    "for i in range(10):\n    print(i * i)\n",
    "Hello! How can I help you today? Tell me about the weather in Paris.",
] * 20


# Llama 2/3's shape: the chat template writes the BOS itself, and so does encoding with special tokens
BOS_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(out: Path, vocab_size: int = 384, *, adds_bos: bool = False) -> PreTrainedTokenizerFast:
    """`adds_bos`: a Llama-like tokenizer: a BOS ("<s>") before every text encoded with special
    tokens, and a chat template that starts with it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<s>"] if adds_bos else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos, extra = "<|im_start|>", {}
    if adds_bos:
        bos, extra = "<s>", {"chat_template": BOS_CHAT_TEMPLATE}
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token=bos, pad_token="<|endoftext|>", **extra
    )
    fast.save_pretrained(out)
    return fast


def make_llama(
    out: Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    context: int = 256,
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        initializer_range=0.3,  # peaky logits: fewer near-ties than a default random init
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model


def without_eos(model_dir: Path, out: Path) -> Path:
    """A copy of a saved model with no end-of-sequence token: its answers run to their max tokens
    (an end_id in the request still stops them). Which token a random tiny model emits when is down
    to the CPU's rounding: on a Zen 5 EPYC in float32 tiny_llama ends "def add(a, b):" at its 12th token."""
    shutil.copytree(model_dir, out)
    for name in ("config.json", "generation_config.json"):
        path = out / name
        if path.exists():
            config = json.loads(path.read_text())
            config["eos_token_id"] = None
            path.write_text(json.dumps(config, indent=2))
    return out
