"""One bad file never stops a worker, tried on real `rollout-svc serve` processes with real files
and the errors the kernel really gives for them.

- Two request files with the same 255-byte name: the second cannot take the first one's name
  in bad/, and a name with a suffix is too long (ENAMETOOLONG) unless it is cut. Both end in
  bad/ with a note, and the worker serves on.
- A request file that cannot be moved (immutable, `chattr +i`: rename fails with EPERM even for
  root): the worker logs it once, serves the other requests, does not spin on it, and serves
  it once it can be moved again.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import poll, start_worker, stop_worker, wait_for_status

from protocol.messages import Request, encode
from protocol.spool import Spool

pytestmark = pytest.mark.timeout(300)

ECHO = ("--engine", "echo", "--idle-exit", "0")


def echo_request(request_id: str) -> Request:
    return Request(
        request_id=request_id, weights_dir="/models/any", prompts=[request_id], n_samples_per_prompt=1,
        max_tokens=4, temperature=0.0,
    )  # fmt: skip


def log_of(log_dir: Path, worker_id: str) -> str:
    return (log_dir / f"{worker_id}.log").read_text(errors="replace")


def hand_submit(spool: Spool, name: str, data: bytes) -> None:
    """As a person does: write in tmp/, then mv into requests/ under any name."""
    scratch = spool.tmp / "by-hand"
    scratch.write_bytes(data)
    os.rename(scratch, spool.requests / name)


def served(client, request_id: str) -> None:
    client.submit(echo_request(request_id))
    result = client.wait([request_id], timeout_s=60)[request_id]
    assert result.ok and result.texts == [[request_id[:4]]]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_two_files_with_the_same_longest_name_both_go_to_bad(tmp_path, client_for):
    spool = Spool(tmp_path / "spool", create=True)
    client = client_for(spool.root)
    name = "x" * 250 + ".json"  # 255 bytes: the longest name a file may have
    proc = start_worker(spool.root, "w", *ECHO, log_dir=tmp_path)
    try:
        hand_submit(spool, name, b"{}")
        poll(lambda: os.listdir(spool.bad), lambda names: name in names)
        hand_submit(spool, name, b"{}")  # the same name again: bad/ holds one already
        served(client, "after")  # the worker got past the second file
        assert proc.poll() is None, log_of(tmp_path, "w")[-3000:]
    finally:
        assert stop_worker(proc) == 0, log_of(tmp_path, "w")[-3000:]
    kept = [n for n in os.listdir(spool.bad) if n.startswith("x" * 200) and not n.endswith(".error.txt")]
    assert len(kept) == 2 and all(len(os.fsencode(n)) <= 255 for n in kept)
    assert os.listdir(spool.requests) == []
    assert "is too long" in spool.bad_note_path(name).read_text()


@pytest.fixture
def immutable(tmp_path):
    """immutable(path): chattr +i, undone at the end (or the test's files could not be removed)."""
    made: list[Path] = []

    def make(path: Path) -> None:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, f"this test needs chattr +i on {tmp_path}'s filesystem (ext4, xfs): {done.stderr}"
        made.append(path)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=False, capture_output=True)


def test_a_request_that_cannot_be_moved_is_skipped_and_served_once_it_can(tmp_path, client_for, immutable):
    spool = Spool(tmp_path / "spool", create=True)
    client = client_for(spool.root)
    stuck = spool.request_path("stuck")
    hand_submit(spool, stuck.name, encode(echo_request("stuck")))
    immutable(stuck)  # rename() fails with EPERM, for root too
    worker = start_worker(spool.root, "w", *ECHO, "--heartbeat", "0.5", "--lease", "5", log_dir=tmp_path)
    calm_spool = Spool(tmp_path / "calm-spool", create=True)
    calm = start_worker(calm_spool.root, "calm", *ECHO, "--heartbeat", "0.5", "--lease", "5", log_dir=tmp_path)
    try:
        wait_for_status(calm_spool, "calm", lambda s: s.state == "idle", 60, calm)
        poll(lambda: log_of(tmp_path, "w"), lambda log: "cannot claim requests/stuck.json" in log, timeout_s=60)
        served(client, "after-1")
        # A window of several heartbeats (each status write is what we wait for), side by side
        # with a worker that has no bad file: a worker spinning on the skipped file would burn
        # a core meanwhile.
        cpu_before = cpu_seconds(worker.pid), cpu_seconds(calm.pid)
        first = wait_for_status(spool, "w", lambda s: True, 10, worker).heartbeat_at
        wait_for_status(spool, "w", lambda s: s.heartbeat_at > first + 5, 60, worker)
        cpu_used = cpu_seconds(worker.pid) - cpu_before[0], cpu_seconds(calm.pid) - cpu_before[1]
        served(client, "after-2")
        log = log_of(tmp_path, "w")
        assert log.count("cannot claim requests/stuck.json") == 1, log[-3000:]  # logged once, not at every scan
        assert "Operation not permitted" in log and "tries this one again in" in log
        assert cpu_used[0] <= 3 * cpu_used[1] + 0.5, cpu_used
        assert stuck.exists() and not spool.has_result("stuck")

        subprocess.run(["chattr", "-i", str(stuck)], check=True)  # an operator fixed it
        result = client.wait(["stuck"], timeout_s=60)["stuck"]  # tried again at once: the file changed
        assert result.ok and result.worker_id == "w"
        assert worker.poll() is None
    finally:
        assert stop_worker(worker) == 0, log_of(tmp_path, "w")[-3000:]
        stop_worker(calm)
