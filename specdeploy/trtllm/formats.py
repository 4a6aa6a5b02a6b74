"""TensorRT-LLM's checkpoint and build formats, written down from its own sources.

Nothing here imports tensorrt_llm (it cannot be installed on these machines, shared/facts.md):
the field sets and names below were read from NVIDIA/TensorRT-LLM and are what the converter
writes and what the tests check against. Sources (file @ commit read):

- tensorrt_llm/models/modeling_utils.py @ 01ea6d79d454bb3ab10c7510a6f706ba039090c2
  PretrainedConfig.__init__ / to_dict, QuantConfig fields, PretrainedModel.load (a tensor the
  model needs but the rank file lacks is an error; an extra tensor is only a warning),
  DecoderModelForCausalLM.forward (EAGLE reads the post-ln_f hidden states), fuse_gate_mlp
  (FP8 fc/gate with different weight scales are requantized with the max at build time).
- tensorrt_llm/models/llama/config.py @ 89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0 (LLaMAConfig)
- tensorrt_llm/models/llama/model.py @ 2340c776201e4dba9aa625b8615e3e6ca9d7a7f6 (LLaMAModel:
  fc_after_embed -> fc(concat([embedding, hidden])) with bias; first layer without
  input_layernorm when use_input_layernorm_in_first_layer is False)
- tensorrt_llm/models/qwen/config.py @ 0428c18828880e7c60c13cc5cc0794bbbc05c0a3 (QWenConfig)
- tensorrt_llm/models/medusa/config.py @ 084a8843ce92c0d349a90e0d4f8ed1232fe8ddbb (MedusaConfig:
  wraps QWenConfig when 'qwen' is in model_type, else LLaMAConfig)
- tensorrt_llm/models/medusa/model.py (MedusaLayer: x + act(linear(x)), ColumnLinear with
  gather_output; MedusaHead.lm_head ColumnLinear)
- tensorrt_llm/models/eagle/config.py @ 0382a8acaeebec1662d4c49db7eabf1c7945a4c2 (EagleConfig)
- tensorrt_llm/models/eagle/model.py @ 89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0 (EagleNet =
  LLaMAModel 'drafter' + lm_head; EagleForCausalLM hard-codes fc_after_embed=True,
  use_input_layernorm_in_first_layer=False, use_last_layernorm=False, eagle net mapping
  tp_size=world_size, pp_size=1; ModelOpt single-checkpoint key map eagle_nets.{i}.drafter.* ->
  eagle_module.*, vocab_embedding -> model.embed_tokens, lm_head -> lm_head)
- tensorrt_llm/models/eagle/weight.py @ 535c9cc6730f5ac999e4b1cb621402b58138f819 and
  examples/eagle/convert_checkpoint.py @ 04a2cacbfd3b9ac76191bd8498ad871607b63a04 (llama weight
  names, TP split rules, eagle_nets.{i}.drafter.fc / lm_head duplicated per EAGLE layer)
- tensorrt_llm/mapping.py (rank = pp_rank * tp_size + tp_rank; pp_layers: contiguous chunks of
  num_layers // pp_size in the 1.0-era code, tensor_split in later code: we require divisibility)
- tensorrt_llm/commands/build.py @ 008b2b8d23af95e4e19fa6f354f9c5f6349b2bfc (trtllm-build flags)
- tensorrt_llm/plugin/plugin.py (use_paged_context_fmha, use_fp8_context_fmha, gemm_plugin)

Quantized tensor names/dtypes/shapes match what ModelOpt 0.47's own export_tensorrt_llm_checkpoint
writes for the same quantized model (tests compare against it as an oracle).
"""

from __future__ import annotations

# The engine flow (convert -> trtllm-build -> C++ tensorrtllm backend) exists up to 1.1.x; later
# releases removed trtllm-build (shared/facts.md). 0.15 is the first release with the EAGLE
# engine flow and --kv_cache_type.
ENGINE_FLOW_MIN = (0, 15)
ENGINE_FLOW_MAX_EXCLUSIVE = (1, 2)
ENGINE_FLOW_WINDOW = ">=0.15,<1.2 (engine flow; 1.2+ is the LLM-API / PyTorch route)"

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
EAGLE_FIELDS = frozenset({"num_eagle_layers", "max_draft_len", "max_non_leaves_per_layer", "eagle_net_config"})
# EagleConfig.from_hugging_face's eagle_net_config dict keys (eagle/config.py).
EAGLE_NET_FIELDS = frozenset({
    "architecture", "dtype", "logits_dtype", "num_hidden_layers", "num_attention_heads",
    "hidden_size", "intermediate_size", "num_key_value_heads", "vocab_size",
    "position_embedding_type", "max_position_embeddings", "hidden_act", "rotary_base",
    "rotary_scaling", "norm_epsilon", "quantization", "mapping", "use_parallel_embedding",
    "embedding_sharding_dim", "head_dim", "head_size",
})
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
MAX_EAGLE_DRAFT_LEN = 256  # examples/eagle/convert_checkpoint.py asserts max_draft_len <= 256
