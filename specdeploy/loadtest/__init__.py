"""`make loadtest`: a serving benchmark, as `vllm bench serve` and GenAI-Perf run one, of the
speculative deployment against its autoregressive twin (the same repository, speculation off).

For each concurrency level (default 1, 2, 4, 8) both arms get the same greedy requests, streamed
through tritonclient (gRPC), in passes (default 2) whose arm order alternates, ABBA within a level,
so that machine noise and drift hit both arms alike; a level's figures pool its passes. At most
`concurrency` requests are in flight: all sent at once (closed loop), or at Poisson arrival times
with --request-rate (open loop; a request that arrives while every slot is busy waits for one, as
`vllm bench serve --max-concurrency` does). A pass sends at least 3 requests per client, and the
prompts ask for different lengths (--length-spread around --max-tokens), so that the closed loop
reaches a steady state past its cold start (each client's first request, all at once into an empty
server), which the steady TTFT leaves out. Per arm and level: output
tokens/s, requests/s, TTFT / TPOT / ITL percentiles (DEFINITIONS), acceptance length, errors; then
the speed-up curve (speculative tokens/s over autoregressive tokens/s) and the break-even
concurrency, the first level where speculation stops paying. Writes loadtest/loadtest.json and
loadtest.png in the build.

--control sweeps again with a second copy of the twin in the speculative arm's place (A/A, the
same passes and order): how far apart two identical deployments land in a pass on this host. A
speculative pass above that floor is within the host's noise (on a shared 2-core VM, 10-24%).

Correctness: every output is compared with the same prompt's solo output (concurrency 1) of the
autoregressive arm (of the only arm, with --url alone). Where the deployment's dtype makes greedy
parity exact (verify.summary.parity_rule: float64, or float32 without quantized activations/KV) any
difference fails the run. Elsewhere a batch of another shape may round a near-tie the other way,
and only the reference's logit margins tell that from a bug: every output that differs from its
solo run, and that solo output, is checked against the Hugging Face reference on the served
weights (verify's near-tie rule, one forward per distinct output, after the servers stop), and
one that leaves the reference's greedy path where its top-2 margin exceeds the near-tie limit
(measured on the served model as verify measures it, or --near-tie) fails the run. Errors always fail.
"""
