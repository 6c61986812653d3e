"""Directories and files of one user in a place others can write (/dev/shm, /tmp): made private,
and checked before each use, so that nobody else can plant a link, a file or a directory there
that the owner would then write through or read from.

A shared directory such as /dev/shm or /tmp lets any user create names in it. A name this user
did not create, or a directory others may write, is refused (NotPrivate, naming the path and
what to do), never used:
- a directory is lstat'ed (a symlink is refused, never followed), must be owned by the expected
  user and must not be writable by its group or others;
- a file is opened with O_NOFOLLOW (and O_EXCL when it is made), then fstat'ed: a regular file
  of the expected owner with one link (a hard link to another file would make a write land in
  that file too).

Guarantees (tests/unit/test_private_dirs.py, tests/trainer/test_slot_ring_privacy.py):
- A path that fails a check is refused before anything is written into it or read from it.
- `make_private_dir` leaves a directory of mode 0700 owned by this user, or raises.
"""

from __future__ import annotations

import errno
import os
import stat

from . import exit_codes

GROUP_OR_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


class NotPrivate(PermissionError):
    """A path another user could have made or could change: the message names it and what to do."""

    exit_code = exit_codes.USAGE

    def __init__(self, path: str | os.PathLike, problem: str, remedy: str = ""):
        remedy = remedy or f"remove {path} if it is not yours to keep, and run again"
        super().__init__(errno.EPERM, f"{path} {problem}: refused; {remedy}")
        self.path = str(path)


def dir_problem(st: os.stat_result, owner: int) -> str | None:
    """Why a directory's lstat result is not a private directory of `owner` (None: it is)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != owner:
        return f"is owned by uid {st.st_uid}, not {owner}"
    if st.st_mode & GROUP_OR_OTHER_WRITE:
        return f"is writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def file_problem(st: os.stat_result, owner: int) -> str | None:
    """Why an open file's fstat result is not a private file of `owner` (None: it is)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != owner:
        return f"is owned by uid {st.st_uid}, not {owner}"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links (another name writes the same file)"
    return None


def check_private_dir(path: str | os.PathLike, owner: int | None = None, remedy: str = "") -> os.stat_result:
    """The lstat of `path`, a private directory of `owner` (default: this user); NotPrivate else
    (FileNotFoundError when it is not there)."""
    owner = os.geteuid() if owner is None else owner
    st = os.lstat(path)
    problem = dir_problem(st, owner)
    if problem:
        raise NotPrivate(path, problem, remedy)
    return st


def make_private_dir(path: str | os.PathLike, remedy: str = "") -> os.stat_result:
    """Create `path` with mode 0700 unless it is there; either way it must then be a private
    directory of this user (NotPrivate else). Its parent must exist."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    return check_private_dir(path, remedy=remedy)


def open_private_file(
    path: str | os.PathLike, flags: int, owner: int | None = None, *, create: bool = False, remedy: str = ""
) -> int:
    """An fd of `path` opened with `flags` and O_NOFOLLOW, checked to be a private file of
    `owner` (default: this user); NotPrivate else (ELOOP from a symlink becomes NotPrivate too).
    `create`: make it (mode 0600, O_EXCL) when it is not there."""
    owner = os.geteuid() if owner is None else owner
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        if not create:
            raise
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # made meanwhile (by whom?): open it as an existing one, checked
            return open_private_file(path, flags, owner, remedy=remedy)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotPrivate(path, "is a symbolic link", remedy) from None
        raise
    try:
        problem = file_problem(os.fstat(fd), owner)
        if problem:
            raise NotPrivate(path, problem, remedy)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def shared_parent_problem(st: os.stat_result) -> str | None:
    """Why a parent directory (stat, following links: /tmp may be one) lets others replace what this
    user makes in it: writable by others without the sticky bit. None when it does not."""
    if st.st_mode & GROUP_OR_OTHER_WRITE and not st.st_mode & stat.S_ISVTX:
        return f"is writable by others without the sticky bit (mode {stat.S_IMODE(st.st_mode):04o})"
    return None
