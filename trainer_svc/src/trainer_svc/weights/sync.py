"""The weight sync: publish the policy's weights where the rollout workers load them, every
`publish.every` steps and at the last one.

Each publish writes publish_dir/step_NNNNNNNN (HF layout in the serving dtype, manifest last,
renamed into place: see publish and writer) and names it in the next requests; with
`publish.delta` on (auto: over a network filesystem) a publish may be a sparse delta against the
previous one (deltas), which the workers rebuild from its chain. Where the worker shares
this host (`publish.slots`), a publish goes into a ring of shared-memory slots instead
(slots), which the requests name the same way; a directory is still written every
`publish.dir_every` steps and at the last one (the portable form), and whenever no slot is free
within `publish.slots_wait_s`. With LoRA (`[lora]` rank > 0) a publish is the adapter alone
(adapters.py: megabytes, PEFT's layout), which the workers apply to the base they hold: no
slots, no deltas, and never a reload of the base. Its cost is the weights' bytes, never the optimizer's: resume
checkpoints are a separate, slower cadence. Old directories are pruned unless a pending or
claimed request still names them; slots are rewritten in turn (slots says when).

Every rank calls these (under FSDP2 the parameters are gathered one at a time for rank 0 to
write) and gets the same WeightsRef back.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from protocol import weight_delta, weights_chain
from protocol.weight_slots import ring_dir
from protocol.weights_dir import MANIFEST, weights_content_id

from ..config import Config
from ..distributed import Distributed
from ..rollout_types import WeightsRef
from . import publish as published
from .adapters import publish_adapter
from .checkpoint import ROLLOUT_WEIGHTS
from .deltas import DeltaPublisher, deltas_wanted
from .slots import SlotRing, publish_slot, slots_choice
from .writer import iter_full_tensors, serving_dtype

log = logging.getLogger(__name__)


class WeightSync:
    def __init__(self, cfg: Config, dist_info: Distributed):
        self.cfg = cfg
        self.dist_info = dist_info
        self.dir = cfg.publish_dir
        self.dtype = {"auto": serving_dtype(dist_info.device), "float32": torch.float32, "bfloat16": torch.bfloat16}[
            cfg.publish.dtype
        ]
        # LoRA: a publish is the adapter alone (adapters.py), applied by the workers to the base
        # whose content id it names; slots and deltas are for whole weights.
        self.base_content_id = weights_content_id(cfg.model.path) if cfg.lora.on else None
        self.deltas_on, self.deltas_why = deltas_wanted(cfg.publish.delta, self.dir)
        self.deltas_on = self.deltas_on and not cfg.lora.on
        self.deltas = DeltaPublisher(cfg.publish.delta_anchor_every) if self.deltas_on else None

        # The slot ring, on rank 0 (None: directories only); `path` says which, for the banner.
        choice = slots_choice(cfg) if dist_info.is_main and not cfg.lora.on else (None, "")
        ring, self.path = dist_info.from_rank0(choice if dist_info.is_main else None)
        self.slots = SlotRing.for_run(cfg, ring) if ring is not None and dist_info.is_main else None
        self.slotted = ring is not None
        self.republish_into: Path | None = None  # after a resume: the slot the requests named

    def describe(self) -> str:
        """For the banner: where publishes go, in which form, and why."""
        if self.cfg.lora.on:
            return (
                f"LoRA adapter directories in {self.dir} (rank {self.cfg.lora.rank}, on base {self.base_content_id}): "
                "the adapter directory is the sync; slots and deltas apply to whole weights"
            )
        directories = describe_weight_sync(self.cfg)  # full directories or sparse deltas, and why
        return f"{self.path}; its directories: {directories}" if self.slotted else f"{self.path}: {directories}"

    def close(self, run_over: bool) -> None:
        """At the end of a launch, once its spawned worker is gone (rank 0). A run that is over
        (finished, or stopped by its tripwire) gives the slot ring's memory back to the host, unless
        a reader still holds a slot or a request in the spool names one. A stopped run keeps it for
        its relaunch, which names the slots its requests named (resume)."""
        if not self.dist_info.is_main or not run_over:
            return
        if self.slots is None:  # a ring directory made for a spawned worker, never used
            with contextlib.suppress(OSError):
                ring_dir(self.cfg.publish.slots_dir, self.cfg.run_dir).rmdir()
            return
        in_use = self.slots.in_use()
        if in_use:
            log.warning(
                "the weight slot ring %s stays: %s still named or read (rm -r it once they are done)",
                self.slots.ring,
                [p.name for p in in_use],
            )
            return
        self.slots.remove()

    def due(self, step: int) -> bool:
        return step % self.cfg.publish.every == 0 or step == self.cfg.train.steps

    def publish(self, model, step: int) -> WeightsRef:
        if not self.slotted:
            return self.publish_dir(model, step)
        every = self.cfg.publish.dir_every
        if (every and step % every == 0) or step == self.cfg.train.steps:
            self.publish_dir(model, step)  # the portable form, for eval jobs, other hosts and people
        wanted, self.republish_into = self.republish_into, None
        slot = self.dist_info.from_rank0(self.slots.choose(wanted) if self.dist_info.is_main else None)
        if slot is None:
            log.warning(
                "no weight slot was free within publish.slots_wait_s = %s s (readers or pending requests hold "
                "them all): publishing step %d as a directory instead",
                self.cfg.publish.slots_wait_s,
                step,
            )
            return self.publish_dir(model, step)
        written = publish_slot(self.slots, slot, step, model, self.dist_info, self.dtype, self.cfg)
        ref = WeightsRef(str(written.path), written.content_id, written.step) if written is not None else None
        return self.dist_info.from_rank0(ref)

    def publish_dir(self, model, step: int) -> WeightsRef:
        if self.cfg.lora.on:
            record = publish_adapter(
                step,
                model,
                publish_dir=self.dir,
                base_model=Path(self.cfg.model.path),
                base_content_id=self.base_content_id,
                dist_info=self.dist_info,
                run_name=self.cfg.run_dir.name,
                dtype=self.dtype,
            )
            return self._published(record)
        write = self.deltas.publish if self.deltas is not None else published.publish
        record = write(
            step,
            iter_full_tensors(model, self.dist_info),
            publish_dir=self.dir,
            base_model=Path(self.cfg.model.path),
            dist_info=self.dist_info,
            run_name=self.cfg.run_dir.name,
            dtype=self.dtype,
        )
        return self._published(record)

    def _published(self, record: published.Published | None) -> WeightsRef:
        """The WeightsRef of a publish, on every rank, once rank 0 has pruned the older ones."""
        ref = None
        if record is not None:  # rank 0
            published.prune_published(self.dir, self.cfg.publish.keep_last, self.cfg.spool_dir)
            ref = WeightsRef(str(record.path), record.content_id, record.step)
        return self.dist_info.from_rank0(ref)

    def resume(
        self, model, step: int, rollout_weights: dict | None = None, checkpoint: Path | None = None
    ) -> WeightsRef:
        """The weights rollouts use after a resume at `step`: those the requests named when the
        checkpoint was saved (`rollout_weights`; None for the starting model or a checkpoint that
        did not record them: its own). With `publish.every > 1` they can be older than the
        checkpoint's own weights, and the uninterrupted run samples from them until its next
        publish, so the resumed run does too. Found in publish_dir (same content id), else put
        back from the checkpoint's copy, else published anew from the restored weights (a step
        whose own weights the requests named). Weights published after `step` are discarded:
        they came from steps this run will take again."""
        ref = None
        if self.dist_info.is_main:
            if self.slots is not None:
                self.slots.discard_newer_than(step)
            discarded = published.discard_newer_than(self.dir, step)
            if discarded:
                log.info("discarded %d published weights newer than step %d", len(discarded), step)
            ref = self._resumed(step, WeightsRef(**rollout_weights) if rollout_weights else None, checkpoint)
        ref = self.dist_info.from_rank0(ref)
        return ref if ref is not None else self.publish(model, step)

    def _rebuildable(self, content_id: str) -> bool:
        """Whether a worker holding nothing can load the published `content_id`: a full directory,
        or a delta publish whose chain back to an anchor is all there."""
        try:
            weight_delta.plan(content_id, weights_chain.links(weights_chain.versions(self.dir)))
        except weight_delta.MissingLink as exc:
            log.warning("the published weights %s cannot be rebuilt (%s); not naming them", content_id, exc)
            return False
        return True

    def _resumed(self, step: int, named: WeightsRef | None, checkpoint: Path | None) -> WeightsRef | None:
        """Rank 0: the weights to name after a resume, or None to publish the restored ones."""
        if step == 0 or (named is not None and named.step is None):
            return WeightsRef(self.cfg.model.path)  # nothing published yet: the starting model
        wanted = named.step if named is not None else step
        if named is not None and self.slots is not None and self.slots.holds(named.dir):
            kept = checkpoint / ROLLOUT_WEIGHTS if checkpoint is not None else None
            found = self.slots.resumed(named.dir, named.content_id, None if wanted == step else kept)
            if found is not None:
                return WeightsRef(str(found.path), found.content_id, found.step)
            if wanted == step:
                self.republish_into = Path(named.dir)  # the checkpoint's own weights, where they were named
                return None
        for found in published.list_published(self.dir):
            if found.step == wanted and (named is None or found.content_id == named.content_id):
                if self._rebuildable(found.content_id):
                    return WeightsRef(str(found.path), found.content_id, found.step)
        if wanted == step:
            return None
        kept = checkpoint / ROLLOUT_WEIGHTS if checkpoint is not None else None
        if kept is not None and (kept / MANIFEST).exists():
            restored = published.restore_published(kept, self.dir)
            log.info("the weights of step %d were gone from %s: put back from %s", wanted, self.dir, kept)
            if self._rebuildable(restored.content_id):
                return WeightsRef(str(restored.path), restored.content_id, restored.step)
        log.warning(
            "the weights of step %d that the requests named are gone from %s and %s keeps no copy: publishing "
            "the checkpoint's own (step %d), newer than an uninterrupted run would sample from until its next publish",
            wanted,
            self.dir,
            checkpoint,
            step,
        )
        return None


def describe_weight_sync(cfg) -> str:
    """How weights reach the workers: 'full directories (...)' or 'sparse deltas (...)'."""
    on, why = deltas_wanted(cfg.publish.delta, cfg.publish_dir)
    if on:
        return f"sparse deltas, a full anchor every {cfg.publish.delta_anchor_every} publishes ({why})"
    return f"full directories ({why})"
