"""TensorRT-LLM's engine-flow checkpoint format, written down from NVIDIA's own sources.

Nothing here imports tensorrt_llm (it cannot be installed where builds are made): the field sets and names below were read from NVIDIA/TensorRT-LLM and triton-inference-server/
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
- trtllm-build's flags and the engine-flow window per release: releases.py (docs/releases.md).
- tensorrt_llm/builder.py build() (search index file 205252225, a 1.x snapshot): the groupwise
  weight-only and SmoothQuant GEMM plugins are switched on from the checkpoint's quantization, so
  no build flag names them (trtllm-build's command line has no flag for either).
- EAGLE-3 draft folders: TensorRT-LLM's Eagle3DraftModel (tensorrt_llm/_torch/models/
  modeling_speculative.py, 1.1- and 1.2-era snapshots) holds its decoder layer as `midlayer`
  (`midlayer.<i>` for several) and has no remap from ModelOpt's `layers.0.*`.

The LLM API's schema per release (decoding_type names, the draft field, field sets) is in
releases.py, with its sources.

Quantized tensor names/dtypes/shapes match what ModelOpt 0.47's own export_tensorrt_llm_checkpoint
writes for the same quantized model (tests compare against it as an oracle).
"""

from __future__ import annotations

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

# trtllm-build --speculative_decoding_mode choices (commands/build.py, 1.1 and 1.2).
SPECULATIVE_MODES = ("draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens", "eagle")
