"""How many spare prompts a step's first sampling carries (`rollout.spare_prompts`, `rollout.spare_prompts_max`).

A dead group (all G rewards equal) teaches nothing. The step replaces it at once by a live group
of a spare prompt sampled beside its own, or else waits for a retry: a second round trip to the
rollout service, which nothing overlaps (the next step's sampling waits behind it on the worker,
and the trainer waits for it before it trains). So the spares should cover the dead groups on
most steps, and cost no more generation than that.

Fixed (`spare_prompts_max = 0`): `spare_prompts` spares on every step.

Sized from the measured dead rate (`spare_prompts_max > 0`): the smallest S in
[spare_prompts, spare_prompts_max] with

    S (1 - d) - P d  >=  z sqrt((S + P) d (1 - d)),    z = 1.645,

where P is the step's own prompts and d the fraction of dead groups over the first samplings of
the last `WINDOW` steps (own prompts and spares alike). Were each group dead independently with
probability d, the live spares minus the dead own groups would be >= 0 on about 95% of steps
(normal approximation to the difference of two binomials): the retry is the exception. Before
anything was measured, and while d = 0, S = spare_prompts; when no S in the range suffices (d near
1: a task the policy always or never solves), S = spare_prompts_max.

The measurements are part of a checkpoint (`state_dict`), so a resumed run sizes its next steps'
spares as the run that never stopped does.
"""

from __future__ import annotations

import math
from collections import deque

from ..config import RolloutConfig

WINDOW = 8  # first samplings the dead rate is measured over: recent enough to follow the policy
Z = 1.645  # one-sided 95% of the normal distribution


class SpareSizer:
    def __init__(self, cfg: RolloutConfig, state: dict | None = None):
        self.cfg = cfg
        self.seen: deque[tuple[int, int]] = deque(maxlen=WINDOW)  # (dead groups, groups) per first sampling
        for dead, total in (state or {}).get("seen", []):
            self.seen.append((dead, total))

    @property
    def adaptive(self) -> bool:
        return self.cfg.spare_prompts_max > 0

    def dead_rate(self) -> float | None:
        """The dead fraction over the measured first samplings; None before the first."""
        total = sum(t for _, t in self.seen)
        return sum(d for d, _ in self.seen) / total if total else None

    def count(self) -> int:
        """Spare prompts for the next first sampling."""
        low, d = self.cfg.spare_prompts, self.dead_rate()
        if not self.adaptive or d is None or d == 0:
            return low
        own = self.cfg.prompts_per_step
        for spares in range(low, self.cfg.spare_prompts_max + 1):
            margin = spares * (1 - d) - own * d
            if margin >= Z * math.sqrt((spares + own) * d * (1 - d)):
                return spares
        return self.cfg.spare_prompts_max

    def observe(self, dead: int, total: int) -> None:
        """A first sampling was scored: `dead` of its `total` groups were dead."""
        if total:
            self.seen.append((dead, total))

    def state_dict(self) -> dict:
        return {"seen": [list(x) for x in self.seen]}
