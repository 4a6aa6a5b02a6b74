"""Proposers by name. Each entry is a lazily imported "module:factory"; a factory takes the
target model and keyword options and returns a Proposer, so a kind pays for its own imports only.
"""

from __future__ import annotations

import importlib
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.runtime.types import Proposer

PROPOSERS: dict[str, str] = {
    "draft": "specdeploy.runtime.proposers.draft:build",
    "ngram": "specdeploy.runtime.proposers.ngram:build",
    "medusa": "specdeploy.runtime.proposers.medusa:build",
    "eagle": "specdeploy.runtime.proposers.eagle:build",
    "dflash": "specdeploy.runtime.proposers.dflash:build",
}


def build_proposer(kind: str, target: Any, **options: Any) -> Proposer:
    """A proposer of `kind` (draft | ngram | medusa | eagle | dflash) for `target`."""
    if kind not in PROPOSERS:
        raise SpecDeployError(f"unknown proposer kind {kind!r}", hint=f"use one of: {', '.join(PROPOSERS)}")
    module_name, factory = PROPOSERS[kind].split(":")
    return getattr(importlib.import_module(module_name), factory)(target, **options)
