"""The worker's side of private directories: a reader refuses a planted slot before it maps a byte
(a symlinked or hard-linked tensors.bin, a ring others can write), as a weights_invalid naming the
path; the worker's own scratch directories are private and never made where others could swap
them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from protocol.messages import ErrorCode
from protocol.private_dirs import NotPrivate
from protocol.weight_slots import SLOT_DATA, leases
from rollout_svc.errors import RequestFailed
from rollout_svc.scratch import own_dir
from rollout_svc.slot_load import MappedSlot, slot_lease

SECRET = b"\x01" * 4096  # a file of this user's that a planted slot would have a worker load


@pytest.fixture
def ring(tmp_path) -> Path:
    ring = tmp_path / "ring"
    (ring / "slot_0").mkdir(parents=True, mode=0o700)
    ring.chmod(0o700)
    return ring


def test_a_reader_refuses_a_symlinked_tensors_file_before_mapping_it(ring, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET)
    (ring / "slot_0" / SLOT_DATA).symlink_to(secret)
    with pytest.raises(NotPrivate, match=f"{ring / 'slot_0' / SLOT_DATA} is a symbolic link"):
        MappedSlot(str(ring / "slot_0"), pin=False)


def test_a_reader_refuses_a_hard_linked_tensors_file(ring, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET)
    os.link(secret, ring / "slot_0" / SLOT_DATA)
    with pytest.raises(NotPrivate, match="hard links"):
        MappedSlot(str(ring / "slot_0"), pin=False)


def test_a_ring_others_can_write_is_refused_as_weights_invalid_before_any_lease(ring):
    (ring / "slot_0" / SLOT_DATA).write_bytes(SECRET)
    ring.chmod(0o777)
    with pytest.raises(RequestFailed) as caught, slot_lease(str(ring / "slot_0"), "any", "w"):
        pass
    assert caught.value.code == ErrorCode.WEIGHTS_INVALID
    assert f"{ring} is writable by its group or others" in caught.value.message
    assert not (ring / "slot_0" / "readers").exists() and leases(ring / "slot_0") == []


def test_own_dir_is_private_and_refuses_a_parent_others_can_swap_it_in(tmp_path):
    made = own_dir(tmp_path, "scratch-")
    assert made.lstat().st_mode & 0o777 == 0o700 and made.lstat().st_uid == os.geteuid()
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # anyone may rename what is made there: no sticky bit
    with pytest.raises(NotPrivate, match="without the sticky bit"):
        own_dir(open_parent, "scratch-")
    assert list(open_parent.iterdir()) == []
    open_parent.chmod(0o1777)  # /tmp's mode: others cannot touch this user's entries
    assert own_dir(open_parent, "scratch-").parent == open_parent


def test_own_dirs_cleanup_never_follows_a_link_of_a_dead_process_name(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("kept")
    parent = tmp_path / "shared"
    parent.mkdir()
    (parent / "scratch-999999999-x").symlink_to(victim)  # a pid no process has
    (parent / "scratch-999999998-y").mkdir()
    (parent / "scratch-999999998-y" / "inner").symlink_to(victim)
    own_dir(parent, "scratch-")
    assert (victim / "keep.txt").read_text() == "kept"
    assert not (parent / "scratch-999999998-y").exists()  # a real dead directory is removed, link and all
