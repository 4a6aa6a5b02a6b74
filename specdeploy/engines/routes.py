"""The vLLM and SGLang routes of a packaged build, written by the package stage beside TensorRT-LLM's:
for each engine release (vllm.py, sglang.py) that serves the build, `triton_repo/<engine>/module/`
(the speculative module in that release's layout, via `specdeploy export`) and
`triton_repo/<engine>/serve.sh` (the exact command), and the record gpu_routes.json keeps under
"engines"; for each one that does not, the reason ("engines_refused").

Paths are `$BUILD_DIR/...` (trtllm/hostpaths.py): the record's argv and command name them so, and
serve.sh resolves them from where it lies (BUILD_DIR, when set, wins), so the build runs wherever
it is mounted. The module folders hold the drafter in the served model's half dtype (the engines
cast to it when loading anyway); a draft-model build's draft is served from where the build has it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdeploy.engines import BuildFacts, sglang, vllm
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_text
from specdeploy.manifest import BuildDir
from specdeploy.trtllm.hostpaths import MARKER, build_path

if TYPE_CHECKING:
    from specdeploy.trtllm.llmapi import DraftStructure

ENGINES = {"vllm": vllm, "sglang": sglang}
SCRIPT = "serve.sh"


def write_engine_routes(out: Path, build: BuildDir, kind: str, structure: DraftStructure | None, *, model_dir: Path,
                        published: Path, draft_model: Path | None = None, tp: int = 1,
                        pp: int = 1) -> tuple[dict[str, Any], dict[str, str]]:
    """Write out/<engine>/ for every engine that serves this build, as `out` will be once published
    as `published` (the package stage's final folder); returns (routes, refusals)."""
    root = build.root.resolve()
    facts = build_facts(build, kind, structure, model_dir, tp=tp, pp=pp)
    routes, refused = {}, {}
    for name, engine in ENGINES.items():
        why = engine.refusal(facts)
        if why:
            refused[name] = why
            continue
        fmt = engine.module_format(kind)
        if fmt is None:  # a draft model: served from where the build has it
            draft = build_path(draft_model, root)
        else:
            try:
                _export(build, fmt, out / name / "module", model_dir)
            except SpecDeployError as err:  # an optional route: the package stage goes on and says why
                shutil.rmtree(out / name, ignore_errors=True)
                refused[name] = f"the module could not be written in {engine.RELEASE.engine}'s layout: {err}"
                continue
            draft = build_path(published / name / "module", root)
        model = build_path(model_dir, root)
        argv = engine.command(model, draft, facts)
        _write_script(out / name / SCRIPT, argv, engine.RELEASE.engine, engine.RELEASE.version)
        routes[name] = {"release": engine.RELEASE.as_dict(), "model": model, "module": draft, "argv": argv,
                        "command": shell_line(argv), "script": build_path(published / name / SCRIPT, root),
                        "notes": shared_notes(build, facts) + engine.notes(facts)}
    return routes, refused


def build_facts(build: BuildDir, kind: str, structure: DraftStructure | None, model_dir: Path, *, tp: int = 1,
                pp: int = 1) -> BuildFacts:
    """The served model's architecture and quantization, and the module's first layer, as routes need them."""
    from specdeploy.checkpoints.modules.eagle import first_layer_norms

    config = json.loads((model_dir / "config.json").read_text())
    quant_file = model_dir / "hf_quant_config.json"  # ModelOpt's export: {"quantization": {"quant_algo", ...}}
    quant = json.loads(quant_file.read_text()).get("quantization", {}) if quant_file.is_file() else {}
    before_residual = kind == "eagle" and first_layer_norms(_eagle_arch(build))[1]
    return BuildFacts(kind=kind, structure=structure, quant_algo=quant.get("quant_algo"),
                      architecture=(config.get("architectures") or [None])[0], norm_before_residual=before_residual,
                      tp=tp, pp=pp)


def shared_notes(build: BuildDir, facts: BuildFacts) -> list[str]:
    """What every engine runs differently from the CPU runtime for this build."""
    from specdeploy.checkpoints.modules import read_spec_config
    from specdeploy.modules.export import notes

    if facts.kind == "eagle":
        return notes(build)
    if facts.kind == "dflash":
        block = int(read_spec_config(build.path("spec"))["block_size"])
        if facts.structure.max_draft_len + 1 < block:
            return [f"the engines run a DFlash block of {facts.structure.max_draft_len + 1} positions (the drafted chain "
                    f"and the pending token) where the module was trained on {block}; the CPU runtime runs the whole "
                    "block and keeps the chain, so their drafts differ"]
    return []


def _eagle_arch(build: BuildDir) -> dict[str, Any]:
    from specdeploy.checkpoints.modules import read_spec_config

    return read_spec_config(build.path("spec"))["modelopt_config"]["eagle_architecture_config"]


def _export(build: BuildDir, fmt: str, folder: Path, model_dir: Path) -> None:
    """The build's module in `fmt`, in the served model's half dtype."""
    from specdeploy.checkpoints import checkpoint_dtype
    from specdeploy.modules.export import export

    folder.parent.mkdir(parents=True, exist_ok=True)
    export(build, fmt, folder, dtype="float16" if checkpoint_dtype(model_dir) == "float16" else "bfloat16")


def shell_line(argv: list[str]) -> str:
    """argv as one POSIX shell line in which `$BUILD_DIR` still expands (and nothing else does): a word
    with anything but plain path characters double-quoted, `"`, `\\`, `` ` `` and `$` escaped in it."""
    def quoted(word: str) -> str:
        if word and all(c.isalnum() or c in "_./=:,+-" for c in word):
            return word
        escaped = "".join("\\" + c if c in '"\\`$' else c for c in word)
        return '"' + escaped.replace("\\" + MARKER, MARKER) + '"'

    return " ".join(quoted(word) for word in argv)


def _write_script(path: Path, argv: list[str], engine: str, version: str) -> None:
    lines = ["#!/bin/sh",
             f"# {engine} {version} serving this build's speculative module (written by `specdeploy package`).",
             "# BUILD_DIR: where the build is mounted (default: two folders up from this script).",
             'BUILD_DIR="${BUILD_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}"',
             f'exec {shell_line(argv)} "$@"']
    atomic_write_text(path, "\n".join(lines) + "\n")
    os.chmod(path, 0o755)
