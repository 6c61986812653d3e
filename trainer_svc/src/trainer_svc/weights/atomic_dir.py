"""A directory put in place whole: built in a hidden staging sibling, then renamed over `dest`.

    with building(dest) as staging:               .<name>.<pid>.partial, beside dest
        ...write the files into staging...
    # here dest is the new directory, synced; an exception in the block removed staging instead

Every directory the trainer writes (published weights, checkpoints, the warm-up's model, an
imported model) is built this way.

Guarantees:

- Atomic: a reader of `dest` sees no directory, the previous complete one, or the new complete
  one, whenever the writer dies. Replacing an existing `dest` swaps the two directories in one
  step (renameat2 RENAME_EXCHANGE, Linux); where the filesystem cannot, the old one is renamed
  aside (a hidden `.partial` sibling too) first, and `dest` is briefly absent.
- Durable once move_into_place returns: the parent directory is fsynced after the rename (the
  files and the staging directory are the caller's to fsync before).
- The previous directory is removed after the swap. A writer killed before that leaves its
  staging (`.<name>.<pid>.partial`) or the old directory set aside (`.<name>.old.<pid>.partial`);
  remove_stale_partials clears them once that pid is gone, and never touches the staging of a
  writer that is alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from protocol.fsio import fsync_dir, fsync_tree
from protocol.leases import process_exists

PARTIAL_SUFFIX = ".partial"


@contextlib.contextmanager
def building(dest: Path, *, files_synced: bool = False) -> Iterator[Path]:
    """A fresh, empty staging directory for `dest` (what dead writers left beside it cleared
    first). When the block ends without an exception the staging is fsynced, files and all (only
    itself with `files_synced`: the caller fsynced each file as it wrote it), and moved into place;
    when it raises, the staging is removed and the exception goes on."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(dest.parent, dest.name + ".")
    staging = staging_dir(dest)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        if files_synced:
            fsync_dir(staging)
        else:
            fsync_tree(staging)
        move_into_place(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def staging_dir(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.{os.getpid()}{PARTIAL_SUFFIX}")


def remove_stale_partials(parent: Path, stem: str = "") -> list[Path]:
    """Remove hidden `.<stem>*.<pid>.partial` entries of `parent` whose writer is gone (no process
    with that pid on this host, or this process). A live writer's staging is left alone."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        name = entry.name
        if not (name.startswith("." + stem) and name.endswith(PARTIAL_SUFFIX)):
            continue
        pid = name[: -len(PARTIAL_SUFFIX)].rsplit(".", 1)[-1]
        if not pid.isdigit() or (int(pid) != os.getpid() and process_exists(int(pid))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def move_into_place(staging: Path, dest: Path) -> None:
    """Rename the complete `staging` to `dest`, replacing any `dest`, and fsync the parent."""
    if os.path.lexists(dest):
        if _exchange(staging, dest):  # staging now holds the old directory
            fsync_dir(dest.parent)
            shutil.rmtree(staging, ignore_errors=True)
            return
        aside = dest.with_name(f".{dest.name}.old.{os.getpid()}{PARTIAL_SUFFIX}")
        os.rename(dest, aside)
        os.rename(staging, dest)
        fsync_dir(dest.parent)
        shutil.rmtree(aside, ignore_errors=True)
        return
    os.rename(staging, dest)
    fsync_dir(dest.parent)


@functools.cache
def _renameat2():
    return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where unsupported."""
    fn = _renameat2()
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, f"swapping {a} with {b}: {os.strerror(err)}")
