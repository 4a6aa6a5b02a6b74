"""Self-distillation data on disk, read back without holding it in RAM.

A shard is a folder with `data.safetensors` (tokens (n,) int64, valid (n,) bool, hidden.<layer>
(n, H) bfloat16) and `info.json`; the distillation writes one shard at a time (a bounded number
of samples), so generating 2N samples holds no more than generating N.

Training reads them through `ShardedData`: the tokens and valid flags of every shard stay in RAM
(9 bytes a position), hidden-state rows are read from the files when a batch needs them, with
`pread` rather than mmap, so the pages read are the kernel's page cache and not the process's
RSS: RAM stays flat as the data grows (ModelOpt's offline mode keeps its hidden states on disk
for the same reason).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdeploy.fileio import atomic_write_json

DATA_FILE = "data.safetensors"
INFO_FILE = "info.json"
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64, "BOOL": torch.bool}


@dataclass
class DistillData:
    """Samples in memory (one shard while it is made, or a whole data set in tests). tokens[i]
    has hidden[layer][i] (the state after consuming token i) for every position except each
    sample's last token, marked by valid[i] == False."""

    tokens: torch.Tensor  # (N,) int64
    valid: torch.Tensor  # (N,) bool: position has hidden states and a next token in its sample
    hidden: dict[int, torch.Tensor]  # layer (output_hidden_states index) -> (N, H) bfloat16
    info: dict[str, Any]

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())


def within_sample(valid: torch.Tensor, back: int, *, itself: bool) -> torch.Tensor:
    """(rows, positions) bool: position i's `back` predecessors (and i, with `itself`) are valid, so
    everything a loss term at i is computed from lies in i's sample, inside the row (valid[j] is
    False at a sample's last position and on a row's padding)."""
    mask = valid.clone() if itself else torch.ones_like(valid)
    for offset in range(1, back + 1):
        before = torch.zeros_like(valid)
        before[:, offset:] = valid[:, :-offset]
        mask &= before
    return mask


def save(data: DistillData, folder: Path) -> None:
    """Write a shard into a folder that is itself published atomically (distill._publish)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"tokens": data.tokens, "valid": data.valid, **{f"hidden.{k}": v.contiguous() for k, v in data.hidden.items()}}
    save_file(tensors, str(folder / DATA_FILE))  # straight to the file: no second copy in RAM
    atomic_write_json(folder / INFO_FILE, data.info)


def load(folder: Path) -> DistillData:
    """One shard, entirely in RAM."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / DATA_FILE))
    hidden = {int(k.split(".", 1)[1]): v for k, v in tensors.items() if k.startswith("hidden.")}
    return DistillData(tensors["tokens"], tensors["valid"], hidden, json.loads((folder / INFO_FILE).read_text()))


class _ShardFile:
    """Row ranges of the tensors in one safetensors file, read with pread (header parsed once)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            self.header = json.loads(handle.read(length))
        self.data_start = 8 + length
        self.fd = os.open(path, os.O_RDONLY)

    def rows(self, name: str) -> int:
        return self.header[name]["shape"][0]

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        info = self.header[name]
        dtype, shape = _DTYPES[info["dtype"]], info["shape"]
        row_items = 1
        for dim in shape[1:]:
            row_items *= dim
        row_bytes = row_items * torch.empty((), dtype=dtype).element_size()
        if stop <= start:
            return torch.empty((0, *shape[1:]), dtype=dtype)
        buffer = bytearray((stop - start) * row_bytes)
        offset = self.data_start + info["data_offsets"][0] + start * row_bytes
        if os.preadv(self.fd, [buffer], offset) != len(buffer):
            raise OSError(f"short read of {name} in a self-distillation shard")
        return torch.frombuffer(buffer, dtype=dtype).view(stop - start, *shape[1:])

    def close(self) -> None:
        os.close(self.fd)


class HiddenRows:
    """One layer's hidden states over all shards, indexed like an (N, H) tensor: a slice reads a
    span, an index tensor reads those rows; both return ordinary tensors."""

    def __init__(self, data: "ShardedData", layer: int, width: int) -> None:
        self.data, self.layer, self.shape = data, layer, (len(data.tokens), width)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> torch.Tensor:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            if step != 1:
                raise IndexError("hidden-state spans are contiguous")
            return self.data.span(self.layer, start, stop)
        return self.data.rows(self.layer, torch.as_tensor(key, dtype=torch.long))


class ShardedData:
    """The training data of several shards: the interface of DistillData (tokens, valid,
    hidden[layer][...], info, num_tokens), with hidden states left on disk."""

    def __init__(self, folders: list[Path]) -> None:
        self.files = [_ShardFile(Path(f) / DATA_FILE) for f in folders]
        tokens = [f.read("tokens", 0, f.rows("tokens")) for f in self.files]
        self.tokens = torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long)
        self.valid = torch.cat([f.read("valid", 0, f.rows("valid")) for f in self.files]) if tokens else torch.empty(0, dtype=torch.bool)
        self.starts = torch.tensor([0, *torch.tensor([len(t) for t in tokens]).cumsum(0).tolist()])
        header = self.files[0].header if self.files else {}
        self.hidden = {int(k.split(".", 1)[1]): HiddenRows(self, int(k.split(".", 1)[1]), v["shape"][1])
                       for k, v in sorted(header.items()) if k.startswith("hidden.")}
        infos = [json.loads((Path(f) / INFO_FILE).read_text()) for f in folders]
        # which data: the shards' cache folders name everything they were made from (the base, the
        # prompts, the distillation dtype, the data version)
        names = "\n".join(sorted(f"{Path(f).parent.name}/{Path(f).name}" for f in folders))
        self.info = {"num_samples": sum(i["num_samples"] for i in infos), "seconds": round(sum(i["seconds"] for i in infos), 1),
                     "num_tokens": self.num_tokens, "shards": len(infos),
                     "data_key": hashlib.sha256(names.encode()).hexdigest()[:16]}

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())

    def span(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a layer, across shard boundaries."""
        name, parts = f"hidden.{layer}", []
        first = int(torch.searchsorted(self.starts, start, right=True)) - 1
        for shard in range(max(first, 0), len(self.files)):
            lo, hi = int(self.starts[shard]), int(self.starts[shard + 1])
            if lo >= stop:
                break
            parts.append(self.files[shard].read(name, max(start, lo) - lo, min(stop, hi) - lo))
        if not parts:
            return self.files[0].read(name, 0, 0)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def rows(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Any rows of a layer, in the order asked: one pread per run of consecutive positions."""
        wanted, inverse = torch.unique(index.reshape(-1), sorted=True, return_inverse=True)
        if not len(wanted):
            return self.span(layer, 0, 0).reshape(*index.shape, -1)
        breaks = (torch.nonzero(wanted[1:] != wanted[:-1] + 1).squeeze(1) + 1).tolist()
        runs = zip([0, *breaks], [*breaks, len(wanted)])
        gathered = torch.cat([self.span(layer, int(wanted[a]), int(wanted[b - 1]) + 1) for a, b in runs])
        return gathered[inverse].reshape(*index.shape, -1)

    def materialize(self) -> DistillData:
        """Everything in RAM (tests; small data)."""
        hidden = {layer: self.span(layer, 0, len(self.tokens)) for layer in self.hidden}
        return DistillData(self.tokens, self.valid, hidden, dict(self.info))

    def close(self) -> None:
        files, self.files = getattr(self, "files", []), []
        for handle in files:
            handle.close()

    __del__ = close
