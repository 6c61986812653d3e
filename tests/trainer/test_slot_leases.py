"""Readers' leases on weight slots, from real reader processes: a live reader outside the writer's
spool (an eval worker) holds its slot however long it reads, while the writer publishes on into
the other slots; a SIGKILLed reader's lease is released; a pid reused by another process does
not hold a slot; a lease judged by its age is kept fresh while it is held.

Run as a script, this file is the reader process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from protocol.leases import process_start  # noqa: E402
from protocol.weight_slots import SLOT_DATA, LeaseJudge, leases, read_slot_manifest, reading  # noqa: E402
from trainer_svc.weights.slots import SlotRing  # noqa: E402
from trainer_svc.weights.writer import as_stream  # noqa: E402

SHORT_LEASE_S = 0.5  # the age rule's lease, shortened so that a test outlives it many times over
DEADLINE_S = 60.0  # generous bounds on waits for another process


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"model.embed_tokens.weight": torch.randn(64, 33, generator=g), "lm_head.weight": torch.randn(40, 33)}


@pytest.fixture
def base(tmp_path) -> Path:
    path = tmp_path / "base"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}\n')
    return path


def publish(ring: SlotRing, step: int, base: Path) -> Path | None:
    slot = ring.choose()
    if slot is None:
        return None
    return ring.write(slot, step, f"run-step{step}", as_stream(weights(step)), None, base).path


def start_reader(slot: Path, tmp_path: Path) -> subprocess.Popen:
    """A reader process holding a lease on `slot` (no status file anywhere: an eval worker)."""
    ready = tmp_path / "reader-ready"
    reader = subprocess.Popen([sys.executable, __file__, "hold", str(slot), str(ready)])
    deadline = time.monotonic() + DEADLINE_S
    while not ready.exists():
        assert reader.poll() is None, "the reader exited"
        assert time.monotonic() < deadline, "the reader never took its lease"
        time.sleep(0.05)
    return reader


def test_a_live_reader_holds_its_slot_past_the_lease_time_while_the_writer_publishes(base, tmp_path):
    ring = SlotRing(tmp_path / "ring", 3, spool_dir=None, wait_s=0)
    ring.judge = LeaseJudge(None, default_lease_s=SHORT_LEASE_S)  # no spool: the age rule, if any, is quick
    held = publish(ring, 1, base)
    before = (held / SLOT_DATA).read_bytes()
    reader = start_reader(held, tmp_path)
    try:
        started, step = time.monotonic(), 1
        # Publish on for many times the lease (at least 8 publishes): the old rule released a
        # lease without a status file once it was older than the lease.
        while time.monotonic() - started < 8 * SHORT_LEASE_S or step < 9:
            step += 1
            assert publish(ring, step, base) not in (None, held), f"step {step} went into the held slot"
            assert (held / SLOT_DATA).read_bytes() == before, "the held slot's tensors were rewritten"
            time.sleep(0.05)
        assert [lease.reader for lease in leases(held)] == ["eval-worker"]  # still there, after all that time
        assert reader.poll() is None
    finally:
        reader.kill()
        reader.wait()
    # SIGKILLed: its process is gone, so its lease holds nothing; the slot is written again at once.
    written = {publish(ring, step + n, base) for n in (1, 2)}
    assert held in written
    assert leases(held) == []
    assert read_slot_manifest(held).step in (step + 1, step + 2)


def test_a_lease_whose_pid_now_belongs_to_another_process_is_released(tmp_path):
    slot = tmp_path / "slot_0"
    slot.mkdir(mode=0o700)
    (slot / "readers").mkdir(mode=0o700)
    judge = LeaseJudge(None)
    pid = os.getpid()
    record = {"reader": "w", "pid": pid, "host": os.uname().nodename, "pidns": os.readlink("/proc/self/ns/pid")}
    (slot / "readers" / "w.1.lease").write_text(json.dumps(record | {"start": process_start(pid)}))
    assert judge.held(slot)  # this process, this start: a live reader
    (slot / "readers" / "w.1.lease").write_text(json.dumps(record | {"start": process_start(pid) - 1}))
    assert judge.held(slot) == []  # same pid, another start: the reader it named is gone
    assert leases(slot) == []


def test_a_lease_judged_by_its_age_is_kept_fresh_while_it_is_held(tmp_path):
    """A reader the judge cannot know by its process (another pid namespace) is judged by its lease
    file's age: the reader touches it while it holds it."""
    now = [0.0]
    judge = LeaseJudge(None, default_lease_s=5.0, clock=lambda: now[0])
    judge._pidns = "pid:[another namespace]"  # the judge's view from a container of its own
    slot = tmp_path / "slot_0"
    slot.mkdir(mode=0o700)
    with reading(slot, "w", refresh_s=0.05) as lease:
        assert judge.held(slot)
        taken = lease.path.stat().st_mtime_ns
        deadline = time.monotonic() + DEADLINE_S
        while lease.path.stat().st_mtime_ns == taken:
            assert time.monotonic() < deadline, "the lease was never touched"
            time.sleep(0.01)
        now[0] += 60.0  # long past the lease on the judge's clock, but the file changed since the last look
        assert judge.held(slot)
    assert leases(slot) == []


def _hold(slot: str, ready: str) -> None:
    with reading(slot, "eval-worker"):
        Path(ready).write_text("held")
        signal.pause()  # until SIGKILL


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        _hold(sys.argv[2], sys.argv[3])
