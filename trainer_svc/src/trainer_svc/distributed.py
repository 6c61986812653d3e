"""This rank and the world it trains in: one process (CPU or one GPU), or the process group
torchrun describes, in which rank 0 decides what every rank then agrees on (`from_rank0`).

`Distributed` is the rank's information; `torch.distributed` (imported as `dist`) the library.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
U = TypeVar("U")


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


def on_rank0(
    dist_info: Distributed | None,
    work: Callable[[], T],
    what: str,
    *,
    agree: bool = True,
    drain: Iterable = (),
    share: bool = False,
) -> T | None:
    """`work()` on rank 0, its result there (None elsewhere). With `agree` every rank calls this and
    learns whether rank 0 failed, so that none waits on for a rank 0 that gave up: rank 0 raises
    its own error, the others one saying it could not `what`. `drain`: what the other ranks must
    still consume first (the gathers of a collective stream that rank 0 did not reach). `share`:
    every rank calls this and gets rank 0's result (a small picklable object), told in the same
    broadcast as its outcome: one round trip to rank 0 and back, not two."""
    main = dist_info is None or dist_info.is_main
    result, error = None, None
    if main:
        try:
            result = work()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks are told
            error = exc
    if (agree or share) and dist_info is not None:
        for _ in drain:
            pass
        told = None if error is None else f"{type(error).__name__}: {error}"
        outcome, shared = dist_info.from_rank0((told, result if share else None))
        if not main and outcome is not None:
            raise RuntimeError(f"rank 0 could not {what}: {outcome}")
        if share:
            result = shared
    if error is not None:
        raise error
    return result


@dataclass
class Begun(Generic[T]):
    """Work every rank has begun together (under FSDP2 the gathers of a publish) and rank 0
    finishes: `finish()` on rank 0 consumes the rest of a collective stream, which the other ranks
    `drain`; `agree` whether they must learn rank 0's outcome (see on_rank0). A caller that adds
    its own rank-0 work (`then`) and shares the result finishes it in one round trip to rank 0."""

    finish: Callable[[], T]
    drain: Iterable = ()
    agree: bool = False

    def then(self, more: Callable[[T], U]) -> Begun[U]:
        """The same work, with `more` run on rank 0 on what `finish` returned."""
        return Begun(lambda: more(self.finish()), self.drain, self.agree)

    def finish_on_rank0(self, dist_info: Distributed | None, what: str, *, share: bool = False) -> T | None:
        return on_rank0(dist_info, self.finish, what, agree=self.agree, drain=self.drain, share=share)


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
