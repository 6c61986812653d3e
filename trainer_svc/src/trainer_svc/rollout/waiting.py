"""What a step waiting on its rollouts says in the log, so that a run can be followed from it: a
line once the wait passes `first_s`, then one every `every_s` (every `first_s` while a worker is
still starting its engine, the wait a new run meets first), with how long it has waited, what each
live worker is doing and, for a worker the run spawned, where its log is: also before that worker
has said anything (its engine's imports alone take tens of seconds)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from protocol.spool import Spool

log = logging.getLogger(__name__)

BUSY_STARTING = {"starting": "starting", "loading": "building its engine"}


class WaitNotes:
    def __init__(
        self,
        what: str,
        spool: Spool,
        worker_log: Path | None,
        first_s: float = 30.0,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`worker_log`: the log of the worker this run spawned; None where it spawned none."""
        self.what, self.spool, self.worker_log = what, spool, worker_log
        self.clock = clock
        self.started = clock()
        self.next_note = self.started + first_s
        self.first_s, self.every_s = first_s, every_s

    def __call__(self) -> None:
        now = self.clock()
        if now < self.next_note:
            return
        workers, starting = self.workers()
        self.next_note = now + (self.first_s if starting else self.every_s)
        log.info("%s: waiting for %.0f s; %s", self.what, now - self.started, workers)

    def workers(self) -> tuple[str, bool]:
        """What the live workers do, and whether one of them (or the spawned one, not yet heard
        from) is still starting its engine."""
        where = f" (its log: {self.worker_log})" if self.worker_log is not None else ""
        live = self.spool.live_workers()
        if not live:
            if self.worker_log is not None:
                return f"the spawned rollout worker is starting and has not written its status yet{where}", True
            return f"no live worker serves {self.spool.root} yet", False
        doing = []
        for status in live:
            state = BUSY_STARTING.get(status.state, status.state)
            since = f" for {time.time() - status.started_at:.0f} s" if status.state in BUSY_STARTING else ""
            doing.append(f"{status.worker_id} {state}{since}")
        starting = any(status.state in BUSY_STARTING for status in live)
        return "workers: " + ", ".join(doing) + where, starting
