"""EngineHost: an engine's own process, its answers and errors, and a close that leaves no
process of it behind (the child, what it started, a child that ignores the shutdown, one that
outlived its worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from protocol.messages import ErrorCode
from rollout_svc.engines.host import EngineHost, HostDied, HostError, descendants, wait_gone
from rollout_svc.errors import RequestFailed

pytestmark = pytest.mark.timeout(60)

HERE = Path(__file__).resolve().parent


def start(grace_s: float = 10.0, exit_wait_s: float = 10.0, **env) -> EngineHost:
    environment = dict(os.environ, PYTHONPATH=str(HERE), **env)
    return EngineHost("host_double", env=environment, grace_s=grace_s, exit_wait_s=exit_wait_s)


@pytest.fixture
def host():
    host = start()
    yield host
    host.close()


def test_calls_are_answered_in_order_by_a_process_of_its_own(host):
    assert host.call("echo", 1, "two", [3]) == (1, "two", [3])
    assert host.call("pid") == host.pid != os.getpid()
    assert host.alive()


def test_a_refused_request_comes_back_as_request_failed(host):
    with pytest.raises(RequestFailed) as caught:
        host.call("refuse", "prompt of 9999 tokens")
    assert caught.value.code == ErrorCode.PROMPT_TOO_LONG and caught.value.message == "prompt of 9999 tokens"
    assert host.call("echo", "still here") == ("still here",)


def test_a_failure_in_the_child_is_a_host_error_and_the_child_serves_on(host):
    with pytest.raises(HostError, match="ValueError: bad weights") as caught:
        host.call("fail", "bad weights")
    assert not isinstance(caught.value, HostDied)
    assert host.call("echo", 1) == (1,)


def test_a_dead_child_is_host_died_then_and_after(host):
    with pytest.raises(HostDied, match="exited with 3"):
        host.call("die")
    assert not host.alive()
    with pytest.raises(HostDied):
        host.call("echo", 1)


def test_close_ends_the_child_and_every_process_it_started(host):
    grandchild = host.call("spawn")
    assert grandchild in descendants(host.pid)
    pids = {host.pid, grandchild}
    host.close()
    assert wait_gone(pids, 0) == set()
    assert host.process.returncode == 0


def test_a_process_that_outlives_the_child_is_killed():
    host = start(exit_wait_s=0.5)
    stray = host.call("spawn", True)
    host.close()
    assert host.process.returncode == 0 and wait_gone({stray}, 0) == set()


def test_a_child_that_hangs_in_shutdown_is_killed_after_the_grace():
    host = start(grace_s=1.0, HOST_DOUBLE_LINGER="1")
    grandchild = host.call("spawn")
    started = time.monotonic()
    host.close()
    assert time.monotonic() - started < 15
    assert wait_gone({host.pid, grandchild}, 0) == set()
    assert host.process.returncode == -signal.SIGKILL


def test_an_interrupted_call_leaves_the_host_unusable_and_close_kills_it():
    host = start()
    grandchild = host.call("spawn")

    class Interrupted(Exception):
        pass

    def interrupt(*_):
        raise Interrupted()

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(Interrupted):
            host.call("sleep", 30)  # the answer never comes back to us
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not host.alive()
    with pytest.raises(HostDied, match="no longer answers"):
        host.call("echo", 1)
    host.close()
    assert wait_gone({host.pid, grandchild}, 0) == set()


def test_the_child_dies_with_a_worker_killed_alone(tmp_path):
    """The worker's process group is usually killed whole; a worker SIGKILLed alone must not
    leave its engine running either (the kernel's parent-death signal)."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "from rollout_svc.engines.host import EngineHost\n"
        f"host = EngineHost('host_double', env=dict(os.environ, PYTHONPATH={str(HERE)!r}))\n"
        f"open({str(pid_file)!r}, 'w').write(str(host.call('pid')))\n"
        "time.sleep(600)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert wait_gone({child}, 0) == {child}
        worker.kill()
        worker.wait()
        assert wait_gone({child}, 10) == set()
    finally:
        worker.kill()
        worker.wait()
