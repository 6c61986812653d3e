"""A run you can follow from its log: where stderr is a file (nohup, systemd), `trainer-svc train`
logs a line per step (at most one every 10 s; the first and last always) with the step, reward,
loss, seconds, the longest phase and the generated tokens per second."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_config
from spool_server import SpoolServer

from protocol import exit_codes
from trainer_svc.config import dump
from trainer_svc.run.outputs import step_line

TRAINER = str(Path(sys.executable).parent / "trainer-svc")


@pytest.mark.timeout(300)
def test_a_run_logged_to_a_file_says_each_step(warm_model, tmp_path):
    spool_dir = tmp_path / "spool"
    cfg = make_config(
        tmp_path / "run", warm_model, train={"steps": 3}, rollout={"spawn": False, "spool": str(spool_dir)}
    )
    config_file = tmp_path / "run.toml"
    config_file.write_bytes(dump(cfg))
    server = SpoolServer(spool_dir, cfg)
    server.start()
    try:
        with open(tmp_path / "train.log", "wb") as log:  # not a terminal: no bar could draw there
            done = subprocess.run([TRAINER, "train", str(config_file)], stdout=log, stderr=log, timeout=300)
    finally:
        server.stop()
    text = (tmp_path / "train.log").read_text()
    assert done.returncode == exit_codes.OK, text[-3000:]
    lines = re.findall(
        r"step (\d)/3: reward [-\d.]+.*, loss [-\d.]+; [\d.]+ s \((\w+) [\d.]+ s the longest\)(.*)", text
    )
    steps = [int(step) for step, _, _ in lines]
    assert steps[0] == 1 and steps[-1] == 3, text[-3000:]
    assert all(re.fullmatch(r", \d+ generated tokens/s", rate) for _, _, rate in lines), lines


def test_a_step_line_names_the_longest_phase_and_the_rate():
    row = {"step": 12, "reward_mean": 0.431, "accuracy": 0.5, "loss": 0.012, "step_s": 0.57, "rollout_s": 0.31,
           "train_s": 0.2, "publish_s": 0.05, "save_s": 0.0, "generated_tokens": 6400, "generate_s": 0.32}  # fmt: skip
    assert step_line(row, 200) == (
        "step 12/200: reward 0.431, accuracy 0.50, loss 0.012; 0.57 s (rollout 0.31 s the longest), "
        "20000 generated tokens/s"
    )


def test_a_long_wait_for_rollouts_says_what_the_workers_do_and_where_the_spawned_ones_log_is(tmp_path, caplog):
    import logging
    import time

    from protocol.messages import WorkerStatus
    from protocol.spool import Spool
    from trainer_svc.rollout.waiting import WaitNotes

    spool = Spool(tmp_path / "spool", create=True)
    now = time.time()
    spool.write_status(
        WorkerStatus(
            worker_id="run-rollout",
            pid=1,
            host="h",
            device="cpu",
            engine="vllm",
            state="loading",
            lease_s=60.0,
            started_at=now - 45,
            heartbeat_at=now,
        )  # fmt: skip
    )
    clock = [0.0]
    notes = WaitNotes("step 0's rollouts (train)", spool, tmp_path / "rollout-worker.log", clock=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="trainer_svc.rollout.waiting"):
        for t in (1.0, 29.0, 31.0, 50.0, 92.0):
            clock[0] = t
            notes()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # at 31 s, then a minute later
    assert said[0].startswith("step 0's rollouts (train): waiting for 31 s; workers: run-rollout building its engine")
    assert f"its log: {tmp_path / 'rollout-worker.log'}" in said[0]
