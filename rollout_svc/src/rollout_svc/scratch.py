"""Directories of one worker process (adapter copies, rebuilt delta weights): named by its pid, so
that the next process of this user removes those whose process is gone (a SIGKILLed worker
cannot remove its own, and they can be a model's size)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from protocol.leases import process_exists


def own_dir(parent: Path, prefix: str) -> Path:
    """A new directory `prefix<pid>-<random>` in `parent`, after removing this user's others there
    whose process no longer exists."""
    for entry in parent.glob(f"{prefix}*-*"):
        pid = entry.name.removeprefix(prefix).split("-", 1)[0]
        try:
            if pid.isdigit() and entry.lstat().st_uid == os.getuid() and not process_exists(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue  # gone meanwhile
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
