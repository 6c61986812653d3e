"""deploy/: the systemd units verify cleanly and tmpfiles/sysusers create the spool as documented."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
INSTALL_PREFIX = "/opt/grpo"  # where the units expect the checkout
SPOOL_DIRS = ("tmp", "requests", "claimed", "results", "done", "bad", "workers")


def materialise_units(into: Path) -> Path:
    """The units as installed, with the checkout's path in place of the install prefix, so that
    verify can check that the interpreter they run exists."""
    unit_dir = into / "etc" / "systemd" / "system"
    unit_dir.mkdir(parents=True)
    for name in ("rollout-svc@.service", "rollout-svc@.path"):
        text = (DEPLOY / name).read_text().replace(INSTALL_PREFIX, str(ROOT))
        (unit_dir / name).write_text(text)
    return unit_dir


def verify(*units: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True)


def test_units_verify_without_a_single_warning(tmp_path):
    unit_dir = materialise_units(tmp_path)
    run = verify(unit_dir / "rollout-svc@0.service", unit_dir / "rollout-svc@3.path")
    # verify exits 0 even for unknown keys; it only prints them, so the output must be empty.
    assert run.returncode == 0 and run.stdout + run.stderr == "", run.stdout + run.stderr


def test_verify_would_catch_a_broken_unit(tmp_path):
    unit_dir = materialise_units(tmp_path)
    service = unit_dir / "rollout-svc@.service"
    service.write_text(service.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    run = verify(unit_dir / "rollout-svc@0.service")
    assert "restart specifier" in run.stdout + run.stderr


def test_service_runs_its_own_venv_interpreter_per_gpu():
    unit = (DEPLOY / "rollout-svc@.service").read_text()
    assert f"ExecStart={INSTALL_PREFIX}/.venvs/rollout/bin/python -m rollout_svc.cli serve" in unit
    assert "Environment=CUDA_VISIBLE_DEVICES=%i" in unit
    assert "Restart=on-failure" in unit and "EnvironmentFile=/etc/rollout-svc/rollout-svc.env" in unit
    assert "Type=notify" in unit and "WatchdogSec=" in unit


def test_path_unit_watches_the_spool_named_in_the_environment_file():
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / "rollout-svc.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    path_unit = (DEPLOY / "rollout-svc@.path").read_text()
    assert f"PathExistsGlob={env['ROLLOUT_SPOOL']}/requests/*.json" in path_unit
    assert "Unit=rollout-svc@%i.service" in path_unit


def test_sysusers_and_tmpfiles_create_a_group_shared_setgid_spool(tmp_path):
    (tmp_path / "etc").mkdir()
    users = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(DEPLOY / "sysusers.d" / "rollout-svc.conf")],
        capture_output=True,
        text=True,
    )
    assert users.returncode == 0, users.stderr
    gid = next(
        int(line.split(":")[2])
        for line in (tmp_path / "etc" / "group").read_text().splitlines()
        if line.startswith("rollout:")
    )
    files = subprocess.run(
        ["systemd-tmpfiles", "--create", f"--root={tmp_path}", str(DEPLOY / "tmpfiles.d" / "rollout-svc.conf")],
        capture_output=True,
        text=True,
    )
    assert files.returncode == 0, files.stderr
    spool = tmp_path / "srv" / "rollout-spool"
    for name in SPOOL_DIRS:
        st = os.stat(spool / name)
        assert stat.S_ISDIR(st.st_mode) and st.st_gid == gid
        assert st.st_mode & 0o7777 == 0o2775  # group-writable, setgid: new files keep the group
