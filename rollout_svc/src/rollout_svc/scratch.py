"""Directories of one worker process (adapter copies, rebuilt delta weights): named by its pid, so
that the next process of this user removes those whose process is gone (a SIGKILLed worker
cannot remove its own, and they can be a model's size).

Guarantees (tests/unit/test_private_dirs.py):
- Private: a directory is made with mode 0700 (tempfile.mkdtemp, an unguessable name) and checked
  after (protocol.private_dirs), in a parent where nobody else can rename it away: a parent that
  others may write without the sticky bit (/tmp and /dev/shm have it) is refused (NotPrivate).
- The cleanup removes only real directories of this user (lstat: a link of that name is left
  alone), without following a link inside them (shutil.rmtree's fd-based walk).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from protocol.leases import process_exists
from protocol.private_dirs import NotPrivate, check_private_dir, shared_parent_problem


def own_dir(parent: Path, prefix: str) -> Path:
    """A new private directory `prefix<pid>-<random>` in `parent`, after removing this user's
    others there whose process no longer exists."""
    problem = shared_parent_problem(os.stat(parent))
    if problem:
        raise NotPrivate(parent, problem, "set TMPDIR to a directory of your own (or one with the sticky bit)")
    for entry in parent.glob(f"{prefix}*-*"):
        pid = entry.name.removeprefix(prefix).split("-", 1)[0]
        try:
            st = entry.lstat()
        except OSError:
            continue  # gone meanwhile
        if pid.isdigit() and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not process_exists(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
    made = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
    check_private_dir(made)
    return made
