"""A run facing error results, from the user's side: the trainer through the real spool (its
rollout service, `rollout.spawn = false`), rollouts served by a worker stand-in that fails the
requests a test picks as a worker does (failing_server.FailingSpoolServer).

- An engine error costs a request sent again; the run goes on and trains exactly as the same run
  without the error (the request sent again asks the same, seed included).
- A permanent error stops `trainer-svc train` with exit 2 and a message naming the request, the
  error and what to do; relaunched once the cause is gone, the run goes on from its checkpoint
  instead of stopping again on that old result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_config
from failing_server import FailingSpoolServer, first

from protocol import exit_codes
from protocol.messages import ErrorCode
from trainer_svc.config import dump
from trainer_svc.run.loop import train

TRAINER = str(Path(sys.executable).parent / "trainer-svc")
TIMING_KEYS = {"rollout_s", "generate_s", "score_s", "train_s", "publish_s", "save_s", "step_s"}


def step_rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def of_step(step: int, run: str):
    return lambda request: request.request_id.startswith(f"{run}-train-s{step:08d}-")


@pytest.mark.timeout(300)
def test_an_engine_error_is_sent_again_and_the_run_trains_as_without_it(warm_model, tmp_path):
    shape = dict(train={"steps": 3}, rollout={"spawn": False, "spool": str(tmp_path / "spool")})
    clean = make_config(tmp_path / "clean", warm_model, **shape)
    flaky = make_config(tmp_path / "flaky", warm_model, **shape)
    server = FailingSpoolServer(tmp_path / "spool", clean, first(1, ErrorCode.ENGINE_ERROR, of_step(1, "flaky")))
    server.start()
    try:
        assert train(clean) == exit_codes.OK
        assert train(flaky) == exit_codes.OK
    finally:
        server.stop()
    (failed,) = server.failed
    assert failed.startswith("flaky-train-s00000001-") and f"{failed}-r1" in server.answered
    assert step_rows(flaky.run_dir) == step_rows(clean.run_dir)


@pytest.mark.timeout(400)
def test_a_permanent_error_stops_the_run_and_the_relaunch_goes_on_once_its_cause_is_gone(warm_model, tmp_path):
    # Step 1's request is sent while step 0 trains (ahead = 1) and saved in the checkpoint of step 1.
    cfg = make_config(
        tmp_path / "run",
        warm_model,
        train={"steps": 3},
        rollout={"spawn": False, "spool": str(tmp_path / "spool"), "ahead": 1, "max_policy_lag": 1},
    )
    config_file = tmp_path / "run.toml"
    config_file.write_bytes(dump(cfg))
    refusing = [True]  # the worker refuses the weights of step 1's request until its options are fixed
    server = FailingSpoolServer(
        tmp_path / "spool",
        cfg,
        lambda request: ErrorCode.WEIGHTS_NOT_ALLOWED if refusing[0] and of_step(1, "run")(request) else None,
    )
    server.start()
    try:
        stopped = subprocess.run([TRAINER, "train", str(config_file)], capture_output=True, text=True, timeout=300)
        assert stopped.returncode == exit_codes.USAGE, stopped.stderr[-3000:]
        (refused,) = server.failed
        message = stopped.stderr
        assert f"rollout request {refused} was refused" in message and "weights_not_allowed" in message
        assert "permanent" in message and "relaunch" in message
        assert (tmp_path / "run" / "checkpoints" / "step_00000001").is_dir()

        refusing[0] = False
        relaunched = subprocess.run([TRAINER, "train", str(config_file)], capture_output=True, text=True, timeout=300)
    finally:
        server.stop()
    assert relaunched.returncode == exit_codes.OK, relaunched.stderr[-3000:]
    assert server.failed == [refused] and f"{refused}-r1" in server.answered
    assert [row["step"] for row in step_rows(tmp_path / "run")] == [1, 2, 3]
