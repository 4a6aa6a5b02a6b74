"""Proposers by name. Each entry is a lazily imported "module:factory"; a factory takes the
target model and keyword options and returns a Proposer, so a kind pays for its own imports only.
An option that is not one of the factory's parameters is refused by name: a misspelled key in
deployment.json must not silently leave a setting at its default.
"""

from __future__ import annotations

import importlib
import inspect
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


# The deployment's cap on drafted tokens per round, which every kind is given: a factory whose
# tree it bounds (Medusa, EAGLE) takes it; the others draft within it round by round.
DRAFT_CAP = "max_draft_len"


def build_proposer(kind: str, target: Any, **options: Any) -> Proposer:
    """A proposer of `kind` (draft | ngram | medusa | eagle | dflash) for `target`."""
    if kind not in PROPOSERS:
        raise SpecDeployError(f"unknown proposer kind {kind!r}", hint=f"use one of: {', '.join(PROPOSERS)}")
    module_name, name = PROPOSERS[kind].split(":")
    factory = getattr(importlib.import_module(module_name), name)
    known = list(inspect.signature(factory).parameters)[1:]  # the first is the target
    if DRAFT_CAP not in known:
        options.pop(DRAFT_CAP, None)
    unknown = [key for key in options if key not in known]
    if unknown:
        raise SpecDeployError(f"unknown {kind} option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}",
                              hint=f"a {kind} proposer takes: {', '.join(known)} (check deployment.json's spec)")
    return factory(target, **options)
