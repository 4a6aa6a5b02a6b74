"""triton_repo/llmapi/: TensorRT-LLM's LLM API (PyTorch backend). The build brings only the
llmapi model's 1/model.yaml (+ trtllm_serve.yaml for `trtllm-serve --config`); the model's code and
config.pbtxt are the release's own, copied from its container by build_scripts/gpu_host.sh.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from specdeploy.fileio import atomic_write_text
from specdeploy.trtllm import llmapi
from specdeploy.trtllm.build import BuildLimits
from specdeploy.trtllm.llmapi import DraftStructure
from specdeploy.trtllm.releases import release_for

# NVIDIA's llmapi model as the container ships it (config.pbtxt, 1/model.py, 1/helpers.py): its
# inputs and outputs are the release's own; the build brings only 1/model.yaml
LLMAPI_CONTAINER_DIR = "/app/all_models/llmapi/tensorrt_llm"


def write_llmapi_repo(out: Path, model: str, summary: dict[str, Any], limits: BuildLimits, *, tp: int, pp: int,
                      max_batch_size: int, kv_cache_free_gpu_mem_fraction: float, decoupled: bool,
                      knobs: dict[str, Any] | None = None) -> None:
    """Triton's llmapi model: its one model.yaml (LLM() arguments from llmapi.llm_args, the
    speculative part as convert wrote it plus the release's speculation controls at scale,
    `knobs`), and trtllm_serve.yaml beside; the model's code and config.pbtxt come from the
    release's container (LLMAPI_CONTAINER_DIR, copied in by build_scripts/gpu_host.sh)."""
    (out / "tensorrt_llm" / "1").mkdir(parents=True, exist_ok=True)
    spec_cfg = summary.get("speculative_config")
    if spec_cfg and knobs:
        spec_cfg = llmapi.checked_config({**spec_cfg, **knobs}, release_for(summary["release"]))
    args = llmapi.llm_args(spec_cfg, tp=tp, pp=pp, max_batch_size=max_batch_size,
                           max_seq_len=limits.max_seq_len, kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction)
    document = llmapi.model_yaml(model, args, decoupled=decoupled)
    atomic_write_text(out / "tensorrt_llm" / "1" / "model.yaml", yaml.safe_dump(document, sort_keys=False))
    atomic_write_text(out / "trtllm_serve.yaml", yaml.safe_dump(args, sort_keys=False))


def gpu_knobs(converted: dict[str, Any], structure: DraftStructure | None, plan_file: Path) -> dict[str, Any]:
    """The LLM-API speculation controls at scale for the build's release, seeded from the CPU
    planner's measurement (llmapi.scale_knobs); none without a speculative config or a plan."""
    if not (converted["llmapi"].get("speculative_config") and structure and plan_file.is_file()):
        return {}
    release = release_for(converted["llmapi"]["release"])
    return llmapi.scale_knobs(release, structure.max_draft_len, json.loads(plan_file.read_text()))
