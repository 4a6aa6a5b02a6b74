"""Prompts and texts from the installed data packages: complete, deterministic, disjoint splits."""

from __future__ import annotations

import json

import pytest

from specdeploy import data
from specdeploy.errors import SpecDeployError


def test_truncated_sharegpt_is_decoded_record_by_record():
    data.sharegpt_records.cache_clear()
    records = data.sharegpt_records()
    assert len(records) == 17671  # every complete conversation before the truncated tail
    assert data.sharegpt_records() is records  # cached
    assert records[0]["id"] == "QWJhYvA_0"


def test_prompts_deterministic_and_seeded():
    a = data.sharegpt_prompts(20, seed=0)
    assert a == data.sharegpt_prompts(20, seed=0)
    assert a[:5] == data.sharegpt_prompts(5, seed=0)
    assert a != data.sharegpt_prompts(20, seed=1)
    assert len(set(a)) == 20 and all(isinstance(p, str) and p.strip() == p and p for p in a)


def test_train_and_heldout_are_disjoint():
    train = set(data.sharegpt_prompts(split="train"))
    heldout = set(data.sharegpt_prompts(split="heldout"))
    assert not train & heldout
    assert 0.05 < len(heldout) / (len(train) + len(heldout)) < 0.15
    # parts of one conversation (id_0, id_1) land in the same split
    assert data.split_of("QWJhYvA_0") == data.split_of("QWJhYvA_1")


def test_no_train_conversation_answers_a_held_out_prompt():
    """ShareGPT holds one prompt (even one conversation) under several ids, and the split hashes
    ids: the teacher-forced reads must not train on what verify and `spec validate` measure."""
    heldout = {c[0]["content"] for c in data.sharegpt_conversations(split="heldout")}
    train = data.sharegpt_conversations(split="train")
    assert len(train) > 1000 and len(heldout) > 100
    assert not [c for c in train if c[0]["content"] in heldout]


def test_max_chars_and_bad_arguments():
    assert all(len(p) <= 100 for p in data.sharegpt_prompts(50, max_chars=100))
    with pytest.raises(SpecDeployError, match="unknown split"):
        data.sharegpt_prompts(3, split="test")
    with pytest.raises(SpecDeployError, match="n must be"):
        data.sharegpt_prompts(-1)


def test_conversations_are_chat_messages():
    conversations = data.sharegpt_conversations(10, split="heldout")
    assert len(conversations) == 10
    for messages in conversations:
        assert messages[0]["role"] == "user"
        assert {m["role"] for m in messages} <= {"user", "assistant"}


def test_heldout_texts_for_perplexity():
    texts = data.heldout_texts(8)
    assert len(texts) == 8 and all(len(t) >= 200 for t in texts)
    train_answers = {m["content"] for c in data.sharegpt_conversations(split="train") for m in c}
    assert not set(texts) & train_answers


def test_humaneval_prompts():
    prompts = data.humaneval_prompts()
    assert len(prompts) == 164
    assert prompts[0].startswith("from typing import List")
    assert data.humaneval_prompts(3) == prompts[:3]


def test_stdlib_code_prompts_are_humaneval_style_and_never_humaneval():
    prompts = data.stdlib_code_prompts()
    assert len(prompts) > 300  # CPython 3.11's library holds ~840 such functions
    assert data.stdlib_code_prompts(5) == data.stdlib_code_prompts(5)
    assert data.stdlib_code_prompts(5, seed=1) != data.stdlib_code_prompts(5)
    for prompt in prompts[:50]:
        assert prompt.startswith("def ") and prompt.rstrip().endswith(("\"", "'"))  # signature + docstring
        compile(prompt + "    pass\n", "<prompt>", "exec")  # a whole def once a body is added
    assert not set(prompts) & set(data.humaneval_prompts())
    assert len(data.stdlib_code_digest()) == 12
    with pytest.raises(SpecDeployError, match="at most"):
        data.stdlib_code_prompts(len(prompts) + 1)


def test_code_prompts_are_parsed_once_and_cached_by_the_content_they_come_from(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path))
    data._stdlib_functions.cache_clear()
    monkeypatch.setattr(data, "_stdlib_functions", data._stdlib_functions.__wrapped__)  # no in-process cache
    parsed = data._stdlib_functions()
    [cached] = (tmp_path / "code_prompts").iterdir()
    assert json.loads(cached.read_text()) == list(parsed)
    cached.write_text(json.dumps(["def planted():\n    \"\"\"Read from the cache.\"\"\"\n"]))
    assert data._stdlib_functions() == ("def planted():\n    \"\"\"Read from the cache.\"\"\"\n",)  # not parsed again
    # another standard library (one file edited): another key, parsed afresh
    sources = data._stdlib_sources()
    edited = [(name, content + b"\n") if i == 0 else (name, content) for i, (name, content) in enumerate(sources)]
    monkeypatch.setattr(data, "_stdlib_sources", lambda: edited)
    assert data._stdlib_functions() == parsed
    assert len(list((tmp_path / "code_prompts").iterdir())) == 2
