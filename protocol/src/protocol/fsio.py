"""Durable, atomic file publication on a POSIX filesystem.

A file is written under a unique name in a scratch directory, fsynced, then linked (no replace)
or renamed (replace) into its final directory, and that directory is fsynced. A reader of the
final directory therefore sees either nothing or the whole file, and after the directory fsync
the file survives a power cut. Scratch files left by a crash are harmless and pruned by age.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

FILE_MODE = 0o664  # group-writable, so one spool can be shared by a service group


def scratch_name(stem: str) -> str:
    """A scratch file name no other writer, in this process or another, will pick."""
    # The stem is cut so that the name stays well under the 255-byte file-name limit.
    return f"{stem[:120]}.{os.getpid()}.{secrets.token_hex(6)}.tmp"


def write_synced(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Create `path` (which must not exist) with `data`, fsynced unless told otherwise."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    except BaseException as exc:
        os.unlink(path)  # a full disk leaves no partial file behind: nobody could use it
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(path)  # write() and fsync() name no file: the log should
        raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def naming_final(final: Path) -> Iterator[None]:
    """An OSError raised while publishing `final` names it too ('scratch' -> 'final'), so a
    log says which file could not be written, not only which scratch file."""
    try:
        yield
    except OSError as exc:
        if exc.filename2 is None and exc.filename != str(final):
            exc.filename2 = str(final)
        raise


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# What link() answers where the filesystem cannot make hard links at all (FAT says EPERM; for a
# file this process just made, EPERM is no question of permission).
LINK_UNSUPPORTED = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK, errno.EXDEV})


class LinksUnsupported(OSError):
    """link() failed for want of hard links in the filesystem, not because of one file: every
    publish there fails the same way."""


def link_no_replace(scratch: Path, final: Path) -> bool:
    """Hard-link `scratch` to `final` unless `final` exists; always removes `scratch`.

    Returns True when this call created `final`. link() fails with EEXIST rather than replace,
    which is what makes "the first result wins" hold between racing writers.

    Over NFSv3 a link() whose reply was lost is sent again, and the retry fails with EEXIST
    although the first attempt made the link. So on EEXIST a `final` with the same content as
    `scratch` counts as ours (a racing writer's file differs: it names its writer and its time).
    """
    try:
        os.link(scratch, final)
        return True
    except FileExistsError:
        return _same_content(scratch, final)
    except OSError as exc:
        if exc.errno in LINK_UNSUPPORTED:
            raise LinksUnsupported(
                exc.errno, f"{exc.strerror} (its filesystem makes no hard links)", str(scratch), None, str(final)
            ) from None
        raise
    finally:
        os.unlink(scratch)


def _same_content(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes (False when either is gone or is not a regular
    file: a FIFO planted under a result's name must not block the writer that meets it)."""
    fds = []
    try:
        for path in (a, b):
            fds.append(_open_regular(path))
        if os.fstat(fds[0]).st_size != os.fstat(fds[1]).st_size:
            return False
        while True:
            chunk = os.read(fds[0], 1 << 20)
            if chunk != _read_exactly(fds[1], len(chunk)):
                return False
            if not chunk:
                return True
    except (FileNotFoundError, NotRegularFile):
        return False
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink under the final name is not our file
            return False
        raise
    finally:
        for fd in fds:
            os.close(fd)


def _read_exactly(fd: int, size: int) -> bytes:
    """Up to `size` bytes from `fd`, fewer only at its end."""
    chunks = []
    while size > 0:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def publish(scratch_dir: Path, final: Path, data: bytes, *, replace: bool = False, durable: bool = True) -> bool:
    """Atomically make `final` hold `data`. See link_no_replace for the return value.

    With `replace` the file is renamed over any existing one (always True). With `durable`
    false there is no fsync: the file is still never seen partial, but may vanish in a power
    cut (good enough for heartbeats, which are rewritten every few seconds).
    """
    scratch = scratch_dir / scratch_name(final.name)
    with naming_final(final):
        write_synced(scratch, data, fsync=durable)
        if replace:
            os.rename(scratch, final)
            created = True
        else:
            created = link_no_replace(scratch, final)
    if durable and created:
        fsync_dir(final.parent)
    return created


class NotRegularFile(OSError):
    """A path that is a FIFO, a device, a socket or a directory where a regular file was expected."""


def read_regular_file(path: str | os.PathLike, max_bytes: int) -> bytes:
    """Read a file someone else may have written: never blocks, never follows a symlink, reads
    only a regular file, and at most `max_bytes`.

    O_NONBLOCK makes opening a FIFO return at once (a plain open waits for a writer forever) and
    fstat then refuses it; O_NOFOLLOW refuses a symlink as the last component (OSError ELOOP).
    Raises NotRegularFile for FIFOs, devices, sockets and directories, and ValueError when the
    file is larger than allowed, without reading it all.
    """
    fd = _open_regular(path)
    try:
        data = _read_exactly(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes} bytes")
    return data


def _open_regular(path: str | os.PathLike) -> int:
    """An fd open for reading on the regular file `path`; never blocks, never follows a final
    symlink (OSError ELOOP); NotRegularFile for anything else."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise NotRegularFile(errno.EINVAL, f"{kind}, not a regular file", str(path))
    return fd


def replace_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Make `path` hold `data`, replacing what it held: readers see the old file or the new
    one, never a part. The scratch file lives beside `path`, on its filesystem."""
    publish(path.parent, path, data, replace=True, durable=durable)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (and `root`), children before parents, so
    that a later rename of `root` publishes contents that survive a power cut."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(directory))
