"""Two real vLLM workers: one is SIGKILLed mid-generation and the other finishes its request
after the lease; then the survivor exits by itself when idle and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import ENGINE_START_TIMEOUT_S, kill_session, start_worker, wait_for_status
from protocol.messages import Request
from protocol.spool import Spool

pytestmark = pytest.mark.timeout(900)

LEASE_S = 4
IDLE_EXIT_S = 15
WORKERS = ("e2e-life-a", "e2e-life-b")


@pytest.fixture(scope="module")
def pair(models, tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-pair")
    spool = Spool(base / "spool", create=True)
    procs = {
        worker_id: start_worker(
            spool.root, worker_id,
            "--engine", "vllm", "--allowed-root", str(models["root"]), "--weights", str(models["a"]),
            "--max-model-len", "256", "--lease", str(LEASE_S), "--heartbeat", "1", "--idle-exit", str(IDLE_EXIT_S),
            log_dir=base,
        )
        for worker_id in WORKERS
    }
    try:
        for worker_id, proc in procs.items():
            wait_for_status(spool, worker_id, lambda s: s.state == "idle" and s.weights_dir, ENGINE_START_TIMEOUT_S, proc)
        yield spool, procs
    finally:
        for proc in procs.values():
            kill_session(proc)
            proc.wait(timeout=30)


def session_processes(session_id: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) == session_id:
                    pids.append(int(name))
            except ProcessLookupError:
                pass
    return pids


def test_a_worker_killed_mid_generation_is_replaced_after_the_lease(pair, models, client_for):
    spool, procs = pair
    client = client_for(spool.root)
    request = Request(
        request_id=f"killed-{time.time_ns()}", weights_dir=str(models["a"]), prompts=["1+1="] * 32,
        n_samples_per_prompt=8, max_tokens=200, temperature=1.0, seed=5,
    )
    client.submit(request)
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline:
        for _, status in spool.statuses():
            if status and status.state == "generating" and status.current_request == request.request_id:
                victim = status.worker_id
        time.sleep(0.05)
    assert victim is not None, "no worker started generating the request"
    os.killpg(procs[victim].pid, signal.SIGKILL)  # the worker and its engine process
    procs[victim].wait(timeout=30)
    survivor = next(w for w in WORKERS if w != victim)

    result = client.wait([request.request_id], timeout_s=600)[request.request_id]
    assert result.ok and result.worker_id == survivor
    assert len(result.texts) == 32 and all(len(samples) == 8 for samples in result.texts)
    assert os.listdir(spool.claimed) == [] and os.listdir(spool.requests) == []


def test_an_idle_worker_exits_by_itself_and_frees_the_device(pair):
    spool, procs = pair
    (survivor,) = [w for w, p in procs.items() if p.poll() is None]
    proc = procs[survivor]
    assert proc.wait(timeout=IDLE_EXIT_S + 120) == 0
    assert not (spool.workers / f"{survivor}.json").exists()
    # The engine runs in child processes of the worker; none may outlive it.
    deadline = time.monotonic() + 30
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert session_processes(proc.pid) == []
