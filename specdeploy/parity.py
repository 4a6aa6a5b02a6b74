"""Parity of served text against the Hugging Face reference: exact match, where the first
divergence sits, and whether it sits at a near-tie (small logit margin in the reference).

At greedy, speculative decoding is exact in fp32; at reduced precision a k-token verify rounds
differently from a 1-token step, so a divergence is acceptable only where the reference itself
hesitated between two tokens. The margin at the divergence point is what tells the two apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from specdeploy.runtime.decoding import eos_token_ids

# The near-tie limit where the served numerics cannot be measured (a TensorRT-LLM server) and the
# floor of a measured one: plain bf16 moves a top-2 margin by <= ~0.5 with the forward's shape.
NEAR_TIE = 1.0
PARTIAL = "\ufffd"  # what a decode of a character's first byte tokens ends in
# The ceiling of a measured one: where the reference preferred its token by more (e^1.5 ~ 4.5x the
# runner-up's probability), parting from it is a fault to look at, however far FP8 rounding can move
# a margin at its rarest positions (up to 2-4 logits on the default build)
NEAR_TIE_CAP = 1.5
# Beyond the cap, a divergence passes only when the deployment reproduces the served answer
# in-process and report a. shows it speculation-exact (verify/replay.py), and only up to this
# margin: bf16 with FP8 activations and K/V moves a margin by 2-4 logits at worst (margin_shift).
ROUNDING_CEILING = 4.0


@dataclass
class Reference:
    """Greedy output on the reference model and the logit margin (top1 - top2) at each step."""

    token_ids: list[int]
    text: str
    margins: list[float]


@dataclass
class ParityResult:
    prompt: str
    reference: str
    served: str
    match: bool
    first_divergence_token: int | None  # index into the reference's new tokens
    margin_at_divergence: float | None

    def as_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def hf_reference(model, tokenizer, prompt_ids: torch.Tensor, max_new_tokens: int, guess: str | None = None, *,
                 complete: bool = True, min_tokens: int = 0) -> Reference:
    """The reference: greedy decoding (`generate(do_sample=False)`) on the same weights and dtype.

    Given a guess (the served answer), its tokens are checked in one forward pass, as a verify
    step checks drafts: the reference keeps every guessed token that is the model's own greedy
    choice, takes its own choice where they part, and then generates on (`complete`) or stops
    there (enough to place the divergence). Wherever no position sits at a rounding-level tie,
    this is token for token what generate() returns, for one forward when the guess is right
    instead of one per token. `min_tokens`: TensorRT-LLM's, generate()'s min_new_tokens (no end token
    until the answer has that many).
    """
    eos = eos_token_ids(model)  # what generate() stops at
    tokens: list[int] = []
    margins: list[float] = []
    if guess is not None:
        tokens, margins = _along_guess(model, tokenizer, prompt_ids, guess, max_new_tokens, eos, min_tokens)
    finished = len(tokens) >= max_new_tokens or bool(tokens) and tokens[-1] in eos
    if complete and not finished:
        prefix = torch.cat([prompt_ids, torch.tensor([tokens], dtype=prompt_ids.dtype, device=prompt_ids.device)], dim=1)
        more, more_margins = _generate(model, tokenizer, prefix, max_new_tokens - len(tokens),
                                       min_new_tokens=max(min_tokens - len(tokens), 0))
        tokens, margins = tokens + more, margins + more_margins
    return Reference(tokens, tokenizer.decode(tokens, skip_special_tokens=True), margins)


def _along_guess(model, tokenizer, prompt_ids: torch.Tensor, guess: str, max_new_tokens: int,
                 eos: set[int], min_tokens: int = 0) -> tuple[list[int], list[float]]:
    """Greedy decoding along the guess's text (`greedy_path` on its tokens). The guess is text, and
    a model can write a text in other tokens than the tokenizer would ("a" then "b" where "ab" is one
    token): where the reference's own token still writes the guess's text, the rest of the text is
    tokenized again after it and followed on, so only a choice of other text ends the path."""
    tokens: list[int] = []
    margins: list[float] = []
    while len(tokens) < max_new_tokens:
        written = tokenizer.decode(tokens, skip_special_tokens=True)
        # mid-character (a character written in byte tokens): the model's own next token goes on with it
        midway = written.endswith(PARTIAL)
        guessed = [] if midway else \
            tokenizer(guess[len(written):], add_special_tokens=False)["input_ids"][:max_new_tokens - len(tokens)]
        prefix = torch.cat([prompt_ids, torch.tensor([tokens], dtype=prompt_ids.dtype, device=prompt_ids.device)], dim=1)
        path, path_margins = greedy_path(model, prefix, guessed, eos, held=max(min_tokens - len(tokens), 0))
        tokens, margins = tokens + path, margins + path_margins
        if path[-1] in eos or not midway and len(path) > len(guessed):
            break  # an end token, or past the guess's end
        if not guess.startswith(tokenizer.decode(tokens, skip_special_tokens=True).rstrip(PARTIAL)):
            break  # the reference wrote other text: where the two part
    return tokens[:max_new_tokens], margins[:max_new_tokens]


def _margin(scores: torch.Tensor) -> float:
    top2 = torch.topk(scores.float(), 2).values
    return float(top2[0] - top2[1])


@torch.inference_mode()
def greedy_path(model, prompt_ids: torch.Tensor, guessed: list[int], eos: set[int],
                held: int = 0) -> tuple[list[int], list[float]]:
    """Greedy decoding along a guess, in one forward: the guessed tokens that are the model's
    argmax given the ones before them, then its own next token (where it parts from the guess, or
    after the last); it stops at an EOS, which cannot be chosen at the first `held` positions
    (generate()'s min_new_tokens). With each token's top-2 logit margin."""
    guess_ids = torch.tensor([guessed], dtype=prompt_ids.dtype, device=prompt_ids.device)
    ids = torch.cat([prompt_ids, guess_ids], dim=1)
    logits = model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=len(guessed) + 1).logits[0]
    tokens, margins = [], []
    ends = torch.tensor(sorted(i for i in eos if 0 <= i < logits.shape[-1]), dtype=torch.long, device=logits.device)
    for position, (scores, token) in enumerate(zip(logits, guessed + [None])):
        if position < held:
            scores = scores.index_fill(0, ends, float("-inf"))
        choice = int(scores.argmax())
        tokens.append(choice)
        margins.append(_margin(scores))
        if choice != token or choice in eos:
            break
    return tokens, margins


@torch.inference_mode()
def margin_shift(model, prompt_ids: torch.Tensor, answer: list[int], chunk: int) -> list[float]:
    """How far each answer position's top-2 logit margin moves with the forward's shape: the
    answer in one forward (as the reference checks it) against the same tokens run through the
    cache `chunk` at a time (as a verify round runs them). 0 in an exact dtype; bf16 moves a
    margin by <= ~0.5, bf16 with FP8 activations by 2-4 at worst (an activation one bf16 step
    apart rounds to another FP8 step): a divergence within that is rounding, not the model's choice."""
    from transformers import DynamicCache

    ids = torch.cat([prompt_ids, torch.tensor([answer], dtype=prompt_ids.dtype, device=prompt_ids.device)], dim=1)
    start = prompt_ids.shape[1]
    whole = model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=len(answer) + 1).logits[0]
    cache = DynamicCache(config=model.config)
    steps = [model(ids[:, :start], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0]]
    steps += [model(ids[:, i:i + chunk], past_key_values=cache, use_cache=True).logits[0]
              for i in range(start, ids.shape[1], chunk)]
    pair = whole.float().topk(2, dim=-1).indices  # the one-forward reference's top two at each position

    def margins(logits: torch.Tensor) -> torch.Tensor:
        top = logits.float().gather(1, pair)
        return top[:, 0] - top[:, 1]

    return (margins(whole) - margins(torch.cat(steps))).abs().tolist()


def _generate(model, tokenizer, prefix: torch.Tensor, max_new_tokens: int,
              min_new_tokens: int = 0) -> tuple[list[int], list[float]]:
    out = model.generate(
        prefix,
        attention_mask=torch.ones_like(prefix),
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,  # its scores are then the held-off ones, as greedy_path's margins
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return out.sequences[0, prefix.shape[1]:].tolist(), [_margin(scores[0]) for scores in out.scores]


def compare(prompt: str, reference: Reference, served: str, tokenizer) -> ParityResult:
    """Exact text match; otherwise the first reference token whose text the served output leaves.
    A served output that goes on past the reference's whole text parts where the reference
    stopped: at its first token that adds no text (its EOS), judged by the margin there. Without
    one (the reference stopped where it parted from the served answer, or was cut at
    max_new_tokens), at the first token where the served text, tokenized, parts from the
    reference's: a token the served text holds in a longer one ("\n" in "\n\n") is where they
    chose apart; only where neither parts is there no margin. A character the reference wrote in
    several byte tokens parts as a whole: at its first token, judged by the largest margin among
    its tokens (which of them chose apart the text cannot tell)."""
    if served == reference.text:
        return ParityResult(prompt, reference.text, served, True, None, None)
    ids = reference.token_ids

    def text(n: int) -> str:
        return tokenizer.decode(ids[:n], skip_special_tokens=True)

    # a prefix that ends inside a character (its first byte tokens) decodes to U+FFFD: not yet text
    divergence = next((i for i in range(len(ids)) if not text(i + 1).endswith(PARTIAL)
                       and not served.startswith(text(i + 1))), None)
    if divergence is None:
        divergence = next(n for n in range(len(ids) + 1) if text(n) == reference.text)
        if divergence == len(ids):  # no EOS of its own: the same text tokenized apart ("\n\n" against "\n")
            served_ids = tokenizer(served, add_special_tokens=False)["input_ids"]
            divergence = next((i for i, (a, b) in enumerate(zip(ids, served_ids)) if a != b), divergence)
    first = divergence
    while first > 0 and text(first).endswith(PARTIAL) and not served.startswith(text(first)):
        first -= 1  # the character they part at began earlier: at which of its byte tokens is not known
    margins = reference.margins[first:divergence + 1]
    margin = max(margins) if margins and divergence < len(reference.margins) else None  # the least tie among them
    return ParityResult(prompt, reference.text, served, False, first, margin)


def parity_holds(result: ParityResult, exact: bool, near_tie: float) -> bool:
    """The parity rule: identical, or (outside `exact`) parting where the reference's top-2
    logit margin is <= near_tie."""
    if result.match:
        return True
    if exact or result.margin_at_divergence is None:
        return False
    return result.margin_at_divergence <= near_tie
