"""The LLM-API route (TensorRT-LLM's PyTorch backend, every release line read: 1.1-1.4): no
engines, the HF checkpoint (ModelOpt's unified quantized export included) loads directly into
`trtllm-serve` or Triton's `llmapi` model. Speculative decoding there: EAGLE-3, DFlash (1.3+),
draft-target and n-gram (not Medusa, not EAGLE-1/2). Names and field sets differ per release
(releases.py: 1.1 says Eagle / DraftTarget / speculative_model_dir, later lines Eagle3 /
Draft_Target / speculative_model), so every config is written for the release named.

What is written depends on the release line the GPU host runs (`--trtllm-version`):
- EAGLE-3 drafts a chain (`max_draft_len`) by default; TRT-LLM's dynamic tree
  (`use_dynamic_tree`, `dynamic_tree_max_topK`, `max_total_draft_tokens`) where the line has it
  and it is asked for; never a static `eagle_choices` tree (discouraged in 1.1/1.2, deprecated in
  1.3, removed in 1.4), never `eagle3_one_model` (two-model EAGLE-3 is gone from 1.3 on). The CPU
  deployment decodes with the same DraftStructure.
- `eagle3_layers_to_capture` is written explicitly: TRT-LLM's default {1, n//2-1, n-4} is a
  set, so on a shallow base it collapses and no longer matches the module's fc width.
- An EAGLE-3 module whose residual is its normed hidden state (speculators' norm_before_residual)
  gets no route: TRT-LLM adds the un-normed one.
- DFlash drafts a chain of at most block_size - 1 tokens in one forward; mask_token_id /
  target_layer_ids are written explicitly as the module was trained.

This file is the configuration side (the speculative_config, the LLM() arguments, which builds
get the route); the draft model folders those configs name are written by draft_folders.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, atomic_write_text
from specdeploy.trtllm.draft_folders import DFLASH_FOLDER, DRAFT_FOLDER, dflash_draft, eagle3_draft, first_layer_fields
from specdeploy.trtllm.half_folder import needs_half, write_half
from specdeploy.trtllm.hostpaths import build_path
from specdeploy.trtllm.releases import DEFAULT_TRTLLM_VERSION, RELEASES, Release

MODES = ("chain", "dynamic")
KINDS = ("eagle", "draft", "ngram", "dflash")  # what the LLM API speculates with (Medusa: engine flow only)
# As NGramDecodingConfig takes them, chosen to match the CPU runtime's prompt lookup: the
# longest suffix of up to 3 tokens, the most recent continuation, one pool per request.
NGRAM_DEFAULTS = {"max_matching_ngram_size": 3, "is_keep_all": True, "is_use_oldest": False, "is_public_pool": False}
HALF_TARGET, HALF_DRAFT = "model_bf16", "draft_model_bf16"  # a float32 target / draft's bfloat16 copy
MAX_RUNTIME_DEPTH = 8  # the CPU runtime's EAGLE proposer drafts at most this deep (runtime/proposers/eagle.py)


def add_trtllm_version_arg(parser: Any) -> None:
    parser.add_argument("--trtllm-version", default=DEFAULT_TRTLLM_VERSION,
                        help=f"the TensorRT-LLM release the GPU host runs (default {DEFAULT_TRTLLM_VERSION}): decides the "
                             "routes, the image and what the LLM-API config carries (lines read: "
                             f"{', '.join(r.version for r in RELEASES.values())}; engine flow up to 1.2)")


@dataclass(frozen=True)
class DraftStructure:
    """What the drafter proposes per step, named once for the GPU config and the CPU deployment."""

    mode: str = "chain"  # chain | dynamic (EAGLE-3 only)
    max_draft_len: int = 4  # chain length; for a dynamic tree its depth
    topk: int | None = None  # dynamic: children per node, nodes expanded per depth
    total: int | None = None  # dynamic: nodes kept per step (max_total_draft_tokens)

    @classmethod
    def make(cls, mode: str = "chain", max_draft_len: int = 4, topk: int | None = None,
             total: int | None = None) -> "DraftStructure":
        if mode not in MODES:
            raise SpecDeployError(f"unknown draft structure {mode!r}", hint=f"use one of: {', '.join(MODES)}")
        if max_draft_len < 1:
            raise SpecDeployError(f"max_draft_len must be >= 1, got {max_draft_len}")
        if mode == "chain":
            return cls("chain", max_draft_len)
        topk = topk or 3
        total = total or min(10, topk * max_draft_len)
        if not max_draft_len <= total <= topk * max_draft_len:
            raise SpecDeployError(
                f"max_total_draft_tokens {total} is outside [max_draft_len {max_draft_len}, topK * max_draft_len "
                f"{topk * max_draft_len}]", hint="TensorRT-LLM's EagleDecodingConfig refuses it; pick a value in that range")
        return cls("dynamic", max_draft_len, topk, total)

    @property
    def tokens_per_step(self) -> int:
        return self.total if self.mode == "dynamic" else self.max_draft_len

    def trtllm_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"max_draft_len": self.max_draft_len}
        if self.mode == "dynamic":
            fields.update(use_dynamic_tree=True, dynamic_tree_max_topK=self.topk, max_total_draft_tokens=self.total)
        return fields

    def runtime_options(self, kind: str) -> dict[str, Any]:
        """deployment.json "spec" options for the CPU proposer drafting the same way."""
        options: dict[str, Any] = {"max_draft_len": self.tokens_per_step}
        if kind == "eagle" and self.mode == "chain":
            options.update(mode="chain", chain_len=self.max_draft_len)
        if kind == "eagle" and self.mode == "dynamic":
            options.update(mode="dynamic", depth=self.max_draft_len, topk=self.topk, width=self.topk, budget=self.total)
        return options

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def check_structure(kind: str, structure: DraftStructure, release: Release) -> None:
    """Refuse a structure the release (or the CPU runtime beside it) cannot run."""
    if kind == "dflash" and not release.dflash:
        raise SpecDeployError(f"TensorRT-LLM {release.name} has no DFlash (DFlashDecodingConfig arrived in the 1.3 line)",
                              hint="pass --trtllm-version 1.3 or 1.4 for a host that runs it")
    if structure.mode == "dynamic" and kind != "eagle":
        raise SpecDeployError(f"a dynamic tree is EAGLE-3 only, not {kind}", hint="use the default chain")
    if structure.mode == "dynamic" and not release.dynamic_tree:
        raise SpecDeployError(
            f"TensorRT-LLM {release.name} has no EAGLE-3 dynamic tree in the PyTorch backend (it arrived in the 1.3 line)",
            hint="draft a chain (the default), or pass --trtllm-version 1.3 / 1.4 for a host that runs one")
    if kind == "eagle" and structure.max_draft_len > MAX_RUNTIME_DEPTH:
        raise SpecDeployError(f"EAGLE draft depth {structure.max_draft_len} exceeds {MAX_RUNTIME_DEPTH}",
                              hint=f"the CPU deployment that predicts the GPU host drafts at most {MAX_RUNTIME_DEPTH} deep")


def refusal(kind: str, quant_algo: str | None, release: Release, kv_algo: str | None = None,
            spec_config: dict[str, Any] | None = None) -> str | None:
    """Why this build has no LLM-API route on `release`, or None."""
    if kind == "eagle" and first_layer_fields(spec_config).get("norm_before_residual"):
        return ("this EAGLE-3 module adds the normed hidden state as its first layer's residual (norm_before_residual, "
                "a speculators option vLLM runs): TensorRT-LLM's Eagle3DecoderLayer adds the un-normed one")
    if kind not in (*KINDS, "none"):
        return (f"TensorRT-LLM's PyTorch backend has no {kind} speculative decoding (MedusaDecodingConfig does not "
                "support the pytorch backend; EAGLE-1/2 drafts are incompatible with EAGLE-3)")
    if kind == "dflash" and not release.dflash:
        return f"TensorRT-LLM {release.name} has no DFlash speculative decoding (DFlashDecodingConfig arrived in the 1.3 line)"
    if quant_algo == "W8A8_SQ_PER_CHANNEL":
        return ("the PyTorch backend has no INT8 SmoothQuant (W8A8-SQ) method ('unsupported quant mode'); "
                "an INT8 SQ checkpoint runs on the engine flow only")
    if kind == "eagle" and kv_algo == "FP8" and not release.fp8_kv_eagle3:
        return (f"TensorRT-LLM {release.name} runs one-model EAGLE-3 on an FP8 KV cache only from 1.2 on (PR #8910; "
                "NVIDIA/TensorRT-LLM#7842 'KV cache data type e4m3 is not the same as input data type'): quantize "
                "with --kv-cache none, or target --trtllm-version 1.2.1")
    return None


def speculative_config(kind: str, structure: DraftStructure, release: Release, *, draft: str | None = None,
                       layers_to_capture: list[int] | None = None, ngram: dict[str, Any] | None = None,
                       dflash: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `speculative_config` mapping of one kind for one release line; only keys it accepts."""
    check_structure(kind, structure, release)
    if kind not in release.decoding_types:
        raise SpecDeployError(f"TensorRT-LLM {release.name}'s LLM API has no speculative decoding for {kind!r}",
                              hint="it runs EAGLE-3 (eagle), draft-target (draft), n-gram (ngram) and, from 1.3, DFlash (dflash); "
                                   "Medusa needs the engine flow (`specdeploy convert --route engine`, TensorRT-LLM 1.1 / 1.2)")
    config: dict[str, Any] = {"decoding_type": release.decoding_types[kind], **structure.trtllm_fields()}
    if kind in ("eagle", "draft", "dflash"):
        if draft is None:
            raise SpecDeployError(f"{release.decoding_types[kind]} needs a draft model folder")
        config[release.draft_field] = draft
    if kind == "eagle" and layers_to_capture:
        config["eagle3_layers_to_capture"] = sorted(layers_to_capture)
    if kind == "ngram":
        config.update({**NGRAM_DEFAULTS, **(ngram or {})})
    if kind == "dflash":
        config.update(dflash or {})
    return checked_config(config, release)


def checked_config(config: dict[str, Any], release: Release) -> dict[str, Any]:
    """`config` unchanged, or an error naming the keys `release` would refuse (its config models
    forbid unknown keys: never write one)."""
    unknown = set(config) - release.fields(config["decoding_type"]) - {"decoding_type"}
    if unknown:
        raise SpecDeployError(f"TensorRT-LLM {release.name} does not accept {sorted(unknown)} in speculative_config "
                              f"(decoding_type {config['decoding_type']})")
    return config


# Iterations the acceptance-rate rolling average spans before it may switch speculation off (1.3+).
ACCEPTANCE_WINDOW = 128


def break_even_rate(cpu_plan: dict[str, Any] | None, draft_len: int) -> float | None:
    """The acceptance rate (accepted / drafted) below which a chain of `draft_len` drafts costs more
    than it saves, from the CPU planner's measured round cost: a round of cost c plain steps emits
    1 + rate * draft_len tokens, so it pays while rate > (c - 1) / draft_len. None unmeasured."""
    plan = (cpu_plan or {}).get("plan") or {}
    ar = plan.get("ar_tokens_per_s")
    rounds = {e["shape"]: e["round_s"] for e in plan.get("estimates", [])}
    round_s = rounds.get(f"chain {draft_len}")
    if not ar or not round_s:
        return None
    return min(1.0, max(0.0, (round_s * ar - 1.0) / draft_len))


def scale_knobs(release: Release, draft_len: int, cpu_plan: dict[str, Any] | None) -> dict[str, Any]:
    """The speculation controls at scale that `release` has, seeded from the CPU planner's measured
    break-even (the package stage records that they came from there): max_concurrency = the largest
    in-flight batch where speculating measured faster, and on 1.3+ the acceptance-rate threshold
    under which a chain of `draft_len` stops paying. A GPU's costs differ: they are starting points."""
    knobs: dict[str, Any] = {}
    off_above = ((cpu_plan or {}).get("load") or {}).get("spec_off_above")
    if "max_concurrency" in release.knobs and off_above:
        knobs["max_concurrency"] = int(off_above)
    rate = break_even_rate(cpu_plan, draft_len)
    if "acceptance_rate_threshold" in release.knobs and rate:
        knobs.update(acceptance_rate_threshold=round(rate, 3), acceptance_rate_window_size=ACCEPTANCE_WINDOW)
    return knobs


def llm_options(spec_cfg: dict[str, Any] | None) -> dict[str, Any]:
    """The speculative part of the LLM() arguments (trtllm-serve --config, model.yaml)."""
    if not spec_cfg:
        return {}
    options: dict[str, Any] = {"speculative_config": spec_cfg}
    if spec_cfg["decoding_type"] in ("Draft_Target", "DraftTarget", "NGram"):
        options["disable_overlap_scheduler"] = True  # as in TRT-LLM's own examples for these
    return options


def llm_args(spec_cfg: dict[str, Any] | None, *, tp: int, pp: int, max_batch_size: int, max_seq_len: int,
             kv_cache_free_gpu_mem_fraction: float) -> dict[str, Any]:
    """LLM() keyword arguments: trtllm-serve's --config file, and model.yaml without model/triton_config."""
    return {
        "backend": "pytorch",
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "max_batch_size": max_batch_size,
        "max_seq_len": max_seq_len,
        "kv_cache_config": {"free_gpu_memory_fraction": kv_cache_free_gpu_mem_fraction},
        **llm_options(spec_cfg),
    }


def model_yaml(model: str, args: dict[str, Any], *, decoupled: bool) -> dict[str, Any]:
    """Triton `llmapi` model.yaml: the model, the LLM() arguments and triton_config."""
    return {"model": model, **args, "triton_config": {"max_batch_size": 0, "decoupled": decoupled}}


# ------------------------------------------------------------------ what the module tells the config


def dflash_fields(spec: Any, structure: DraftStructure) -> dict[str, Any]:
    """mask_token_id and target_layer_ids as the module was trained; a chain within one block."""
    config = (spec.config or {}).get("modelopt_config") or {}
    layers = (config.get("dflash_architecture_config") or {}).get("target_layer_ids")
    if config.get("dflash_mask_token_id") is None or not layers:
        raise SpecDeployError("spec_config.json names no dflash_mask_token_id / target_layer_ids",
                              hint="re-run `specdeploy spec train --spec dflash`: it records both")
    block = int(config.get("dflash_block_size") or spec.config.get("block_size"))
    if structure.mode != "chain" or structure.max_draft_len > block - 1:
        raise SpecDeployError(f"DFlash drafts a chain of at most block_size - 1 = {block - 1} tokens, not "
                              f"{structure.as_dict()}", hint=f"use --max-draft-len <= {block - 1} (a chain)")
    return {"mask_token_id": int(config["dflash_mask_token_id"]), "target_layer_ids": [int(i) for i in layers]}


def layers_to_capture(spec: Any) -> list[int]:
    """The base layers the module's fc reads (ModelOpt's eagle_aux_hidden_state_layer_ids)."""
    arch = ((spec.config or {}).get("modelopt_config") or {}).get("eagle_architecture_config") or {}
    layers = arch.get("eagle_aux_hidden_state_layer_ids")
    if not layers:
        raise SpecDeployError("spec_config.json names no eagle_aux_hidden_state_layer_ids",
                              hint="re-run `specdeploy spec train`: it records the layers the module was trained on")
    return sorted(set(int(i) for i in layers))


def write_llmapi(model_dir: str | Path, out: Path, *, spec: Any, structure: DraftStructure, release: Release,
                 spec_dir: Path | None = None, base_dir: Path | None = None, root: Path | None = None,
                 published: Path | None = None) -> dict[str, Any]:
    """out/speculative_config.yaml (+ out/eagle3_draft/), and the summary package reads. Paths
    are `$BUILD_DIR/...` relative to the build `root` (absolute without one), as they will be
    once `out` is published as `published` (the stage's final folder)."""
    import yaml

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec_cfg = None
    if spec.kind != "none":
        from specdeploy.checkpoints import checkpoint_dtype

        # the drafter in the target's half dtype; bf16 beside a float32 target (TensorRT-LLM's kernels lack
        # float32: NVIDIA/TensorRT-LLM#5260)
        dtype = checkpoint_dtype(model_dir) if checkpoint_dtype(model_dir) == "float16" else "bfloat16"
        draft: str | None = None
        capture = dflash = None
        if spec.kind == "eagle":
            eagle3_draft(spec, spec_dir, base_dir or Path(model_dir), out, dtype)
            draft = build_path((published or out) / DRAFT_FOLDER, root)
            capture = layers_to_capture(spec)
        elif spec.kind == "dflash":
            dflash = dflash_fields(spec, structure)
            dflash_draft(spec_dir, out, dtype)
            draft = build_path((published or out) / DFLASH_FOLDER, root)
        elif spec.kind == "draft":
            draft = build_path(spec.draft_dir, root)
        spec_cfg = speculative_config(spec.kind, structure, release, draft=draft, layers_to_capture=capture,
                                      ngram=(spec.config or {}).get("ngram"), dflash=dflash)
    atomic_write_text(out / "speculative_config.yaml", yaml.safe_dump(llm_options(spec_cfg), sort_keys=False))
    target = build_path(model_dir, root)
    if needs_half(Path(model_dir)):  # the PyTorch backend cannot run float32 (half_folder.py)
        write_half(Path(model_dir), out / HALF_TARGET)
        target = build_path((published or out) / HALF_TARGET, root)
    summary = {"route": "llmapi", "kind": spec.kind, "release": release.name, "structure": structure.as_dict(),
               "speculative_config": spec_cfg, "model": target}
    atomic_write_json(out / "llmapi_summary.json", summary)
    return summary
