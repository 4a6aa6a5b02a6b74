"""Text in, text out: what the Triton python-backend model runs (on the deployment's device).

`load_decoder(deployment.json)` loads the target on the recorded device, its tokenizer and the
proposer the package stage recorded; `Decoder.generate` tokenizes (with the chat template when
asked), decodes with the runtime, and streams text increments that never split a multi-byte
character or leak a stop string.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from specdeploy.device import check_device_spec, resolve_device
from specdeploy.errors import SpecDeployError
from specdeploy.prompts import chat_ids, text_ids
from specdeploy.runtime.batch import InflightBatcher
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.kv_cache import check_full_attention
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import GenerationResult, Proposer, SamplingParams, model_device


def load_model(path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """The target model on `device` and its tokenizer (the one switch point to specdeploy.checkpoints),
    its attention through specdeploy.attention's CPU sdpa (faster on the CPU, the same elsewhere)."""
    from specdeploy.attention import use_cpu_sdpa
    from specdeploy.checkpoints import load_causal_lm, load_tokenizer

    return use_cpu_sdpa(load_causal_lm(path, dtype=dtype, device=str(device))), load_tokenizer(path)


class TextStream:
    """Turns growing token lists into safe text increments.

    A byte-level token can end in the middle of a UTF-8 character (decoded as U+FFFD until the
    rest arrives), and a stop string must not be streamed before it is known to be one, so the
    last len(longest stop string) - 1 characters wait until generation ends.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.stop_strings = stop_strings
        self.holdback = max((len(s) - 1 for s in stop_strings), default=0)
        self.tokens: list[int] = []
        self.sent = 0

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""
        return self._send(text, min(len(cut_at_stop(text, self.stop_strings)), len(text) - self.holdback))

    def finish(self, final_text: str) -> str:
        return self._send(final_text, len(final_text))

    def _send(self, text: str, end: int) -> str:
        piece = text[self.sent : end] if end > self.sent else ""
        self.sent += len(piece)
        return piece


def cut_at_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """The text before the first stop string, which itself is not returned."""
    cuts = [text.find(s) for s in stop_strings if s in text]
    return text[: min(cuts)] if cuts else text


class Decoder:
    """One target, its tokenizer and an optional proposer; one request at a time."""

    def __init__(
        self,
        target: Any,
        tokenizer: Any,
        proposer: Proposer | None = None,
        *,
        draft_len: int | None = None,
        chat_template: bool = False,
        adaptive: bool = True,
        spec_off_above: int | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.draft_len = draft_len
        self.chat_template = chat_template
        self.adaptive = adaptive  # see runtime/adaptive.py
        self.spec_off_above = spec_off_above  # batches larger than this decode plainly (batch.py)

    @property
    def device(self) -> torch.device:
        """Where the runtime computes: the target's device."""
        return model_device(self.target)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def encode(self, prompt: str, chat: bool | None = None) -> list[int]:
        """Token ids of `prompt` as the served preprocessing makes them (specdeploy.prompts),
        wrapped in the chat template when asked and there is one."""
        use_chat = self.chat_template if chat is None else chat
        return chat_ids(self.tokenizer, prompt) if use_chat else text_ids(self.tokenizer, prompt)

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams,
                     on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """The deployment's generation at the token level (the Triton model's entry: the ensemble
        has already tokenized); `on_tokens` gets each accepted group."""
        return generate(self.target, prompt_ids, params, self.proposer, on_tokens=on_tokens,
                        draft_len=self.draft_len, decode=self.decode, adaptive=self.adaptive)

    def batcher(self, max_batch_size: int = 8, spec_off_above: int | None = None) -> InflightBatcher:
        """An in-flight batcher over this deployment (each sequence gets a fork of the proposer);
        `spec_off_above` None takes the deployment's."""
        return InflightBatcher(
            self.target,
            self.proposer.fork if self.proposer is not None else None,
            draft_len=self.draft_len,
            max_batch_size=max_batch_size,
            spec_off_above=self.spec_off_above if spec_off_above is None else spec_off_above,
            decode=self.decode,
            adaptive=self.adaptive,
        )

    def generate(
        self,
        prompt: str,
        params: SamplingParams,
        on_text: Callable[[str], None] | None = None,
        *,
        chat: bool | None = None,
    ) -> tuple[str, GenerationResult]:
        """The generated text (stop string excluded) and the runtime's result."""
        stream = TextStream(self.decode, params.stop_strings)

        def on_tokens(tokens: list[int]) -> None:
            piece = stream.push(tokens)
            if piece:
                on_text(piece)

        result = self.generate_ids(self.encode(prompt, chat), params, on_tokens if on_text else None)
        text = cut_at_stop(self.decode(result.token_ids), params.stop_strings)
        if on_text:
            rest = stream.finish(text)
            if rest:
                on_text(rest)
        return text, result


# how a draft model drafts (proposers/draft.py): the options bench's --draft-option takes
DRAFT_OPTIONS = ("head_rows", "stop_below", "draft_quant")
# spec keys the Decoder reads itself; every other one (null: the default) is an option of the proposer
DECODER_KEYS = ("kind", "path", "adaptive")


def _local_path(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def make_proposer(spec: dict[str, Any], target: Any, tokenizer: Any, base: Path = Path(".")) -> Proposer | None:
    """The proposer a deployment spec asks for (None for kind "none"); paths relative to `base`.
    Every spec key but the Decoder's own goes to the proposer's factory, which refuses one it
    does not take (a misspelled key)."""
    kind = spec.get("kind") or "none"
    if kind == "none":
        return None
    check_full_attention(target.config, "speculative decoding",
                         hint="decode it plainly (`specdeploy generate --spec none`), or serve it with TensorRT-LLM on a GPU host")
    options = {key: value for key, value in spec.items() if key not in DECODER_KEYS and value is not None}
    if kind == "draft":
        if not spec.get("draft_model_dir"):
            raise SpecDeployError("spec kind 'draft' needs spec.draft_model_dir", hint="re-run the package stage")
        options.update(draft_model_dir=str(_local_path(base, spec["draft_model_dir"])), tokenizer=tokenizer)
    elif kind != "ngram":
        if not spec.get("path"):
            raise SpecDeployError(f"spec kind {kind!r} needs spec.path (the trained module)",
                                  hint="re-run the package stage")
        options["spec_dir"] = str(_local_path(base, spec["path"]))
    return build_proposer(kind, target, **options)


def deployment_device(config: dict[str, Any], path: Path, override: str | torch.device | None = None) -> torch.device:
    """The device a deployment runs on: `override` (a Triton GPU instance, --device), else its
    "device" field (auto | cpu | cuda | cuda:N); builds packaged before the field run on the CPU."""
    spec = override if override is not None else config.get("device", "cpu")
    if isinstance(spec, torch.device):
        return spec
    try:
        check_device_spec(str(spec))
    except argparse.ArgumentTypeError as err:
        raise SpecDeployError(f"{path}: device {spec!r} is not a device",
                              hint="use auto, cpu, cuda or cuda:N (re-run `specdeploy package --device ...`)") from err
    return resolve_device(str(spec))


def spec_off_above(config: dict[str, Any], path: Path) -> int | None:
    """deployment.json's optional "spec_off_above": in-flight batches with more active requests
    than that decode plainly (batch.py); absent: always speculate."""
    value = config.get("spec_off_above")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise SpecDeployError(f"{path}: spec_off_above must be a non-negative integer, got {value!r}",
                              hint="omit it to always speculate, or give a batch size such as 4")
    return value


def load_decoder(path: str | Path, device: str | torch.device | None = None, dtype: str | None = None) -> Decoder:
    """A Decoder from deployment.json: {"model_dir", "dtype", "device", "spec_off_above",
    "spec": {"kind", "adaptive", ...}}.

    Relative paths are relative to the folder holding the file. `device` and `dtype` override the
    file's (verify's float64 exactness check loads the same deployment in float64).
    `adaptive` false (the default) speculates every step with the full draft, as TensorRT-LLM does.
    """
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SpecDeployError(f"cannot read {path}: {err}", hint="run `specdeploy package` to write it") from err
    if "model_dir" not in config:
        raise SpecDeployError(f"{path} has no model_dir", hint="re-run `specdeploy package`")
    off_above = spec_off_above(config, path)
    where = deployment_device(config, path, device)
    dtype = dtype or config.get("dtype", "float32")
    if dtype == "float64" and where.type == "cuda":
        # the package stage chose it to prove exact parity; allowed, but it is not a serving dtype
        print(f"specdeploy runtime: {path} serves in float64 on {where}: exact, but 4x the memory of bfloat16 "
              "and far slower on a GPU (`package --dtype bfloat16`, `engine --serve-dtype bfloat16`)", file=sys.stderr)
    target, tokenizer = load_model(_local_path(path.parent, config["model_dir"]), dtype, where)
    spec = config.get("spec") or {}
    return Decoder(
        target,
        tokenizer,
        make_proposer(spec, target, tokenizer, path.parent),
        draft_len=spec.get("max_draft_len"),
        chat_template=bool(config.get("chat_template", False)),
        adaptive=bool(spec.get("adaptive", False)),
        spec_off_above=off_above,
    )
