"""The exported quant_algo names the project's quantized-checkpoint reader knows (standard library
only: the quantize stage's format tables and the report read them without importing torch)."""

# What the activations of a quantized Linear are fake-quantized to, per exported quant_algo: the
# formats the project's loader serves (checkpoints.quantized).
ACT_FORMAT = {"FP8": "fp8", "W8A8_SQ_PER_CHANNEL": "int8", "W4A16_AWQ": None, "W4A8_AWQ": "fp8"}
# Exported quant_algos with dynamic FP4 block quantization: ModelOpt runs them only on CUDA and the
# project's loader does not implement them, so only TensorRT-LLM serves them.
FP4_ALGOS = ("NVFP4", "W4A8_NVFP4_FP8", "NVFP4_AWQ")
