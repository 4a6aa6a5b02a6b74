"""triton_repo/engine/: TensorRT-LLM's engine flow (1.1 / 1.2, the C++ tensorrtllm backend) for
base, Medusa and draft-target (tensorrt_llm_bls + tensorrt_llm_draft) builds. Files are named as
`$BUILD_DIR/...` (trtllm/hostpaths.py), resolved by build_scripts/gpu_host.sh where the build is
mounted; `fill_template_args.txt` repeats the values in the backend's fill_template.py syntax.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdeploy.choices import ChoicesTree
from specdeploy.fileio import atomic_write_text
from specdeploy.trtllm.build import BuildLimits
from specdeploy.triton.templating import TEMPLATES, backend_fill_args, common_values, fill_model

# NVIDIA's BLS model code as the container ships it: the engine repository's tensorrt_llm_bls/1/
BLS_CONTAINER_DIR = "/app/all_models/inflight_batcher_llm/tensorrt_llm_bls/1"


def write_engine_repo(out: Path, kind: str, tree: ChoicesTree | None, engines: str, tokenizer_dir: str, limits: BuildLimits, *,
                      max_batch_size: int, kv_cache_free_gpu_mem_fraction: float, decoupled: bool) -> dict[str, Any]:
    """The inflight_batcher_llm set for the C++ tensorrtllm backend; returns the values used."""
    # draft-target: NVIDIA's BLS calls tensorrt_llm and tensorrt_llm_draft with exec(decoupled=False),
    # which the Python backend refuses for a decoupled model (python_backend src/request_executor.cc);
    # NVIDIA's draft_target_model example fills every model with decoupled_mode False
    decoupled = decoupled and kind != "draft"
    values = {
        **common_values(tokenizer_dir, limits, max_batch_size, decoupled),
        "triton_backend": "tensorrtllm",
        "instance_kind": "KIND_CPU",  # as upstream: the C++ backend places the engine on its GPUs itself
        "batching_strategy": "inflight_fused_batching",
        "engine_dir": f"{engines}/target",  # the build stage writes engines/target (+ engines/draft)
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction,
        # draft-target needs the target's KV cache reused across the BLS calls of one request
        "enable_kv_cache_reuse": kind == "draft",
        "tensorrt_llm_model_name": "tensorrt_llm",
        "tensorrt_llm_draft_model_name": "tensorrt_llm_draft" if kind == "draft" else "",
        "multimodal_encoders_name": "",
        **({"decoding_mode": "medusa", "medusa_choices": tree.to_pbtxt()} if kind == "medusa" and tree else {}),
    }
    ibl = TEMPLATES / "inflight_batcher_llm"
    for model in ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"):
        fill_model(out / model, ibl / model, values)
    if kind == "draft":
        draft_values = {**values, "engine_dir": f"{engines}/draft", "decoding_mode": "${decoding_mode}"}
        fill_model(out / "tensorrt_llm_draft", ibl / "tensorrt_llm", draft_values, rename="tensorrt_llm_draft")
    atomic_write_text(out / "fill_template_args.txt", backend_fill_args(values) + "\n")
    return values
