"""The CPU repository's `tensorrt_llm` model (templates/cpu/tensorrt_llm/1/model.py, which Triton's
Python backend loads) does its work here, one job per module:

    requests.py    a request's inputs read and checked with TensorRT-LLM's semantics -> an Entry
    scheduler.py   the scheduler thread over the runtime's InflightBatcher (admit, cancel, step, answer)
    responses.py   response senders, streaming (accepted groups as they come) and output tensors
    metrics.py     TensorRT-LLM's perf outputs and the Triton metrics (speculative-decoding counters)
    stub.py        Triton's triton_python_backend_utils, looked up when used

Only Triton's Python-backend stub provides triton_python_backend_utils: these modules never import
it when they are imported (stub.pb_utils resolves it on use), so they import anywhere, tests included.
"""
