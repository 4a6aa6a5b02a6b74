"""What the `package` stage reads from the build: the model and tokenizer folders, the limits
the engines were built for, convert's summary (the GPU routes and the draft structure), the
Medusa tree and DFlash block the spec stage trained, the draft model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdeploy.choices import ChoicesTree, validate_choices
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from specdeploy.trtllm.build import PLAN, BuildLimits
from specdeploy.trtllm.hostpaths import resolve
from specdeploy.trtllm.llmapi import DraftStructure


def model_dir(build: BuildDir) -> Path:
    """The model to serve: the quantize stage's, else resolve's."""
    for stage, out in (("quantize", "quantized"), ("resolve", "base")):
        if build.record(stage) is not None:
            return build.path(out).resolve()
    raise SpecDeployError(f"no model to package in {build.root}", hint="run `specdeploy resolve` (or `make engine`) first")


def tokenizer_dir(build: BuildDir, model: Path) -> Path:
    base = build.path("base").resolve()
    return base if (base / "tokenizer_config.json").exists() else model


def serving_limits(build: BuildDir, model: Path) -> BuildLimits:
    """The build stage's limits (already fitted to the model's context), else its defaults fitted
    the same way: every repository declares what the engines were built for."""
    plan = build.path("engines") / PLAN
    limits = BuildLimits(**json.loads(plan.read_text())["limits"]) if build.record("build") and plan.exists() else BuildLimits()
    return limits.fit(_read_context_len(model))


def _read_context_len(model: Path) -> int | None:
    config = model / "config.json"
    if not config.exists():
        return None
    data = json.loads(config.read_text())
    return data.get("max_position_embeddings") or data.get("max_sequence_length")


def convert_summary(build: BuildDir) -> dict[str, Any] | None:
    path = build.path("trtllm_ckpt") / "convert_summary.json"
    return json.loads(path.read_text()) if build.record("convert") is not None and path.exists() else None


def tree(choices: Any) -> ChoicesTree | None:
    return None if choices is None else validate_choices(choices)


def medusa_tree(spec_dir: Path, choices: Any) -> ChoicesTree | None:
    """The Medusa tree given, else the one the spec stage trained for (spec/spec_config.json)."""
    config = spec_dir / "spec_config.json"
    if choices is None and config.exists():
        choices = json.loads(config.read_text()).get("choices")
    return tree(choices)


def dflash_block(spec_dir: Path) -> int | None:
    """The block size the spec stage trained DFlash with (spec/spec_config.json)."""
    config = spec_dir / "spec_config.json"
    return json.loads(config.read_text()).get("block_size") if config.is_file() else None


def structure(kind: str, converted: dict[str, Any] | None, max_draft_len: int | None,
              block_size: int | None = None) -> DraftStructure | None:
    """The drafting the convert stage named for the GPU host (or, without one, a chain: DFlash's
    whole block)."""
    if kind in ("none", "medusa"):
        return None
    recorded = (converted or {}).get("structure")
    if recorded is None:
        return DraftStructure.make("chain", max_draft_len or (block_size - 1 if block_size else 4))
    drafted = DraftStructure(**recorded)
    if max_draft_len is not None and max_draft_len != drafted.max_draft_len:
        raise SpecDeployError(f"max_draft_len {max_draft_len} differs from the {drafted.mode} of {drafted.max_draft_len} "
                              "the convert stage wrote for the GPU host",
                              hint="re-run `specdeploy convert` with the same --max-draft-len (the CPU deployment must draft "
                                   "as the GPU host does)")
    return drafted


def draft_dir(kind: str, converted: dict | None, given: str | Path | None, spec_dir: Path, root: Path) -> Path | None:
    """The draft model both sides run: the copy convert put in the build, else the one given."""
    if kind != "draft":
        return None
    carried = (converted or {}).get("draft_model")
    if carried:
        return Path(resolve(carried, root))
    return Path(given).resolve() if given else spec_dir
