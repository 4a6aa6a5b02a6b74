"""The one way text becomes a model's prompt ids: distillation, calibration, validation, the
quality report, the planner, bench, verify and the served preprocessing all encode through here,
so the model is measured, trained and served on the same ids.

The served ensemble receives text, so everything is defined on text. A chat turn is rendered
with the tokenizer's chat template, as a chat client sends it. Text is encoded with the
tokenizer's special tokens unless it already starts with the BOS token: a chat template that
writes its own BOS (Llama 2/3) would otherwise get a second one, and a tokenizer that adds a BOS
(Llama) gets it before raw text and before a template that writes none.

Standard library only: the preprocessing model (specdeploy/triton/templates/inflight_batcher_llm/
preprocessing) imports a copy of this file from its own folder, which `specdeploy package` writes
there (triton.templating.SHARED_CODE), because NVIDIA's container runs it without specdeploy installed.
"""

from __future__ import annotations

from typing import Any


def text_ids(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """`text` as the served preprocessing tokenizes it (`add_special_tokens`: its config parameter)."""
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = bool(bos) and text.startswith(bos)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens and not has_bos))


def chat_text(tokenizer: Any, prompt: str) -> str:
    """A user turn as a chat client sends it: in the chat template, ready for the answer; the
    prompt itself when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """A user turn's prompt ids, as served."""
    return text_ids(tokenizer, chat_text(tokenizer, prompt))


def conversation_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation with its answers (training and calibration text), as it would be served:
    in the chat template, or the turns one paragraph each without one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    else:
        text = "\n\n".join(m["content"] for m in messages)
    return text_ids(tokenizer, text)
