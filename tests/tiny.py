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


def make_gguf(out: Path, *, rope_scaling: str | None = None, rope_freqs: bool = False, adds_bos: bool = False) -> Path:
    """A 2-layer Llama GGUF (float32 tensors) with a byte-level tokenizer: what llama.cpp's files
    say about RoPE scaling and BOS, in a few kilobytes."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    hidden, layers, ffn, heads, kv_heads, vocab = 64, 2, 128, 4, 2, 300
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    if rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
        writer.add_rope_scaling_factor(4.0)
    byte_tokens = [bytes_to_unicode()[i] for i in range(256)] + ["Ġt", "Ġa", "he", "in"]
    tokens = byte_tokens + [f"x{i}" for i in range(len(byte_tokens), vocab - 3)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 3) + [3] * 3)
    writer.add_token_merges(["Ġ t", "Ġ a", "h e", "i n"])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    writer.add_add_bos_token(adds_bos)
    rng = np.random.default_rng(0)
    weight = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", weight(vocab, hidden))
    if rope_freqs:  # Llama 3.1's scaled RoPE, as llama.cpp stores it
        writer.add_tensor("rope_freqs.weight", np.linspace(1, 8, hidden // heads // 2).astype(np.float32))
    head_dim = hidden // heads
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
                            ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
