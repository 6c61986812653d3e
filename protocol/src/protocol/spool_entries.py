"""The spool's file names and directory entries: how a request id becomes a file name and back,
how a claim's name carries its worker id, and what one scan of a directory sees.

Names only, no I/O but `scan`; the spool's modules (spool.py says which) build on them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .messages import is_valid_id

JSON_SUFFIX = ".json"


@dataclass(frozen=True)
class Entry:
    """One directory entry as a scan saw it."""

    name: str
    path: Path
    mtime: float  # when the file was written (renames keep it)
    ctime: float  # when it last moved (renames set it)
    size: int

    @property
    def request_id(self) -> str | None:
        """The id this entry names, or None when its name is not `<valid id>.json`."""
        return id_from_name(self.name)


def name_for_id(request_id: str) -> str:
    """`<request_id>.json`: the name of a request in requests/ and of its result in results/."""
    return f"{request_id}{JSON_SUFFIX}"


def id_from_name(name: str) -> str | None:
    """Inverse of name_for_id: the id, or None when `name` is not `<valid id>.json`."""
    if not name.endswith(JSON_SUFFIX):
        return None
    stem = name[: -len(JSON_SUFFIX)]
    return stem if is_valid_id(stem) else None


def claimed_name(name: str, worker_id: str) -> str:
    """The name in claimed/ of the entry `name` of requests/ claimed by `worker_id`."""
    if name.endswith(JSON_SUFFIX):
        return f"{name[: -len(JSON_SUFFIX)]}@{worker_id}{JSON_SUFFIX}"
    return f"{name}@{worker_id}"


def split_claimed_name(claimed: str) -> tuple[str, str]:
    """Inverse of claimed_name: (original name, worker id). Worker ids contain no '@'."""
    suffix = JSON_SUFFIX if claimed.endswith(JSON_SUFFIX) else ""
    base = claimed[: len(claimed) - len(suffix)]
    original, _, worker_id = base.rpartition("@")
    return original + suffix, worker_id


def scan(directory: Path) -> list[Entry]:
    """The entries of `directory`, in no order; one that moves away while listed is left out."""
    entries = []
    with os.scandir(directory) as it:
        for d in it:
            try:
                st = d.stat(follow_symlinks=False)
            except FileNotFoundError:  # moved away while we listed
                continue
            entries.append(Entry(d.name, Path(d.path), st.st_mtime, st.st_ctime, st.st_size))
    return entries
