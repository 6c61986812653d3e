"""Two real vLLM workers: one is SIGKILLed mid-generation and the other finishes its request
after the lease; an idle worker exits by itself and leaves no process behind.

The workers are shared by the module; each test starts again those it needs that an earlier
test (a kill, an idle exit) ended, so the tests run in any order and alone.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import ServedWorker, keep_running, poll

from protocol.messages import Request
from protocol.spool import Spool

pytestmark = pytest.mark.timeout(900)

LEASE_S = 4
IDLE_EXIT_S = 15
WORKERS = ("e2e-life-a", "e2e-life-b")


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    """The module's spool and its two workers, started by the tests that need them."""
    base = tmp_path_factory.mktemp("vllm-pair")
    spool = Spool(base / "spool", create=True)
    args = [
        "--engine", "vllm", "--allowed-root", str(models["root"]), "--weights", str(models["a"]),
        "--max-model-len", "256", "--lease", str(LEASE_S), "--heartbeat", "1", "--idle-exit", str(IDLE_EXIT_S),
    ]  # fmt: skip
    workers = {worker_id: ServedWorker(spool, worker_id, args, log_dir=base) for worker_id in WORKERS}
    try:
        yield spool, workers
    finally:
        for worker in workers.values():
            worker.kill()


@pytest.fixture
def pair(fleet):
    """Both workers running and ready, whatever earlier tests did to them."""
    spool, workers = fleet
    keep_running(*workers.values())
    return spool, workers


@pytest.fixture
def idle_workers(fleet) -> tuple[Spool, list[ServedWorker]]:
    """The workers running now (the survivor of a kill, say), or a freshly started one."""
    spool, workers = fleet
    running = [w for w in workers.values() if w.running()]
    if not running:
        running = [workers[WORKERS[0]]]
        keep_running(*running)
    return spool, running


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
    spool, workers = pair
    client = client_for(spool.root)
    request = Request(
        request_id=f"killed-{time.time_ns()}",
        weights_dir=str(models["a"]),
        prompts=["1+1="] * 32,
        n_samples_per_prompt=8,
        max_tokens=200,
        temperature=1.0,
        seed=5,
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
    os.killpg(workers[victim].proc.pid, signal.SIGKILL)  # the worker and its engine process
    workers[victim].proc.wait(timeout=30)
    survivor = next(w for w in WORKERS if w != victim)

    result = client.wait([request.request_id], timeout_s=600)[request.request_id]
    assert result.ok and result.worker_id == survivor
    assert len(result.texts) == 32 and all(len(samples) == 8 for samples in result.texts)
    # The survivor archives its claim just after it publishes the result.
    left = poll(lambda: os.listdir(spool.claimed) + os.listdir(spool.requests), until=lambda names: not names)
    assert left == []


def test_an_idle_worker_exits_by_itself_and_frees_the_device(idle_workers):
    spool, running = idle_workers
    for worker in running:
        proc = worker.proc
        assert proc.wait(timeout=IDLE_EXIT_S + 120) == 0
        assert not spool.status_path(worker.worker_id).exists()
        # The engine runs in child processes of the worker; none may outlive it.
        deadline = time.monotonic() + 30
        while session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert session_processes(proc.pid) == []
