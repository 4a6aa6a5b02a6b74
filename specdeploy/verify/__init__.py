"""`make verify`: is the served output still the base model's, and is it faster?

Three reports, each with its own rule (the CPU deployment):
a. exactness (the algorithm's proof): the deployment's own weights loaded in float64 in-process,
   speculative vs plain greedy decoding, token for token; 100% identical required (exactness.py).
b. served: tritonserver on the packaged CPU repository (or a running one with --url) is sent
   held-out chat and code prompts through tritonclient (gRPC streaming); every answer is compared
   with the Hugging Face reference, greedy decoding in-process on the very weights and dtype the
   server loaded (for a quantized build, the same fake-quantized model), on --device: the served
   tokens are checked in one forward pass and `generate(do_sample=False)` runs on only from where
   they leave the model's greedy path (parity.hf_reference). An autoregressive twin (same
   repository, speculation off) runs beside it and the two are asked the same prompts in
   alternation, so the speed-up is measured on one noisy machine in one run. Parity is exact where
   the served dtype allows, else by the near-tie rule.
c. fidelity: the served answers against the user's original model (the resolved base checkpoint in
   its own dtype, unquantized): how much quantization and the deployment dtype change the output,
   apart from speculation. Reported, not judged: the user decides what is close enough.

`--server trtllm --url HOST:PORT` checks a TensorRT-LLM deployment instead (what
build_scripts/gpu_host.sh starts): the route's entry model and request inputs come from
triton_repo/gpu_routes.json, the reference runs in float32 on --device, and parity follows the
near-tie rule, because TensorRT-LLM computes in bf16/fp16 (FP8 kernels for FP8 checkpoints) where a
k-token verify and a 1-token step round apart. Reports: reports_gpu/. It runs in two phases,
`--phase served` (the served answers and perf counters to a JSON file; no model loaded) and
`--phase reference` (reads that file, computes the reference; no server needed), so that the
reference can load after the server stopped: TensorRT-LLM takes most of the GPU's free memory for
its KV cache. `--phase all` (default) runs both in one process while the server is still up: fine
where the reference fits beside it (another GPU, --device cpu, a small model).

Writes reports/verify.json, verify.md and two PNG plots; exits 1 when a. is not 100%, when served
parity fails or the acceptance length is under --ar-lower-bound. Served parity is exact (any
difference fails) where the runtime can be exact: float64, or float32 without quantized
activations/KV (see checkpoints.quantized.rounds_activations); elsewhere (bf16, the default serving dtype) a
divergence passes only at a near-tie.

Acceptance length is TensorRT-LLM's (runtime.types.acceptance_length): (accepted draft tokens +
1 per target forward) / target forwards, the prefill not counted, summed over prompts first, from
the server's own counters: the CPU repository's emitted tokens and target forwards (so a draft
accepted but never sent, past a stop, does not count); a TensorRT-LLM server reports neither, so
there its total_accepted_draft_tokens and the answer's tokens counted on its text.
"""
