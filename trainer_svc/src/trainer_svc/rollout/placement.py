"""Which GPU a spawned rollout worker gets: the one home of `ROLLOUT_GPU` and of the mapping from
the positions this process sees to the GPUs the system numbers (what workers report)."""

from __future__ import annotations

import os


def physical_gpu(position: int) -> str:
    """The GPU at `position` among those this process sees, as the system numbers it (what a
    worker started with CUDA_VISIBLE_DEVICES=<it> uses, and reports)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[position].strip() if visible else str(position)


def requested_rollout_gpu(world_size: int) -> str:
    """ROLLOUT_GPU as given (a position among the visible GPUs), by default the first after the
    training ranks; unchecked: the topology gate checks it."""
    return os.environ.get("ROLLOUT_GPU", str(world_size))


def rollout_gpu(world_size: int, cuda_devices: int, colocate: bool = False) -> str | None:
    """The physical GPU for a spawned worker: rank 0's when colocated; else ROLLOUT_GPU's; None
    without GPUs."""
    if cuda_devices == 0 and "ROLLOUT_GPU" not in os.environ:
        return None
    if colocate:
        return physical_gpu(0)
    return physical_gpu(int(requested_rollout_gpu(world_size)))
