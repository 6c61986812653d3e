"""A really small filesystem for full-disk tests: a tmpfs of a given size, mounted by the test.

Mounting needs root (CAP_SYS_ADMIN), which the test machines and CI have. Where the mount
cannot be made the test fails with a message naming what is missing: a full-disk test that
quietly did not run would prove nothing.

    with small_tmpfs(tmp_path / "disk", 2 * 2**20) as disk:
        ...  # writes past 2 MiB fail with ENOSPC
        disk.grow(64 * 2**20)  # room again, the files kept
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


class SmallTmpfs:
    def __init__(self, path: Path, size_bytes: int):
        self.path = path
        self.size_bytes = size_bytes

    def grow(self, size_bytes: int) -> None:
        """Resize in place (the files stay): a full disk that an operator made room on."""
        _mount_cmd(["-o", f"remount,size={size_bytes}", str(self.path)])
        self.size_bytes = size_bytes

    def fill(self, leave_bytes: int = 0) -> Path:
        """Take all the free space but `leave_bytes` with one file; returns it (delete it to free)."""
        filler = self.path / ".filler"
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize - leave_bytes
        # Unbuffered: a process writing to the disk meanwhile makes the last writes fail, and a
        # buffer left holding their bytes would fail again, raising, at close.
        with open(filler, "ab", buffering=0) as f:
            chunk = b"\0" * 2**16
            while free > 0:
                try:
                    free -= f.write(chunk[: min(len(chunk), free)])
                except OSError:
                    break
        return filler

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize


def _mount_cmd(args: list[str]) -> None:
    try:
        subprocess.run(["mount", *args], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise RuntimeError("full-disk tests need `mount` (util-linux) on PATH") from None
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(
            f"full-disk tests mount a small tmpfs and need root (CAP_SYS_ADMIN): `mount {' '.join(args)}` "
            f"failed: {exc.stderr.strip()}"
        ) from None


@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[SmallTmpfs]:
    """A tmpfs of `size_bytes` mounted at `path` (created) for the block's duration."""
    path.mkdir(parents=True, exist_ok=True)
    _mount_cmd(["-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", str(path)])
    try:
        yield SmallTmpfs(path, size_bytes)
    finally:
        # Lazy: a process the test started may still hold a file open there.
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
