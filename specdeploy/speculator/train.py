"""Train a Medusa, EAGLE or DFlash module (ModelOpt-converted model, base frozen) on cached
self-distillation data; checkpointed (safetensors) and resumable; writes the spec/ contract.

Training runs on the stage's device: the base without its decoder layers (embeddings and lm_head:
all the module needs besides the cached hidden states) in `frozen_dtype(device)` (bf16 on a GPU,
fp32 on the CPU), the module's master weights in fp32, the forward under bf16 autocast where
the device has native bf16 (device.native_bf16), else in fp32. The budget is a number of steps, never wall-clock time, so the same settings make
the same module on another machine. Data-parallel under torchrun (speculator.parallel)."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdeploy.choices import DEFAULT_TREE_10, validate_choices
from specdeploy.device import frozen_dtype, native_bf16, resolve_device
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json
from specdeploy.preflight import dtype_bytes
from specdeploy.checkpoints.modules import DFLASH_EXPORT, EAGLE_EXPORT, MODULE_FILE, SPEC_CONFIG, read_spec_config
from specdeploy.speculator import convert_model, load_module_weights, module_state_dict
from specdeploy.speculator import dflash as dflash_spec
from specdeploy.checkpoints.modules import eagle as eagle_config
from specdeploy.checkpoints.modules import medusa as medusa_config
from specdeploy.speculator import eagle as eagle_spec
from specdeploy.speculator import medusa as medusa_spec
from specdeploy.speculator import memory
from specdeploy.speculator.common import load_checkpoint, load_offline_base, save_checkpoint, save_tensors
from specdeploy.speculator.distill import TF_MAX_TOKENS, distill
from specdeploy.speculator.parallel import Parallel
from specdeploy.speculator.shards import DistillData, ShardedData

Data = DistillData | ShardedData  # in memory (tests) or on disk (the stage): the same interface

AUTOCAST = os.environ.get("SPECDEPLOY_TRAIN_AUTOCAST", "1") == "1"
KINDS = ("medusa", "eagle", "dflash")
MEDUSA_TREE: list[list[int]] = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@dataclass
class TrainSettings:
    """Everything that changes the trained module (the stage's settings)."""

    kind: str = "eagle"
    steps: int = 300
    lr: float = 1e-3
    batch_size: int = 4  # EAGLE: windows per step; Medusa: positions per step = batch_size * window
    window: int = 256
    num_prompts: int = 128
    max_new_tokens: int = 192
    teacher_forced: int = 256  # extra ShareGPT answers read (not generated) by the base
    code_prompts: int = 0  # standard-library functions the base completes (code answers of its own)
    tf_max_tokens: int = TF_MAX_TOKENS  # each read conversation is cut to this many tokens
    # answers generated at once (the CPU presets take 64). On 2 CPU cores, SmolLM2, 64 answers in batches of
    # 16 vs 64: fp32 161 s vs 400 s before grouped-query attention read K/V in place (2026-11-25); since then
    # 132 vs 99 s in bf16 and 147 vs 127 s in fp32 with AVX2 kernels (2026-11-26, docs/measurements.md)
    distill_batch: int = 16
    medusa_heads: int = 3
    medusa_layers: int = 1
    medusa_train_lm_head: bool = False
    eagle_layers: int = 1
    draft_vocab: int = eagle_config.DEFAULT_DRAFT_VOCAB
    ttt_steps: int = 3
    block_size: int = dflash_spec.DEFAULT_BLOCK_SIZE  # DFlash: the pending token + block_size - 1 drafts
    anchors: int = 64  # DFlash: blocks trained per window
    checkpoint_every: int = 50
    seed: int = 0
    choices: list[list[int]] | None = None

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise SpecDeployError(f"unknown spec kind '{self.kind}'", hint=f"use --spec {'|'.join(KINDS)}")
        counts = (self.num_prompts, self.teacher_forced, self.code_prompts)
        if min(counts) < 0 or sum(counts) == 0:
            raise SpecDeployError("no training data: num-prompts, code-prompts and teacher-forced are all 0 (or one is negative)",
                                  hint="e.g. --num-prompts 128 (generated answers) and/or --teacher-forced 256")
        for name in ("steps", "batch_size", "window", "max_new_tokens", "tf_max_tokens", "medusa_heads", "eagle_layers", "ttt_steps",
                     "anchors", "checkpoint_every", "distill_batch", "draft_vocab", "medusa_layers"):
            if getattr(self, name) <= 0:
                raise SpecDeployError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}", hint="pass a positive value")
        if self.block_size < 2 or (self.kind == "dflash" and dflash_spec.crop(self.window, self.block_size) == 0):
            raise SpecDeployError(f"block-size must be >= 2 and <= window, got {self.block_size} (window {self.window})",
                                  hint="a block is the pending token plus at least one draft, e.g. --block-size 4")
        if self.lr <= 0:
            raise SpecDeployError(f"lr must be positive, got {self.lr}", hint="e.g. --lr 1e-3")
        default_choices(self)  # raises a SpecDeployError naming the bad path


# how EAGLE and DFlash read the data: 2, one sample a row, right-padded (rows packed several before)
TRAINER_VERSION = 2


def default_choices(settings: TrainSettings) -> list[list[int]]:
    """The tree recorded in spec_config.json, validated against the module's depth."""
    if settings.kind == "dflash":  # one block: a chain of block_size - 1 drafts
        return validate_choices(settings.choices or [[0] * d for d in range(1, settings.block_size)],
                                max_depth=settings.block_size - 1, name="dflash_choices").to_list()
    if settings.kind == "medusa":
        tree = settings.choices or [p for p in MEDUSA_TREE if len(p) <= settings.medusa_heads]
        name, depth = "medusa_choices", settings.medusa_heads
    else:
        tree, name, depth = settings.choices or DEFAULT_TREE_10, "eagle_choices", None
    return validate_choices(tree, max_depth=depth, name=name).to_list()


def data_layers(num_layers: int) -> list[int]:
    """Hidden states captured once for both kinds: EAGLE-3's three aux layers + the last (normed)."""
    return sorted(set(eagle_config.hidden_layers(num_layers)) | {num_layers})


def _modelopt_config(settings: TrainSettings, base_config: Any, offline: bool) -> dict[str, Any]:
    if settings.kind == "medusa":
        return medusa_config.modelopt_config(settings.medusa_heads, settings.medusa_layers)
    if settings.kind == "dflash":
        return dflash_spec.modelopt_config(base_config, block_size=settings.block_size, anchors=settings.anchors,
                                           offline=offline)
    return eagle_config.modelopt_config(
        base_config, draft_vocab_size=settings.draft_vocab, num_layers=settings.eagle_layers,
        ttt_steps=settings.ttt_steps, offline=offline,
    )


def _batch(data: Data, settings: TrainSettings, gen: torch.Generator, fixed: dict, parallel: Parallel) -> dict:
    """This rank's slice of the step's global batch (drawn from `gen`, the same on every rank),
    on the device. Only the rows a batch needs are read from the hidden-state shards."""
    device = parallel.device
    if settings.kind == "medusa":
        valid_pos = fixed["valid_positions"]
        pick = parallel.split(valid_pos[torch.randint(len(valid_pos), (settings.batch_size * settings.window,), generator=gen)])
        return {"positions": pick.to(device), "h": data.hidden[fixed["last_layer"]][pick].to(device),
                "tokens": fixed["tokens"], "sample_ids": fixed["sample_ids"], "vocab_ids": fixed["vocab_ids"]}
    n = len(data.tokens)
    window = min(settings.window, n)
    if settings.kind == "dflash":
        window = dflash_spec.crop(window, settings.block_size)
    picks = parallel.split(torch.randint(0, n, (settings.batch_size,), generator=gen)).tolist()
    rows = [sample_row(fixed["last"], p, window) for p in picks]
    return {
        "seed": int(torch.randint(2**62, (), generator=gen)) + parallel.rank,  # DFlash's anchors
        "tokens": torch.stack([padded(data.tokens[r], window, 0) for r in rows]).to(device),
        "valid": torch.stack([padded(data.valid[r], window, False) for r in rows]).to(device),
        "attention": torch.stack([padded(torch.ones(r.stop - r.start, dtype=torch.long), window, 0) for r in rows]).to(device),
        "hidden": {k: torch.stack([padded(v[r], window, 0) for r in rows]).to(device) for k, v in data.hidden.items()},
    }


def sample_row(last: torch.Tensor, position: int, window: int) -> slice:
    """The positions a row trains on: `window` of them inside the sample holding `position` (its
    whole sample where that is shorter; `last`: every sample's last position). One sample per row,
    right-padded (padded()), as ModelOpt's EagleOfflineDataCollator makes rows: in a window packing
    several, the draft at a later sample attends to the earlier one, which serving never shows it."""
    k = int(torch.searchsorted(last, position))
    start, end = (int(last[k - 1]) + 1 if k else 0), int(last[k]) + 1
    begin = max(start, min(position, end - window))
    return slice(begin, min(begin + window, end))


def padded(values: torch.Tensor, length: int, fill: Any) -> torch.Tensor:
    """`values` extended to `length` along its first dimension with `fill`."""
    missing = length - values.shape[0]
    return values if missing == 0 else torch.cat([values, values.new_full((missing, *values.shape[1:]), fill)])


def _fixed(data: Data, settings: TrainSettings, extra: dict, num_layers: int, device: torch.device) -> dict:
    """Per-run tensors a step reads: EAGLE's and DFlash's each sample's last position, Medusa's
    tokens and sample ids (16 bytes a position)."""
    if settings.kind != "medusa":
        return {"last": (~data.valid).nonzero().squeeze(1)}
    return {"valid_positions": data.valid.nonzero().squeeze(1), "last_layer": num_layers,
            "tokens": data.tokens.to(device), "sample_ids": medusa_spec.sample_ids(data.valid).to(device),
            "vocab_ids": torch.tensor(extra["draft_vocab_ids"], device=device)}


def _lr(settings: TrainSettings, step: int) -> float:
    """Warmup, then cosine to 10% at the last step."""
    warmup = min(max(1, settings.steps // 20), 20)
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def build_training_model(base_dir: Path, settings: TrainSettings, data: Data, *, device: torch.device,
                         trust_remote_code: bool = False) -> tuple[Any, dict, dict]:
    """The converted model ready to train, the online modelopt config, and extra facts to record."""
    from transformers import AutoConfig

    base_config = AutoConfig.from_pretrained(base_dir, trust_remote_code=trust_remote_code)
    num_layers = base_config.num_hidden_layers
    model = load_offline_base(base_dir, frozen_dtype(device), device=device, trust_remote_code=trust_remote_code)
    config = _modelopt_config(settings, base_config, offline=True)
    convert_model(model, settings.kind, config)
    # ModelOpt gives the module the base's dtype (bf16 on a GPU): train fp32 master weights
    _module(model, settings.kind).float()
    if settings.kind == "dflash":
        online, extra = dflash_spec.online_config(config), {"block_size": settings.block_size}
    elif settings.kind == "medusa":
        medusa_spec.init_module(model)
        online = config
        d2t, coverage = eagle_spec.draft_vocab(data.tokens, data.valid, min(settings.draft_vocab, base_config.vocab_size), base_config.vocab_size)
        ids = (d2t + torch.arange(len(d2t))).tolist()
        extra = {"draft_vocab_ids": ids, "draft_vocab_coverage": round(coverage, 4)}  # what the proposer ranks
    else:
        size = model.eagle_module.config.draft_vocab_size
        d2t, coverage = eagle_spec.draft_vocab(data.tokens, data.valid, size, base_config.vocab_size)
        eagle_spec.init_module(model, d2t if size < base_config.vocab_size else None)
        eagle_spec.use_draft_vocab_logits(model)
        extra = {"draft_vocab_size": size, "draft_vocab_coverage": round(coverage, 4)}
        online = eagle_spec.online_config(config)
    extra["hidden_layers"] = HIDDEN_LAYERS[settings.kind](num_layers)
    return model, online, extra


HIDDEN_LAYERS = {"medusa": medusa_config.hidden_layers, "eagle": eagle_config.hidden_layers, "dflash": dflash_spec.hidden_layers}


def _module(model: Any, kind: str) -> torch.nn.Module:
    return {"medusa": lambda: model.medusa_heads, "eagle": lambda: model.eagle_module, "dflash": lambda: model.dflash_module}[kind]()


def _step(model: Any, settings: TrainSettings, batch: dict, num_layers: int, device: torch.device) -> tuple[torch.Tensor, list[float]]:
    # bf16 matmuls where they are native (AMX/avx512-bf16 on the CPU, tensor cores on a GPU); on an
    # AVX2-only CPU emulated bf16 made a quick-preset EAGLE step ~50 s instead of ~1 s: fp32 there
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=AUTOCAST and native_bf16(device)):
        if settings.kind == "medusa":
            return medusa_spec.training_step(model, batch)
        if settings.kind == "dflash":
            return dflash_spec.training_step(model, batch, num_layers)
        return eagle_spec.training_step(model, batch, num_layers, eagle_config.hidden_layers(num_layers))


@dataclass
class Fitted:
    """A trained module (on its converted model) and what spec_config.json records about it."""

    model: Any
    online_config: dict
    extra: dict
    stats: dict


def fit(base_dir: str | Path, settings: TrainSettings, *, data: Data | None = None, ckpt_dir: str | Path | None = None,
        stop_at: int | None = None, device: Any = "auto", parallel: Parallel | None = None,
        trust_remote_code: bool = False) -> Fitted:
    """Distill (cached) and train; the trained model in memory, nothing written but checkpoints."""
    settings.validate()
    base_dir = Path(base_dir)
    parallel = parallel or Parallel(device=resolve_device(device))
    memory.check_split(settings.batch_size, parallel.world)  # before the distillation, not after it
    device = parallel.device
    num_layers = json.loads((base_dir / "config.json").read_text())["num_hidden_layers"]
    if data is None:
        data = distill(base_dir, num_prompts=settings.num_prompts, max_new_tokens=settings.max_new_tokens,
                       layers=data_layers(num_layers), batch_size=settings.distill_batch,
                       teacher_forced_samples=settings.teacher_forced, tf_max_tokens=settings.tf_max_tokens,
                       code_prompts=settings.code_prompts, device=device, trust_remote_code=trust_remote_code, parallel=parallel)
    memory.check_training(base_dir, settings, device, num_layers_kept=len(data.hidden),
                          frozen_bytes=dtype_bytes(frozen_dtype(device)), world=parallel.world)
    torch.manual_seed(settings.seed)
    model, online_config, extra = build_training_model(base_dir, settings, data, device=device, trust_remote_code=trust_remote_code)
    model.train()
    if settings.kind == "medusa":
        params = medusa_spec.trainable(model, settings.medusa_train_lm_head)
    else:
        params = (dflash_spec if settings.kind == "dflash" else eagle_spec).trainable(model)
    # fused: one kernel updates every parameter (Adam was ~10% of a CPU EAGLE step as a loop of small ops)
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0, fused=True)
    ckpt = Path(ckpt_dir) if ckpt_dir else None
    fixed = _fixed(data, settings, extra, num_layers, device)
    steps, seconds, history = _loop(model, optimizer, params, data, settings, num_layers, ckpt, stop_at, fixed, parallel)
    return Fitted(model, online_config, extra, _stats(history, steps, seconds, data, settings))


def train(base_dir: str | Path, out_dir: str | Path | None, settings: TrainSettings, ckpt_dir: str | Path | None = None,
          data: Data | None = None, stop_at: int | None = None, *, device: Any = "auto", parallel: Parallel | None = None,
          trust_remote_code: bool = False) -> dict[str, Any]:
    """Train and write spec_config.json + module.safetensors (+ eagle3_export/) into out_dir
    (rank 0 only under torchrun: the other ranks pass None).

    stop_at: end this invocation after that many steps (checkpointed), as an interruption would.
    """
    parallel = parallel or Parallel(device=resolve_device(device))
    fitted = fit(base_dir, settings, data=data, ckpt_dir=ckpt_dir, stop_at=stop_at, parallel=parallel,
                 trust_remote_code=trust_remote_code)
    if parallel.is_main:
        _write_spec(fitted, Path(out_dir), settings, Path(base_dir), parallel.device, trust_remote_code)
    parallel.barrier()
    return fitted.stats


def _loop(model: Any, optimizer: Any, params: list, data: Data, settings: TrainSettings, num_layers: int,
          ckpt: Path | None, stop_at: int | None, fixed: dict, parallel: Parallel) -> tuple[int, float, list]:
    """The optimisation steps, resumed from and saved to `ckpt`: (steps done, seconds, history)."""
    from tqdm import tqdm

    start, history, elapsed, stale = _resume(model, optimizer, settings, data, ckpt)
    parallel.barrier()  # every rank has read the checkpoint before rank 0 replaces it
    if stale and parallel.is_main:
        shutil.rmtree(ckpt)  # another configuration: start over
    began = time.time() - elapsed  # seconds span every invocation of a resumed run (a record, not a budget)
    bar = tqdm(range(start, settings.steps), desc=f"train {settings.kind}", unit="step", initial=start, total=settings.steps,
               disable=not parallel.is_main)
    step = start
    for step in bar:
        gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)  # resumable data order
        for group in optimizer.param_groups:
            group["lr"] = _lr(settings, step)
        loss, accs = _step(model, settings, _batch(data, settings, gen, fixed, parallel), num_layers, parallel.device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        parallel.average_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        loss_value, *accs = parallel.average([float(loss.detach()), *accs])
        history.append({"step": step, "loss": round(loss_value, 4), "acc": [round(a, 3) for a in accs]})
        bar.set_postfix(loss=f"{loss_value:.3f}", acc="/".join(f"{a:.2f}" for a in accs))
        stop = stop_at is not None and step + 1 >= stop_at
        if ckpt and parallel.is_main and ((step + 1) % settings.checkpoint_every == 0 or stop):
            _checkpoint(model, optimizer, settings, data, ckpt, step + 1, history, time.time() - began)
        if stop:
            step += 1
            break
    else:
        step = settings.steps
    bar.close()
    return step, time.time() - began, history


def stage_settings(settings: TrainSettings) -> dict[str, Any]:
    """What the spec stage and its checkpoint are keyed on: the settings and how they are trained
    (a module trained by another trainer version is trained again)."""
    return {**asdict(settings), "trainer": TRAINER_VERSION}


def _ckpt_state(settings: TrainSettings, data: Data) -> dict[str, Any]:
    keep = stage_settings(settings)
    # steps stay: the learning-rate schedule follows them, so a longer run resuming a shorter one
    # would make a module no fresh run with its settings makes
    keep.pop("checkpoint_every")
    # and the data: distilled in another dtype (another host's CPU flags) or from other prompts, it is
    # other data under the same settings
    keep["data"] = data.info.get("data_key")
    return keep


def _resume(model: Any, optimizer: Any, settings: TrainSettings, data: Data, ckpt: Path | None) -> tuple[int, list, float, bool]:
    """(first step, history, seconds so far, whether `ckpt` holds another configuration's run)."""
    if ckpt is None or not (ckpt / "state.json").is_file():
        return 0, [], 0.0, False
    if json.loads((ckpt / "state.json").read_text()).get("settings") != json.loads(json.dumps(_ckpt_state(settings, data))):
        return 0, [], 0.0, True
    module, state = load_checkpoint(ckpt, optimizer)
    model.load_state_dict(module, strict=False)
    print(f"resuming {settings.kind} training at step {state['step']} from {ckpt}")
    return int(state["step"]), state["history"], float(state["seconds"]), False


def _checkpoint(model: Any, optimizer: Any, settings: TrainSettings, data: Data, ckpt: Path, step: int, history: list,
                seconds: float) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "state.json").unlink(missing_ok=True)  # incomplete until state.json is back
    state = {"step": step, "history": history, "seconds": seconds, "settings": _ckpt_state(settings, data)}
    save_checkpoint(ckpt, module_state_dict(model, settings.kind), optimizer, state)


def _stats(history: list, steps: int, seconds: float, data: Data, settings: TrainSettings) -> dict[str, Any]:
    def mean(rows: list, key: str) -> float:
        return round(sum(r[key] for r in rows) / max(len(rows), 1), 4)

    head = history[: max(1, min(10, len(history) // 5))]
    tail = history[-max(1, min(10, len(history) // 5)):]
    acc_tail = [round(sum(r["acc"][i] for r in tail) / len(tail), 3) for i in range(len(tail[0]["acc"]))] if tail else []
    return {  # seconds to the ms: the sizing probe times a dozen steps
        "steps": steps, "seconds": round(seconds, 3), "first_loss": mean(head, "loss"), "final_loss": mean(tail, "loss"),
        "final_acc": acc_tail, "lr": settings.lr, "tokens": data.num_tokens,
        "distill": data.info, "settings": asdict(settings),
    }


def _write_spec(fitted: Fitted, out_dir: Path, settings: TrainSettings, base_dir: Path, device: torch.device,
                trust_remote_code: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tensors(out_dir / MODULE_FILE, module_state_dict(fitted.model, settings.kind))
    config = {
        "format_version": 1, "kind": settings.kind, "modelopt_config": fitted.online_config,
        "choices": default_choices(settings), "base_model": str(base_dir), "training": fitted.stats, **fitted.extra,
    }
    atomic_write_json(out_dir / SPEC_CONFIG, config)
    if settings.kind in EXPORTS:
        export_draft(base_dir, out_dir, device=device, trust_remote_code=trust_remote_code)


EXPORTS = {"eagle": EAGLE_EXPORT, "dflash": DFLASH_EXPORT}  # the kinds ModelOpt's HF export covers


def export_draft(base_dir: Path, spec_dir: Path, *, device: Any = "auto", trust_remote_code: bool = False) -> Path:
    """ModelOpt's export_speculative_decoding of the trained EAGLE or DFlash module, from a fresh
    fp32 model. The export copies the module's weights and config only, so the base's decoder
    layers are not loaded (the same files as from the whole base: checked in tests)."""
    from modelopt.torch.export import export_speculative_decoding

    config = read_spec_config(spec_dir)
    kind = config["kind"]
    model = load_offline_base(base_dir, torch.float32, device=resolve_device(device), trust_remote_code=trust_remote_code)
    convert_model(model, kind, {**config["modelopt_config"], f"{kind}_offline": True})
    load_module_weights(model, kind, spec_dir)
    tmp = spec_dir / f".{EXPORTS[kind]}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    export_speculative_decoding(model.eval(), export_dir=str(tmp))
    if kind == "dflash":  # ModelOpt writes the base's num_hidden_layers: 0 on a model without its layers
        exported = json.loads((tmp / "config.json").read_text())
        atomic_write_json(tmp / "config.json", {**exported, "num_target_layers": model.config.num_orig_hidden_layers})
    final = spec_dir / EXPORTS[kind]
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


