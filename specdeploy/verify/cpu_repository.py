"""The packaged CPU repository as verify and the load test use it: where its deployment.json
lies, a twin of it with speculation off (the autoregressive arm), and the tokens one verify round
of its deployment runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from specdeploy.fileio import atomic_write_json

DEPLOYMENT = Path("tensorrt_llm") / "1" / "deployment.json"


def autoregressive_twin(cpu_repo: Path, out: Path) -> Path:
    """A copy of the CPU repository whose deployment does not speculate. `out` sits as deep as
    the repository, so its relative paths (tokenizer, model) hold unchanged."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(cpu_repo, out, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    config = json.loads((cpu_repo / DEPLOYMENT).read_text())
    config["spec"] = {"kind": "none"}
    atomic_write_json(out / DEPLOYMENT, config)
    return out


def round_tokens(deployment: dict[str, Any]) -> int:
    """The tokens one verify round of the deployment runs: the pending token and its draft."""
    return (deployment.get("spec") or {}).get("max_draft_len", 0) + 1
