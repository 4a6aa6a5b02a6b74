"""TensorRT-LLM's checkpoint, build and LLM-API formats, written down from NVIDIA's own sources.

Nothing here imports tensorrt_llm (it cannot be installed on these machines, shared/facts.md):
the field sets and names below were read from NVIDIA/TensorRT-LLM and triton-inference-server/
tensorrtllm_backend and are what the converter writes and what the tests check against.

Engine flow (convert_checkpoint -> trtllm-build -> C++ backend), file @ commit read:
- tensorrt_llm/models/modeling_utils.py @ 01ea6d79d454bb3ab10c7510a6f706ba039090c2
  PretrainedConfig.__init__ / to_dict, QuantConfig fields, PretrainedModel.load (a tensor the
  model needs but the rank file lacks is an error; an extra tensor is only a warning),
  fuse_gate_mlp (FP8 fc/gate with different weight scales are requantized with the max).
- tensorrt_llm/models/llama/config.py @ 89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0 (LLaMAConfig)
- tensorrt_llm/models/qwen/config.py @ 0428c18828880e7c60c13cc5cc0794bbbc05c0a3 (QWenConfig)
- tensorrt_llm/models/medusa/config.py @ 084a8843ce92c0d349a90e0d4f8ed1232fe8ddbb (MedusaConfig:
  wraps QWenConfig when 'qwen' is in model_type, else LLaMAConfig)
- tensorrt_llm/models/medusa/model.py (MedusaLayer: x + act(linear(x)), ColumnLinear with
  gather_output; MedusaHead.lm_head ColumnLinear)
- tensorrt_llm/mapping.py (rank = pp_rank * tp_size + tp_rank; pp_layers: contiguous chunks of
  num_layers // pp_size in the 1.0-era code, tensor_split in later code: we require divisibility)
- tensorrt_llm/commands/build.py @ 008b2b8d23af95e4e19fa6f354f9c5f6349b2bfc (trtllm-build flags)
- tensorrt_llm/plugin/plugin.py (use_paged_context_fmha, use_fp8_context_fmha, gemm_plugin)
- The window: trtllm-build is deprecated since PR #11723 (Feb 2026, the 1.2/1.3 lines still build
  engines) and removed for the 1.4 line (PRs #15763, #15907, #15918, #16369, as the issue names
  them; not re-read here); docs/source/legacy/tensorrt-backend-removal.md @
  335107a7646f9682c5e24103b11fc2b3e2c8362f: trtllm-build, convert_checkpoint.py and
  LLM(backend="tensorrt") are gone, HF checkpoints load directly.

LLM API (PyTorch backend: trtllm-serve --config, Triton's `llmapi` model), per release line:
- 1.2: tensorrt_llm/llmapi/llm_args.py, the 1.2-line version (search-index file id 7019226376;
  the index keeps no commit for it; dated by its TensorRT-backend imports and the static-tree
  warning "PLEASE DO NOT USE IT"): Eagle3DecodingConfig(EagleDecodingConfig) with
  decoding_type Literal["Eagle3"], eagle3_layers_to_capture, speculative_model (validation alias
  speculative_model_dir), Draft_Target, NGram; StrictBaseModel (extra keys refused). Dynamic
  trees: fields only; the PyTorch attention backend of that era asserts "currently dynamic tree
  is not supported" (index file id 2450153673). Open 1.2.0rc6 bugs on static trees: #10323, #10343.
- 1.3: the same file, 1.3-line version (index file id 55143598664): static trees warn "deprecated
  and will be removed in release 1.4" (PR #11761), two-model EAGLE-3 deprecated, dynamic tree in
  the PyTorch backend (PRs #12062/#13081, April 2026): use_dynamic_tree, dynamic_tree_max_topK,
  max_total_draft_tokens in [max_draft_len, topK * max_draft_len].
- DFlash: the 1.3-line llm_args.py (index file id 55143598664, ~char 110,000) has
  DFlashDecodingConfig(DecodingBaseConfig): decoding_type Literal["DFlash"], mask_token_id and
  target_layer_ids (both default to the draft folder's dflash_config), max_total_draft_tokens =
  max_draft_len (a chain), supports_backend == "pytorch" only (no engine flow), K + 1 tokens per
  step; the draft comes as speculative_model. The 1.2-line file's SpeculativeConfig union (index
  file id 7019226376, ~char 70,700) ends at PARDDecodingConfig, AutoDecodingConfig: no DFlash, so
  1.2 is refused. 1.4 (main) is taken to keep the 1.3 class (not re-read for DFlash).
  The draft folder is ModelOpt 0.47's DFlash export (modelopt/torch/export/plugins/
  hf_spec_export.py, DFlashExporter: config.json `architectures: [DFlashDraftModel]`, block_size,
  dflash_config {mask_token_id, target_layer_ids}, num_target_layers; model.safetensors), the
  z-lab format that TensorRT-LLM and vLLM (`dflash_config`) read.
- 1.4 (main): llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412 (eagle3_one_model=False is
  ignored, same Eagle3/Draft_Target/NGram fields), then PR #18210 (merged 2026-08-26) removed
  eagle_choices: a config carrying it fails validation.
- docs/source/features/speculative-decoding.md @ 04c8822cc42ffd1f5b6270874e5b9a64a20e7a58:
  chain by default (max_draft_len), the dynamic-tree constraints, disable_overlap_scheduler in
  the DraftTarget and NGram examples, speculative_model_dir as an accepted alias.
- triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @ b35ac1b64368513d215c57d2ed01d62d910df8da:
  `from helpers import ...` (helpers.py must sit beside it), model.yaml read from the model
  folder, LLM(**model.yaml without triton_config): relative paths resolve against the server's
  working directory, so the host-side script writes absolute ones.
- tensorrtllm_backend @ 0b9d7d5a195820d53abadfcf7208d0ccdbfd5332: README's container
  nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3; its Dockerfile installs tensorrt_llm 1.2.1
  and copies triton_backend/all_models to /app/all_models. PyPI's newest tensorrt-llm: 1.2.1.
- EAGLE-3 draft folders: `midlayer.*` is the key form every loader accepts (TRT-LLM's early 1.2
  loaders, vLLM, speculators, SGLang); ModelOpt >= 0.43 writes `layers.0.*` (shared/facts.md,
  read by the session that filed the issue; not re-read here).

Quantized tensor names/dtypes/shapes match what ModelOpt 0.47's own export_tensorrt_llm_checkpoint
writes for the same quantized model (tests compare against it as an oracle).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdeploy.errors import SpecDeployError

# The engine flow (convert -> trtllm-build -> C++ tensorrtllm backend): 0.15 is the first
# release with --kv_cache_type; deprecated from 1.2, removed for the 1.4 line.
ENGINE_FLOW_MIN = (0, 15)
ENGINE_FLOW_DEPRECATED = (1, 2)
ENGINE_FLOW_MAX_EXCLUSIVE = (1, 4)
ENGINE_FLOW_WINDOW = ">=0.15,<1.4 (engine flow; deprecated in 1.2 and 1.3, removed for 1.4)"
# NVIDIA's Triton container with TensorRT-LLM 1.2.1: both routes (trtllm-build still there).
DEFAULT_IMAGE = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"

# PretrainedConfig.__init__ named parameters + what to_dict() adds (modeling_utils.py).
PRETRAINED_CONFIG_FIELDS = frozenset({
    "architecture", "dtype", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "vocab_size", "hidden_act", "logits_dtype", "norm_epsilon", "position_embedding_type",
    "max_position_embeddings", "rotary_embedding_dim", "num_key_value_heads",
    "intermediate_size", "mapping", "quantization", "use_parallel_embedding",
    "embedding_sharding_dim", "head_size", "qk_layernorm",
})
# LLaMAConfig.__init__ named parameters (llama/config.py); tie_word_embeddings is passed by
# LLaMAConfig.from_hugging_face as a kwarg.
LLAMA_CONFIG_FIELDS = frozenset({
    "mlp_bias", "attn_bias", "rotary_base", "rotary_scaling", "residual_mlp",
    "disable_weight_only_quant_plugin", "moe", "remove_duplicated_kv_heads",
    "embedding_multiplier", "attention_multiplier", "residual_multiplier",
    "output_multiplier_scale", "tie_word_embeddings",
})
# QWenConfig.__init__ named parameters + the kwargs QWenConfig.from_hugging_face passes.
QWEN_CONFIG_FIELDS = frozenset({
    "mlp_bias", "attn_bias", "rotary_base", "rotary_scaling", "disable_weight_only_quant_plugin",
    "use_logn_attn", "moe", "num_labels", "seq_length", "qwen_type", "moe_intermediate_size",
    "moe_shared_expert_intermediate_size", "tie_word_embeddings",
})
MEDUSA_FIELDS = frozenset({"num_medusa_heads", "num_medusa_layers", "max_draft_len", "model_type"})
MAPPING_FIELDS = frozenset({"world_size", "tp_size", "pp_size"})
QUANT_CONFIG_FIELDS = frozenset({
    "quant_algo", "kv_cache_quant_algo", "group_size", "smoothquant_val", "clamp_val",
    "use_meta_recipe", "has_zero_point", "pre_quant_scale", "exclude_modules",
})
# QuantAlgo values (quantization/mode.py) this converter writes.
QUANT_ALGOS = frozenset({"FP8", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ"})
KV_CACHE_QUANT_ALGOS = frozenset({"FP8", "INT8"})

# trtllm-build --speculative_decoding_mode choices (commands/build.py).
SPECULATIVE_MODES = ("draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens", "eagle")


# ------------------------------------------------------------------------------ LLM API

# DecodingBaseConfig fields present in every release line read (1.2, 1.3, main); each line
# also has others this project never writes.
DECODING_BASE_FIELDS = frozenset({
    "decoding_type", "max_draft_len", "max_total_draft_tokens", "speculative_model", "max_concurrency",
    "draft_len_schedule", "load_format", "allow_advanced_sampling",
})
EAGLE_FIELDS_MAIN = frozenset({
    "greedy_sampling", "posterior_threshold", "use_dynamic_tree", "dynamic_tree_max_topK", "num_eagle_layers",
    "max_non_leaves_per_layer", "eagle3_one_model", "eagle3_layers_to_capture", "eagle3_model_arch",
})
NGRAM_FIELDS = frozenset({"max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool"})
DFLASH_FIELDS = frozenset({"mask_token_id", "target_layer_ids"})
DECODING_TYPES = {"eagle": "Eagle3", "draft": "Draft_Target", "ngram": "NGram", "dflash": "DFlash"}


@dataclass(frozen=True)
class Release:
    """One TensorRT-LLM release line as read: what its LLM-API configs accept."""

    line: tuple[int, int]
    source: str
    engine_flow: str  # "deprecated" (still builds engines) | "removed"
    dynamic_tree: bool  # EAGLE-3 dynamic tree in the PyTorch backend
    static_tree: str  # eagle_choices: "discouraged" | "deprecated" | "removed"
    eagle_fields: frozenset[str]
    dflash: bool  # DFlashDecodingConfig (PyTorch backend)

    @property
    def name(self) -> str:
        return f"{self.line[0]}.{self.line[1]}"

    def fields(self, decoding_type: str) -> frozenset[str]:
        """The keys a speculative_config of that type may carry in this release."""
        extra = {"Eagle3": self.eagle_fields, "NGram": NGRAM_FIELDS, "DFlash": DFLASH_FIELDS}.get(decoding_type, frozenset())
        return DECODING_BASE_FIELDS | extra


RELEASES = {
    (1, 2): Release((1, 2), "llm_args.py, 1.2-line version (index file id 7019226376)", "deprecated", False,
                    "discouraged", EAGLE_FIELDS_MAIN | {"eagle_choices"}, False),
    (1, 3): Release((1, 3), "llm_args.py, 1.3-line version (index file id 55143598664)", "deprecated", True,
                    "deprecated", EAGLE_FIELDS_MAIN | {"eagle_choices"}, True),
    (1, 4): Release((1, 4), "llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412 + PR #18210", "removed", True,
                    "removed", EAGLE_FIELDS_MAIN, True),
}
DEFAULT_TRTLLM_VERSION = "1.2.1"  # the newest release published (PyPI, NVIDIA's Triton container)


def parse_version(text: str) -> tuple[int, int]:
    """'1.2.0rc6' -> (1, 2)."""
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in str(text).split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def has_engine_flow(version: str) -> bool:
    return ENGINE_FLOW_MIN <= parse_version(version) < ENGINE_FLOW_MAX_EXCLUSIVE


def llmapi_release(version: str) -> Release | None:
    """The release line whose LLM-API configs were read, None below 1.2 (engine flow only)."""
    line = parse_version(version)
    if line < (1, 2):
        return None
    if line not in RELEASES:
        newest = max(RELEASES)
        raise SpecDeployError(
            f"TensorRT-LLM {version} was not checked by this project (release lines read: "
            f"{', '.join(r.name for r in RELEASES.values())})",
            hint=f"pass --trtllm-version {newest[0]}.{newest[1]} (main as read) or an older line, and check its "
                 "llm_args.py against specdeploy/trtllm/formats.py",
        )
    return RELEASES[line]
