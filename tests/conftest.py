from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.tiny import make_llama, make_tokenizer

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    make_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A 2-layer Llama (hidden 64) with its tokenizer, saved as an HF safetensors folder."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny_llama")
    make_llama(out, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A smaller Llama sharing the tiny tokenizer: a draft model for tiny_llama."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny_draft")
    make_llama(out, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), hidden=32, layers=1, heads=2, kv_heads=1, seed=1)
    return out
