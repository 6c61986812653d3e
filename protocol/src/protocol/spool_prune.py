"""Pruning the spool by age: done/ entries, tmp/ leftovers and dead workers' status files."""

from __future__ import annotations

import os
import time

from .spool_entries import scan
from .spool_layout import SpoolLayout


class Pruning(SpoolLayout):
    """The spool's housekeeping: what grows without bound is deleted once old enough."""

    def prune(
        self,
        *,
        done_older_than_s: float,
        tmp_older_than_s: float = 3600.0,
        dead_workers_older_than_s: float = 86400.0,
        now: float | None = None,
    ) -> dict[str, int]:
        """Delete done/ entries archived more than `done_older_than_s` ago, tmp/ leftovers
        older than `tmp_older_than_s` (a writer needs well under a second for a scratch file),
        and status files of workers silent for `dead_workers_older_than_s` (killed workers
        leave theirs; a live worker rewrites its own every few seconds)."""
        now = time.time() if now is None else now
        removed = {"done": 0, "tmp": 0, "workers": 0}
        limits = (("done", done_older_than_s), ("tmp", tmp_older_than_s), ("workers", dead_workers_older_than_s))
        for state, age_limit in limits:
            for entry in scan(self.root / state):
                # ctime: when the entry was moved here (rename keeps mtime, sets ctime); a
                # status file's age is its mtime, the heartbeat.
                age = now - (entry.mtime if state == "workers" else max(entry.ctime, entry.mtime))
                if age > age_limit:
                    try:
                        os.unlink(entry.path)
                        removed[state] += 1
                    except FileNotFoundError:
                        pass
        return removed
