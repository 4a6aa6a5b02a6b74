"""The TensorRT-LLM >= 1.2 route: no engines, the PyTorch backend through the LLM API.

trtllm-build and the C++ engine backend are gone from these releases (shared/facts.md);
`trtllm-serve --config speculative_config.yaml` and Triton's `llmapi` model (model.yaml) load
the HF checkpoint (ModelOpt's unified quantized export included) directly. Their speculative
decoding covers EAGLE-3, draft-target and n-gram - not Medusa nor EAGLE-1/2.

Formats read from NVIDIA/TensorRT-LLM:
- tensorrt_llm/llmapi/llm_args.py (EagleDecodingConfig.validate_eagle_config): with eagle_choices,
  max_draft_len is reset to the tree's depth and max_total_draft_tokens = len(eagle_choices).
- docs/source/features/speculative-decoding.md @ 04c8822cc42ffd1f5b6270874e5b9a64a20e7a58:
  `speculative_config: {decoding_type: Eagle3 | DraftTarget | NGram, max_draft_len, speculative_model
  (alias speculative_model_dir)}`; NGram options max_matching_ngram_size, is_public_pool,
  is_keep_all, is_use_oldest; DraftTarget / NGram examples run with disable_overlap_scheduler.
- triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml @ 0ebb1536ac12bbe27201185de960df3ab00bcecc:
  `model`, `backend: pytorch`, `tensor_parallel_size`, `pipeline_parallel_size`, LLM() arguments,
  `triton_config: {max_batch_size, decoupled}`.
We write `speculative_model_dir`, the name both the 1.0-era and current releases accept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from specdeploy.choices import ChoicesTree
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, atomic_write_text

DECODING_TYPES = {"eagle": "Eagle3", "draft": "DraftTarget", "ngram": "NGram"}
NGRAM_DEFAULTS = {"max_matching_ngram_size": 3, "is_public_pool": False, "is_keep_all": True, "is_use_oldest": True}


def speculative_config(kind: str, max_draft_len: int, draft_dir: str | Path | None = None,
                       ngram: dict[str, Any] | None = None, tree: ChoicesTree | None = None) -> dict[str, Any]:
    """The `speculative_config` mapping for one spec kind. An EAGLE tree is given as TRT-LLM's
    EagleDecodingConfig takes it: max_draft_len = its depth (draft layers), eagle_choices, and
    max_total_draft_tokens = its node count (what that config derives from the choices)."""
    if kind not in DECODING_TYPES:
        raise SpecDeployError(
            f"TensorRT-LLM's LLM-API route has no speculative decoding for {kind!r}",
            hint="it supports EAGLE-3 (eagle), draft-target (draft) and n-gram (ngram); Medusa and EAGLE-1/2 need "
                 "the engine flow (TRT-LLM <= 1.1.x, `specdeploy convert --route engine`)",
        )
    if max_draft_len < 1:
        raise SpecDeployError(f"max_draft_len must be >= 1, got {max_draft_len}")
    config: dict[str, Any] = {"decoding_type": DECODING_TYPES[kind], "max_draft_len": int(max_draft_len)}
    if kind == "eagle" and tree is not None:
        config.update(max_draft_len=tree.depth, eagle_choices=tree.to_list(), max_total_draft_tokens=tree.num_nodes)
    if kind in ("eagle", "draft"):
        if draft_dir is None:
            raise SpecDeployError(f"{DECODING_TYPES[kind]} needs a draft model folder")
        config["speculative_model_dir"] = str(draft_dir)
    if kind == "ngram":
        config.update({**NGRAM_DEFAULTS, **(ngram or {})})
    return config


def llm_options(spec_cfg: dict[str, Any] | None) -> dict[str, Any]:
    """trtllm-serve --config / --extra_llm_api_options content."""
    options: dict[str, Any] = {}
    if spec_cfg:
        options["speculative_config"] = spec_cfg
        if spec_cfg["decoding_type"] in ("DraftTarget", "NGram"):
            options["disable_overlap_scheduler"] = True  # as in TRT-LLM's own examples for these
    return options


def model_yaml(model_dir: str | Path, spec_cfg: dict[str, Any] | None, tp: int = 1, pp: int = 1,
               decoupled: bool = True) -> dict[str, Any]:
    """Triton `llmapi` model.yaml: LLM() arguments + triton_config."""
    return {
        "model": str(model_dir),
        "backend": "pytorch",
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        **llm_options(spec_cfg),
        "triton_config": {"max_batch_size": 0, "decoupled": decoupled},
    }


def export_eagle3_draft(base_dir: Path, spec_dir: Path, out: Path) -> Path:
    """ModelOpt's own EAGLE-3 draft export (a LlamaForCausalLMEagle3 folder) from the spec stage's module."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding

    spec_config = json.loads((spec_dir / "spec_config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    mtsp.convert(model, [("eagle", json.loads(json.dumps(spec_config["modelopt_config"])))])
    module = load_file(str(spec_dir / "module.safetensors"))
    missing = set(module) - set(model.state_dict())
    if missing:
        raise SpecDeployError(f"module tensors {sorted(missing)[:3]} do not fit the EAGLE module built from spec_config.json")
    model.load_state_dict(module, strict=False)
    with torch.inference_mode():
        export_speculative_decoding(model, export_dir=out)
    return out


def is_eagle3(spec: Any) -> bool:
    """ModelOpt's EAGLE-3 layout: auxiliary hidden states of several base layers (fc + hidden_norm)."""
    arch = ((spec.config or {}).get("modelopt_config") or {}).get("eagle_architecture_config") or {}
    return bool(arch.get("use_aux_hidden_state")) or any(".hidden_norm." in k for k in (spec.module or {}))


def eagle3_draft_dir(spec: Any, spec_dir: Path | None, base_dir: Path, out: Path) -> Path:
    """The spec stage's own ModelOpt export (spec/eagle3_export) when present, else export here."""
    if spec_dir is None:
        raise SpecDeployError("EAGLE-3 on the LLM-API route needs the spec stage output (spec/)")
    if not is_eagle3(spec):
        raise SpecDeployError(
            "this EAGLE module is EAGLE-1/2 shaped; TensorRT-LLM's LLM API runs EAGLE-3 drafts only",
            hint="use the engine flow (TRT-LLM <= 1.1.x, `specdeploy convert --route engine`) for this module",
        )
    ready = Path(spec_dir) / "eagle3_export"
    if (ready / "config.json").exists() and list(ready.glob("*.safetensors")):
        return ready
    return export_eagle3_draft(base_dir, Path(spec_dir), out / "eagle3_draft")


def write_llmapi(model_dir: str | Path, out: Path, *, spec: Any, spec_dir: Path | None = None,
                 base_dir: Path | None = None, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """out/speculative_config.yaml + out/model.yaml (+ out/eagle3_draft/ for EAGLE-3)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec_cfg = None
    if spec.kind != "none":
        draft_dir: Path | None = spec.draft_dir
        if spec.kind == "eagle":
            draft_dir = eagle3_draft_dir(spec, spec_dir, base_dir or Path(model_dir), out)
        spec_cfg = speculative_config(spec.kind, spec.max_draft_len or 4, draft_dir.resolve() if draft_dir else None,
                                      (spec.config or {}).get("ngram"), tree=spec.tree)
    atomic_write_text(out / "speculative_config.yaml", yaml.safe_dump(llm_options(spec_cfg), sort_keys=False))
    atomic_write_text(out / "model.yaml", yaml.safe_dump(model_yaml(Path(model_dir).resolve(), spec_cfg, tp, pp), sort_keys=False))
    summary = {"route": "llmapi", "kind": spec.kind, "speculative_config": spec_cfg, "model": str(Path(model_dir).resolve())}
    atomic_write_json(out / "llmapi_summary.json", summary)
    return summary
