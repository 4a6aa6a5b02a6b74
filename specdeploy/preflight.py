"""Memory preflight: before a stage loads a model, compare what it will hold with what the
device(s) and RAM have, and refuse with the options that would make it fit.

Parameter counts come from the safetensors headers (no weights are read), so an 8B or 70B
folder is sized in milliseconds. The estimate is deliberately simple (weights at the load dtype
plus the stage's own working set); it exists to turn an out-of-memory crash an hour into a run
into a clear message before anything is loaded.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import checkpoint_files

if TYPE_CHECKING:
    import torch

GiB = 1 << 30
# Tests (and users who share a host) can pretend a device is smaller than it is.
BUDGET_ENV = "SPECDEPLOY_MEMORY_BUDGET_GIB"


def parameter_count(model_dir: str | os.PathLike) -> int:
    """Number of weight elements in a checkpoint folder's weight files, read from their headers."""
    total = 0
    for file in checkpoint_files(model_dir):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for dim in info["shape"]:
                    count *= dim
                total += count
    return total


def dtype_bytes(dtype: "str | torch.dtype") -> int:
    import torch

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def available_bytes(device: "torch.device", *, all_gpus: bool = False) -> int:
    """Free memory where the tensors will live: the GPU (all visible GPUs for device_map=auto)
    or the host's available RAM. $SPECDEPLOY_MEMORY_BUDGET_GIB caps it."""
    import torch

    if device.type == "cuda":
        indices = range(torch.cuda.device_count()) if all_gpus else [device.index or 0]
        free = sum(torch.cuda.mem_get_info(i)[0] for i in indices)
    else:
        free = _host_available()
    budget = os.environ.get(BUDGET_ENV)
    return min(free, int(float(budget) * GiB)) if budget else free


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass
class MemoryPlan:
    """What a stage will hold on one device, in bytes, by item (for the message)."""

    what: str  # "spec training", "calibration", ...
    items: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.items.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {size / GiB:.1f} GiB" for name, size in self.items.items())
        return f"{self.what} needs ~{self.total / GiB:.1f} GiB ({parts})"


def check(plan: MemoryPlan, device: "torch.device", *, options: list[str], all_gpus: bool = False,
          headroom: float = 0.9) -> None:
    """Refuse (SpecDeployError naming `options`) when `plan` exceeds `headroom` of what is free."""
    free = available_bytes(device, all_gpus=all_gpus)
    if plan.total <= headroom * free:
        return
    where = "all visible GPUs" if all_gpus and device.type == "cuda" else str(device)
    raise SpecDeployError(
        f"{plan.describe()}, but {where} has {free / GiB:.1f} GiB free",
        hint="options: " + "; ".join(options),
    )


def fit(plan: MemoryPlan, device: "torch.device", *, options: list[str], may_spread: bool = True) -> str | None:
    """The device_map to load with: None when `plan` fits `device`; "auto" when it does not fit one
    GPU but fits all visible ones and `may_spread` (accelerate spreads the layers, as ModelOpt's
    hf_ptq.py loads large models); else refuse naming `options`, before anything is loaded."""
    import sys

    import torch

    spread = (may_spread and device.type == "cuda" and torch.cuda.device_count() > 1
              and plan.total > 0.9 * available_bytes(device))
    check(plan, device, options=options, all_gpus=spread)
    if spread:
        print(f"{plan.what}: does not fit {device}; spreading the model over {torch.cuda.device_count()} GPUs "
              "(device_map=auto)", file=sys.stderr)
        return "auto"
    return None


def weights_bytes(model_dir: str | os.PathLike, dtype: "str | torch.dtype") -> int:
    return parameter_count(model_dir) * dtype_bytes(dtype)
