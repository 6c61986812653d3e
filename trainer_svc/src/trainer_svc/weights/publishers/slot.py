"""Shared-memory slots: where the worker shares this host, a publish goes into a ring of slots
(weights.slots writes them; protocol.weight_slots defines one) that the worker copies straight
into its engine. A directory (the portable form: full or deltas) is still written every
`publish.dir_every` steps and at the last one, and whenever no slot is free within
`publish.slots_wait_s`.

Guarantees:
- One decision and one answer cross the ranks per publish: rank 0 chooses the slot (all ranks
  must know whether a slot or a directory is written: both are collective under FSDP2), and
  rank 0's outcome comes back to all with the WeightsRef in one broadcast (distributed.on_rank0).
- A resume names the slot the requests named while it still holds their content id, else puts
  the checkpoint's copy back into that slot, else (the checkpoint's own weights) republishes into
  it; otherwise it asks the portable form.
- A run that is over gives the ring's memory back to the host, unless a reader still holds a slot
  or a request in the spool names one; a stopped run keeps it for its relaunch.
"""

from __future__ import annotations

import logging
from pathlib import Path

from protocol.weights_dir import step_content_id

from ...cadence import on_cadence
from ...distributed import on_rank0
from ...rollout_types import WeightsRef
from ..checkpoint import ROLLOUT_WEIGHTS
from ..slots import SlotRing
from ..writer import TensorStream, iter_full_tensors
from .base import Publisher
from .directory import DirectoryPublisher

log = logging.getLogger(__name__)


class SlotPublisher(Publisher):
    form = "slot"

    def __init__(self, cfg, dist_info, dtype, ring: Path, portable: DirectoryPublisher):
        super().__init__(cfg, dist_info, dtype)
        self.ring_path = Path(ring)
        self.ring = SlotRing.for_run(cfg, ring) if dist_info.is_main else None  # rank 0 writes
        self.portable = portable  # the directories beside the slots
        self.republish_into: Path | None = None  # after a resume: the slot the requests named

    def describe(self) -> str:
        every = self.cfg.publish.dir_every
        return (
            f"shared-memory slots: {self.cfg.publish.slots_count} in {self.ring_path}, loaded by the worker straight "
            f"into its engine; a directory in {self.dir} {f'every {every} steps and ' if every else ''}at the last step"
        )

    def publish(self, model, step: int) -> WeightsRef:
        if on_cadence(step, self.cfg.publish.dir_every, self.cfg.train.steps):
            self.portable.publish(model, step)  # the portable form, for eval jobs, other hosts and people
        wanted, self.republish_into = self.republish_into, None
        slot = self.dist_info.from_rank0(self.ring.choose(wanted) if self.ring is not None else None)
        if slot is None:
            log.warning(
                "no weight slot was free within publish.slots_wait_s = %s s (readers or pending requests hold "
                "them all): publishing step %d as a directory instead",
                self.cfg.publish.slots_wait_s,
                step,
            )
            return self.portable.publish(model, step)
        stream = iter_full_tensors(model, self.dist_info)
        source = stream.fetch([spec.name for spec in stream.specs])  # the order a slot's layout takes them in
        content_id = step_content_id(self.cfg.run_dir.name, step)
        written = on_rank0(
            self.dist_info,
            lambda: self.ring.write(
                slot,
                step,
                content_id,
                TensorStream(stream.specs, lambda _: source),
                self.dtype,
                Path(self.cfg.model.path),
            ),
            f"write the weight slot {slot}",
            agree=stream.collective,
            drain=source,
            share=True,
        )
        return WeightsRef(str(written.path), written.content_id, written.step)

    def resumed(self, step: int, named: WeightsRef | None, checkpoint: Path | None) -> WeightsRef | None:
        self.ring.discard_newer_than(step)
        self.portable.discard_newer_than(step)
        if step > 0 and named is not None and named.step is not None and self.ring.holds(named.dir):
            kept = checkpoint / ROLLOUT_WEIGHTS if checkpoint is not None else None
            found = self.ring.resumed(named.dir, named.content_id, None if named.step == step else kept)
            if found is not None:
                return WeightsRef(str(found.path), found.content_id, found.step)
            if named.step == step:
                self.republish_into = Path(named.dir)  # the checkpoint's own weights, where they were named
                return None
        return self.portable.found(step, named, checkpoint)

    def close(self, run_over: bool) -> None:
        if self.ring is None or not run_over:
            return
        in_use = self.ring.in_use()
        if in_use:
            log.warning(
                "the weight slot ring %s stays: %s still named or read (rm -r it once they are done)",
                self.ring.ring,
                [p.name for p in in_use],
            )
            return
        self.ring.remove()
