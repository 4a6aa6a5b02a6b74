from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.tiny import make_llama, make_tokenizer

torch.set_num_threads(min(2, os.cpu_count() or 1))

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `gpu` need CUDA: where torch sees none they are reported as skipped with
    the reason (never as passed); `make test-gpu` runs only them."""
    if CUDA:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none here (run `make test-gpu` on a GPU host)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def cuda_device() -> torch.device:
    """The GPU a `gpu` test runs on."""
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def spec_cache(tmp_path_factory):
    """A private self-distillation cache per test module, and one thread (tiny tensors: a second
    thread only adds sync on busy cores). Modules opt in with pytestmark usefixtures."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECDEPLOY_CACHE", str(tmp_path_factory.mktemp("spec_cache")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


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
