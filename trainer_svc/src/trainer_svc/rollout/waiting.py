"""What a step waiting on its rollouts says in the log, so that a run can be followed from it: a
line once the wait passes `first_s`, then one every `every_s`, with how long it has waited, what
each live worker is doing (a worker still building its engine says so) and, for a worker the run
spawned, where its log is."""

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
        self.what, self.spool, self.worker_log = what, spool, worker_log
        self.clock = clock
        self.started = clock()
        self.next_note = self.started + first_s
        self.every_s = every_s

    def __call__(self) -> None:
        now = self.clock()
        if now < self.next_note:
            return
        self.next_note = now + self.every_s
        log.info("%s: waiting for %.0f s; %s", self.what, now - self.started, self.workers())

    def workers(self) -> str:
        live = self.spool.live_workers()
        if not live:
            return f"no live worker serves {self.spool.root} yet"
        doing = []
        for status in live:
            state = BUSY_STARTING.get(status.state, status.state)
            since = f" for {time.time() - status.started_at:.0f} s" if status.state in BUSY_STARTING else ""
            doing.append(f"{status.worker_id} {state}{since}")
        where = f" (its log: {self.worker_log})" if self.worker_log is not None else ""
        return "workers: " + ", ".join(doing) + where
