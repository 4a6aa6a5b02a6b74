"""TensorRT-LLM stage: `convert` (engine-flow checkpoints and the LLM-API files, per release),
`build` (trtllm-build plan/script), `reader` (checkpoint -> HF layout, the offline check),
`llmapi` (the TRT-LLM >= 1.2 route) and `hostpaths` (GPU-side paths relative to the build).

Nothing here imports tensorrt_llm: it cannot be installed on these machines (shared/facts.md).
The formats are written down, with the sources and commits they were read from, in formats.py.
"""
