"""The spool's layout: its directories, and the one place each kind of file in them is named.

SpoolLayout is the base of the spool's parts (spool.py composes them into Spool): every part
goes through its path methods, so a file name is spelled out once.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import fsio
from .spool_entries import JSON_SUFFIX, Entry, claimed_name, name_for_id, scan

STATES = ("tmp", "requests", "claimed", "results", "done", "bad", "workers")
_RESULT_SUFFIX = ".result.json"
_REQUEST_SUFFIX = ".request.json"
_NOTE_SUFFIX = ".error.txt"


class SpoolError(RuntimeError):
    """The spool directory is missing, incomplete or unusable; the message says what to do."""


class SpoolLayout:
    """The directories of a spool rooted at `root` (set by Spool.__init__) and the paths of its files."""

    root: Path
    tmp: Path
    requests: Path
    claimed: Path
    results: Path
    done: Path
    bad: Path
    workers: Path

    def _check_layout(self) -> None:
        missing = [s for s in STATES if not (self.root / s).is_dir()]
        if missing:
            raise SpoolError(
                f"{self.root} is not a spool: missing {', '.join(m + '/' for m in missing)}. "
                f"Create it with `spoolctl init {self.root}` (or let `rollout-svc serve` create it)."
            )
        devices = {(self.root / s).stat().st_dev for s in STATES}
        if len(devices) > 1:
            raise SpoolError(
                f"the directories of spool {self.root} are on {len(devices)} filesystems; "
                "renames between them are not atomic. Keep all of them on one filesystem."
            )

    # -- paths: each kind of spool file is named here and nowhere else ---------------------------

    def request_path(self, request_id: str) -> Path:
        """requests/<request_id>.json: a request ready for any worker."""
        return self.requests / name_for_id(request_id)

    def claim_path(self, name: str, worker_id: str) -> Path:
        """claimed/<request_id>@<worker_id>.json: the entry `name` of requests/ once `worker_id`
        claimed it (an entry not named `<...>.json` becomes `<name>@<worker_id>`)."""
        return self.claimed / claimed_name(name, worker_id)

    def result_path(self, request_id: str) -> Path:
        """results/<request_id>.json: the one result of a request, until a producer consumes it."""
        return self.results / name_for_id(request_id)

    def archived_request_path(self, request_id: str) -> Path:
        """done/<request_id>.request.json: a served request, kept for audit and replay."""
        return self.done / f"{request_id}{_REQUEST_SUFFIX}"

    def consumed_result_path(self, request_id: str) -> Path:
        """done/<request_id>.result.json: a result once its producer consumed it."""
        return self.done / f"{request_id}{_RESULT_SUFFIX}"

    def bad_path(self, name: str) -> Path:
        """bad/<name>: an entry of requests/ that could not be accepted, under its own name."""
        return self.bad / name

    def bad_note_path(self, name: str) -> Path:
        """bad/<name>.error.txt: why the entry `name` (which has no valid id, hence no result)
        was refused; long names are cut."""
        return self.bad / f"{name[:200]}{_NOTE_SUFFIX}"

    def status_path(self, worker_id: str) -> Path:
        """workers/<worker_id>.json: a worker's status; its mtime is the heartbeat."""
        return self.workers / f"{worker_id}{JSON_SUFFIX}"

    def scratch_path(self, stem: str) -> Path:
        """tmp/<stem>.<pid>.<random>.tmp: a scratch file no other writer will pick."""
        return self.tmp / fsio.scratch_name(stem)

    def _free_bad_path(self, name: str) -> Path:
        """bad/<name>, or bad/<name>.<n> with the first n not taken: earlier rejects are kept.
        A name too long for a suffix is cut to make room (file names hold 255 bytes)."""
        target, n = self.bad_path(name), 1
        while os.path.lexists(target):
            suffix = f".{n}"
            target, n = self.bad_path(_cut_to_bytes(name, 255 - len(suffix)) + suffix), n + 1
        return target

    def entries(self, state: str) -> list[Entry]:
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}; one of {', '.join(STATES)}")
        return sorted(scan(self.root / state), key=lambda e: (e.mtime, e.name))


def _cut_to_bytes(name: str, limit: int) -> str:
    """`name` shortened to at most `limit` bytes once encoded, never splitting a character."""
    while len(os.fsencode(name)) > limit:
        name = name[:-1]
    return name
