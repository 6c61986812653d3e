"""A run you can follow from its log: where stderr is a file (nohup, systemd), `trainer-svc train`
logs a line per step (at most one every `log.every_s`; the first, the last and each canary step
always) with the step, reward, accuracy, loss, seconds, the longest phase and the generated tokens
per second; a long wait on rollouts says what the workers do and where a spawned worker's log is."""

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
def test_a_run_logged_to_a_file_says_the_first_the_canary_and_the_last_step(warm_model, tmp_path):
    spool_dir = tmp_path / "spool"
    cfg = make_config(
        tmp_path / "run",
        warm_model,
        train={"steps": 4},
        rollout={"spawn": False, "spool": str(spool_dir)},
        canary={"every": 3, "problems": 4},
        log={"every_s": 1e6},  # no line between the ones always logged
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
        r"step (\d)/4: reward [-\d.]+, accuracy [\d.]+, loss [-\d.]+(, canary [\d.]+)?; "
        r"[\d.]+ s \((?:rollout|train|publish|save) [\d.]+ s the longest\)(.*)",
        text,
    )
    assert [(int(step), bool(canary)) for step, canary, _ in lines] == [(1, False), (3, True), (4, False)], text[-3000:]
    assert all(re.fullmatch(r", \d+ generated tokens/s", rate) for _, _, rate in lines), lines


def test_the_step_lines_are_throttled_but_keep_the_first_the_last_and_each_canary_step(caplog):
    import logging

    from trainer_svc.run.outputs import Progress

    clock = [0.0]
    progress = Progress(10, 0, every_s=10.0, terminal=False, clock=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="trainer_svc.run.outputs"):
        for step, t in [(1, 0.0), (2, 4.0), (3, 9.9), (4, 10.0), (5, 12.0), (6, 15.0), (7, 22.0), (8, 23.0),
                        (9, 23.5), (10, 24.0)]:  # fmt: skip
            clock[0] = t
            canary = {"canary_accuracy": 0.5} if step == 5 else {}
            progress.update({"step": step, "reward_mean": 0.1, "loss": 0.0, **canary})
    logged = [int(re.match(r"step (\d+)/10", r.getMessage())[1]) for r in caplog.records]
    # 1 the first; 4 ten seconds on; 5 a canary (and the next ten seconds count from it); 7; 10 the last
    assert logged == [1, 4, 5, 7, 10]
    assert "canary 0.50" in caplog.records[2].getMessage()


def test_log_every_s_0_logs_every_step(caplog):
    import logging

    from trainer_svc.run.outputs import Progress

    progress = Progress(3, 0, every_s=0.0, terminal=False, clock=lambda: 5.0)
    with caplog.at_level(logging.INFO, logger="trainer_svc.run.outputs"):
        for step in (1, 2, 3):
            progress.update({"step": step, "reward_mean": 0.1, "loss": 0.0})
    assert [r.getMessage()[:8] for r in caplog.records] == ["step 1/3", "step 2/3", "step 3/3"]


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
    assert len(said) == 2, said  # at 31 s, then 30 s on while its engine is still building (not at 50 s)
    assert said[0].startswith("step 0's rollouts (train): waiting for 31 s; workers: run-rollout building its engine")
    assert said[1].startswith("step 0's rollouts (train): waiting for 92 s")
    assert all(f"its log: {tmp_path / 'rollout-worker.log'}" in line for line in said)


def test_a_spawned_worker_not_yet_heard_from_is_named_with_its_log_every_30_s(tmp_path, caplog):
    import logging

    from protocol.spool import Spool
    from trainer_svc.rollout.waiting import WaitNotes

    spool = Spool(tmp_path / "spool", create=True)  # no status file: the worker is still importing its engine
    clock = [0.0]
    notes = WaitNotes("step 0's rollouts (train)", spool, tmp_path / "rollout-worker.log", clock=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="trainer_svc.rollout.waiting"):
        for t in (10.0, 30.0, 45.0, 60.0, 89.0, 90.0):
            clock[0] = t
            notes()
    said = [r.getMessage() for r in caplog.records]
    assert [line.split(";")[0] for line in said] == [
        f"step 0's rollouts (train): waiting for {t} s" for t in (30, 60, 90)
    ]
    assert all(
        line.endswith(f"has not written its status yet (its log: {tmp_path / 'rollout-worker.log'})") for line in said
    ), said


def test_a_wait_on_workers_already_serving_is_noted_every_minute(tmp_path, caplog):
    import logging
    import time

    from protocol.messages import WorkerStatus
    from protocol.spool import Spool
    from trainer_svc.rollout.waiting import WaitNotes

    spool = Spool(tmp_path / "spool", create=True)
    now = time.time()
    spool.write_status(
        WorkerStatus(
            worker_id="w0",
            pid=1,
            host="h",
            device="cpu",
            engine="vllm",
            state="generating",
            lease_s=60.0,
            started_at=now - 500,
            heartbeat_at=now,
        )  # fmt: skip
    )
    clock = [0.0]
    notes = WaitNotes("step 7's rollouts (train)", spool, None, clock=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="trainer_svc.rollout.waiting"):
        for t in (31.0, 61.0, 90.0, 91.0):
            clock[0] = t
            notes()
    said = [r.getMessage() for r in caplog.records]
    assert said == ["step 7's rollouts (train): waiting for 31 s; workers: w0 generating",
                    "step 7's rollouts (train): waiting for 91 s; workers: w0 generating"]  # fmt: skip
