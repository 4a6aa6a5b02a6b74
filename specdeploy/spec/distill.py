"""Self-distillation data: the base model's own greedy answers to ShareGPT prompts, with the
target hidden states the modules train on captured during the same generation.

Capturing hidden states while generating is ModelOpt's "offline" EAGLE training without a second
pass: training never runs the 30-layer base again, only the small module. Cached under
$SPECDEPLOY_CACHE/spec_data/<key>/ (written atomically, reused by every build on the same base).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdeploy.fileio import atomic_write_json
from specdeploy.spec.common import cache_root, chat_prompts, load_base, save_tensors

DATA_VERSION = 1
MAX_PROMPT_TOKENS = 192


@dataclass
class DistillData:
    """Concatenated samples. tokens[i] has hidden[layer][i] (the state after consuming token i)
    for every position except each sample's last token, marked by valid[i] == False."""

    tokens: torch.Tensor  # (N,) int64
    valid: torch.Tensor  # (N,) bool: position has hidden states and a next token in its sample
    hidden: dict[int, torch.Tensor]  # layer (output_hidden_states index) -> (N, H) bfloat16
    info: dict[str, Any]

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())


def _model_fingerprint(model_dir: Path) -> str:
    """Same weights and config in any folder (cache, build/<name>/base/) -> same data."""
    sizes = sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors"))
    blob = json.dumps(sizes).encode() + (model_dir / "config.json").read_bytes()
    return hashlib.sha256(blob).hexdigest()[:12]


def cache_key(model_dir: Path, settings: dict[str, Any]) -> str:
    blob = json.dumps({**settings, "v": DATA_VERSION}, sort_keys=True).encode()
    return f"{_model_fingerprint(model_dir)}-{hashlib.sha256(blob).hexdigest()[:12]}"  # any folder of the same model


def _encode_prompts(tokenizer: Any, prompts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][:max_prompt_tokens]
        text = tokenizer.decode(ids)
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            ids = ids["input_ids"] if isinstance(ids, dict) else list(ids)
        out.append(list(ids))
    return out


@torch.no_grad()
def _generate_batch(model: Any, batch: list[list[int]], max_new_tokens: int, layers: list[int], eos: set[int], pad: int):
    """Greedy answers for a left-padded batch; yields (tokens, {layer: (n-1, H)}) per sample."""
    width = max(len(b) for b in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
        output_hidden_states=True, return_dict_in_generate=True, pad_token_id=pad,
    )
    steps = out.hidden_states  # step 0: prefill (B, width, H) per layer; then (B, 1, H)
    for row, prompt in enumerate(batch):
        answer = out.sequences[row, width:].tolist()
        stop = next((i + 1 for i, t in enumerate(answer) if t in eos), len(answer))
        answer = answer[:stop]
        tokens = prompt + answer
        hidden = {}
        for layer in layers:
            pre = steps[0][layer][row, width - len(prompt):]
            dec = [steps[s][layer][row, -1:] for s in range(1, len(answer))]
            hidden[layer] = torch.cat([pre, *dec], dim=0).to(torch.bfloat16)
        yield tokens, hidden


def generate(
    model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int, layers: list[int], batch_size: int = 32,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS, progress: Any = None,
) -> DistillData:
    """Run the base model over prompts (batched, longest first to limit padding)."""
    eos = {t for t in [tokenizer.eos_token_id, *(_as_list(model.generation_config.eos_token_id))] if t is not None}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    encoded = sorted(_encode_prompts(tokenizer, prompts, max_prompt_tokens), key=len, reverse=True)
    tokens, valid, hidden = [], [], {layer: [] for layer in layers}
    started = time.time()
    for start in range(0, len(encoded), batch_size):
        for seq, states in _generate_batch(model, encoded[start:start + batch_size], max_new_tokens, layers, eos, pad):
            tokens.append(torch.tensor(seq))
            valid.append(torch.tensor([True] * (len(seq) - 1) + [False]))
            for layer in layers:  # pad the last position (it has no state) with zeros
                hidden[layer].append(torch.cat([states[layer], states[layer].new_zeros(1, states[layer].shape[-1])]))
            if progress is not None:
                progress.update(1)
    info = {"num_samples": len(tokens), "seconds": round(time.time() - started, 1), "layers": layers,
            "max_new_tokens": max_new_tokens}
    data = DistillData(torch.cat(tokens), torch.cat(valid), {k: torch.cat(v) for k, v in hidden.items()}, info)
    data.info["num_tokens"] = data.num_tokens
    return data


def _conversation_ids(tokenizer: Any, conversation: list[dict[str, str]], max_tokens: int) -> list[int]:
    turns = [t for t in conversation[:2] if t["role"] in ("user", "assistant")]
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False)
        ids = list(out["input_ids"] if isinstance(out, dict) else out)
    else:
        ids = tokenizer("\n".join(t["content"] for t in turns), add_special_tokens=False)["input_ids"]
    return ids[:max_tokens]


@torch.no_grad()
def teacher_forced(
    model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]], *, layers: list[int],
    max_tokens: int = 384, batch_size: int = 8, progress: Any = None,
) -> DistillData:
    """ShareGPT answers read (not generated) by the base: one prefill per batch, ~10x more
    positions per CPU second than generating. The training targets are still the base's own
    predictions (logit distillation), only the contexts are off-policy."""
    encoded = sorted((_conversation_ids(tokenizer, c, max_tokens) for c in conversations), key=len, reverse=True)
    encoded = [e for e in encoded if len(e) > 8]
    tokens, valid, hidden = [], [], {layer: [] for layer in layers}
    started = time.time()
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start:start + batch_size]
        width = max(len(b) for b in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
        states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1).hidden_states
        for row, seq in enumerate(batch):
            tokens.append(torch.tensor(seq))
            valid.append(torch.tensor([True] * (len(seq) - 1) + [False]))
            for layer in layers:
                h = states[layer][row, : len(seq)].to(torch.bfloat16).clone()
                h[-1] = 0  # like generated samples: the last token has no state
                hidden[layer].append(h)
            if progress is not None:
                progress.update(1)
    info = {"num_samples": len(tokens), "seconds": round(time.time() - started, 1), "layers": layers, "source": "sharegpt"}
    data = DistillData(torch.cat(tokens), torch.cat(valid), {k: torch.cat(v) for k, v in hidden.items()}, info)
    data.info["num_tokens"] = data.num_tokens
    return data


def concat(parts: list[DistillData]) -> DistillData:
    info = {"num_samples": sum(p.info["num_samples"] for p in parts), "seconds": round(sum(p.info["seconds"] for p in parts), 1),
            "num_tokens": sum(p.num_tokens for p in parts), "shards": len(parts)}
    return DistillData(
        torch.cat([p.tokens for p in parts]), torch.cat([p.valid for p in parts]),
        {k: torch.cat([p.hidden[k] for p in parts]) for k in parts[0].hidden}, info,
    )


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def save(data: DistillData, folder: Path) -> None:
    tensors = {"tokens": data.tokens, "valid": data.valid, **{f"hidden.{k}": v for k, v in data.hidden.items()}}
    save_tensors(folder / "data.safetensors", tensors)
    atomic_write_json(folder / "info.json", data.info)


def load(folder: Path) -> DistillData:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "data.safetensors"))
    hidden = {int(k.split(".", 1)[1]): v for k, v in tensors.items() if k.startswith("hidden.")}
    return DistillData(tensors["tokens"], tensors["valid"], hidden, json.loads((folder / "info.json").read_text()))


SHARD = 64  # prompts per cached shard: a longer run reuses (and resumes after) a shorter one's shards
TF_SHARD = 256


def distill(
    model_dir: str | os.PathLike, *, num_prompts: int, max_new_tokens: int, layers: list[int],
    batch_size: int = 32, dtype: str = "bfloat16", teacher_forced_samples: int = 0,
) -> DistillData:
    """Cached training data: the base's answers to the first `num_prompts` training prompts, plus
    `teacher_forced_samples` ShareGPT answers read by the base. Stored in shards that each appear
    atomically, so an interrupted generation resumes at the first missing shard and a larger
    request reuses a smaller one's shards."""
    from tqdm import tqdm

    from specdeploy.data import sharegpt_conversations
    from specdeploy.models import load_tokenizer

    model_dir = Path(model_dir)
    settings = {"max_new_tokens": max_new_tokens, "layers": sorted(layers), "dtype": dtype, "max_prompt_tokens": MAX_PROMPT_TOKENS}
    root = cache_root() / "spec_data" / cache_key(model_dir, settings)
    jobs = []  # (folder, kind, items)
    prompts = chat_prompts(num_prompts, "train")
    for i in range(0, len(prompts), SHARD):
        jobs.append((root / f"shard-{i // SHARD:05d}-{len(prompts[i:i + SHARD])}", "generate", prompts[i:i + SHARD]))
    if teacher_forced_samples:
        convs = sharegpt_conversations(teacher_forced_samples, "train", seed=1)
        for i in range(0, len(convs), TF_SHARD):
            jobs.append((root / f"tf-shard-{i // TF_SHARD:05d}-{len(convs[i:i + TF_SHARD])}", "read", convs[i:i + TF_SHARD]))
    missing = [job for job in jobs if not (job[0] / "info.json").is_file()]
    if missing:
        model, tokenizer = load_base(model_dir, dtype), load_tokenizer(model_dir)
        bar = tqdm(total=sum(len(job[2]) for job in missing), desc="self-distillation", unit="sample")
        for folder, kind, items in missing:
            if kind == "generate":
                data = generate(model, tokenizer, items, max_new_tokens=max_new_tokens, layers=sorted(layers),
                                batch_size=batch_size, progress=bar)
            else:
                data = teacher_forced(model, tokenizer, items, layers=sorted(layers), progress=bar)
            _publish(data, folder)
        bar.close()
    return concat([load(job[0]) for job in jobs])


def _publish(data: DistillData, final: Path) -> None:
    tmp = final.with_name(f".{final.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    save(data, tmp)
    try:
        os.rename(tmp, final)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
