"""This rank and the world it trains in: one process (CPU or one GPU), or the process group
torchrun describes, in which rank 0 decides what every rank then agrees on (`from_rank0`).

`Distributed` is the rank's information; `torch.distributed` (imported as `dist`) the library.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Distributed:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def from_rank0(self, obj):
        """Rank 0's `obj` on every rank (a small picklable object); every rank must call it."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_distributed() -> Distributed:
    """One process, or the process group torchrun describes (gloo on CPU, NCCL on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        return Distributed(dist.get_rank(), world, device)
    return Distributed(0, 1, torch.device("cuda", 0) if cuda else torch.device("cpu"))
