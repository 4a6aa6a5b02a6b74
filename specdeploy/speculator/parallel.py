"""Data-parallel spec training under `torchrun` / `accelerate launch`.

    torchrun --nproc_per_node 8 -m specdeploy spec train --model <folder> --spec eagle --device cuda

Every rank draws the same global batch of each step from one seeded generator and trains on its
own slice of it (batch-size / world windows); the gradients of the module's parameters are
averaged with all_reduce before the optimizer step, so every rank holds the same weights. Each
rank's loss is its own mean over its own scored positions (ModelOpt's EAGLE loss, the Medusa loss),
so ranks weigh equally, not positions: as torch DDP trains, close to but not exactly what a single
process would train on the same batches. Self-distillation shards are split between the ranks the
same way (shard i on rank i % world). Only rank 0 writes spec/, the
checkpoints and the manifest. Alone (no torchrun), world is 1 and the same code runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specdeploy.device import world as read_world


@dataclass
class Parallel:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        """Leave the process group together: a rank that exits while its peer still talks to it
        makes gloo abort the peer (SIGABRT)."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()

    def mine(self, items: list) -> list:
        """This rank's share of a list of independent jobs."""
        return items[self.rank::self.world]

    def split(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a global batch (dim 0 divisible by world: memory.check_training)."""
        size = batch.shape[0] // self.world
        return batch[self.rank * size:(self.rank + 1) * size]

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        if self.world == 1:
            return
        import torch.distributed as dist

        pending = [dist.all_reduce(p.grad, async_op=True) for p in params if p.grad is not None]
        for work in pending:
            work.wait()
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.world)

    def average(self, values: list[float]) -> list[float]:
        """Mean over ranks of a few logged numbers (loss, accuracies)."""
        if self.world == 1:
            return values
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return (tensor / self.world).tolist()


def setup(device: torch.device) -> Parallel:
    """The process group when launched by torchrun (RANK/WORLD_SIZE set), else a single process.
    On CUDA each rank computes on cuda:LOCAL_RANK."""
    rank, world = read_world()
    if world == 1:
        return Parallel(0, 1, device)
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Parallel(rank, world, device)

