"""Draft-model proposer: a smaller model of the same family drafts a chain token by token.

Its KV cache follows the accepted sequence without bookkeeping from the verifier: each round the
cache is cropped to the longest prefix it shares with the current sequence, and only the tokens
after that prefix are fed (the accepted ones, and the target's correction/bonus token).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from specdeploy.errors import SpecDeployError
from specdeploy.runtime.kv_cache import crop
from specdeploy.runtime.sampling import sample, warp
from specdeploy.runtime.types import DraftTree, Proposer, TargetState


class DraftModelProposer(Proposer):
    kind = "chain"

    def __init__(self, draft: PreTrainedModel, vocab_size: int) -> None:
        self.draft = draft
        self.vocab_size = vocab_size  # the target's logits width, which q must match
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.draft.config)
        self.cached: list[int] = []

    def _sync(self, tokens: list[int]) -> list[int]:
        """Crop the cache to its common prefix with `tokens`; the tokens still to feed (>= 1)."""
        common, limit = 0, min(len(self.cached), len(tokens) - 1)
        while common < limit and self.cached[common] == tokens[common]:
            common += 1
        crop(self.cache, common)
        del self.cached[common:]
        return tokens[common:]

    def _logits(self, feed: list[int]) -> torch.Tensor:
        out = self.draft(input_ids=torch.tensor([feed]), past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cached.extend(feed)
        logits = out.logits[0, -1, : self.vocab_size]
        # a draft head narrower than the target's: its missing tokens are never proposed
        return torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))

    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        feed = self._sync(state.tokens[0].tolist())
        drafted: list[int] = []
        probs: list[torch.Tensor] = []
        with torch.inference_mode():
            for _ in range(max_tokens):
                logits = self._logits(feed)
                if state.params.greedy:
                    token = int(logits.argmax())
                else:
                    probs.append(warp(logits, state.params))
                    token = sample(probs[-1], state.generator)
                drafted.append(token)
                feed = [token]
        return DraftTree.chain(torch.tensor(drafted, dtype=torch.long), torch.stack(probs) if probs else None)


def check_tokenizers(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Speculation is only exact when both models mean the same thing by each token id."""
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda item: item[1])
    examples = ", ".join(f"{token!r}={index}" for token, index in differing[:4])
    raise SpecDeployError(
        f"the draft tokenizer ({getattr(draft_tokenizer, 'name_or_path', '?')}, {len(draft_vocab)} tokens) "
        f"does not match the target's ({getattr(target_tokenizer, 'name_or_path', '?')}, {len(target_vocab)} "
        f"tokens): {len(differing)} (token, id) pairs differ, e.g. {examples}",
        hint="use a draft model of the same family that shares the target's tokenizer "
        "(e.g. Qwen2.5-Coder-0.5B for Qwen2.5-Coder-1.5B), or the ngram proposer",
    )


def build(
    target: PreTrainedModel,
    *,
    draft_model: PreTrainedModel | None = None,
    draft_model_dir: str | None = None,
    tokenizer: Any = None,
    draft_tokenizer: Any = None,
) -> DraftModelProposer:
    """From a loaded `draft_model`, or from `draft_model_dir` (loaded in the target's dtype).

    Pass the target's `tokenizer` to have the two tokenizers checked against each other.
    """
    if draft_model is None:
        if draft_model_dir is None:
            raise SpecDeployError("the draft proposer needs a draft model", hint="set draft_model_dir (--draft)")
        from specdeploy.models import load_causal_lm, load_tokenizer

        draft_model = load_causal_lm(draft_model_dir, dtype=str(target.dtype).removeprefix("torch."))
        draft_tokenizer = draft_tokenizer or load_tokenizer(draft_model_dir)
    if tokenizer is not None and draft_tokenizer is not None:
        check_tokenizers(tokenizer, draft_tokenizer)
    return DraftModelProposer(draft_model, vocab_size=target.get_output_embeddings().weight.shape[0])
