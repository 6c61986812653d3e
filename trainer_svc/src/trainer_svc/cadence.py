"""When an every-N-steps action runs: the publish (`publish.every`), the checkpoint
(`checkpoint.every`) and the slot publisher's portable directory (`publish.dir_every`) share it."""

from __future__ import annotations


def on_cadence(step: int, every: int, last: int) -> bool:
    """Whether the action runs after optimizer step `step` (1-based): at each multiple of `every`, and at
    the run's `last` step whatever `every` is, so the final weights are always there; every = 0: the last only."""
    return (every > 0 and step % every == 0) or step == last
