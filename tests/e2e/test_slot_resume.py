"""A run on weight slots beside its spawned vLLM worker, stopped (SIGTERM, exit 75), its ring then
removed as a reboot would empty /dev/shm, and relaunched: the relaunch spawns a new worker, makes
the ring again, publishes the checkpoint's weights into the slot its requests name, and takes the
same steps as the run never stopped (on the session's shared worker, through directories: the
same weights give the same samples, test_trainer_process's determinism note)."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
from test_trainer_process import SPAWNED, interrupt_after, launch, log_tail, setting, step_rows, write_config

from protocol import exit_codes
from protocol.weight_slots import ring_dir

pytestmark = pytest.mark.timeout(1200)
__all__ = ["setting"]  # the module fixture of test_trainer_process: its uninterrupted run's rows


def test_a_relaunch_on_slots_after_the_ring_was_lost_takes_the_same_steps(setting):
    base = setting["base"]
    run_dir, shm = base / "lost-ring", base / "lost-ring-shm"
    shm.mkdir()
    spawned = {"rollout": {**SPAWNED, "spool": base / "lost-ring-spool"}, "publish": {"slots_dir": shm}}
    config = write_config(base / "lost-ring.toml", run_dir, setting["model"], setting["spool"].root, **spawned)
    interrupt_after(config, run_dir, 2, lambda proc: proc.send_signal(signal.SIGTERM))
    done = base / "lost-ring-spool" / "done"
    before_relaunch = set(done.glob("*.request.json"))
    ring = ring_dir(shm, run_dir)
    assert any((slot / "slot.json").is_file() for slot in ring.glob("slot_*")), "the stop kept no slot"
    shutil.rmtree(ring)  # a reboot: /dev/shm is empty at the relaunch

    finished = launch(config)
    assert finished.wait(timeout=900) == exit_codes.OK, log_tail(finished)
    assert step_rows(run_dir) == setting["expected"]
    banner = json.loads((run_dir / "stage_result.json").read_text())["banner"]
    assert banner["weight_sync"].startswith("shared-memory slots"), banner["weight_sync"]
    relaunched = [json.loads(p.read_text())["weights_dir"] for p in set(done.glob("*.request.json")) - before_relaunch]
    assert any(d.startswith(f"{ring}/slot_") for d in relaunched), relaunched  # from the ring it made again
