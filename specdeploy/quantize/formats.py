"""The quantization formats the project knows, as plain tables: no torch, no ModelOpt, so the CLI
(`--quant` choices), the loader and the TensorRT-LLM converter can all read them cheaply."""

from __future__ import annotations

# --quant name -> ModelOpt 0.47 config (attribute of modelopt.torch.quantization); none = unquantized
QFORMATS = {
    "fp8": "FP8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int4_awq": "INT4_AWQ_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG",
    "none": None,
}
QUANT_FORMATS: tuple[str, ...] = tuple(QFORMATS)  # the choices of --quant
KV_CACHE = ("fp8", "int8", "none")
# the deployment's weight dtype (quantize --dtype, engine --dtype); float32 only unquantized
DEPLOY_DTYPES = ("bfloat16", "float16", "float32")
BLOCK_QFORMATS = ("int4_awq", "w4a8_awq")
# the block sizes TensorRT-LLM's fine-grained INT4 GEMMs run (ModelOpt packs any divisor):
# cutlass fpA_intB_gemm_template.h (567239f) takes 64 and 128 for W4A16 and only 128 with FP8
# activations (W4A8); on Hopper (fpA_intB_launcher_sm90.inl, 03cff08) a block is a multiple of the
# K tile, 64 for bf16 and 128 for FP8 activations
AWQ_BLOCK_SIZES = {"int4_awq": (64, 128), "w4a8_awq": (128,)}
# TRT-LLM honours exclude_modules for FP8 and weight-only AWQ (quantize_layers); its INT8
# SmoothQuant plugin path quantizes every layer, so mixed precision is refused there.
EXCLUDABLE_QFORMATS = ("fp8", "int4_awq")
EXCLUDED_NAMES = ("lm_head", "output_layer", "embed")  # never quantized by the ModelOpt presets
# TensorRT-LLM runs these Linears as one GEMM (attention.qkv; the fused gate/up MLP), so a layer
# keeps or quantizes each group as a whole.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

FP4_QFORMATS = ("nvfp4",)
