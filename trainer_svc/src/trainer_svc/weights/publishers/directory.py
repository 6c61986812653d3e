"""The portable form: each publish is a full HF directory, publish_dir/step_NNNNNNNN (weights.publish
writes it, manifest last, renamed into place), read by any worker, eval job or person.

Guarantees:
- Every rank gets the same WeightsRef, once rank 0 has pruned the older publishes (never the
  newest `publish.keep_last`, never one a pending or claimed request names: protocol.spool_names).
- One round trip to rank 0 per publish (delta and adapter publishes too): rank 0's outcome of the
  write and the prune comes back to every rank with the WeightsRef in one broadcast.
- A resume names the weights the requests named (same step and content id) when a worker holding
  nothing can load them (for a delta, its whole chain back to an anchor), else a copy the
  checkpoint kept, put back byte for byte, else nothing (the restored weights are published anew).
"""

from __future__ import annotations

import logging
from pathlib import Path

from protocol import weight_delta, weights_chain
from protocol.weights_dir import MANIFEST

from ...distributed import Begun
from ...rollout_types import WeightsRef
from .. import publish as published
from ..checkpoint import ROLLOUT_WEIGHTS
from ..writer import iter_full_tensors
from .base import Publisher

log = logging.getLogger(__name__)


class DirectoryPublisher(Publisher):
    form = "directory"

    def describe(self) -> str:
        return self.what(self.cfg)

    @classmethod
    def what(cls, cfg) -> str:
        """The form, as the banner says it, before a publisher is made (run.outputs.banner)."""
        return "full directories"

    def publish(self, model, step: int) -> WeightsRef:
        # The write, the prune and the WeightsRef in one round trip to rank 0: every rank learns
        # rank 0's outcome and the ref in the same broadcast.
        begun = self.begin(model, step).then(self._pruned)
        return begun.finish_on_rank0(self.dist_info, f"publish step {step}", share=True)

    def begin(self, model, step: int) -> Begun[published.Published]:
        """Every rank: the publish of `step` begun (under FSDP2, the gathers), for rank 0 to finish."""
        return published.begin_publish(step, iter_full_tensors(model, self.dist_info), **self._where())

    def _pruned(self, record: published.Published) -> WeightsRef:
        """Rank 0, once `record` is written: the older publishes pruned; what the requests name now."""
        published.prune_published(self.dir, self.cfg.publish.keep_last, self.cfg.spool_dir)
        return WeightsRef(str(record.path), record.content_id, record.step)

    def _where(self) -> dict:
        return {
            "publish_dir": self.dir,
            "base_model": Path(self.cfg.model.path),
            "dist_info": self.dist_info,
            "run_name": self.cfg.run_dir.name,
            "dtype": self.dtype,
        }

    def resumed(self, step: int, named: WeightsRef | None, checkpoint: Path | None) -> WeightsRef | None:
        self.discard_newer_than(step)
        return self.found(step, named, checkpoint)

    def discard_newer_than(self, step: int) -> None:
        discarded = published.discard_newer_than(self.dir, step)
        if discarded:
            log.info("discarded %d published weights newer than step %d", len(discarded), step)

    def found(self, step: int, named: WeightsRef | None, checkpoint: Path | None) -> WeightsRef | None:
        """Rank 0: the named weights in publish_dir or the checkpoint's copy (see the module
        docstring), the starting model before any publish, or None."""
        if step == 0 or (named is not None and named.step is None):
            return WeightsRef(self.cfg.model.path)  # nothing published yet: the starting model
        wanted = named.step if named is not None else step
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

    def _rebuildable(self, content_id: str) -> bool:
        """Whether a worker holding nothing can load the published `content_id`: a full directory,
        or a delta publish whose chain back to an anchor is all there."""
        try:
            weight_delta.plan(content_id, weights_chain.links(weights_chain.versions(self.dir)))
        except weight_delta.MissingLink as exc:
            log.warning("the published weights %s cannot be rebuilt (%s); not naming them", content_id, exc)
            return False
        return True
