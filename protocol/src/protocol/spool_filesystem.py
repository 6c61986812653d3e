"""Whether the spool's filesystem does what the spool needs: hard links (a result is published with
link(), which never replaces: the first result wins) and rename() over an existing file (status
files, claims). FAT, exFAT and some FUSE mounts lack links; without this check every result
would fail as if it were one bad file, forever.

`spoolctl init`, `rollout-svc serve` and every SpoolClient check once, at start, with a file of
their own in tmp/, and refuse with one message naming what is missing.

Guarantees (tests/unit/test_hostile_spool_reads.py, tests/e2e/test_spool_filesystem.py):
- The check leaves no file behind, and raises only SpoolUnsupported (a SpoolError) for what the
  filesystem lacks; a probe file that cannot be written at all (a full disk, no permission)
  decides nothing: the spool's own writes report that as they do without the check.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from . import fsio
from .spool_layout import SpoolError
from .watch import filesystem_type

_FIX = "put the spool on ext4, xfs, btrfs, tmpfs or NFS"


class SpoolUnsupported(SpoolError):
    """The spool's filesystem lacks hard links or atomic rename; the message says which."""


def check_filesystem(root: str | os.PathLike) -> None:
    """Raise SpoolUnsupported unless link() and rename() over a file work in `root`/tmp."""
    tmp = Path(root) / "tmp"
    first, second = tmp / fsio.scratch_name(".fs-check"), tmp / fsio.scratch_name(".fs-check")
    linked = tmp / fsio.scratch_name(".fs-check")
    try:
        fsio.write_synced(first, b"link", fsync=False)
        fsio.write_synced(second, b"rename", fsync=False)
    except OSError:
        _remove(first, second)
        return  # nothing to judge by; the spool's own writes will say what is wrong
    try:
        try:
            os.link(first, linked)
        except OSError as exc:
            if exc.errno in fsio.LINK_UNSUPPORTED:
                raise SpoolUnsupported(
                    f"spool {Path(root)} is on a filesystem without hard links ({_fstype(tmp)}: link() failed: "
                    f"{exc.strerror}): the spool needs link() for exactly-once results; {_FIX}"
                ) from None
            raise
        try:
            os.rename(second, linked)  # over an existing file, as status files are replaced
        except OSError as exc:
            if exc.errno in fsio.LINK_UNSUPPORTED or exc.errno == errno.EEXIST:
                raise SpoolUnsupported(
                    f"spool {Path(root)} is on a filesystem without atomic rename over a file ({_fstype(tmp)}: "
                    f"rename() failed: {exc.strerror}): the spool needs it for claims and status files; {_FIX}"
                ) from None
            raise
    finally:
        _remove(first, second, linked)


def _remove(*paths: Path) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _fstype(path: Path) -> str:
    return filesystem_type(path) or "filesystem type unknown"
