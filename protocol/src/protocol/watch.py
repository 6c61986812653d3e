"""File events as hints: a Waker that wakes a scanner when a spool directory may have changed.

inotify loses events (queue overflow, bursts, files present before the watch starts) and sees
nothing written by other NFS clients, so nothing here says *what* changed: a wake-up only makes
the owner rescan the directory, and the owner also rescans on a timer. On filesystems without
inotify (NFS, Lustre, CIFS, FUSE) the Waker polls instead.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.polling import PollingObserver

try:
    from watchdog.observers.inotify_move_event_grouper import InotifyMoveEventGrouper
except ImportError:  # not Linux, or another watchdog layout: nothing to tune
    InotifyMoveEventGrouper = None

log = logging.getLogger(__name__)
# watchdog logs an ERROR when an event arrives while its observer is stopping; at our shutdown
# that is expected and says nothing about the spool.
logging.getLogger("watchdog.observers.inotify").setLevel(logging.CRITICAL)
# watchdog holds each unpaired IN_MOVED_FROM for half a second, hoping to pair it with an
# IN_MOVED_TO, and every event queued behind it waits too. Claims and consumed results move
# files out of watched directories all the time, so without this a new request or result would
# wake its reader up to 0.5 s late. Events are only hints here; pairs are not needed.
if InotifyMoveEventGrouper is not None:
    InotifyMoveEventGrouper.delay = 0.0

# Filesystem types on which inotify does not see other hosts' writes.
_NETWORK_FS = ("nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "gpfs", "beegfs", "9p")


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path`, from /proc/self/mounts ("" when unknown)."""
    path = Path(path).resolve()
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount_point = fields[1].replace("\\040", " ")
                inside = path == Path(mount_point) or Path(mount_point) in path.parents
                if inside and len(mount_point) > len(best):
                    best, fstype = mount_point, fields[2]
    except OSError:
        return ""
    return fstype


def needs_polling(path: Path) -> bool:
    fstype = filesystem_type(path)
    return fstype in _NETWORK_FS or fstype.startswith("fuse")


class _Wake(FileSystemEventHandler):
    def __init__(self, event: threading.Event):
        self._event = event

    def on_any_event(self, event: FileSystemEvent) -> None:
        self._event.set()


class Waker:
    """Sets an Event when any watched directory may have changed.

    Use as a context manager; `wait(timeout)` returns after a hint or after `timeout` seconds,
    whichever comes first, and the caller rescans either way.
    """

    def __init__(self, directories: list[Path], *, poll: bool | None = None, poll_interval_s: float = 1.0):
        self.directories = [Path(d) for d in directories]
        self.polling = any(needs_polling(d) for d in self.directories) if poll is None else poll
        self.poll_interval_s = poll_interval_s
        self._event = threading.Event()
        self._observer = None

    def _observer_for(self, polling: bool):
        observer = PollingObserver(timeout=self.poll_interval_s) if polling else Observer()
        for directory in self.directories:
            observer.schedule(_Wake(self._event), os.fspath(directory), recursive=False)
        return observer

    def __enter__(self) -> Waker:
        if not self.polling:
            try:  # watchdog opens the inotify instance in Observer() or at start(), by version
                self._observer = self._observer_for(polling=False)
                self._observer.start()
                return self
            except OSError as exc:  # inotify limits reached, or no inotify: poll instead
                log.warning("file events unavailable (%s); polling %s", exc, [str(d) for d in self.directories])
                self.polling = True
        self._observer = self._observer_for(polling=True)
        self._observer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)

    def wait(self, timeout: float) -> bool:
        """Block until a hint or `timeout`; True when woken by a hint. Clears the hint."""
        woke = self._event.wait(timeout)
        self._event.clear()
        return woke

    def poke(self) -> None:
        """Wake the waiter from another thread (shutdown, for instance)."""
        self._event.set()
