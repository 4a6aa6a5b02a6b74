"""TensorRT-LLM stage: `convert` (checkpoints), `build` (trtllm-build plan/script), `reader`
(checkpoint -> HF layout, the offline check) and `llmapi` (the TRT-LLM >= 1.2 route).

Nothing here imports tensorrt_llm: it cannot be installed on these machines (shared/facts.md).
The formats are written down, with the sources and commits they were read from, in formats.py.
"""
