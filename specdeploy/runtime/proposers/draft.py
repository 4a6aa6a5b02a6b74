"""Draft-model proposer: a smaller model of the same family drafts a chain token by token.

Its KV cache follows the accepted sequence without bookkeeping from the verifier: each round the
cache is cropped to the longest prefix it shares with the current sequence, and only the tokens
after that prefix are fed (the accepted ones, and the target's correction/bonus token).

A greedy draft does not need its full-vocabulary head: Qwen2.5's 0.5B model spends ~28% of
each drafted token's weights on 151,936 rows. With `head_rows`, greedy drafting takes its top-1
over a restricted vocabulary instead (head.py). The target verifies every drafted token, so the
output is still exactly the target's greedy output; only how often a draft is accepted can change.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from specdeploy.attention import use_cpu_sdpa
from specdeploy.errors import SpecDeployError
from specdeploy.runtime.kv_cache import check_full_attention, crop
from specdeploy.runtime.proposers.head import restricted_head
from specdeploy.runtime.proposers.quant import check_quant, int8_linears
from specdeploy.runtime.sampling import sample, warp
from specdeploy.runtime.types import DraftTree, Proposer, TargetState, model_device


class DraftModelProposer(Proposer):
    kind = "chain"
    per_request = ("head",)  # the restricted head keeps the request's own tokens

    def __init__(
        self, draft: PreTrainedModel, vocab_size: int, head_rows: int | None = None, stop_below: float = 0.0
    ) -> None:
        self.draft = draft
        self.device = model_device(draft)
        self.vocab_size = vocab_size  # the target's logits width, which q must match
        self.head = restricted_head(draft, min(head_rows, vocab_size) if head_rows else None)
        # end the draft after a token the draft itself gives less than this probability
        self.stop_below = stop_below
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.draft.config)
        self.cached: list[int] = []
        if self.head is not None:
            self.head.reset()

    def _sync(self, tokens: list[int]) -> list[int]:
        """Crop the cache to its common prefix with `tokens`; the tokens still to feed (>= 1)."""
        common, limit = 0, min(len(self.cached), len(tokens) - 1)
        while common < limit and self.cached[common] == tokens[common]:
            common += 1
        crop(self.cache, common)
        del self.cached[common:]
        return tokens[common:]

    def _logits(self, feed: list[int]) -> torch.Tensor:
        ids = torch.tensor([feed], device=self.device)
        out = self.draft(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cached.extend(feed)
        logits = out.logits[0, -1, : self.vocab_size]
        # a draft head narrower than the target's: its missing tokens are never proposed
        return torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))

    def _hidden(self, feed: list[int]) -> torch.Tensor:
        """The draft's final state after `feed`, without its head."""
        ids = torch.tensor([feed], device=self.device)
        out = self.draft.get_decoder()(input_ids=ids, past_key_values=self.cache, use_cache=True)
        self.cached.extend(feed)
        return out.last_hidden_state[0, -1]

    def _next(self, feed: list[int], state: TargetState) -> tuple[int, float, torch.Tensor | None]:
        """The next draft token, the draft's probability of it, and q when sampling."""
        if self.head is not None and state.params.greedy:
            token, confidence = self.head.top1(self._hidden(feed)[None])
            return int(token[0]), float(confidence[0]), None
        logits = self._logits(feed)
        if state.params.greedy:
            token = int(logits.argmax())
            return token, float(torch.softmax(logits.float(), dim=-1)[token]) if self.stop_below else 1.0, None
        q = warp(logits, state.params)
        token = sample(q, state.generator)
        return token, float(q[token]), q

    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        feed = self._sync(state.tokens[0].tolist())
        if self.head is not None:
            self.head.see(feed)
        drafted: list[int] = []
        probs: list[torch.Tensor] = []
        with torch.inference_mode():
            for _ in range(max_tokens):
                token, confidence, q = self._next(feed, state)
                drafted.append(token)
                if q is not None:
                    probs.append(q)
                if confidence < self.stop_below:  # HF assisted generation's confidence stop
                    break
                feed = [token]
        tokens = torch.tensor(drafted, dtype=torch.long, device=state.tokens.device)
        return DraftTree.chain(tokens, torch.stack(probs).to(tokens.device) if probs else None)


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
    head_rows: int | None = None,
    stop_below: float = 0.0,
    draft_quant: str | None = None,
) -> DraftModelProposer:
    """From a loaded `draft_model` (moved to the target's device), or from `draft_model_dir`
    (loaded in the target's dtype, on the target's device).

    Pass the target's `tokenizer` to have the two tokenizers checked against each other.
    `head_rows`: greedy drafts take their top-1 over that many common ids plus the request's
    own tokens (None: the full head). `stop_below`: end a round's draft after a token the draft
    gives less probability than that (0: always draft the full length). `draft_quant` "int8":
    the draft runs with dynamic int8 weights (CPU only; quant.py).
    """
    check_quant(draft_quant)
    if not 0 <= stop_below <= 1:
        raise SpecDeployError(f"stop_below {stop_below} is not a probability",
                              hint="e.g. 0.4 (Hugging Face's assistant_confidence_threshold), or 0 to draft the full length")
    device = model_device(target)
    if draft_model is None:
        if draft_model_dir is None:
            raise SpecDeployError("the draft proposer needs a draft model", hint="set draft_model_dir (--draft)")
        from specdeploy.checkpoints import load_causal_lm, load_tokenizer

        draft_model = use_cpu_sdpa(load_causal_lm(draft_model_dir, dtype=str(target.dtype).removeprefix("torch."),
                                                  device=device))
        draft_tokenizer = draft_tokenizer or load_tokenizer(draft_model_dir)
    elif model_device(draft_model) != device:
        draft_model = draft_model.to(device)
    # the draft's cache is cropped to the accepted tokens every round, as the target's
    check_full_attention(draft_model.config, "a draft model", hint="use a draft model with full attention")
    if tokenizer is not None and draft_tokenizer is not None:
        check_tokenizers(tokenizer, draft_tokenizer)
    if draft_quant == "int8":
        draft_model = int8_linears(draft_model, device)
    return DraftModelProposer(draft_model, vocab_size=target.get_output_embeddings().weight.shape[0],
                              head_rows=head_rows, stop_below=stop_below)
