"""sd_notify: datagrams on a real Unix socket (a path and the abstract namespace), the watchdog
environment, and a real `rollout-svc serve` process talking to a socket as systemd would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import rollout_svc.notify as notify
from rollout_svc.notify import Notifier

pytestmark = pytest.mark.timeout(60)


class Listener:
    """The systemd side: a bound SOCK_DGRAM socket; each datagram is one message."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)

    def next(self, timeout: float = 5.0) -> str:
        self.sock.settimeout(timeout)
        return self.sock.recv(65536).decode()

    def until(self, predicate, timeout: float, what: str) -> list[tuple[float, str]]:
        """Messages with their arrival times, up to the first one for which predicate holds."""
        deadline = time.monotonic() + timeout
        got = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {what} within {timeout} s; received {[m for _, m in got]}")
            try:
                message = self.next(left)
            except TimeoutError:
                continue
            got.append((time.monotonic(), message))
            if predicate(message, got):
                return got

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def socket_path(tmp_path) -> Path:
    path = tmp_path / "n.sock"
    assert len(os.fsencode(path)) < 108, "AF_UNIX path limit"
    return path


@pytest.fixture
def listener(socket_path):
    listener = Listener(str(socket_path))
    yield listener
    listener.close()


def fields(message: str) -> dict[str, str]:
    lines = message.split("\n")
    assert all("=" in line for line in lines), message
    return dict(line.split("=", 1) for line in lines)


# -- messages ------------------------------------------------------------------------------------


def test_each_message_is_one_datagram_of_newline_separated_assignments(listener, socket_path):
    notifier = Notifier({"NOTIFY_SOCKET": str(socket_path), "WATCHDOG_USEC": "2000000"})
    assert notifier.enabled and notifier.address == str(socket_path)
    notifier.ready("idle; no weights loaded")
    notifier.status("generating r1")
    notifier.watchdog()
    notifier.stopping()
    notifier.send(READY=1, STATUS="x", ERRNO=0)
    assert listener.next() == "READY=1\nSTATUS=idle; no weights loaded"
    assert listener.next() == "STATUS=generating r1"
    assert listener.next() == "WATCHDOG=1"
    assert listener.next() == "STOPPING=1"
    assert listener.next() == "READY=1\nSTATUS=x\nERRNO=0"


def test_an_address_starting_with_at_is_in_the_abstract_namespace():
    name = f"rollout-svc-test-{os.getpid()}-{uuid.uuid4().hex}"
    listener = Listener("\0" + name)
    try:
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.address == "\0" + name
        notifier.ready("idle")
        notifier.stopping()
        assert listener.next() == "READY=1\nSTATUS=idle"
        assert listener.next() == "STOPPING=1"
    finally:
        listener.close()


def test_without_notify_socket_nothing_is_sent(monkeypatch):
    opened = []
    monkeypatch.setattr(notify.socket, "socket", lambda *a, **k: opened.append(a) or pytest.fail("socket opened"))
    for environ in ({}, {"NOTIFY_SOCKET": ""}, {"WATCHDOG_USEC": "1000000"}):
        notifier = Notifier(environ)
        assert not notifier.enabled
        notifier.ready("idle")
        notifier.status("x")
        notifier.watchdog()
        notifier.stopping()
    assert opened == []


def test_the_process_environment_is_read_by_default(monkeypatch, listener, socket_path):
    monkeypatch.setenv("NOTIFY_SOCKET", str(socket_path))
    monkeypatch.setenv("WATCHDOG_USEC", "500000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    notifier = Notifier()
    assert notifier.enabled and notifier.watchdog_s == 0.5
    notifier.watchdog()
    assert listener.next() == "WATCHDOG=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not Notifier().enabled


@pytest.mark.parametrize("where", ["missing", "regular_file", "nobody_listening"])
def test_a_socket_that_cannot_take_the_message_raises_nothing(tmp_path, where):
    path = tmp_path / "gone.sock"
    if where == "regular_file":
        path.write_text("")
    elif where == "nobody_listening":
        Listener(str(path)).close()  # bound once, then closed: the path stays, nobody reads
    notifier = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000"})
    assert notifier.enabled and notifier.watchdog_s == 1.0  # it does try: each call must not raise
    notifier.ready("idle")
    notifier.watchdog()
    notifier.stopping()


# -- watchdog ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "environ, watchdog_s",
    [
        ({"WATCHDOG_USEC": "1000000"}, 1.0),
        ({"WATCHDOG_USEC": "250000", "WATCHDOG_PID": str(os.getpid())}, 0.25),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": ""}, None),
        ({"WATCHDOG_USEC": "1e6"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_PID": str(os.getpid())}, None),
        ({}, None),
    ],
)
def test_watchdog_settings(environ, watchdog_s):
    assert Notifier(environ).watchdog_s == watchdog_s


@pytest.mark.parametrize("environ", [{"WATCHDOG_PID": "1", "WATCHDOG_USEC": "1000000"}, {}])
def test_no_watchdog_pings_when_the_watchdog_is_not_ours(listener, socket_path, environ):
    notifier = Notifier({"NOTIFY_SOCKET": str(socket_path), **environ})
    notifier.watchdog()
    notifier.status("marker")  # datagrams on one socket arrive in order
    assert listener.next() == "STATUS=marker"


def test_watchdog_pings_for_our_own_pid(listener, socket_path):
    notifier = Notifier(
        {"NOTIFY_SOCKET": str(socket_path), "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    )
    notifier.watchdog()
    assert listener.next() == "WATCHDOG=1"


# -- a real worker process -----------------------------------------------------------------------


def start_worker(tmp_path, socket_path) -> subprocess.Popen:
    """`rollout-svc serve --engine echo` with systemd's notification environment."""
    executable = Path(sys.executable).parent / "rollout-svc"
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env.update(NOTIFY_SOCKET=str(socket_path), WATCHDOG_USEC="1000000")
    command = [
        str(executable),
        "serve",
        "--spool",
        str(tmp_path / "spool"),
        "--engine",
        "echo",
        "--heartbeat",
        "0.5",
        "--lease",
        "3",
        "--idle-exit",
        "0",
        "--worker-id",
        "notify-test",
    ]
    with open(tmp_path / "worker.log", "wb") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def is_ready(message: str, _got) -> bool:
    return "READY=1" in message.split("\n")


def test_rollout_svc_serve_notifies_ready_watchdog_and_stopping(tmp_path, listener, socket_path):
    proc = start_worker(tmp_path, socket_path)
    try:
        ready = listener.until(is_ready, 20, "READY=1")
        ready_message = fields(ready[-1][1])
        assert ready_message["READY"] == "1"
        assert "no weights loaded; ok 0, failed 0" in ready_message["STATUS"]
        pings = listener.until(lambda _, got: sum(m == "WATCHDOG=1" for _, m in got) >= 3, 10, "three WATCHDOG=1")
        times = [t for t, m in pings if m == "WATCHDOG=1"]
        gaps = [b - a for a, b in zip([ready[-1][0], *times[:-1]], times, strict=True)]
        assert max(gaps) < 1.0, f"watchdog pings {gaps} s apart; WATCHDOG_USEC is 1 s"
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        listener.until(lambda m, _: m == "STOPPING=1", 10, "STOPPING=1")
        assert proc.wait(timeout=15) == 0, (tmp_path / "worker.log").read_text()
    finally:
        kill(proc)


def test_the_ready_status_says_the_worker_is_idle(tmp_path, listener, socket_path):
    proc = start_worker(tmp_path, socket_path)
    try:
        messages = [m for _, m in listener.until(is_ready, 20, "READY=1")][-1:]
        messages += [m for _, m in listener.until(lambda _, got: len(got) >= 3, 10, "three more messages")]
        statuses = [fields(m)["STATUS"] for m in messages if "STATUS" in fields(m)]
        assert statuses[-1].startswith("idle;"), statuses
    finally:
        kill(proc)
