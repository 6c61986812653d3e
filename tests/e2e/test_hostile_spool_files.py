"""No file in the spool freezes a worker or a producer, tried on real `rollout-svc serve` processes,
real producers and `spoolctl` in their own processes, and real FIFOs (a plain open() of a FIFO
waits for a writer forever).

A FIFO in workers/, requests/, claimed/ and results/: the worker serves new requests, a producer's
wait ends at its deadline, a result that is a FIFO is reported as that request's error,
`spoolctl stats` and `show` finish, SIGTERM stops the worker, and an idle worker still exits
when its idle time is up. Every producer action runs in a child process with a generous
deadline, so a freeze fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import BIN, start_worker, stop_worker, wait_for_status

from protocol.spool import Spool

pytestmark = pytest.mark.timeout(400)

ECHO = ("--engine", "echo", "--heartbeat", "0.5", "--lease", "5")
DEADLINE_S = 60  # far beyond what any of these steps needs; only a freeze reaches it


def log_of(log_dir: Path, worker_id: str) -> str:
    return (log_dir / f"{worker_id}.log").read_text(errors="replace")


def producer(spool: Path, code: str) -> subprocess.CompletedProcess:
    """Run `code` with `client` (a SpoolClient of `spool`) and `echo_request` defined, in a child
    process that must end within DEADLINE_S."""
    prelude = f"""
        from protocol.client import SpoolClient, ResultTimeout
        from protocol.messages import Request
        def echo_request(request_id):
            return Request(request_id=request_id, weights_dir="/models/any", prompts=[request_id],
                           n_samples_per_prompt=1, max_tokens=4, temperature=0.0)
        client = SpoolClient({str(spool)!r}, no_worker_grace_s=30)
    """
    script = textwrap.dedent(prelude) + textwrap.dedent(code)
    try:
        return subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=DEADLINE_S, env=dict(os.environ)
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"a producer froze on the spool's FIFOs (still running after {DEADLINE_S} s):\n{code}")


def spoolctl(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([str(BIN / "spoolctl"), *args], capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`spoolctl {' '.join(args)}` froze on the spool's FIFOs (still running after {DEADLINE_S} s)")


def plant_fifos(spool: Spool) -> None:
    os.mkfifo(spool.workers / "zz.json")  # a "worker" whose status never reads
    os.mkfifo(spool.requests / "fifo.json")
    os.mkfifo(spool.claimed / "fifo2@ghost.json")
    os.mkfifo(spool.results / "planted.json")  # the result a producer will wait for


def test_fifos_in_the_spool_freeze_no_worker_and_no_producer(tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    worker = start_worker(spool.root, "w", *ECHO, "--idle-exit", "0", log_dir=tmp_path)
    try:
        wait_for_status(spool, "w", lambda s: s.state == "idle", 60, worker)
        plant_fifos(spool)

        served = producer(
            spool.root,
            """
            client.submit(echo_request("after-fifo"))
            result = client.wait(["after-fifo"], timeout_s=50)["after-fifo"]
            print("served", result.ok, result.worker_id)
            """,
        )
        assert served.stdout.strip() == "served True w", served.stderr[-3000:] + log_of(tmp_path, "w")[-3000:]

        bounded = producer(
            spool.root,
            """
            try:
                client.wait(["never-sent"], timeout_s=3)
            except ResultTimeout:
                print("timed out")
            """,
        )
        assert bounded.stdout.strip() == "timed out", bounded.stderr[-3000:]

        planted = producer(
            spool.root,
            """
            result = client.wait(["planted"], timeout_s=30)["planted"]
            print(result.ok, result.error.code.value)
            print(result.error.message)
            """,
        )
        first, _, message = planted.stdout.partition("\n")
        assert first == "False bad_result", planted.stderr[-3000:]
        assert "results/planted.json" in message and "FIFO" in message, message
        assert os.path.lexists(spool.results / "planted.json")  # left for an operator to look at

        stats = spoolctl("stats", "--json", "-s", str(spool.root))
        assert stats.returncode == 0, stats.stderr
        report = json.loads(stats.stdout)
        by_id = {w["worker_id"]: w for w in report["workers"]}
        assert by_id["w"]["live"] and not by_id["zz"]["live"], by_id
        shown = spoolctl("show", "--json", "-s", str(spool.root), "planted")
        assert shown.returncode == 0, shown.stderr
        assert "FIFO" in json.loads(shown.stdout)["results/planted.json"]["unreadable"]
        assert spoolctl("show", "-s", str(spool.root), "after-fifo").returncode == 0

        # The FIFOs of requests/ and claimed/ end in bad/ (the claim given back first, once its
        # lease of a worker without a status ran out): nothing is lost, nothing retried forever.
        assert "fifo.json" in os.listdir(spool.bad)
        worker_log = log_of(tmp_path, "w")
        assert worker_log.count("workers/zz.json") == 1, worker_log[-3000:]  # logged once, not at every scan
    finally:
        code = stop_worker(worker, timeout_s=DEADLINE_S)
    assert code == 0, log_of(tmp_path, "w")[-3000:]  # SIGTERM stopped it, by itself


def test_an_idle_worker_exits_on_time_beside_a_fifo_status(tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    os.mkfifo(spool.workers / "zz.json")
    worker = start_worker(spool.root, "idle", *ECHO, "--idle-exit", "3", log_dir=tmp_path)
    try:
        code = worker.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        stop_worker(worker, timeout_s=5)
    assert code == 0, log_of(tmp_path, "idle")[-3000:]
