"""Request files the worker could not handle, skipped for a while so that one bad file neither
stops the worker nor keeps it busy.

A skipped entry is left out of the scans until its time is up (`first_s`, doubling at each new
failure up to `max_s`), and one log line says so at each failure, not at each scan. An entry
that changes (replaced, touched, moved away and back) is tried again at once.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from protocol.spool import Entry

log = logging.getLogger(__name__)


@dataclass
class _Skip:
    identity: tuple | None  # (mtime, ctime, size) as it was skipped; another identity is another file
    until: float  # monotonic time of the next try
    delay_s: float


class Skipped:
    def __init__(self, first_s: float = 10.0, max_s: float = 600.0):
        self.first_s = first_s
        self.max_s = max_s
        self._skips: dict[str, _Skip] = {}

    def skip(self, name: str, path: Path, error: BaseException, what: str) -> None:
        """Skip the entry `name` of requests/ (now at `path`) for a while after `error`; `what`
        says what failed and what to do."""
        identity = _identity_of(path)
        earlier = self._skips.get(name)
        # The same file failing again waits twice as long. Its ctime may differ: a claim given
        # back by this worker was moved, which sets it; its mtime and size stay.
        again = earlier is not None and _same_file(earlier.identity, identity)
        delay = min(self.max_s, earlier.delay_s * 2) if again else self.first_s
        self._skips[name] = _Skip(identity, time.monotonic() + delay, delay)
        log.error("%s: %s; the worker serves the other requests and tries this one again in %.1f s", what, error, delay)

    def servable(self, entries: list[Entry]) -> list[Entry]:
        """`entries` without those skipped now. Forgets entries that are gone."""
        now = time.monotonic()
        names = {e.name for e in entries}
        self._skips = {name: skip for name, skip in self._skips.items() if name in names}
        out = []
        for entry in entries:
            skip = self._skips.get(entry.name)
            if skip is not None and _same(skip.identity, _identity(entry)) and now < skip.until:
                continue
            out.append(entry)
        return out

    def __len__(self) -> int:
        return len(self._skips)


def _identity(entry: Entry) -> tuple:
    return (entry.mtime, entry.ctime, entry.size)


def _identity_of(path: Path) -> tuple | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None  # unknown: any file of that name counts as the one skipped
    return (st.st_mtime, st.st_ctime, st.st_size)


def _same(skipped: tuple | None, seen: tuple) -> bool:
    return skipped is None or skipped == seen


def _same_file(earlier: tuple | None, now: tuple | None) -> bool:
    return earlier is None or now is None or (earlier[0], earlier[2]) == (now[0], now[2])
