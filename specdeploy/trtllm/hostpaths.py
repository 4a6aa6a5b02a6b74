"""Paths in GPU-side files, relative to the build directory, so a build works wherever it is mounted.

Every generated file a GPU host reads (Triton config.pbtxt, the llmapi model.yaml, trtllm-serve's
config, fill_template_args.txt) names files of the build as `$BUILD_DIR/<path inside the build>`.
build_scripts/gpu_host.sh replaces `$BUILD_DIR` with the directory where the build is mounted
(TensorRT-LLM's C++ backend and LLM() take absolute paths only). Files that are not part of the
build (a draft model given by path) keep their absolute path.
"""

from __future__ import annotations

import os
from pathlib import Path

MARKER = "$BUILD_DIR"


def build_path(path: str | os.PathLike, root: str | os.PathLike | None) -> str:
    """`$BUILD_DIR/rel` for a path inside `root`, else the absolute path (root None: absolute)."""
    path = Path(path).resolve()
    if root is None:
        return str(path)
    root = Path(root).resolve()
    if path == root:
        return MARKER
    if root in path.parents:
        return f"{MARKER}/{path.relative_to(root).as_posix()}"
    return str(path)


def resolve(text: str, root: str | os.PathLike) -> str:
    """`text` with every `$BUILD_DIR` replaced by `root` (what gpu_host.sh does with sed)."""
    return text.replace(MARKER, str(Path(root).resolve()))

