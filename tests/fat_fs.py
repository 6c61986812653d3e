"""A FAT filesystem, which has no hard links: an image made with mkfs.vfat and mounted with
fusefat (FUSE, so no kernel vfat module is needed), for the spool's filesystem check.

Where the tools or /dev/fuse are missing the test fails naming what to install
(scripts/system_packages.sh installs them): a check that quietly did not run would prove nothing.

    with fat_mount(tmp_path / "fat") as mount_point:
        ...  # os.link() there fails with EPERM
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGES = "fusefat dosfstools"


@contextlib.contextmanager
def fat_mount(path: Path, size_kib: int = 8192) -> Iterator[Path]:
    """A FAT image of `size_kib` mounted read-write at `path`/mnt for the block's duration."""
    missing = [tool for tool in ("mkfs.vfat", "fusefat", "fusermount") if shutil.which(tool) is None]
    if not os.path.exists("/dev/fuse"):
        missing.append("/dev/fuse")
    if missing:
        pytest.fail(f"cannot mount FAT here: missing {', '.join(missing)}; `apt-get install -y {PACKAGES}`")
    path.mkdir(parents=True, exist_ok=True)
    image, mount_point = path / "fat.img", path / "mnt"
    mount_point.mkdir(exist_ok=True)
    subprocess.run(["mkfs.vfat", "-C", str(image), str(size_kib)], check=True, capture_output=True, timeout=60)
    subprocess.run(["fusefat", "-o", "rw+", str(image), str(mount_point)], check=True, capture_output=True, timeout=60)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mount_point) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.ismount(mount_point), f"fusefat did not mount {image} at {mount_point}"
        yield mount_point
    finally:
        subprocess.run(["fusermount", "-u", "-z", str(mount_point)], check=False, capture_output=True, timeout=60)
