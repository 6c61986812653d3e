"""`make test` does its own set-up: scripts/system_packages.sh installs the Debian packages the
tests use, or, where this user cannot install them, stops at once with one message naming them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "system_packages.sh"


def test_a_user_who_cannot_install_gets_one_message_naming_every_missing_package(tmp_path):
    # A PATH with only the shell, `env` and an `id` that answers as an ordinary user: every tool
    # the tests use is missing, and so are sudo and apt-get.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "env"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    (bin_dir / "id").write_text("#!" + shutil.which("bash") + "\necho 1000\n")
    (bin_dir / "id").chmod(0o755)
    done = subprocess.run(
        [str(bin_dir / "bash"), str(SCRIPT)], env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and "cannot install" in lines[0], done.stderr
    for package in ("systemd", "sshfs", "openssh-client", "bindfs", "fuse3", "mount"):
        assert f" {package}" in lines[0]
    assert "apt-get install -y" in lines[1]


def test_on_a_machine_that_has_everything_it_does_nothing():
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done
