"""Worker status files and liveness: workers publish their status (its mtime is the heartbeat);
observers judge by it which workers live (leases.py says how), which of them wait for work (a
worker leaves the parts of a call to its idle peers), and give a dead worker's claims back to
requests/.

A status file that does not read (a FIFO, a symlink, a device, past MAX_STATUS_BYTES) or does not
decode is no worker: it never blocks a reader, never counts as live or idle, and its claims are
judged by their own age; the first such failure of each file name is logged, not every scan.
"""

from __future__ import annotations

import functools
import logging
import os
import time

from . import fsio
from .leases import HeartbeatWatch, Seen
from .messages import MessageError, WorkerStatus, decode_status, encode_pretty
from .spool_entries import JSON_SUFFIX, Entry, scan, split_claimed_name
from .spool_layout import SpoolLayout

DEFAULT_LEASE_S = 30.0
MAX_STATUS_BYTES = 2**20  # a status file is a few hundred bytes; a larger one is not a worker's
WAITING_STATES = ("idle", "sleeping")  # a worker in these states takes the next request it finds

log = logging.getLogger(__name__)


class Liveness(SpoolLayout):
    """Spool methods for worker status files, heartbeats and the recovery of dead workers' claims."""

    _workers_watch: HeartbeatWatch  # by status file name; set by Spool.__init__
    _claims_watch: HeartbeatWatch  # claims without a readable status, by name; set by Spool.__init__
    _unreadable_statuses: set[str]  # status file names whose failure was logged; set by Spool.__init__

    def write_status(self, status: WorkerStatus) -> None:
        # Not fsynced: it is rewritten every few seconds and only its freshness matters.
        fsio.publish(self.tmp, self.status_path(status.worker_id), encode_pretty(status), replace=True, durable=False)

    def remove_status(self, worker_id: str) -> None:
        try:
            os.unlink(self.status_path(worker_id))
        except FileNotFoundError:
            pass

    def statuses(self) -> list[tuple[Entry, WorkerStatus | None]]:
        """Every status file with its decoded content (None when it does not read or decode)."""
        entries = [entry for entry in scan(self.workers) if entry.name.endswith(JSON_SUFFIX)]
        self._unreadable_statuses &= {entry.name for entry in entries}  # a name back later is logged again
        return [(entry, self._read_status(entry)) for entry in entries]

    def _read_status(self, entry: Entry) -> WorkerStatus | None:
        """The status in `entry`, or None (logged once per file name) when there is none to read."""
        try:
            return decode_status(fsio.read_regular_file(entry.path, MAX_STATUS_BYTES))
        except FileNotFoundError:
            return None  # the worker stopped since the listing
        except (OSError, ValueError) as exc:  # MessageError is a ValueError
            if entry.name not in self._unreadable_statuses:
                self._unreadable_statuses.add(entry.name)
                why = exc.message if isinstance(exc, MessageError) else exc.strerror or str(exc)
                log.warning("workers/%s is not a worker's status (%s); counted as no worker", entry.name, why)
            return None

    def filesystem_now(self) -> float:
        """Now by the clock that stamps this spool's files (the file server's on NFS and sshfs,
        the writer's on Lustre): the mtime of a file just written in tmp/."""
        probe = self.scratch_path(".clock")
        fsio.write_synced(probe, b"", fsync=False)
        try:
            return os.stat(probe).st_mtime
        finally:
            os.unlink(probe)

    def heartbeats(self) -> list[tuple[Entry, WorkerStatus | None, Seen]]:
        """Every status file, its content (None when unreadable), and what this Spool's observer
        has seen of it (leases.py: ages by change, on this process's clock)."""
        fs_now = functools.cache(self.filesystem_now)  # asked once, and only at a first sight
        out = []
        for entry, status in self.statuses():
            signature = (entry.mtime, entry.size, status.heartbeat_at if status is not None else None)
            seen = self._workers_watch.look(entry.name, signature, lambda e=entry: fs_now() - e.mtime)
            out.append((entry, status, seen))
        self._workers_watch.forget_all_but({entry.name for entry, _, _ in out})
        return out

    def live_workers(self, now: float | None = None) -> list[WorkerStatus]:
        """Workers whose heartbeat changed within their lease, as this observer saw it (a first
        sight counts the heartbeat's age on the filesystem's clock). `now` judges as if the
        wall clock read `now`."""
        ahead = 0.0 if now is None else now - time.time()
        watch = self._workers_watch
        return [s for _, s, seen in self.heartbeats() if s is not None and watch.age(seen, ahead) <= s.lease_s]

    def idle_peers(self, worker_id: str | None, enough: int) -> list[str]:
        """Ids of live workers other than `worker_id` whose status says they wait for work (idle
        or sleeping): they could take a request now. At most `enough` of them: status files are
        read, in listing order, only until that many are found, and the own file never, so a
        scan costs one listing and at most a read per other worker (none when `enough` is 0)."""
        if enough <= 0:
            return []
        fs_now = functools.cache(self.filesystem_now)  # asked once, and only at a first sight
        own = None if worker_id is None else self.status_path(worker_id).name
        peers = []
        for entry in scan(self.workers):
            if entry.name == own or not entry.name.endswith(JSON_SUFFIX):
                continue
            status = self._read_status(entry)
            if status is None:  # gone, not a file, or not a status
                continue
            signature = (entry.mtime, entry.size, status.heartbeat_at)
            seen = self._workers_watch.look(entry.name, signature, lambda e=entry: fs_now() - e.mtime)
            if status.state in WAITING_STATES and self._workers_watch.age(seen) <= status.lease_s:
                peers.append(status.worker_id)
                if len(peers) >= enough:
                    break
        return peers

    def recover_stale(self, default_lease_s: float = DEFAULT_LEASE_S, now: float | None = None) -> list[str]:
        """Put back in requests/ every claim whose worker is dead; returns their names.

        A worker is dead when its heartbeat (its status file) has not changed for its own
        lease, as this observer saw it, and the observer watched it stand still for at least
        half the lease (leases.py: a first look never takes claims). A claim without a
        readable status file is judged the same way by the claim itself and `default_lease_s`.
        `now` judges as if the wall clock read `now` (the time since passing without change).
        """
        ahead = 0.0 if now is None else now - time.time()
        heartbeats = {s.worker_id: (seen, s.lease_s) for _, s, seen in self.heartbeats() if s is not None}
        fs_now = functools.cache(self.filesystem_now)  # asked once, and only at a first sight
        claims = scan(self.claimed)
        self._claims_watch.forget_all_but({entry.name for entry in claims})
        recovered = []
        for entry in claims:
            original, worker_id = split_claimed_name(entry.name)
            if worker_id in heartbeats:
                seen, lease = heartbeats[worker_id]
                watch = self._workers_watch
            else:
                age = lambda e=entry: fs_now() - e.ctime  # noqa: E731
                seen, lease = self._claims_watch.look(entry.name, (entry.ctime, entry.mtime), age), default_lease_s
                watch = self._claims_watch
            if not watch.dead(seen, lease, ahead):
                continue
            try:
                os.rename(entry.path, self.requests / original)
            except FileNotFoundError:
                continue  # finished or recovered by someone else meanwhile
            recovered.append(original)
        return recovered
