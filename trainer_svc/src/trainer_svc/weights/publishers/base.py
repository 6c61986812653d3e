"""The interface every form of the weight sync stands behind.

A publisher is made once per run, on every rank, by weights.sync. Every rank calls each method
(under FSDP2 the parameters are gathered one at a time for rank 0 to write) and gets the same
WeightsRef back: what the next requests name as their weights.

    describe() -> str                          the form and where it writes, for the banner
    publish(model, step) -> WeightsRef         the model's weights, published for `step`
    resume(model, step, rollout_weights, checkpoint) -> WeightsRef
                                               after a resume: the weights the requests named
    close(run_over)                            at the end of a launch, once its worker is gone
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import torch

from ...config import Config
from ...distributed import Distributed, on_rank0
from ...rollout_types import WeightsRef


class Publisher(ABC):
    form: ClassVar[str]  # "directory", "delta", "slot" or "adapter": what the banner and tests call it

    def __init__(self, cfg: Config, dist_info: Distributed, dtype: torch.dtype | None):
        self.cfg = cfg
        self.dist_info = dist_info
        self.dtype = dtype  # the serving dtype (None: the tensors' own)
        self.dir = Path(cfg.publish_dir)

    @abstractmethod
    def describe(self) -> str:
        """The form and where it writes (weights.sync adds why it was chosen)."""

    @abstractmethod
    def publish(self, model, step: int) -> WeightsRef:
        """Every rank: the model's weights published for `step`; what the requests name now."""

    @abstractmethod
    def resumed(self, step: int, named: WeightsRef | None, checkpoint: Path | None) -> WeightsRef | None:
        """Rank 0, after a resume at `step`: the weights to name (see `resume`), or None to publish
        the restored ones. Discards what was published after `step`."""

    def resume(
        self, model, step: int, rollout_weights: dict | None = None, checkpoint: Path | None = None
    ) -> WeightsRef:
        """The weights rollouts use after a resume at `step`: those the requests named when the
        checkpoint was saved (`rollout_weights`; None for the starting model or a checkpoint that
        did not record them: its own). With `publish.every > 1` they can be older than the
        checkpoint's own weights, and the uninterrupted run samples from them until its next
        publish, so the resumed run does too. Found where they were published (same content id),
        else put back from the checkpoint's copy, else published anew from the restored weights.
        Weights published after `step` are discarded: they came from steps this run will take
        again."""
        named = WeightsRef(**rollout_weights) if rollout_weights else None
        ref = on_rank0(
            self.dist_info,
            lambda: self.resumed(step, named, checkpoint),
            f"find the weights of step {step}",
            share=True,
        )
        return ref if ref is not None else self.publish(model, step)

    def close(self, run_over: bool) -> None:  # noqa: B027 - most forms hold nothing to give back
        """Every rank, at the end of a launch (run_over: finished, or stopped by its tripwire)."""
