"""A weight-slot ring planted before the trainer's first publish is refused, from the user's side:
the ring made beforehand (by this user, by another user, or open to everyone) with tensors.bin a
symlink or a hard link to a victim file, or a slot that is a symlink to a victim directory; the
trainer's real publish path (SlotRing as WeightSync uses it) refuses it with NotPrivate naming
the path and what to do, and the victim is unchanged. The trainer turns the refusal into exit 2.

The tests run as whatever user runs them; another user's ring is made with chown where this user
is root (else that case is skipped: only root can give a file away)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from protocol.private_dirs import NotPrivate, dir_problem
from protocol.weight_slots import SLOT_DATA, read_slot_manifest
from trainer_svc.weights.slots import SlotRing
from trainer_svc.weights.writer import as_stream

VICTIM_TEXT = b"a file of this user's that no publish may touch\n"
NOBODY = 65534


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM_TEXT)
    return path


def publish(ring_path: Path, base: Path) -> Path:
    """The trainer's publish path: a ring of 2 slots, a free slot chosen, the weights written."""
    ring = SlotRing(ring_path, 2, spool_dir=None, wait_s=0)
    slot = ring.choose()
    return ring.write(slot, 1, "run-step1", as_stream({"w": torch.ones(64, 33)}), None, base).path


def plant(ring: Path, mode: int = 0o700) -> Path:
    """A ring with its slot_0 made beforehand, as someone who guessed its name would."""
    (ring / "slot_0").mkdir(parents=True)
    ring.chmod(mode)
    (ring / "slot_0").chmod(mode)
    return ring / "slot_0"


def refused(ring: Path, base: Path, named: Path) -> str:
    with pytest.raises(NotPrivate) as caught:
        publish(ring, base)
    message = caught.value.strerror
    assert str(named) in message and "remove it" in message and "publish.slots_dir" in message, message
    return message


def test_a_symlinked_tensors_file_is_refused_and_its_target_is_untouched(tmp_path, base, victim):
    slot = plant(tmp_path / "ring")
    (slot / SLOT_DATA).symlink_to(victim)
    assert "symbolic link" in refused(tmp_path / "ring", base, slot / SLOT_DATA)
    assert victim.read_bytes() == VICTIM_TEXT


def test_a_ring_anyone_can_write_is_refused_before_anything_is_written(tmp_path, base, victim):
    slot = plant(tmp_path / "ring", 0o777)
    (slot / SLOT_DATA).symlink_to(victim)
    assert "writable by its group or others" in refused(tmp_path / "ring", base, tmp_path / "ring")
    assert victim.read_bytes() == VICTIM_TEXT
    assert sorted(p.name for p in slot.iterdir()) == [SLOT_DATA]  # no config, no manifest, no readers/


def test_a_hard_linked_tensors_file_is_refused_and_the_other_name_is_untouched(tmp_path, base, victim):
    slot = plant(tmp_path / "ring")
    os.link(victim, slot / SLOT_DATA)
    assert "hard links" in refused(tmp_path / "ring", base, slot / SLOT_DATA)
    assert victim.read_bytes() == VICTIM_TEXT


def test_a_slot_that_is_a_symlink_to_another_directory_is_refused(tmp_path, base):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "ring").mkdir(mode=0o700)
    (tmp_path / "ring" / "slot_0").symlink_to(elsewhere)
    refused(tmp_path / "ring", base, tmp_path / "ring" / "slot_0")
    assert list(elsewhere.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make a ring owned by another user")
def test_a_ring_owned_by_another_user_is_refused(tmp_path, base, victim):
    slot = plant(tmp_path / "ring", 0o755)
    (slot / SLOT_DATA).symlink_to(victim)
    for path in (tmp_path / "ring", slot):
        os.chown(path, NOBODY, NOBODY)
    assert f"owned by uid {NOBODY}" in refused(tmp_path / "ring", base, tmp_path / "ring")
    assert victim.read_bytes() == VICTIM_TEXT


def test_the_owner_check_refuses_another_users_directory_whoever_runs_it(tmp_path):
    """The check itself, fed another uid's stat: what a user who is not root can test."""
    st = os.lstat(tmp_path)
    assert dir_problem(st, os.geteuid()) is None
    assert dir_problem(st, os.geteuid() + 1) == f"is owned by uid {st.st_uid}, not {os.geteuid() + 1}"


def test_a_fresh_ring_is_private_and_a_publish_into_it_reads_back(tmp_path, base):
    os.umask(0o002)  # a group-writable default (the rollout unit's UMask) must not open the ring
    try:
        slot = publish(tmp_path / "ring", base)
    finally:
        os.umask(0o022)
    for path in (tmp_path / "ring", slot, slot / "readers"):
        assert os.lstat(path).st_mode & 0o777 == 0o700, path
    assert os.lstat(slot / SLOT_DATA).st_mode & 0o077 == 0
    assert read_slot_manifest(slot).step == 1


def test_the_trainer_refuses_a_planted_ring_at_launch_with_exit_2(tmp_path, tiny_model, victim):
    """`trainer-svc train` on slots, its ring planted open to everyone with tensors.bin linked to a
    victim file: exit 2 (a setting to fix), the message naming the ring, the victim unchanged."""
    import socket
    import time

    from typer.testing import CliRunner

    from protocol import exit_codes
    from protocol.messages import WorkerStatus
    from protocol.spool import Spool
    from protocol.weight_slots import ring_dir
    from trainer_svc.cli import app

    spool = Spool(tmp_path / "spool", create=True)  # a worker looks live there: the launch gets to the ring
    spool.write_status(WorkerStatus(worker_id="w", pid=os.getpid(), host=socket.gethostname(), device="cpu",
                                    engine="vllm", state="idle", started_at=time.time(), heartbeat_at=time.time(),
                                    lease_s=600.0))  # fmt: skip
    shm, run_dir = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    ring = ring_dir(shm, run_dir)
    (plant(ring, 0o777) / SLOT_DATA).symlink_to(victim)
    config = tmp_path / "run.toml"
    config.write_text(
        f'[run]\ndir = "{run_dir}"\n[model]\npath = "{tiny_model}"\n'
        f'[rollout]\nspawn = false\nspool = "{spool.root}"\nprompts_per_step = 4\nsamples_per_prompt = 4\n'
        f'max_tokens = 4\n[train]\nsteps = 2\n[publish]\nslots = "on"\nslots_dir = "{shm}"\n'
    )
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == exit_codes.USAGE, result.output
    assert f"{ring} is writable by its group or others" in result.output and "rm -r" in result.output
    assert "Traceback" not in result.output
    assert victim.read_bytes() == VICTIM_TEXT
