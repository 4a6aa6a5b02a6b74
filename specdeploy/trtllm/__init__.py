"""TensorRT-LLM stage: `convert` (engine-flow checkpoints and the LLM-API files, per release),
`build` (trtllm-build plan/script), `reader` (checkpoint -> HF layout, the offline check),
`llmapi` (the LLM-API route), `releases` (what each TensorRT-LLM release takes) and
`hostpaths` (GPU-side paths relative to the build).

Nothing here imports tensorrt_llm: it cannot be installed where builds are made. The formats
are written down, with the sources they were read from, in formats.py and releases.py.
"""
