"""Stage `resolve`: what the user named (a folder, a .gguf file, a bundled name) becomes
build/<name>/base/, a Hugging Face safetensors folder. One file per source: gguf.py, bundled.py,
local.py; cache.py their shared write discipline; stage.py the stage and its CLI."""

from specdeploy.resolve.stage import DEFAULT_MODEL, OUT, STAGE, resolve_model_dir, run

__all__ = ["DEFAULT_MODEL", "OUT", "STAGE", "resolve_model_dir", "run"]
