"""Stage `quantize`: ModelOpt post-training quantization of the base model (and optionally of the
Medusa/EAGLE module), exported as a unified HF checkpoint the specdeploy runtime serves and the
TensorRT-LLM convert stage reads.

Layout of build/<name>/quantized/ (read by specdeploy.trtllm.convert and by load_causal_lm):

    config.json              HF config with `quantization_config` (quant_method "modelopt")
    hf_quant_config.json     {"producer": {"name": "modelopt", "version"},
                              "quantization": {"quant_algo": FP8 | W8A8_SQ_PER_CHANNEL | W4A16_AWQ |
                                               W4A8_AWQ | NVFP4 | null,
                                               "kv_cache_quant_algo": FP8 | INT8 | null,
                                               "group_size", "has_zero_point", "pre_quant_scale",
                                               "exclude_modules": ["lm_head", "model.embed_tokens",
                                                                   + what --exclude kept]}}
    model.safetensors        ModelOpt's export: per quantized Linear `<m>.weight` (float8_e4m3fn,
                             int8, or uint8 = two int4 packed along the output dim), `<m>.weight_scale`
                             (per tensor / per row / per (row, block)), `<m>.weight_scale_2` (W4A8),
                             `<m>.input_scale` (static activation scale), `<m>.pre_quant_scale`
                             (SmoothQuant / AWQ smoothing not fused into a norm), and
                             `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale` (KV cache).
                             Other weights in the export dtype (--dtype, bf16 by default).
    generation_config.json, tokenizer files, chat template (copied from base/)
    specdeploy_quant.json    the settings, ModelOpt config and calibration summary of this run
    quantize.json, quantize.md   the quality report (report.py)
    spec/                    only with --quantize-spec: spec_config.json (+ "quantization") and
                             module.safetensors with the module's quantized linears in the same
                             naming as above (<m>.weight fp8, <m>.weight_scale, <m>.input_scale)

The checkpoint is served (runtime, Triton model, verify, bench) by checkpoints.quantized, with the
numerics it was calibrated with, on any device: see that module.

One job per module; the runtime imports only the first two:
    formats.py      the format tables (no torch: the CLI's --quant choices)
    loader.py       load_quantized / parity_dtype: the checkpoint's numerics, no ModelOpt
    config.py       the ModelOpt config of a format, --exclude, block-size checks
    calibrate.py    calibration data and ModelOpt PTQ (forward loops on the model's device)
    export.py       the base going in, ModelOpt's unified HF export coming out
    placement.py    memory preflight; device_map="auto" when one GPU is too small
    spec_module.py  --quantize-spec: FP8 PTQ of the Medusa/EAGLE module
    report.py       the quality report
    stage.py        the stage (run) and its command line (add_arguments, main)
"""

from __future__ import annotations

from typing import Any

_STAGE_NAMES = ("run", "add_arguments", "main", "STAGE", "OUT")


def __getattr__(name: str) -> Any:
    """`specdeploy.quantize.run` / `.add_arguments` / `.main` (the CLI module path): loaded on first
    use, so importing the loader or the format tables never loads the stage, torch or ModelOpt."""
    if name in _STAGE_NAMES:
        from specdeploy.quantize import stage

        return getattr(stage, name)
    raise AttributeError(f"module 'specdeploy.quantize' has no attribute '{name}'")
