"""Real rollout workers for end-to-end tests: processes, spools and tiny models.

A vLLM engine takes tens of seconds to start on a CPU, so workers are shared per module and
tests are written to run against a worker that has already served other requests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protocol.client import SpoolClient
from protocol.messages import WorkerStatus
from protocol.spool import Spool

BIN = Path(sys.executable).parent
ENGINE_START_TIMEOUT_S = 420.0


def start_worker(spool_dir: Path, worker_id: str, *args: str, log_dir: Path) -> subprocess.Popen:
    """`rollout-svc serve` in its own session, so a test can kill it with its engine process."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"{worker_id}.log", "ab")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [str(BIN / "rollout-svc"), "serve", "--spool", str(spool_dir), "--worker-id", worker_id, *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )


def wait_for_status(spool: Spool, worker_id: str, predicate, timeout_s: float, proc: subprocess.Popen | None = None) -> WorkerStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, status in spool.statuses():
            if status is not None and status.worker_id == worker_id and predicate(status):
                return status
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"worker {worker_id} exited with {proc.returncode} before reaching the state")
        time.sleep(0.2)
    raise AssertionError(f"worker {worker_id} did not reach the state within {timeout_s} s")


def stop_worker(proc: subprocess.Popen, timeout_s: float = 90.0) -> int:
    """SIGTERM, as systemd does; SIGKILL the whole session if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    kill_session(proc)
    return proc.returncode


def kill_session(proc: subprocess.Popen) -> None:
    """Leave no engine process behind: they share the worker's session id."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def build_model(path: Path, **options) -> Path:
    """A wide initialisation: greedy outputs with clear margins, so vLLM and transformers
    cannot disagree by rounding."""
    from rollout_svc.tiny_model import build

    return build(path, init_std=0.3, **options)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny models under one allowed root: a and b share an architecture, wide does not."""
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("models")
    return {
        "root": root,
        "a": build_model(root / "a", seed=0),
        "b": build_model(root / "b", seed=1),
        "wide": build_model(root / "wide", seed=2, hidden=192),
    }


@pytest.fixture(scope="session")
def reference():
    """transformers' view of a model directory, the yardstick for the engine's outputs."""
    from reference_model import Reference

    return Reference()


@pytest.fixture
def client_for():
    clients = []

    def make(spool_dir: Path) -> SpoolClient:
        client = SpoolClient(spool_dir, no_worker_grace_s=30)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
