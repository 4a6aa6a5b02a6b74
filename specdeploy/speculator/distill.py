"""Self-distillation data: the base model's own greedy answers to ShareGPT prompts, with the
target hidden states the modules train on captured during the same generation.

Capturing hidden states while generating is ModelOpt's "offline" EAGLE training without a second
pass: training never runs the base's decoder layers again, only the small module. The samples
are streamed into shards of bounded size under $SPECDEPLOY_CACHE/spec_data/<key>/ as they are
made (each published atomically, reused by every build of the same base) and training reads them
back from disk (shards.ShardedData), so RAM does not grow with the amount of data. Under
torchrun the shards still to make are split between the ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specdeploy.device import fast_dtype, resolve_device
from specdeploy.fileio import cache_dir, content_fingerprint
from specdeploy.prompts import conversation_ids
from specdeploy.resolve.stage import KEEP_SUFFIXES
from specdeploy.speculator import memory
from specdeploy.speculator.common import chat_prompts, load_base
from specdeploy.speculator.parallel import Parallel
from specdeploy.runtime.types import model_device
from specdeploy.speculator.shards import INFO_FILE, DistillData, ShardedData, save

DATA_VERSION = 5  # 3: prompts encoded as served (one BOS); 4: no train conversation opens with a held-out prompt;
# 5: answers are plain argmax whatever the base's generation_config says (checkpoints.plain_greedy)
MAX_PROMPT_TOKENS = 192
TF_MAX_TOKENS = 384  # teacher-forced conversations are cut to this many tokens
TF_BATCH = 8


def _model_fingerprint(model_dir: Path) -> str:
    """Same content in any folder (cache, build/<name>/base/) -> same data; a fine-tune of the
    same architecture and sizes, another chat template or tokenizer file -> other data: every file
    resolve keeps (content hashes, remembered by size and mtime)."""
    blob = json.dumps(content_fingerprint(model_dir, KEEP_SUFFIXES), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def cache_key(model_dir: Path, settings: dict[str, Any]) -> str:
    blob = json.dumps({**settings, "v": DATA_VERSION}, sort_keys=True).encode()
    return f"{_model_fingerprint(model_dir)}-{hashlib.sha256(blob).hexdigest()[:12]}"  # any folder of the same model


@torch.no_grad()
def _generate_batch(model: Any, batch: list[list[int]], max_new_tokens: int, layers: list[int], eos: set[int], pad: int):
    """Greedy answers for a left-padded batch; yields (tokens, {layer: (n-1, H) bf16 on the CPU}) per sample."""
    width = max(len(b) for b in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    device = model_device(model)
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens, do_sample=False,
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
            hidden[layer] = torch.cat([pre, *dec], dim=0).to(torch.bfloat16).cpu()
        yield tokens, hidden


def generate(
    model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int, layers: list[int], batch_size: int = 16,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS, chat: bool = True, progress: Any = None,
) -> DistillData:
    """Run the base model over prompts (batched, longest first to limit padding); `chat`: through
    the chat template, else raw completions (code)."""
    eos = {t for t in [tokenizer.eos_token_id, *(_as_list(model.generation_config.eos_token_id))] if t is not None}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    from specdeploy.speculator.validate import encode  # the one encoder: answers are generated from what validate feeds

    category = "chat" if chat else "code"
    encoded = sorted((encode(tokenizer, p, category, max_prompt_tokens) for p in prompts), key=len, reverse=True)
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


def read_ids(tokenizer: Any, conversation: list[dict[str, str]], max_tokens: int) -> list[int]:
    """A conversation's first exchange as the base reads it, cut to `max_tokens`."""
    turns = [t for t in conversation[:2] if t["role"] in ("user", "assistant")]
    return conversation_ids(tokenizer, turns)[:max_tokens]


def readable(tokenizer: Any, conversations: list[list[dict[str, str]]], max_tokens: int) -> list[list[int]]:
    """What teacher_forced() reads of `conversations`: their ids, longest first (batches pad little),
    without those too short to train on."""
    encoded = sorted((read_ids(tokenizer, c, max_tokens) for c in conversations), key=len, reverse=True)
    return [e for e in encoded if len(e) > 8]


@torch.no_grad()
def teacher_forced(
    model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]], *, layers: list[int],
    max_tokens: int = TF_MAX_TOKENS, batch_size: int = TF_BATCH, progress: Any = None,
) -> DistillData:
    """ShareGPT answers read (not generated) by the base: one prefill per batch, ~10x more
    positions per CPU second than generating. EAGLE's and DFlash's training targets are still the
    base's own predictions (logit distillation), only the contexts are off-policy; Medusa's heads
    learn the read tokens themselves (hard labels, as ModelOpt's Medusa trains), and on read answers
    many of those are tokens the base would not produce."""
    encoded = readable(tokenizer, conversations, max_tokens)
    tokens, valid, hidden = [], [], {layer: [] for layer in layers}
    started = time.time()
    device = model_device(model)
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start:start + batch_size]
        width = max(len(b) for b in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
        states = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                       logits_to_keep=1).hidden_states
        for row, seq in enumerate(batch):
            tokens.append(torch.tensor(seq))
            valid.append(torch.tensor([True] * (len(seq) - 1) + [False]))
            for layer in layers:
                h = states[layer][row, : len(seq)].to(torch.bfloat16).cpu().clone()
                h[-1] = 0  # like generated samples: the last token has no state
                hidden[layer].append(h)
            if progress is not None:
                progress.update(1)
    info = {"num_samples": len(tokens), "seconds": round(time.time() - started, 1), "layers": layers, "source": "sharegpt"}
    data = DistillData(torch.cat(tokens), torch.cat(valid), {k: torch.cat(v) for k, v in hidden.items()}, info)
    data.info["num_tokens"] = data.num_tokens
    return data


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


SHARD = 64  # prompts per cached shard: a longer run reuses (and resumes after) a shorter one's shards
TF_SHARD = 256


class Job(NamedTuple):
    """One shard to make: generated answers to prompts, or conversations read by the base."""

    folder: Path
    kind: str  # "generate" (chat) | "complete" (code) | "read"
    items: list
    seq: int  # tokens per sample at most


def _shard_size(default: int, tokens_per_sample: int, bytes_per_token: int) -> int:
    """Samples per shard: the default, fewer for a wide model (memory.SHARD_BYTES of hidden
    states at most), so the RAM the distillation needs does not grow with the model either."""
    return max(1, min(default, memory.SHARD_BYTES // max(tokens_per_sample * bytes_per_token, 1)))


def _jobs(root: Path, num_prompts: int, conversations: int, code_prompts: int, gen_seq: int, tf_seq: int,
          per_token: int, batch_size: int) -> list[Job]:
    """The shards of a request. A generated shard's name holds the batch it is made in (left
    padding rounds the states apart; a batch past the shard's size is the shard): after a lower
    --distill-batch the shards made in the old batch are not taken, the read ones (TF_BATCH) are."""
    from specdeploy.data import sharegpt_conversations, stdlib_code_digest, stdlib_code_prompts

    sources = [("shard", "generate", chat_prompts(num_prompts, "train"), SHARD, gen_seq)]
    if code_prompts:  # named by the prompts' digest: another Python's standard library, other shards
        sources.append((f"code-{stdlib_code_digest()}", "complete", stdlib_code_prompts(code_prompts), SHARD, gen_seq))
    if conversations:
        sources.append(("tf-shard", "read", sharegpt_conversations(conversations, "train", seed=1), TF_SHARD, tf_seq))
    jobs = []
    for prefix, kind, items, default, seq in sources:
        size = _shard_size(default, seq, per_token)
        batch = "" if kind == "read" else f"b{min(batch_size, size)}-"
        for i in range(0, len(items), size):
            chunk = items[i:i + size]
            jobs.append(Job(root / f"{prefix}-{batch}{i // size:05d}-{len(chunk)}", kind, chunk, seq))
    return jobs


def distill(
    model_dir: str | os.PathLike, *, num_prompts: int, max_new_tokens: int, layers: list[int],
    batch_size: int = 16, dtype: str | None = None, teacher_forced_samples: int = 0, tf_max_tokens: int = TF_MAX_TOKENS,
    code_prompts: int = 0, device: Any = "auto", trust_remote_code: bool = False, parallel: Parallel | None = None,
) -> ShardedData:
    """Cached training data: the base's answers to the first `num_prompts` training prompts and
    its completions of `code_prompts` standard-library functions (data.stdlib_code_prompts), plus
    `teacher_forced_samples` ShareGPT answers read by the base. Stored in shards that each appear
    atomically, so an interrupted generation resumes at the first missing shard and a larger
    request reuses a smaller one's shards. The memory preflight runs before the base is loaded;
    under torchrun each rank makes its share of the missing shards. The base computes in `dtype`,
    by default the device's fast one (bf16 where native, else float32: device.fast_dtype)."""
    model_dir, device = Path(model_dir), resolve_device(device)
    dtype = dtype or fast_dtype(device)
    parallel = parallel or Parallel(device=device)
    layers = sorted(layers)
    # CPU and GPU kernels round the states apart (a generated shard's name holds its batch: see _jobs)
    settings = {"max_new_tokens": max_new_tokens, "layers": layers, "dtype": dtype, "max_prompt_tokens": MAX_PROMPT_TOKENS,
                "tf_max_tokens": tf_max_tokens, "device_type": device.type}
    root = cache_dir() / "spec_data" / cache_key(model_dir, settings)
    per_token = memory.hidden_bytes_per_token(memory.Arch.read(model_dir), len(layers))
    gen_seq = MAX_PROMPT_TOKENS + max_new_tokens
    jobs = _jobs(root, num_prompts, teacher_forced_samples, code_prompts, gen_seq, tf_max_tokens, per_token, batch_size)
    missing = [job for job in jobs if not (job.folder / INFO_FILE).is_file()]
    # every rank lists the missing shards before any rank publishes one: a rank that listed after
    # another's first shard appeared would split a shorter list, and a shard would go unmade
    parallel.barrier()
    mine = parallel.mine(missing)
    if mine:
        _remove_orphans(mine)
        memory.check_disk(root, sum(len(job.items) * job.seq for job in mine) * per_token)
        largest = max(len(job.items) for job in mine)
        device_map = memory.plan_distillation(
            model_dir, device, batch=min(batch_size, largest), seq=gen_seq, tf_batch=TF_BATCH, tf_seq=tf_max_tokens,
            num_layers_kept=len(layers), shard_samples=largest, world=parallel.world)
        _make(model_dir, mine, dtype=dtype, device=device, device_map=device_map, trust_remote_code=trust_remote_code,
              batch_size=batch_size, max_new_tokens=max_new_tokens, layers=layers, tf_max_tokens=tf_max_tokens)
    parallel.barrier()  # every rank's shards are published
    return ShardedData([job.folder for job in jobs])


def distillation_model(model_dir: Path, dtype: str, *, device: torch.device, device_map: str | None = None,
                       trust_remote_code: bool = False) -> Any:
    """The base as distillation runs it: its answers are the served runtime's, plain argmax."""
    from specdeploy.attention import use_cpu_sdpa
    from specdeploy.checkpoints import plain_greedy

    # padded batches attend with a mask: read grouped K/V in place (the same bits, ~20% less time here)
    return use_cpu_sdpa(plain_greedy(load_base(model_dir, dtype, device=device, device_map=device_map,
                                               trust_remote_code=trust_remote_code)))


def _make(model_dir: Path, jobs: list[Job], *, dtype: str, device: torch.device, device_map: str | None,
          trust_remote_code: bool, batch_size: int, max_new_tokens: int, layers: list[int], tf_max_tokens: int) -> None:
    """Load the base once and write each shard as soon as it is made."""
    from tqdm import tqdm

    from specdeploy.checkpoints import load_tokenizer

    model = distillation_model(model_dir, dtype, device=device, device_map=device_map, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(model_dir)
    bar = tqdm(total=sum(len(job.items) for job in jobs), desc="self-distillation", unit="sample")
    for job in jobs:
        if job.kind in ("generate", "complete"):
            data = generate(model, tokenizer, job.items, max_new_tokens=max_new_tokens, layers=layers,
                            batch_size=batch_size, chat=job.kind == "generate", progress=bar)
        else:
            data = teacher_forced(model, tokenizer, job.items, layers=layers, max_tokens=tf_max_tokens, progress=bar)
        _publish(data, job.folder)
        del data  # freed before the next shard is made: one shard in RAM at a time
    bar.close()


def _temp_shard(final: Path, pid: int) -> Path:
    """Where a process writes a shard before it appears: named by its host and pid (a cache
    shared over the network can have other hosts' runs in it)."""
    return final.with_name(f"{_temp_prefix(final)}{pid}.partial")


def _temp_prefix(final: Path) -> str:
    return f".{final.name}.{socket.gethostname()}-"


def _remove_orphans(jobs: list[Job]) -> None:
    """Temp shards of this host's runs that were killed (their pid is gone): up to a shard's size each."""
    for job in jobs:
        prefix = _temp_prefix(job.folder)
        for tmp in job.folder.parent.glob(f"{prefix}*.partial"):
            pid = tmp.name.removeprefix(prefix).removesuffix(".partial")
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _publish(data: DistillData, final: Path) -> None:
    tmp = _temp_shard(final, os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    save(data, tmp)
    try:
        os.rename(tmp, final)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
