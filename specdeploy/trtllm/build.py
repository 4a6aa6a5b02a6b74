"""`specdeploy build` (stage `build`): the trtllm-build commands for the converted checkpoints,
written to engines/build_engines.sh + engines/build_plan.json, and run only where they can run.

trtllm-build runs here only when `tensorrt_llm` is importable, its release line has the engine
flow (releases.py: 1.1, and 1.2 where it is deprecated; removed in the 1.3 line) and a GPU is
visible. Anywhere else - this project's CPU machines included - nothing is faked: the
stage says plainly that no engine was built and how to build them (the script, inside NVIDIA's
container, via build_scripts/gpu_host.sh or build_scripts/build_engines.sh).

Flags: only what trtllm-build's parser takes in 1.1 and 1.2 (tensorrt_llm/commands/build.py and
plugin/plugin.py cli_plugin_args; tests/data/trtllm_build_flags.json names the snapshots read and
tests parse every generated command against them). --speculative_decoding_mode {medusa,
draft_tokens_external} with --max_draft_len = the number of nodes of the Medusa choices tree or
the draft length (draft-target: without it the target rejects every draft token); draft-target
uses the paged context FMHA for KV reuse; FP8 KV cache -> --use_fp8_context_fmha enable. INT4 AWQ
and INT8 SQ need no flag: builder.py enables their GEMM plugins from the checkpoint's quantization
(formats.py), and the command line has no flag for either. --max_seq_len and
--max_input_len never exceed the model's context (max_position_embeddings): the Triton
repositories declare the same numbers (triton/build_inputs.py serving_limits).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, atomic_write_text
from specdeploy.manifest import BuildDir, add_build_args, build_from_args
from specdeploy.trtllm.releases import DEFAULT_TRTLLM_VERSION, ENGINE_FLOW_LINES, RELEASES, release_for

STAGE, OUT = "build", "engines"
SCRIPT, PLAN = "build_engines.sh", "build_plan.json"
ENGINE_FLOW_WINDOW = " and ".join(RELEASES[line].version for line in ENGINE_FLOW_LINES)
CONTAINER_HINT = ("on a GPU host, build_scripts/gpu_host.sh build/<name> builds them in the image of the build's release, serves "
                  "and verifies; or run build_scripts/build_engines.sh build/<name> (see build_scripts/README.md)")


# Sequences a GPU deployment runs at once: the engines' --max_batch_size, the repositories'
# max_batch_size and the LLM API's, one number, so neither route queues what the other would run
GPU_MAX_BATCH_SIZE = 64


@dataclass(frozen=True)
class BuildLimits:
    max_batch_size: int = GPU_MAX_BATCH_SIZE
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int = 8192
    workers: int = 1

    def fit(self, context: int | None) -> "BuildLimits":
        """The same limits, capped at the model's context (the repositories declare the result)."""
        if not context:
            return self
        seq = min(self.max_seq_len, context)
        return replace(self, max_seq_len=seq, max_input_len=min(self.max_input_len, seq))


# ------------------------------------------------------------------------- host checks

def check_engine_flow_version(version: str) -> None:
    """Refuse TRT-LLM versions without the engine flow, or whose trtllm-build was not read."""
    release = release_for(version)
    if release.engine_flow == "removed":
        raise SpecDeployError(
            f"TensorRT-LLM {version} has no trtllm-build / engine flow (removed in the 1.3 line); "
            f"engine flow checked for: {ENGINE_FLOW_WINDOW}",
            hint="use the LLM-API route: `specdeploy convert --route llmapi` writes the speculative_config YAML "
                 "for trtllm-serve and Triton's llmapi model.yaml (EAGLE-3, draft-target, n-gram)",
        )
    if release.engine_flow == "deprecated":
        print(f"note: TensorRT-LLM {version} still builds engines, but the engine flow is deprecated there "
              "(removed in 1.3); the LLM-API route is the one that stays")


def trtllm_version() -> str | None:
    """The installed tensorrt_llm version, or None when it is not importable."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return None
    for dist in ("tensorrt_llm", "tensorrt-llm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def gpu_visible() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
    return done.returncode == 0 and "GPU" in done.stdout


def host_can_build() -> tuple[bool, str]:
    """(can build, why not) for this host."""
    version = trtllm_version()
    if version is None:
        return False, "tensorrt_llm is not importable on this host (it cannot be installed on these machines)"
    check_engine_flow_version(version)
    if not gpu_visible():
        return False, f"tensorrt_llm {version} is installed but no GPU is visible"
    return True, f"tensorrt_llm {version} with a GPU"


# --------------------------------------------------------------------------------- the plan

def quant_flags(quantization: dict[str, Any]) -> list[str]:
    """INT4 AWQ / INT8 SQ need none: trtllm-build enables their GEMM plugins from the checkpoint."""
    flags = ["--gemm_plugin", "auto"]
    if quantization.get("kv_cache_quant_algo") == "FP8":
        flags += ["--use_fp8_context_fmha", "enable"]
    return flags


def spec_flags(config: dict[str, Any], role: str, summary: dict[str, Any]) -> list[str]:
    arch, kind = config["architecture"], summary.get("kind", "none")
    if arch == "MedusaForCausalLM":
        return ["--speculative_decoding_mode", "medusa", "--max_draft_len", str(config["max_draft_len"])]
    if role == "target" and kind == "draft":
        return ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(summary["max_draft_len"])]
    return []


def engine_command(config: dict[str, Any], role: str, summary: dict[str, Any], limits: BuildLimits) -> list[str]:
    """trtllm-build argv with {ckpt} / {engines} placeholders for the two roots."""
    argv = ["trtllm-build", "--checkpoint_dir", f"{{ckpt}}/{role}", "--output_dir", f"{{engines}}/{role}",
            "--max_batch_size", str(limits.max_batch_size), "--max_input_len", str(limits.max_input_len),
            "--max_seq_len", str(limits.max_seq_len), "--max_num_tokens", str(limits.max_num_tokens),
            "--gpt_attention_plugin", "auto", "--remove_input_padding", "enable", "--kv_cache_type", "paged",
            "--workers", str(limits.workers)]
    argv += quant_flags(config["quantization"])
    argv += spec_flags(config, role, summary)
    paged_fmha = summary.get("kind") == "draft" or config["quantization"].get("kv_cache_quant_algo") == "FP8"
    if paged_fmha:  # draft-target uses KV reuse; FP8 context FMHA builds on it
        argv += ["--use_paged_context_fmha", "enable"]
    if role == "draft":
        argv += ["--gather_generation_logits"]  # the BLS draft-target model can use draft logits
    return argv


def plan_notes(checkpoints: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """What the engines will and will not do, for whoever serves them."""
    arch = checkpoints.get("target", {}).get("architecture")
    notes = []
    if arch == "MedusaForCausalLM":
        notes.append("TRT-LLM's Medusa decoding is greedy only; serve with decoding_mode medusa and the same medusa_choices")
    if summary.get("kind") == "draft":
        notes.append("draft tokens come from the draft engine through Triton's tensorrt_llm_bls, which speculates only when "
                     f"the request carries num_draft_tokens (<= max_draft_len={summary.get('max_draft_len')}) and does not stream")
    if summary.get("tp_size", 1) * summary.get("pp_size", 1) > 1:
        notes.append("multi-GPU engines are served with mpirun -n <world_size> (one rank per GPU)")
    return notes


def make_plan(ckpt_root: Path, limits: BuildLimits = BuildLimits()) -> dict[str, Any]:
    summary_file = ckpt_root / "convert_summary.json"
    if not summary_file.exists():
        raise SpecDeployError(f"{summary_file} not found", hint="run `specdeploy convert` (engine route) first")
    summary = json.loads(summary_file.read_text())
    roles = [r for r in ("target", "draft") if (ckpt_root / r / "config.json").exists()]
    if roles:
        limits = limits.fit(model_context(ckpt_root / "target"))
    commands, checkpoints = [], {}
    for role in roles:
        config = json.loads((ckpt_root / role / "config.json").read_text())
        checkpoints[role] = {"architecture": config["architecture"], "mapping": config["mapping"],
                             "quantization": config["quantization"], "max_draft_len": config.get("max_draft_len")}
        commands.append(engine_command(config, role, summary, limits))
    plan = {"trtllm_version": summary.get("trtllm_version") or DEFAULT_TRTLLM_VERSION, "spec": summary, "limits": limits.__dict__,
            "checkpoints": checkpoints, "commands": commands, "world_size": summary["tp_size"] * summary["pp_size"],
            "engine_flow": bool(commands), "notes": plan_notes(checkpoints, summary)}
    if not commands:
        plan["reason"] = summary.get("engine_reason") or "no engine-flow checkpoint in trtllm_ckpt/"
    return plan


def model_context(checkpoint: Path) -> int | None:
    """The context the converted model was trained for (its max_position_embeddings)."""
    config = checkpoint / "config.json"
    return json.loads(config.read_text()).get("max_position_embeddings") if config.exists() else None


def render_script(plan: dict[str, Any]) -> str:
    """A bash script that runs the plan in NVIDIA's container, paths relative to its own folder; it
    refuses a container whose TensorRT-LLM line is not the one whose trtllm-build the flags fit."""
    release = release_for(plan["trtllm_version"])
    lines = [
        "#!/usr/bin/env bash",
        "# Generated by `specdeploy build`: builds the TensorRT-LLM engines for this build directory.",
        f"# Run inside NVIDIA's container for TensorRT-LLM {release.name} ({release.triton_image}), on a GPU host.",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        'CKPT_DIR="${CKPT_DIR:-$HERE/../trtllm_ckpt}"',
        'ENGINE_DIR="${ENGINE_DIR:-$HERE}"',
        *_no_engine_flow(plan),
        'command -v trtllm-build >/dev/null || { echo "trtllm-build not found: run this inside the TensorRT-LLM container" >&2; exit 3; }',
        "python3 - <<'PY'",
        "import sys, tensorrt_llm",
        "v = tuple(int(''.join(c for c in p if c.isdigit()) or 0) for p in tensorrt_llm.__version__.split('.')[:2])",
        f"if v != {release.line}:",
        f"    sys.exit(f'TensorRT-LLM {{tensorrt_llm.__version__}} is not the {release.name} line this build was written for: "
        f"use {release.triton_image}, or convert again with --trtllm-version set to the container version')",
        "PY",
        'nvidia-smi -L >/dev/null || { echo "no GPU visible" >&2; exit 4; }',
    ]
    for argv in plan["commands"]:
        lines.append(" ".join(_shell_arg(a) for a in argv))
    lines.append('echo "engines written to $ENGINE_DIR"')
    return "\n".join(lines) + "\n"


def _no_engine_flow(plan: dict[str, Any]) -> list[str]:
    """Stop before anything else when there is nothing to build (e.g. an EAGLE-3 build: LLM API only)."""
    if plan["commands"]:
        return []
    message = "no TensorRT-LLM engine flow for this build: " + plan["reason"]
    return [f"echo {shlex.quote(message)} >&2", "exit 5"]


def _shell_arg(arg: str) -> str:
    """Quote one argument; the {ckpt}/{engines} placeholders become the script's variables."""
    for placeholder, var in (("{ckpt}", "$CKPT_DIR"), ("{engines}", "$ENGINE_DIR")):
        if arg.startswith(placeholder):
            rest = arg[len(placeholder):]
            return f'"{var}"' + (shlex.quote(rest) if rest else "")
    return shlex.quote(arg)


def write_plan(ckpt_root: Path, out: Path, limits: BuildLimits = BuildLimits()) -> dict[str, Any]:
    plan = make_plan(ckpt_root, limits)
    atomic_write_text(out / SCRIPT, render_script(plan))
    (out / SCRIPT).chmod(0o755)
    atomic_write_json(out / PLAN, plan)
    return plan


def run_plan(plan: dict[str, Any], ckpt_root: Path, engines: Path) -> None:
    """Really run trtllm-build (only called where host_can_build() said yes)."""
    for argv in plan["commands"]:
        real = [a.replace("{ckpt}", str(ckpt_root)).replace("{engines}", str(engines)) for a in argv]
        print("+", shlex.join(real), flush=True)
        subprocess.run(real, check=True)


def run(build: BuildDir, limits: BuildLimits = BuildLimits()) -> Path:
    """Stage `build`: engines/ with the plan and script; engines too when this host can build."""
    ckpt_root = build.path("trtllm_ckpt")
    try:
        can, why = host_can_build()
    except SpecDeployError as err:  # e.g. TensorRT-LLM >= 1.2: no engine flow, say so and go on
        can, why = False, str(err)
    settings = {"limits": limits.__dict__, "built_here": can}
    if build.completed(STAGE, settings, consumes=("convert",)):
        return build.path(OUT)
    with build.stage(STAGE, OUT, settings, consumes=("convert",)) as tmp:
        plan = write_plan(ckpt_root, tmp, limits)
        can = can and plan["engine_flow"]
        if can:
            run_plan(plan, ckpt_root, tmp)
        plan["engines_built"], plan["host"] = can, why
        atomic_write_json(tmp / PLAN, plan)
    return build.path(OUT)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    defaults = BuildLimits()
    for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "workers"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))


def main(args: argparse.Namespace) -> int:
    limits = BuildLimits(args.max_batch_size, args.max_input_len, args.max_seq_len, args.max_num_tokens, args.workers)
    build = build_from_args(args)
    out = run(build, limits)
    plan = json.loads((out / PLAN).read_text())
    if plan.get("engines_built"):
        print(f"engines built in {out}")
        return 0
    if not plan.get("engine_flow", True):
        print(f"no TensorRT-LLM engines for this build: {plan.get('reason')}")
        print(f"This build's GPU route is the LLM API: {build.path('trtllm_ckpt')}/llmapi/, packaged as "
              f"triton_repo/llmapi by `specdeploy package`; build_scripts/gpu_host.sh {build.root} serves and verifies it.")
        return 0
    print(f"engines were NOT built on this host: {plan.get('host')}.")
    print(f"The build plan and script are in {out}/{PLAN} and {out}/{SCRIPT}.")
    print(f"To build them: {CONTAINER_HINT}.")
    for note in plan.get("notes", []):
        print(f"note: {note}")
    return 0
