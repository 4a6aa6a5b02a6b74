"""The TensorRT-LLM releases a build can target (`--trtllm-version`): for each release line, the
image that carries it, the libraries it pins, and what its LLM-API schema accepts.

Every entry was read from NVIDIA's published material; `sources` names the file and commit (or
the dated snapshot where the release tag itself could not be read). docs/releases.md is the same
table for readers, with the reasoning behind each cell.

Nothing here imports tensorrt_llm: it cannot be installed on the machines that build, so the
release is named, not detected. A GPU host checks that its container runs the line the build
names (build_scripts/gpu_host.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from specdeploy.errors import SpecDeployError

# ------------------------------------------------------------------------------ field sets

_NGRAM = frozenset({"max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool"})
_EAGLE_1_1 = frozenset({
    "eagle_choices", "greedy_sampling", "posterior_threshold", "use_dynamic_tree", "dynamic_tree_max_topK",
    "num_eagle_layers", "max_non_leaves_per_layer", "eagle3_one_model", "eagle3_layers_to_capture",
})
_EAGLE_1_3 = frozenset({
    "eagle_choices", "use_dynamic_tree", "dynamic_tree_max_topK", "num_eagle_layers", "max_non_leaves_per_layer",
    "eagle3_layers_to_capture", "eagle3_model_arch", "sa_config",
})
_BASE_1_3 = frozenset({
    "max_draft_len", "max_total_draft_tokens", "speculative_model", "max_concurrency", "draft_len_schedule",
    "load_format", "acceptance_rate_window_size", "acceptance_rate_threshold", "use_rejection_sampling",
    "allow_advanced_sampling", "advanced_sampling_mode", "enable_penalty",
})
_DFLASH_1_3 = frozenset({"mask_token_id", "target_layer_ids", "attention_backend"})

# The image line every release shares: NVIDIA publishes nvcr.io/nvidia/tensorrt-llm/release:<version>
# (TensorRT-LLM docs, installation/containers.html: "IMAGE_TAG ... tensorrt_llm.__version__").
SERVE_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:{version}"


@dataclass(frozen=True)
class Release:
    """One TensorRT-LLM release line, as read from its sources."""

    line: tuple[int, int]
    version: str  # the release of the line the entry was read for
    triton_image: str | None  # NGC tritonserver image carrying this release (None: none published)
    triton_image_note: str
    transformers: str  # the release's own pin (its wheel's Requires-Dist)
    torch: str
    serve_flag: str  # trtllm-serve's option for the YAML of extra LLM() arguments
    decoding_types: Mapping[str, str]  # spec kind -> decoding_type
    draft_field: str  # the key naming the draft model folder
    base_fields: frozenset[str]  # DecodingBaseConfig
    own_fields: Mapping[str, frozenset[str]]  # decoding_type -> its class's own fields
    engine_flow: str  # "yes" | "deprecated" (still builds) | "removed"
    dynamic_tree: bool  # EAGLE-3 dynamic tree in the PyTorch backend
    static_tree: str  # eagle_choices: "discouraged" | "deprecated" | "removed"
    fp8_kv_eagle3: bool  # one-model EAGLE-3 on an FP8 KV cache with a bf16 drafter (PR #8910)
    knobs: frozenset[str]  # speculation controls at scale this project writes for the release
    sources: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        return f"{self.line[0]}.{self.line[1]}"

    @property
    def dflash(self) -> bool:
        return "dflash" in self.decoding_types

    @property
    def serve_image(self) -> str:
        return SERVE_IMAGE.format(version=self.version)

    def fields(self, decoding_type: str) -> frozenset[str]:
        """The keys a speculative_config of that type may carry in this release (extra keys are refused)."""
        return self.base_fields | self.own_fields.get(decoding_type, frozenset())

    def as_dict(self) -> dict[str, object]:
        """What gpu_routes.json records, for the GPU host."""
        return {"version": self.version, "line": self.name, "triton_image": self.triton_image,
                "triton_image_note": self.triton_image_note, "serve_image": self.serve_image,
                "serve_flag": self.serve_flag, "transformers": self.transformers, "torch": self.torch,
                "engine_flow": self.engine_flow}


_COMPAT = "triton-inference-server/server docs/introduction/compatibility.md @ e1db8a603d863b1317ee859bdeea2be19959462e"
_WHEEL = "the release's wheel metadata (PyPI tensorrt-llm=={v} sdist, PKG-INFO Requires-Dist)"

RELEASES: dict[tuple[int, int], Release] = {
    (1, 1): Release(
        line=(1, 1), version="1.1.0",
        triton_image="nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3",
        triton_image_note="NGC; 25.12, 26.01 and 26.02 carry TensorRT-LLM 1.1.0 (Triton's compatibility matrix)",
        transformers="4.56.0", torch=">=2.9.0a0,<=2.9.0", serve_flag="--extra_llm_api_options",
        decoding_types={"eagle": "Eagle", "draft": "DraftTarget", "ngram": "NGram"},
        draft_field="speculative_model_dir",
        base_fields=frozenset({"max_draft_len", "speculative_model_dir", "max_concurrency", "load_format"}),
        own_fields={"Eagle": _EAGLE_1_1, "NGram": _NGRAM},
        engine_flow="yes", dynamic_tree=False, static_tree="discouraged", fp8_kv_eagle3=False,
        knobs=frozenset({"max_concurrency"}),
        sources=(_COMPAT, _WHEEL.format(v="1.1.0"),
                 "llm_args.py, commands/serve.py, commands/build.py at Ataraksia/TensorRT-LLM @ "
                 "a451bf93888ef588251268516ac6cd4be0a124c5 (upstream main at version 1.1.0rc6, right after the 1.1.0rc5 "
                 "release; the v1.1.0 tag itself could not be read): DecodingBaseConfig.from_dict keys Eagle / DraftTarget "
                 "/ NGram, speculative_model_dir, StrictBaseModel extra='forbid', --extra_llm_api_options only"),
    ),
    (1, 2): Release(
        line=(1, 2), version="1.2.1",
        triton_image="nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3",
        triton_image_note="NGC; 26.04-26.07 carry TensorRT-LLM 1.2.1, 26.03 carries 1.2.0 (Triton's compatibility matrix)",
        transformers="4.57.3", torch=">=2.9.1,<=2.10.0a0", serve_flag="--config",
        decoding_types={"eagle": "Eagle3", "draft": "Draft_Target", "ngram": "NGram"},
        draft_field="speculative_model",
        base_fields=frozenset({"max_draft_len", "max_total_draft_tokens", "speculative_model", "max_concurrency",
                               "draft_len_schedule", "load_format", "acceptance_window", "acceptance_length_threshold",
                               "allow_advanced_sampling"}),
        own_fields={"Eagle3": _EAGLE_1_1 | {"eagle3_model_arch"}, "NGram": _NGRAM},
        engine_flow="deprecated", dynamic_tree=False, static_tree="discouraged", fp8_kv_eagle3=True,
        knobs=frozenset({"max_concurrency"}),
        sources=(_COMPAT, _WHEEL.format(v="1.2.1"),
                 "llm_args.py, a 1.2-era snapshot (search index file 7019226376: after PR #10124 Eagle3 / speculative_model, "
                 "before PR #12905; the v1.2.1 tag itself could not be read)",
                 "triton-inference-server/tutorials Feature_Guide/Speculative_Decoding/TRT-LLM/README.md @ 4fe2b90 "
                 "(NVIDIA's guide for the 1.2.x Triton containers: Eagle3, Draft_Target, speculative_model)",
                 "PR #9104 (Nov 2025): trtllm-serve --config, alias of --extra_llm_api_options; "
                 "PR #8910 (Nov 2025): EAGLE-3 one-model on an FP8 KV cache with a bf16 drafter"),
    ),
    (1, 3): Release(
        line=(1, 3), version="1.3.0rc29",
        triton_image=None,
        triton_image_note=("no NGC Triton image carries 1.3 (the compatibility matrix ends at 26.07 = 1.2.1) and 1.3 "
                           "has no final release: serve with trtllm-serve in the release image, or pass an image you built"),
        transformers="5.5.4", torch=">=2.14.0a0,<=2.14.0", serve_flag="--config",
        decoding_types={"eagle": "Eagle3", "draft": "Draft_Target", "ngram": "NGram", "dflash": "DFlash"},
        draft_field="speculative_model",
        base_fields=_BASE_1_3,
        own_fields={"Eagle3": _EAGLE_1_3, "NGram": _NGRAM, "DFlash": _DFLASH_1_3},
        engine_flow="removed", dynamic_tree=True, static_tree="deprecated", fp8_kv_eagle3=True,
        knobs=frozenset({"max_concurrency", "acceptance_rate_threshold"}),
        sources=(_COMPAT, _WHEEL.format(v="1.3.0rc29") + "; no tensorrt requirement from 1.3.0rc22 (engine flow removed, "
                 "PR #15918)",
                 "nvidia.github.io/TensorRT-LLM/1.3.0rc27/llm-api/reference/{Eagle3,DFlash}DecodingConfig.html "
                 "(acceptance_rate_* from PR #12905; no eagle3_one_model); NGram and Draft_Target fields not re-read "
                 "(carried from 1.2)"),
    ),
    (1, 4): Release(
        line=(1, 4), version="1.4.0rc1",
        triton_image=None,
        triton_image_note="no NGC Triton image carries 1.4 (a pre-release): pass an image you built",
        transformers="5.5.4", torch=">=2.14.0a0,<=2.14.0", serve_flag="--config",
        decoding_types={"eagle": "Eagle3", "draft": "Draft_Target", "ngram": "NGram", "dflash": "DFlash"},
        draft_field="speculative_model",
        base_fields=_BASE_1_3 | {"moe_backend"},
        own_fields={"Eagle3": (_EAGLE_1_3 - {"eagle_choices"}) | {"spec_dec_variant"}, "NGram": _NGRAM,
                    "DFlash": _DFLASH_1_3 | {"spec_dec_variant", "context_recompute_tail", "skip_ctx_buffer_budget_check"}},
        engine_flow="removed", dynamic_tree=True, static_tree="removed", fp8_kv_eagle3=True,
        knobs=frozenset({"max_concurrency", "acceptance_rate_threshold"}),
        sources=(_WHEEL.format(v="1.4.0rc1"),
                 "nvidia.github.io/TensorRT-LLM/1.4.0rc1/llm-api/reference/Eagle3DecodingConfig.html (no eagle_choices: "
                 "PR #18210); two-model speculation removed (PR #18721)"),
    ),
}
DEFAULT_TRTLLM_VERSION = RELEASES[(1, 2)].version  # the newest final release, in NVIDIA's newest Triton image
ENGINE_FLOW_LINES = tuple(line for line, release in RELEASES.items() if release.engine_flow != "removed")


def parse_version(text: str) -> tuple[int, int]:
    """'1.2.0rc6' -> (1, 2)."""
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in str(text).split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def release_for(version: str) -> Release:
    """The entry for a release line this project read; anything else is refused by name."""
    line = parse_version(version)
    if line not in RELEASES:
        lines = ", ".join(f"{r.name} ({r.version})" for r in RELEASES.values())
        raise SpecDeployError(f"TensorRT-LLM {version} was not checked by this project (release lines read: {lines})",
                              hint=f"pass --trtllm-version with one of those lines (default {DEFAULT_TRTLLM_VERSION}); "
                                   "docs/releases.md says what each was read from")
    return RELEASES[line]


def has_engine_flow(version: str) -> bool:
    """trtllm-build and the C++ Triton backend exist in this release (deprecated from 1.2, gone in 1.3)."""
    return release_for(version).engine_flow != "removed"
