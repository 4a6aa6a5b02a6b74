"""Speculative modules made elsewhere: read in the layouts their authors and engines publish, turned
into the spec/ contract (specdeploy/speculator/__init__.py) by the import stage, and written back out for
other engines by `specdeploy export`.

    files.py            a module folder: config.json, tensors (safetensors; pickles only with --allow-pickle), sha256s
    module.py           Module: one module's facts and tensors in ModelOpt's names, whatever the layout
    eagle3.py           EAGLE-3 as the EAGLE authors publish it (midlayer.*, LlamaForCausalLM + draft_vocab_size)
    eagle3_modelopt.py  EAGLE-3 as ModelOpt / SpecForge / AngelSlim export it (LlamaForCausalLMEagle3)
    speculators.py      vLLM's speculators format (Eagle3Speculator, DFlashSpeculator): read and written
    dflash.py           DFlash as z-lab publishes it (DFlashDraftModel)
    medusa.py           Medusa heads as FasterDecoding/Medusa and ModelOpt save them
    spec.py             Module <-> spec/, the engines' defaults, the checks against the base
    stage.py            the import stage (stage name "spec") and its acceptance gate; `specdeploy spec import`
    export.py           `specdeploy export --format trtllm|speculators|dflash|sglang`

A layout file has NAME, matches(folder) and read(folder) -> Module; the detector tries them in
LAYOUTS order (the most specific first). Nothing here imports ModelOpt at import time.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from specdeploy.errors import SpecDeployError
from specdeploy.modules.files import Folder, read_folder
from specdeploy.modules.module import Module

LAYOUTS = ("speculators", "dflash", "eagle3_modelopt", "eagle3", "medusa")
SPECDEPLOY = "specdeploy"  # a spec/ folder of another build


def read_module(path: str | os.PathLike, *, allow_pickle: bool = False) -> tuple[Module, Folder]:
    """The module in `path`, its layout detected from the files, and the folder as read."""
    from specdeploy.checkpoints.modules import SPEC_CONFIG

    path = Path(path).expanduser()
    folder = read_folder(path, allow_pickle=allow_pickle)
    if (path / SPEC_CONFIG).is_file():
        from specdeploy.modules.spec import from_spec

        return from_spec(path), folder
    for name in LAYOUTS:
        layout = importlib.import_module(f"specdeploy.modules.{name}")
        if layout.matches(folder):
            return layout.read(folder), folder
    architectures = folder.config.get("architectures")
    raise SpecDeployError(
        f"{path}: no known module layout (config architectures {architectures}, tensors {sorted(folder.tensors)[:4]})",
        hint="layouts read: EAGLE-3 (EAGLE authors, ModelOpt/SpecForge, speculators), DFlash (z-lab, speculators), "
             "Medusa (FasterDecoding, ModelOpt), a specdeploy spec/ folder; see docs/formats.md")
