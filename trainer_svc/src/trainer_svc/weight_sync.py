"""The weight sync: publish the policy's weights where the rollout workers load them.

    sync = WeightSync(cfg, dist_info)
    weights = sync.resume(model, step)      # after a resume: the newest published weights of `step`
    if sync.due(step):
        weights = sync.publish(model, step)  # every `publish.every` steps, and at the last one

Each publish writes publish_dir/step_NNNNNNNN (HF layout in the serving dtype, manifest last,
renamed into place: see publish and weights_writer) and names it in the next requests. Its cost
is the weights' bytes, never the optimizer's: resume checkpoints are a separate, slower cadence.
Old directories are pruned unless a pending or claimed request still names them.

Every rank calls these (under FSDP2 the parameters are gathered one at a time for rank 0 to
write) and gets the same WeightsRef back.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from . import publish as published
from .config import Config
from .model import Distributed
from .sampling import WeightsRef
from .weights_writer import iter_full_tensors, serving_dtype

log = logging.getLogger(__name__)


class WeightSync:
    def __init__(self, cfg: Config, dist_info: Distributed):
        self.cfg = cfg
        self.dist = dist_info
        self.dir = cfg.publish_dir
        self.dtype = {"auto": serving_dtype(dist_info.device), "float32": torch.float32, "bfloat16": torch.bfloat16}[
            cfg.publish.dtype
        ]

    def due(self, step: int) -> bool:
        return step % self.cfg.publish.every == 0 or step == self.cfg.train.steps

    def publish(self, model, step: int) -> WeightsRef:
        record = published.publish(
            step,
            iter_full_tensors(model, self.dist),
            publish_dir=self.dir,
            base_model=Path(self.cfg.model.path),
            dist_info=self.dist,
            run_name=self.cfg.run_dir.name,
            dtype=self.dtype,
        )
        ref = None
        if record is not None:  # rank 0
            published.prune_published(self.dir, self.cfg.publish.keep_last, self.cfg.spool_dir)
            ref = WeightsRef(str(record.path), record.content_id, record.step)
        return self.dist.from_rank0(ref)

    def resume(self, model, step: int) -> WeightsRef:
        """The weights rollouts use after a resume at `step`: the starting model at step 0; else
        the weights published at `step`, published again if they are gone (a tmpfs emptied by a
        reboot, or a step between publishes). Weights published after `step` are discarded: they
        came from steps this run will take again."""
        ref = None
        if self.dist.is_main:
            discarded = published.discard_newer_than(self.dir, step)
            if discarded:
                log.info("discarded %d published weights newer than step %d", len(discarded), step)
            found = published.latest_published(self.dir)
            if step == 0:
                ref = WeightsRef(self.cfg.model.path)
            elif found is not None and found.step == step:
                ref = WeightsRef(str(found.path), found.content_id, found.step)
        ref = self.dist.from_rank0(ref)
        return ref if ref is not None else self.publish(model, step)
