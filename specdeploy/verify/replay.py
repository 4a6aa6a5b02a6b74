"""A served divergence the near-tie limit does not cover, put to the deployment itself.

On an FP8 build served in bf16 a verify round and a plain step round an activation or a K/V entry
to different FP8 steps, and the shift compounds along the answer: on the default build the logits
of a speculative round and of a plain step at the same position, after the same tokens, differ by
up to 1-3 over the vocabulary, so a divergence now and then lands where the reference preferred its
token by more than the near-tie limit. `reproduces` tells that rounding from a serving fault: the
deployment, loaded in-process in its served dtype, decodes the prompt as the server did (alone in
its in-flight batch); an answer it reproduces text for text is the deployment's own computation,
and report a. (float64, the same prompt) shows that computation is speculation-exact. A served
answer it does not reproduce (the server, its batching or its text handling changed something) is
still a failure, as is any divergence beyond parity.ROUNDING_CEILING.
"""

from __future__ import annotations

from pathlib import Path

from specdeploy.exactness import decode_together
from specdeploy.runtime.types import SamplingParams


def reproduces(deployment: Path, prompts: list[list[int]], served: list[str], max_new_tokens: int,
               device: str | None = None) -> list[bool]:
    """For each prompt (token ids, as served), whether the deployment decodes `served` in-process."""
    from specdeploy.runtime.deployment import load_decoder

    decoder = load_decoder(deployment, device=device)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    answers = []
    for ids in prompts:  # one at a time, as verify sent them
        (result,) = decode_together(decoder.batcher(), [ids], params, "replaying a served answer in-process")
        answers.append(decoder.decode(result.token_ids))
    return [answer == text for answer, text in zip(answers, served)]
