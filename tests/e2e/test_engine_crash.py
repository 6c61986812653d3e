"""A transient failure for real: `trainer-svc train` spawns its vLLM worker, and the worker's
engine process is killed in the middle of a call. The worker answers that request with
engine_error and builds a new engine; the trainer sends the request again under a fresh id
(`<id>-r1`, asking the same) and the run finishes (exit 0)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import engine_process, hanging_call, poll
from run_config import ROLLOUT_VENV, SMALL_STEPS, write_run_config

from protocol import exit_codes
from protocol.spool import Spool

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / ".venvs" / "trainer" / "bin" / "trainer-svc"
STEPS = 12  # many more than the one step taken before the engine is killed: the run is still going


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("engine-crash") / "tiny"
    subprocess.run([str(ROOT / ".venvs/rollout/bin/rollout-svc"), "tiny-model", str(path)], check=True)
    return path


def metrics_rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_an_engine_killed_mid_call_costs_one_resend_and_the_run_finishes(model, tmp_path):
    run_dir = tmp_path / "run"
    ours = {
        "run": {"dir": run_dir, "seed": 5},
        "model": {"path": model},
        # Every request names the starting weights the worker preloaded (one publish, at the
        # end): its calls never reload weights, so the call that hangs in the frozen engine is a
        # generation.
        "rollout": {"rollout_venv": ROLLOUT_VENV, "worker_args": ["--max-model-len", "64"], "max_policy_lag": STEPS},
        "publish": {"every": STEPS},
        "train": {"steps": STEPS},
        "tripwire": {"armed": False},  # the untrained tiny model answers at the length cap, which it flags
    }
    cfg = write_run_config(tmp_path / "run.toml", SMALL_STEPS, ours)
    log = tmp_path / "trainer.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(TRAINER), "train", str(cfg)], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
    worker_session = None
    try:
        taken = poll(lambda: metrics_rows(run_dir), lambda n: n >= 1 or proc.poll() is not None, timeout_s=600)
        assert taken >= 1 and proc.poll() is None, log.read_text()[-3000:]
        spool = Spool(run_dir / "spool")
        (worker,) = [s for _, s in spool.statuses() if s is not None]
        worker_session = worker.pid  # the spawned worker leads its own session, engines included
        engine = engine_process(worker.pid)
        os.kill(engine, signal.SIGSTOP)  # the worker's next engine call hangs in it...
        hanging_call(spool, time.monotonic())
        os.kill(engine, signal.SIGKILL)  # ...and the engine dies under it
        assert proc.wait(timeout=700) == exit_codes.OK, log.read_text()[-3000:]
    finally:
        for session in (proc.pid, worker_session):  # a failed test leaves no frozen engine behind
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.killpg(session, signal.SIGKILL)
    assert metrics_rows(run_dir) == STEPS
    results = {p.name: json.loads(p.read_text()) for p in (run_dir / "spool" / "done").glob("*.result.json")}
    failed = [r for r in results.values() if not r["ok"]]
    assert [r["error"]["code"] for r in failed] == ["engine_error"], failed
    assert results[f"{failed[0]['request_id']}-r1.result.json"]["ok"]
