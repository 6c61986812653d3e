"""A spool on a filesystem without hard links (FAT, through a real fusefat mount) is refused at
start, with one message naming what it lacks, by `spoolctl init`, by `rollout-svc serve` and by
a producer (SpoolClient, which the trainer's rollout service makes). Without the check a worker
would serve there and fail every result's link() as if it were one bad file, forever."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import BIN
from fat_fs import fat_mount

from protocol.client import SpoolClient
from protocol.spool_filesystem import SpoolUnsupported

pytestmark = pytest.mark.timeout(300)

LACKS = "without hard links"


def test_a_spool_on_fat_is_refused_by_init_the_worker_and_the_producer(tmp_path):
    with fat_mount(tmp_path / "fat") as mount_point:
        spool_dir = mount_point / "spool"
        init = subprocess.run(
            [str(BIN / "spoolctl"), "init", str(spool_dir)], capture_output=True, text=True, timeout=60
        )
        assert init.returncode == 2 and LACKS in init.stderr and "ext4" in init.stderr, init
        assert "fat" in init.stderr  # the filesystem named: fuse.fusefat
        assert os.listdir(spool_dir / "tmp") == []  # the check's files removed

        serve = subprocess.run(
            [str(BIN / "rollout-svc"), "serve", "--spool", str(spool_dir), "--engine", "echo", "--idle-exit", "5"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert serve.returncode == 2 and LACKS in serve.stderr, serve.stderr[-3000:]
        assert os.listdir(spool_dir / "workers") == []  # it never started serving

        with pytest.raises(SpoolUnsupported, match=LACKS):
            SpoolClient(spool_dir, create=False)
