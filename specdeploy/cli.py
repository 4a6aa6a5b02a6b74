"""`specdeploy <command>`: one subcommand per pipeline stage, plus the tools around them.

Each command lives in its own module, which provides `add_arguments(parser)` and
`main(args) -> int`. Only the module of the command being run is imported, so `--help` stays fast
and a stage never pays for another stage's heavy imports (ModelOpt takes ~10 s).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from specdeploy.errors import SpecDeployError

# name -> (module, one-line help). Order is the pipeline's.
COMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("specdeploy.pipeline", "run the whole pipeline: resolve -> spec -> quantize -> convert -> build -> package"),
    "resolve": ("specdeploy.resolve.stage", "stage 1: turn a local folder, .gguf file or bundled name into an HF safetensors folder"),
    "spec": ("specdeploy.speculator.commands", "stage 2: train (ModelOpt), import (--module) or validate an EAGLE-3, DFlash or Medusa module"),
    "quantize": ("specdeploy.quantize", "stage 3: ModelOpt post-training quantization of base (and module)"),
    "convert": ("specdeploy.trtllm.convert", "stage 4: write TensorRT-LLM checkpoints"),
    "build": ("specdeploy.trtllm.build", "stage 5: trtllm-build plan and script (runs only on a GPU host)"),
    "package": ("specdeploy.triton.stage", "stage 6: fill the Triton model repository"),
    "serve": ("specdeploy.triton.serve", "start tritonserver on the packaged repository (loopback)"),
    "client": ("specdeploy.client", "send a request to a running server with tritonclient"),
    "export": ("specdeploy.modules.export", "write a build's module in an engine's layout: trtllm, speculators (vLLM), dflash, sglang"),
    "verify": ("specdeploy.verify.command", "parity vs the Hugging Face reference, acceptance, speed-up, through Triton"),
    "generate": ("specdeploy.runtime.command", "generate in-process with the speculative-decoding runtime"),
    "bench": ("specdeploy.bench", "benchmark autoregressive vs speculative vs HF assisted generation"),
    "loadtest": ("specdeploy.loadtest.command", "serving benchmark: speculative vs autoregressive over concurrency levels"),
}


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("specdeploy")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, as in NVIDIA's containers
        from specdeploy import __version__

        return f"{__version__} (source tree, not installed)"


def _parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdeploy",
        description="Ship an LLM with speculative decoding: ModelOpt -> TensorRT-LLM -> Triton, verified.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, (module, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = _parser(command if command in COMMANDS else None).parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.main(args) or 0)
    except SpecDeployError as err:
        print(f"specdeploy {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specdeploy {args.command}: interrupted; rerun to resume", file=sys.stderr)
        return 130
