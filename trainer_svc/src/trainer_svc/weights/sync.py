"""The weight sync: publish the policy's weights where the rollout workers load them, every
`publish.every` steps and at the last one. This module chooses the form, once per run, and says
why in the banner; each form is a publisher of weights.publishers, behind one interface.

The forms, and when each is chosen:
- adapter: with LoRA (`[lora]` rank > 0) a publish is the adapter alone (megabytes, PEFT's
  layout), which the workers apply to the base they hold: no slots, no deltas, never a reload of
  the base.
- slot: where the worker shares this host (`publish.slots`; auto: a spawned worker and room in
  publish.slots_dir), a ring of shared-memory slots, with a directory (full or deltas, as below)
  every `publish.dir_every` steps, at the last one, and whenever no slot is free.
- delta: with `publish.delta` on (auto: publish_dir on a network filesystem), sparse deltas
  against the previous publish, rebuilt by the workers from the chain.
- directory: otherwise, full HF directories (the portable form).

A publish costs the weights' bytes, never the optimizer's: resume checkpoints are a separate,
slower cadence. Every rank makes the same choice (rank 0 judges slots_dir, the others follow) and
calls the publisher (under FSDP2 the parameters are gathered one at a time for rank 0 to write).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch

from protocol.watch import filesystem_type, needs_polling
from protocol.weight_slots import SLOT_DATA, ring_dir

from ..config import Config
from ..distributed import Distributed, on_rank0
from ..rollout_types import WeightsRef
from .publishers.adapter import AdapterPublisher
from .publishers.base import Publisher
from .publishers.delta import DeltaPublisher
from .publishers.directory import DirectoryPublisher
from .publishers.slot import SlotPublisher
from .writer import serving_dtype


class WeightSync:
    """The run's publisher, chosen once (`publisher`), and the publish cadence (`due`)."""

    def __init__(self, cfg: Config, dist_info: Distributed):
        self.cfg = cfg
        self.dist_info = dist_info
        dtype = {"auto": serving_dtype(dist_info.device), "float32": torch.float32, "bfloat16": torch.bfloat16}[
            cfg.publish.dtype
        ]
        self.publisher, self.why = choose(cfg, dist_info, dtype)

    def describe(self) -> str:
        """For the banner: where publishes go, in which form, and why."""
        return self.why

    def publish(self, model, step: int) -> WeightsRef:
        return self.publisher.publish(model, step)

    def resume(
        self, model, step: int, rollout_weights: dict | None = None, checkpoint: Path | None = None
    ) -> WeightsRef:
        """The weights rollouts use after a resume at `step` (Publisher.resume says which)."""
        return self.publisher.resume(model, step, rollout_weights, checkpoint)

    def close(self, run_over: bool) -> None:
        """At the end of a launch, once its spawned worker is gone. A run that is over (finished,
        or stopped by its tripwire) gives back what its form holds (a slot ring's memory, unless
        a reader or a request still holds a slot), and the ring directory made for a spawned
        worker when it stayed empty; a stopped run keeps them for its relaunch."""
        self.publisher.close(run_over)
        if self.dist_info.is_main and run_over:
            with contextlib.suppress(OSError):  # gone, or a ring that stays
                ring_dir(self.cfg.publish.slots_dir, self.cfg.run_dir).rmdir()


def choose(cfg: Config, dist_info: Distributed, dtype: torch.dtype | None) -> tuple[Publisher, str]:
    """The run's publisher and the banner's line: the form, where it writes, and why."""
    if cfg.lora.on:
        adapter = AdapterPublisher(cfg, dist_info, dtype)
        return (
            adapter,
            f"{adapter.describe()}: the adapter directory is the sync; slots and deltas apply to whole weights",
        )
    form, _ = portable_form(cfg)
    portable = form(cfg, dist_info, dtype)
    directories = describe_weight_sync(cfg)
    # Rank 0 judges the slots' filesystem (the others may see another /dev/shm) and all follow.
    ring, why_not = on_rank0(dist_info, lambda: slots_choice(cfg), "judge publish.slots_dir", share=True)
    if ring is None:
        return portable, f"weights directories in {cfg.publish_dir} ({why_not}): {directories}"
    slots = SlotPublisher(cfg, dist_info, dtype, ring, portable)
    return slots, f"{slots.describe()}; its directories: {directories}"


def slots_choice(cfg: Config) -> tuple[Path | None, str]:
    """Whether this run publishes into slots: (the ring, ""), or (None, why not). `publish.slots =
    "on"` with a slots_dir that cannot hold the ring is an error."""
    mode, root = cfg.publish.slots, Path(cfg.publish.slots_dir)
    if mode == "off":
        return None, "publish.slots = off"
    if mode == "auto" and not cfg.rollout.spawn:
        return None, (
            "publish.slots = auto and rollout.spawn = false: the workers may be on other hosts; set "
            "publish.slots = on where they share this one"
        )
    need = cfg.publish.slots_count * _weights_bytes(Path(cfg.model.path))
    free = shutil.disk_usage(root).free if root.is_dir() else 0
    free += sum(p.lstat().st_size for p in ring_dir(root, cfg.run_dir).glob(f"*/{SLOT_DATA}"))  # a relaunch's own
    if free < need:
        why = f"{root} has {free / 2**20:.0f} MiB free, the ring needs about {need / 2**20:.0f} MiB"
        if mode == "on":
            raise ValueError(
                f"publish.slots = on, but {why}: give publish.slots_dir a larger tmpfs, lower publish.slots_count, "
                "or set publish.slots = auto"
            )
        return None, f"{why}: publish.slots_dir"
    return ring_dir(root, cfg.run_dir), ""


def _weights_bytes(model: Path) -> int:
    """What a publish of `model` holds, about: its safetensors files (the serving dtype may halve it)."""
    return sum(p.stat().st_size for p in model.glob("*.safetensors")) or 2**20


def deltas_wanted(mode: str, publish_dir: Path) -> tuple[bool, str]:
    """Whether `publish.delta = mode` publishes deltas into `publish_dir`, and why (for the banner):
    "auto" turns them on over a network filesystem, where each byte a worker reads crosses the
    network, and off on a local one, where a full publish costs less than a diff."""
    if mode in ("on", "off"):
        return mode == "on", f"publish.delta = {mode}"
    probe = Path(publish_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # not created yet: its filesystem is its nearest existing parent's
    fstype = filesystem_type(probe) or "unknown"
    if needs_polling(probe):
        return True, f"auto: {probe} is on a network filesystem ({fstype})"
    return False, f"auto: {probe} is on a local filesystem ({fstype})"


def portable_form(cfg: Config) -> tuple[type[DirectoryPublisher], str]:
    """The form of the run's directories, full or deltas, and why."""
    deltas, why = deltas_wanted(cfg.publish.delta, cfg.publish_dir)
    return (DeltaPublisher if deltas else DirectoryPublisher), why


def describe_weight_sync(cfg: Config) -> str:
    """How weights reach the workers in directories: 'full directories (...)' or 'sparse deltas (...)'."""
    form, why = portable_form(cfg)
    return f"{form.what(cfg)} ({why})"
