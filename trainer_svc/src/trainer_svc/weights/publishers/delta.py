"""Sparse deltas: a publish may hold only the elements that changed since the previous one
(weights.deltas.DeltaWriter decides and writes; a full anchor at least every
`publish.delta_anchor_every` publishes), in the same step directories as the directory form,
which the workers rebuild from the chain. Pruning keeps a named delta's links back to its anchor
(protocol.spool_names), and a resume names a delta only when its chain is all there."""

from __future__ import annotations

from ...distributed import Begun
from ..deltas import DeltaWriter
from ..publish import Published
from ..writer import iter_full_tensors
from .directory import DirectoryPublisher


class DeltaPublisher(DirectoryPublisher):
    form = "delta"

    def __init__(self, cfg, dist_info, dtype):
        super().__init__(cfg, dist_info, dtype)
        # The last publish's tensors, held on rank 0 to diff the next against: the first publish of
        # a process (a resume, a restart) is full.
        self.writer = DeltaWriter(cfg.publish.delta_anchor_every)

    @classmethod
    def what(cls, cfg) -> str:
        return f"sparse deltas, a full anchor every {cfg.publish.delta_anchor_every} publishes"

    def begin(self, model, step: int) -> Begun[Published]:
        return self.writer.begin(step, iter_full_tensors(model, self.dist_info), **self._where())
