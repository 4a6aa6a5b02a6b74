"""`specdeploy export --format trtllm|speculators|dflash|sglang --out DIR`: a build's module (trained
or imported: its spec/) as a folder in an engine's layout, for engines beside TensorRT-LLM.

    trtllm       EAGLE-3: the eagle3_draft folder convert writes (draft_folders.eagle3_draft: ModelOpt's export,
                 its layer as midlayer.*); DFlash: the dflash_draft folder (TensorRT-LLM 1.3+). Medusa has
                 no such folder (engine flow only: `specdeploy convert --route engine`).
    speculators  vLLM's speculators layout (modules/speculators.py), EAGLE-3 or DFlash, with d2t and t2d:
                 what vLLM 0.33.0 loads for both (engines/vllm.py).
    dflash       DFlash as z-lab publishes it (what vLLM's and SGLang's dflash methods load): the same
                 folder as trtllm's for DFlash.
    sglang       what SGLang 0.5.23 loads (engines/sglang.py): EAGLE-3 as its LlamaForCausalLMEagle3
                 (layers.0.*, d2t, eagle_config with the captured layers); DFlash the dflash folder.

Each reads back through `specdeploy spec import` to the same module, bit for bit (float32).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir, add_build_args, build_from_args

if TYPE_CHECKING:
    from specdeploy.modules.module import Module
    from specdeploy.modules.spec import Base

FORMATS = ("trtllm", "speculators", "dflash", "sglang")
# trtllm: the half dtype convert deploys drafts in (TensorRT-LLM's kernels lack float32); the others
# keep the module as stored, which vLLM and SGLang cast to the serving dtype when loading
DEFAULT_DTYPES = {"trtllm": "bfloat16", "speculators": "float32", "dflash": "float32", "sglang": "float32"}


def export(build: BuildDir, fmt: str, out: Path, *, dtype: str | None = None, verifier: str | None = None) -> Path:
    """Write the build's module to `out` in `fmt`; returns `out`."""
    from specdeploy.checkpoints.modules import read_spec_config

    spec_dir, base_dir = build.path("spec"), build.path("base")
    kind = read_spec_config(spec_dir)["kind"]
    dtype = dtype or DEFAULT_DTYPES[fmt]
    refuse(fmt, kind)
    staging = out.parent / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        written = _write(build, fmt, kind, spec_dir, base_dir, staging, dtype, verifier)
        shutil.rmtree(out, ignore_errors=True)
        written.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def refuse(fmt: str, kind: str) -> None:
    if kind == "medusa":
        raise SpecDeployError(f"no {fmt} layout holds Medusa heads: no LLM-API engine (TensorRT-LLM's PyTorch backend, "
                              "vLLM, SGLang) serves them", hint="TensorRT-LLM 1.1/1.2's engine flow does: "
                                                                "`specdeploy convert --route engine`")
    if fmt == "dflash" and kind != "dflash":
        raise SpecDeployError(f"--format dflash writes DFlash modules; this build's is {kind}",
                              hint="use --format trtllm, speculators or sglang")


def _write(build: BuildDir, fmt: str, kind: str, spec_dir: Path, base_dir: Path, staging: Path, dtype: str,
           verifier: str | None) -> Path:
    from specdeploy.trtllm import draft_folders, llmapi
    from specdeploy.trtllm.releases import DEFAULT_TRTLLM_VERSION, release_for
    from specdeploy.trtllm.spec_input import load_spec

    if fmt == "speculators":
        return _speculators(build, spec_dir, base_dir, staging / "module", dtype, verifier)
    if fmt == "sglang" and kind == "eagle":
        return _sglang(build, spec_dir, base_dir, staging / "module", dtype)
    if kind == "dflash":
        return draft_folders.dflash_draft(spec_dir, staging, dtype)
    spec = load_spec(spec_dir)
    why = llmapi.refusal(kind, None, release_for(DEFAULT_TRTLLM_VERSION), None, spec.config)  # as the LLM-API route decides
    if why:
        raise SpecDeployError(f"no TensorRT-LLM layout for this module: {why}",
                              hint="export it with --format speculators (vLLM runs it), or serve the CPU deployment")
    return draft_folders.eagle3_draft(spec, spec_dir, base_dir, staging, dtype)


def _normalised(build: BuildDir, spec_dir: Path, base_dir: Path) -> tuple[Module, Base, list[str]]:
    """(the module with its optional fields filled against the base, the base, the base's names)."""
    from specdeploy.modules.spec import Base, from_spec, normalise
    from specdeploy.modules.stage import build_aliases

    aliases = build_aliases(build)
    base = Base.of(base_dir, *aliases)
    return normalise(from_spec(spec_dir), base), base, aliases


def _speculators(build: BuildDir, spec_dir: Path, base_dir: Path, out: Path, dtype: str, verifier: str | None) -> Path:
    from specdeploy.modules import speculators

    module, base, aliases = _normalised(build, spec_dir, base_dir)
    return speculators.write(module, out, verifier=verifier or aliases[0] or str(base_dir),
                             verifier_architectures=list(base.config.get("architectures") or []),
                             max_positions=int(base.config.get("max_position_embeddings", 4096)), dtype=dtype)


def _sglang(build: BuildDir, spec_dir: Path, base_dir: Path, out: Path, dtype: str) -> Path:
    from specdeploy.engines import sglang

    module, base, _ = _normalised(build, spec_dir, base_dir)
    return sglang.write_eagle3(module, out, max_positions=int(base.config.get("max_position_embeddings", 4096)), dtype=dtype)


def notes(build: BuildDir) -> list[str]:
    """What an engine will run differently from the CPU runtime, said when exporting."""
    from specdeploy.checkpoints.modules import read_spec_config
    from specdeploy.trtllm.draft_folders import first_layer_fields

    config: dict[str, Any] = read_spec_config(build.path("spec"))
    if config["kind"] != "eagle" or "hidden_norm_input" not in first_layer_fields(config):
        return []
    return ["this EAGLE-3 module was trained with ModelOpt's first layer (hidden_norm on input_layernorm(fc)); TensorRT-LLM, "
            "vLLM and SGLang apply hidden_norm to the fc output, so their drafts differ from the CPU runtime's and their "
            "acceptance may be lower (the folder records hidden_norm_input for specdeploy's own import)"]


def dtype_notes(fmt: str, dtype: str | None) -> list[str]:
    """What a float32 trtllm folder is for: TensorRT-LLM's PyTorch backend runs a drafter in its
    config.json's dtype and its kernels lack float32 (NVIDIA/TensorRT-LLM#5260), while specdeploy's
    import reads the folder back bit for bit; so it is written, with a word on serving it."""
    if fmt != "trtllm" or dtype != "float32":
        return []
    return ["float32 weights: TensorRT-LLM will not serve this folder (its PyTorch backend drafts in the config's dtype "
            "and its kernels lack float32, NVIDIA/TensorRT-LLM#5260); it is for `specdeploy spec import` (bit for bit). "
            "To serve the module, export it with --dtype bfloat16 (the default) or float16"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    parser.add_argument("--format", required=True, choices=FORMATS, help="the layout to write (see docs/formats.md)")
    parser.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="the weights' dtype (default: trtllm bfloat16, as convert deploys drafts; else float32, as stored)")
    parser.add_argument("--verifier", help="speculators: the verifier's name_or_path to record (default: the model the "
                                           "build resolved, as MODEL named it)")


def main(args: argparse.Namespace) -> int:
    build = build_from_args(args)
    out = export(build, args.format, Path(args.out), dtype=args.dtype, verifier=args.verifier)
    for note in notes(build) + dtype_notes(args.format, args.dtype):
        print(f"note: {note}")
    print(f"{args.format}: {out}")
    return 0
