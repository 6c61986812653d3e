"""Leases judged by change, as one observer sees it, never by comparing two hosts' clocks.

A worker's heartbeat is its status file in workers/, rewritten every few seconds. Comparing its
mtime with this host's clock compares two clocks when the worker runs elsewhere: the file
server's (NFS, sshfs) or the worker's own (Lustre and CephFS stamp mtimes with the writer's
clock). A worker whose clock runs hours behind would look dead while it beats; one hours ahead
would look alive for hours after it died.

So each observer (one per Spool object) remembers what it last saw of each heartbeat (its
mtime, size and the `heartbeat_at` it carries) and when, on its own monotonic clock, that last
changed. A heartbeat's age is the time since that change.

The first sight has no change to count from. The observer then takes the heartbeat's age on the
filesystem's clock: the mtime of a file it has just written in tmp/ minus the heartbeat's mtime
(on NFS and sshfs the server stamps both, so no two hosts' clocks meet). That guess serves
liveness hints (`live_workers`, a producer's "no live worker"), which correct themselves at the
next beat. Taking claims away is not done on a guess: a worker is dead for recovery only when
this observer has also watched its heartbeat stand still for half its lease, longer than any
live worker goes between beats (`Heartbeat` beats at least three times per lease), whatever the
clocks say.

Guarantees (tests/unit/test_many_hosts.py):
1. A worker that keeps beating is never judged dead, however far its clock is from the
   observer's or the file server's.
2. A worker that stops beating is judged dead once its heartbeat has stood still for its lease
   as the observer saw it (at most a lease after the later of the observer's first look and
   the last change it saw), however far ahead its clock was.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass


@dataclass
class Seen:
    signature: Hashable  # what the heartbeat looked like
    changed_at: float  # observer clock: when it last changed (first sight: estimated)
    watched_since: float  # observer clock: since when this observer has seen it unchanged


class HeartbeatWatch:
    """What one observer saw of each heartbeat, on its own clock (`clock`: monotonic seconds;
    injectable so tests need not sleep)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._seen: dict[Hashable, Seen] = {}

    def look(self, key: Hashable, signature: Hashable, first_sight_age: Callable[[], float]) -> Seen:
        """Record a look at heartbeat `key`; `first_sight_age()` (seconds, by the filesystem's
        clock) is asked only when this observer has never seen it."""
        now = self.clock()
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = Seen(signature, now - max(0.0, first_sight_age()), now)
        elif seen.signature != signature:
            seen.signature, seen.changed_at, seen.watched_since = signature, now, now
        return seen

    def age(self, seen: Seen, ahead_s: float = 0.0) -> float:
        """Seconds since the heartbeat last changed, as this observer knows it (`ahead_s`:
        judge as if that much more time had passed without a change)."""
        return self.clock() + ahead_s - seen.changed_at

    def dead(self, seen: Seen, lease_s: float, ahead_s: float = 0.0) -> bool:
        """Dead for recovery: older than the lease, and watched standing still for half of it (a
        live worker beats at least every third of its lease)."""
        watched = self.clock() + ahead_s - seen.watched_since
        return self.age(seen, ahead_s) > lease_s and watched >= lease_s / 2

    def forget_all_but(self, keys: set) -> None:
        """Drop what was seen of heartbeats that are gone (status files removed, claims moved)."""
        for key in [k for k in self._seen if k not in keys]:
            del self._seen[key]


def process_start(pid: int) -> int | None:
    """When the process `pid` of this host started (clock ticks since boot, /proc/PID/stat's 22nd
    field), so a record of a pid can tell its process from a later one given the same pid; None
    when it is gone, a zombie (it has exited), or there is no /proc to ask."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name, in parentheses, may hold anything
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def process_exists(pid: int) -> bool:
    """Whether a process with this pid lives on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
