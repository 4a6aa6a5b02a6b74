"""Choices trees (`medusa_choices`, `eagle_choices`) in TensorRT-LLM's format.

A tree is a list of paths of top-k indices: [[0], [0, 0], [1]] means "the top-1 token of the
first head, then the top-1 of the second head after it, and the top-2 of the first head". The
runtime, the TRT-LLM build (max_draft_len) and the Triton config (a "{0}, {0, 0}" string) all
read the same validated tree from here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from specdeploy.errors import SpecDeployError

Path_ = tuple[int, ...]

# Small trees for CPU verification: in bf16 a verify over <= ~16 tokens costs 1.0-1.3 decode steps
# on a 2-core CPU (docs/measurements.md, 2026-11-22); wider trees only pay on a GPU.
DEFAULT_CHAIN_4: list[list[int]] = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
DEFAULT_TREE_10: list[list[int]] = [
    [0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0, 0]
]


@dataclass(frozen=True)
class ChoicesTree:
    """A validated tree: paths sorted by (depth, path), so parents come before children."""

    paths: tuple[Path_, ...]

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    def parents(self) -> list[int]:
        """Index of each node's parent in `paths` (-1 for depth-1 nodes): DraftTree.parents."""
        index = {path: i for i, path in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    def to_list(self) -> list[list[int]]:
        return [list(p) for p in self.paths]

    def to_pbtxt(self) -> str:
        """Triton config.pbtxt form: '{0}, {0, 0}, {1}'."""
        return ", ".join("{" + ", ".join(str(i) for i in p) + "}" for p in self.paths)


def _fail(name: str, what: str) -> SpecDeployError:
    return SpecDeployError(
        f"invalid {name}: {what}",
        hint="a choices tree is a list of paths of top-k indices, e.g. [[0], [0, 0], [1]]; "
        "every path's prefix must be in the tree too",
    )


def parse_choices(text: str, name: str = "choices") -> list[list[int]]:
    """Read a tree from JSON ('[[0], [0, 0]]') or config.pbtxt form ('{0}, {0, 0}')."""
    stripped = text.strip()
    if stripped.startswith("{"):
        stripped = "[" + re.sub(r"\{", "[", re.sub(r"\}", "]", stripped)) + "]"
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError as err:
        raise _fail(name, f"cannot parse {text!r} ({err.msg})") from err
    if not isinstance(value, list):
        raise _fail(name, f"expected a list of paths, got {type(value).__name__}")
    return value


def validate_choices(
    choices: list[list[int]] | str,
    *,
    max_depth: int | None = None,
    max_draft_len: int | None = None,
    name: str = "choices",
) -> ChoicesTree:
    """Check a tree the way TRT-LLM would need it, with a message naming the bad path.

    max_depth is the number of Medusa heads or EAGLE layers; max_draft_len the engine's limit
    on draft tokens (the number of nodes).
    """
    if isinstance(choices, str):
        choices = parse_choices(choices, name)
    if not choices:
        raise _fail(name, "the tree is empty")
    seen: set[Path_] = set()
    for raw in choices:
        if not isinstance(raw, (list, tuple)) or not raw:
            raise _fail(name, f"{raw!r} is not a non-empty list of indices")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in raw):
            raise _fail(name, f"{list(raw)} holds something that is not a top-k index (an int >= 0)")
        path = tuple(raw)
        if path in seen:
            raise _fail(name, f"path {list(path)} appears twice")
        seen.add(path)
    for path in seen:
        if len(path) > 1 and path[:-1] not in seen:
            raise _fail(name, f"path {list(path)} has no parent {list(path[:-1])} in the tree")
    ordered = tuple(sorted(seen, key=lambda p: (len(p), p)))
    tree = ChoicesTree(ordered)
    if max_depth is not None and tree.depth > max_depth:
        deepest = max(ordered, key=len)
        raise _fail(name, f"path {list(deepest)} has depth {tree.depth} but there are only {max_depth} heads/layers")
    if max_draft_len is not None and tree.num_nodes > max_draft_len:
        raise _fail(name, f"{tree.num_nodes} nodes exceed max_draft_len {max_draft_len}")
    return tree
