"""Chaos: echo workers SIGKILLed at random while producers submit thousands of requests.

Real `rollout-svc serve` processes (each in its own process group, short lease) serve a spool
fed by producer threads. A chaos thread SIGKILLs random workers at random times and restarts
them, under the same id or a new one, and now and then freezes one (SIGSTOP) for longer than its
lease: its claims are recovered meanwhile, and once thawed it must exit without publishing. A
reader thread decodes every file it sees in requests/, results/ and workers/ the whole time, and
inotify counts claims to measure re-executions. At the end:

- every submitted request has exactly one result file, with the expected echo;
- no reader ever decoded a partial file;
- once the live workers drained the spool and stopped cleanly, and stale claims were
  recovered, claimed/ and requests/ are empty and bad/ holds nothing.

It runs twice: on local disk, and on an sshfs mount over loopback with its caches on
(tests/netfs.py), where the workers poll by themselves. On the mount every file operation is a
round trip through sftp, so that run is smaller: 3 x 500 requests and 24 kills (at least 12)
instead of 3 x 1000 and 36 (at least 20).

Figures (kills, recoveries, executions, scratch leftovers) are printed; see them with `pytest -s`.
"""

from __future__ import annotations

import ctypes
import os
import random
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from torn_reads import TornReadReader

from protocol.client import SpoolClient
from protocol.messages import MessageError, Request, decode_result, decode_status
from protocol.spool import Spool, split_claimed_name

LEASE_S = 3.0
HEARTBEAT_S = 0.5
N_WORKERS = 3  # kept alive (restarted after each kill)
N_PRODUCERS = 3
# By storage: requests per producer, kills aimed at, kills needed for the run to mean something.
SCALE = {"local": (1000, 36, 20), "sshfs": (500, 24, 12)}
SEED = int(os.environ.get("CHAOS_SEED", "0")) or random.SystemRandom().randrange(1, 2**31)


def worker_command() -> list[str]:
    """`rollout-svc` from this interpreter's environment."""
    script = Path(sys.executable).with_name("rollout-svc")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from rollout_svc.cli import main; main()"]


def make_request(request_id: str, rng: random.Random) -> Request:
    """Prompts whose echo is checkable: the id itself, and a longer one the echo may truncate."""
    return Request(
        request_id=request_id,
        weights_dir="/models/echo",
        prompts=[request_id, f"{request_id}|{'x' * rng.randrange(0, 40)}"],
        n_samples_per_prompt=rng.choice((1, 1, 2, 4)),
        max_tokens=rng.choice((len(request_id) + 5, 4096)),
        temperature=rng.choice((0.0, 1.0)),
        tag="chaos",
    )


def expected_texts(request: Request) -> list[list[str]]:
    return [[p[: request.max_tokens]] * request.n_samples_per_prompt for p in request.prompts]


@dataclass
class Life:
    """One worker process: a worker id may have several lives."""

    worker_id: str
    proc: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)


class Fleet:
    """The worker processes this test started, and nothing else."""

    def __init__(self, spool: Spool, log_dir: Path, rng: random.Random):
        self.spool = spool
        self.log_dir = log_dir
        self.rng = rng
        self.lives: list[Life] = []  # every life, in start order
        self.live: dict[str, Life] = {}
        self.next_id = 0
        self.last_counters: dict[int, dict] = {}  # pid -> counters of its last heartbeat
        self.paused: set[int] = set()  # pids stopped with SIGSTOP
        self.exit_codes: list[int] = []  # of lives that exited by themselves
        self.lock = threading.Lock()

    def new_id(self) -> str:
        self.next_id += 1
        return f"w{self.next_id:02d}"

    def start(self, worker_id: str | None = None) -> Life:
        worker_id = worker_id or self.new_id()
        log = self.log_dir / f"{worker_id}.{len(self.lives)}.log"
        cmd = worker_command() + [
            "serve", "--spool", str(self.spool.root), "--engine", "echo", "--worker-id", worker_id,
            "--idle-exit", "0", "--lease", str(LEASE_S), "--heartbeat", str(HEARTBEAT_S),
            "--max-batch", str(self.rng.choice((8, 32, 64))), "--log-level", "WARNING",
        ]  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        life = Life(worker_id, proc, log)
        with self.lock:
            self.lives.append(life)
            self.live[worker_id] = life
        return life

    def read_counters(self, life: Life) -> None:
        try:
            status = decode_status((self.spool.workers / f"{life.worker_id}.json").read_bytes())
        except (OSError, MessageError):
            return
        if status.pid == life.proc.pid:
            self.last_counters[life.proc.pid] = {
                "ok": status.counters.requests_ok,
                "failed": status.counters.requests_failed,
                "abandoned": status.counters.requests_abandoned,
            }

    def kill(self, life: Life) -> None:
        """SIGKILL a life's process group (its own session: only the worker is in it)."""
        if life.proc.poll() is None:
            os.killpg(life.proc.pid, signal.SIGKILL)
        life.proc.wait(timeout=10)
        self.read_counters(life)  # its last heartbeat, before a restart under its id rewrites it
        with self.lock:
            if self.live.get(life.worker_id) is life:
                del self.live[life.worker_id]

    def pause(self, life: Life, seconds: float) -> None:
        """SIGSTOP a life for longer than its lease, then SIGCONT it: its claims are recovered
        meanwhile, and when it wakes it must not publish for them."""
        with self.lock:
            if life.proc.poll() is not None:
                return
            os.killpg(life.proc.pid, signal.SIGSTOP)
            self.paused.add(life.proc.pid)
        timer = threading.Timer(seconds, self.resume, args=(life,))
        timer.daemon = True
        timer.start()

    def resume(self, life: Life) -> None:
        with self.lock:
            if life.proc.pid in self.paused:
                self.paused.discard(life.proc.pid)
                if life.proc.poll() is None:
                    os.killpg(life.proc.pid, signal.SIGCONT)

    def resume_all(self) -> None:
        with self.lock:
            lives = [life for life in self.lives if life.proc.pid in self.paused]
        for life in lives:
            self.resume(life)

    def reap(self) -> list[Life]:
        """Forget lives that exited by themselves (a worker that woke from a pause past its
        lease exits with 1); returns them."""
        with self.lock:
            gone = [life for life in self.live.values() if life.proc.poll() is not None]
            for life in gone:
                del self.live[life.worker_id]
                self.exit_codes.append(life.proc.returncode)
        for life in gone:
            self.read_counters(life)
        return gone

    def running(self) -> list[Life]:
        with self.lock:
            return [
                life for life in self.live.values() if life.proc.poll() is None and life.proc.pid not in self.paused
            ]

    def stop_all(self, timeout: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every live worker and wait for a clean exit; their exit codes by id. A life
        that exited before it was signalled exited by itself: its code goes to `exit_codes`."""
        with self.lock:
            lives = list(self.live.values())
        signalled = []
        for life in lives:
            self.read_counters(life)
            if life.proc.poll() is None:
                os.killpg(life.proc.pid, signal.SIGTERM)
                signalled.append(life)
            else:
                with self.lock:
                    self.exit_codes.append(life.proc.returncode)
        codes = {}
        for life in signalled:
            try:
                codes[life.worker_id] = life.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                codes[life.worker_id] = None
        with self.lock:
            self.live.clear()
        return codes

    def cleanup(self) -> None:
        self.resume_all()
        for life in self.lives:
            if life.proc.poll() is None:
                try:
                    os.killpg(life.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                life.proc.wait(timeout=10)

    def wait_serving(self, timeout: float) -> None:
        """Until each running life has written its own status file: it serves, and its SIGTERM
        handler is in place (one signalled before that dies of the signal, not exiting 0)."""
        deadline = time.monotonic() + timeout
        for life in self.running():
            while True:
                try:
                    status = decode_status((self.spool.workers / f"{life.worker_id}.json").read_bytes())
                except (OSError, MessageError):
                    status = None
                if (status is not None and status.pid == life.proc.pid) or life.proc.poll() is not None:
                    break
                assert time.monotonic() < deadline, f"{life.worker_id} (pid {life.proc.pid}) did not start serving"
                time.sleep(0.05)

    def wait_live(self, worker_ids, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        want = {f"{w}.json" for w in worker_ids}
        while not want <= set(os.listdir(self.spool.workers)):
            assert time.monotonic() < deadline, f"workers {sorted(want)} did not start; see {self.log_dir}"
            time.sleep(0.05)


class ClaimCounter(threading.Thread):
    """Counts executions from inotify, in kernel order: a claim (a rename into claimed/) made
    before the request's result appeared in results/ starts an execution; one made after it is
    only archived by its worker (modulo the microseconds between a claim and the worker's
    has_result check). Requests claimed more than once before their result ran more than once."""

    IN_MOVED_TO, IN_CREATE, IN_Q_OVERFLOW = 0x80, 0x100, 0x4000
    _EVENT = struct.Struct("iIII")

    def __init__(self, spool: Spool):
        super().__init__(name="claim-counter", daemon=True)
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.claimed_wd = self.libc.inotify_add_watch(self.fd, bytes(spool.claimed), self.IN_MOVED_TO)
        self.results_wd = self.libc.inotify_add_watch(self.fd, bytes(spool.results), self.IN_CREATE)
        assert self.claimed_wd >= 0 and self.results_wd >= 0
        self.stop = threading.Event()
        self.executions: dict[str, int] = {}  # claims before the result existed
        self.archived: dict[str, int] = {}  # claims after it
        self.published: set[str] = set()
        self.overflowed = False

    def run(self) -> None:
        try:
            while not self.stop.is_set() or select.select([self.fd], [], [], 0)[0]:
                if not select.select([self.fd], [], [], 0.1)[0]:
                    continue
                try:
                    data = os.read(self.fd, 1 << 20)
                except BlockingIOError:
                    continue
                offset = 0
                while offset < len(data):
                    wd, mask, _cookie, length = self._EVENT.unpack_from(data, offset)
                    offset += self._EVENT.size
                    name = data[offset : offset + length].rstrip(b"\0").decode()
                    offset += length
                    if mask & self.IN_Q_OVERFLOW:
                        self.overflowed = True
                    elif wd == self.results_wd and name.endswith(".json"):
                        self.published.add(name[: -len(".json")])
                    elif wd == self.claimed_wd:
                        rid = split_claimed_name(name)[0][: -len(".json")]
                        counts = self.archived if rid in self.published else self.executions
                        counts[rid] = counts.get(rid, 0) + 1
        finally:
            os.close(self.fd)


class Producer(threading.Thread):
    """Submits its requests in batches of random size over several seconds, then waits."""

    def __init__(self, spool_root: Path, index: int, n: int, rng: random.Random):
        super().__init__(name=f"producer-{index}", daemon=True)
        self.client = SpoolClient(spool_root, create=False, no_worker_grace_s=30.0)
        self.rng = rng
        self.requests = [make_request(f"p{index}-{i:05d}", rng) for i in range(n)]
        self.results: dict = {}
        self.error: BaseException | None = None
        self.submitted_at: float | None = None

    def run(self) -> None:
        try:
            i = 0
            while i < len(self.requests):
                batch = self.requests[i : i + self.rng.randrange(1, 50)]
                i += len(batch)
                if len(batch) == 1:
                    self.client.submit(batch[0])
                else:
                    self.client.submit_many(batch)
                time.sleep(self.rng.uniform(0.2, 0.6))
            self.submitted_at = time.monotonic()
            ids = [r.request_id for r in self.requests]
            self.results = self.client.wait(ids, timeout_s=120.0, consume=False)
        except BaseException as exc:
            self.error = exc
        finally:
            self.client.close()


def _log_sum(fleet: Fleet, pattern: str) -> int:
    total = 0
    for life in fleet.lives:
        try:
            text = life.log.read_text(errors="replace")
        except OSError:
            continue
        total += sum(int(m) for m in re.findall(pattern, text))
    return total


@pytest.mark.timeout(170)
@pytest.mark.parametrize("storage", list(SCALE))
def test_chaos_kill_workers_while_producing(tmp_path, storages, storage):
    requests_per_producer, target_kills, min_kills = SCALE[storage]
    rng = random.Random(SEED)
    print(f"\nchaos seed {SEED} (set CHAOS_SEED to replay the choices), on {storage}")
    spool = Spool(storages.root(storage, tmp_path.name, tmp_path) / "spool", create=True)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    fleet = Fleet(spool, log_dir, rng)
    reader = TornReadReader(spool, pause_s=0.02)
    counter = ClaimCounter(spool)
    producers: list[Producer] = []
    figures = {"kills": 0, "restart_same_id": 0, "restart_new_id": 0, "double_kills": 0, "pauses": 0}
    chaos_stop = threading.Event()
    chaos_errors: list[BaseException] = []

    def chaos() -> None:
        try:
            # Stops at target_kills, or once the producers are done and min_kills were made.
            while figures["kills"] < target_kills and not (chaos_stop.is_set() and figures["kills"] >= min_kills):
                time.sleep(rng.uniform(0.1, 0.5))
                # Workers that exited by themselves (woken from a pause) are restarted too.
                for life in fleet.reap():
                    fleet.start(life.worker_id)
                victims = fleet.running()
                if not victims:
                    continue
                if len(victims) > 1 and rng.random() < 0.1:
                    fleet.pause(rng.choice(victims), rng.uniform(LEASE_S + 0.5, LEASE_S + 2.5))
                    figures["pauses"] += 1
                    continue
                chosen = rng.sample(victims, 2 if len(victims) > 1 and rng.random() < 0.15 else 1)
                figures["double_kills"] += len(chosen) == 2
                for life in chosen:
                    fleet.kill(life)
                    figures["kills"] += 1
                if rng.random() < 0.3:
                    time.sleep(rng.uniform(0.2, 1.5))  # leave the fleet short for a moment
                for life in chosen:
                    same = rng.random() < 0.5
                    figures["restart_same_id" if same else "restart_new_id"] += 1
                    fleet.start(life.worker_id if same else None)
        except BaseException as exc:
            chaos_errors.append(exc)

    chaos_thread = threading.Thread(target=chaos, name="chaos", daemon=True)
    started = time.monotonic()
    try:
        first = [fleet.start() for _ in range(N_WORKERS)]
        fleet.wait_live([life.worker_id for life in first], timeout=30)
        reader.start()
        counter.start()
        producers = [
            Producer(spool.root, i, requests_per_producer, random.Random(rng.random())) for i in range(N_PRODUCERS)
        ]
        for p in producers:
            p.start()
        chaos_thread.start()

        for p in producers:
            p.join(timeout=150 - (time.monotonic() - started))
            assert not p.is_alive(), f"{p.name} still waiting; spool {spool.root}"
        chaos_stop.set()
        chaos_thread.join(timeout=30)
        assert not chaos_errors, chaos_errors
        fleet.resume_all()
        produced_s = time.monotonic() - started
        for p in producers:
            assert p.error is None, f"{p.name}: {p.error!r}"

        # Survivors drain what kills left behind: claims of dead workers come back to requests/
        # after the lease, and a request whose result already exists is only archived.
        drain_deadline = time.monotonic() + 4 * LEASE_S + 10
        while os.listdir(spool.claimed) or os.listdir(spool.requests) or not fleet.running():
            fleet.reap()
            if not fleet.running():
                fleet.start()
            assert time.monotonic() < drain_deadline, (
                f"spool not drained: claimed {sorted(os.listdir(spool.claimed))[:5]}, "
                f"requests {sorted(os.listdir(spool.requests))[:5]}"
            )
            time.sleep(0.1)
        # A life the chaos or the drain started just now may not have installed its handlers yet.
        fleet.wait_serving(timeout=30)
        time.sleep(2 * HEARTBEAT_S)  # a last heartbeat carries the final counters
        fleet.reap()
        codes = fleet.stop_all()
        assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"
        assert set(fleet.exit_codes) <= {1}, f"workers exited by themselves with {fleet.exit_codes}"

        reader.finish(timeout_s=30)
        counter.stop.set()
        counter.join(timeout=30)
        assert not reader.errors, f"partial or corrupt files seen: {reader.errors[:5]}"

        # Stale claims of killed workers: recover whatever is left (nothing, after the drain).
        recovered_at_end = spool.recover_stale(LEASE_S, now=time.time() + LEASE_S + 1)
        assert recovered_at_end == []
        assert os.listdir(spool.claimed) == []
        assert os.listdir(spool.requests) == []
        assert os.listdir(spool.bad) == []

        # Exactly one result per request, each the expected echo.
        submitted = {r.request_id: r for p in producers for r in p.requests}
        assert len(submitted) == N_PRODUCERS * requests_per_producer
        result_files = sorted(os.listdir(spool.results))
        assert result_files == sorted(f"{rid}.json" for rid in submitted)
        wrong = []
        for rid, request in submitted.items():
            result = decode_result((spool.results / f"{rid}.json").read_bytes())
            if not (result.request_id == rid and result.ok and result.error is None
                    and result.texts == expected_texts(request)):  # fmt: skip
                wrong.append((rid, result.ok, result.error, result.texts))
        assert not wrong, f"{len(wrong)} wrong results, e.g. {wrong[:3]}"
        # ... and what the producers were handed is the same.
        for p in producers:
            assert set(p.results) == {r.request_id for r in p.requests}
            for r in p.requests:
                assert p.results[r.request_id].texts == expected_texts(r)
        assert counter.published == set(submitted)
        assert counter.overflowed or set(counter.executions) == set(submitted)
        archived = {n[: -len(".request.json")] for n in os.listdir(spool.done) if n.endswith(".request.json")}
        assert archived == set(submitted)

        # Figures.
        n = len(submitted)
        counted = sum(c["ok"] for c in fleet.last_counters.values())
        abandoned = sum(c["abandoned"] for c in fleet.last_counters.values())
        recovered = _log_sum(fleet, r"gave back (\d+) claims of dead workers")
        taken_back = _log_sum(fleet, r"(\d+) claims were taken back during generation")
        tmp_left = os.listdir(spool.tmp)
        stale_status = len(os.listdir(spool.workers))
        winners = {}
        for rid in submitted:
            w = decode_result((spool.results / f"{rid}.json").read_bytes()).worker_id
            winners[w] = winners.get(w, 0) + 1
        print(
            f"chaos on {storage}: {n} requests from {N_PRODUCERS} producers, {len(fleet.lives)} worker lives "
            f"({len(winners)} ids published results), all results in after {produced_s:.1f} s, "
            f"test {time.monotonic() - started:.1f} s\n"
            f"  kills {figures['kills']} (double {figures['double_kills']}), restarts same id "
            f"{figures['restart_same_id']}, new id {figures['restart_new_id']}; pauses past the lease "
            f"{figures['pauses']}, after which {len(fleet.exit_codes)} workers exited by themselves "
            f"(heartbeat lost)\n"
            f"  claims given back by workers' recovery (logged) {recovered}, not published because "
            f"taken back {taken_back}; abandoned (counters) {abandoned}\n"
            f"  executions (inotify, claims before the result existed) {sum(counter.executions.values())}: "
            f"{sum(1 for c in counter.executions.values() if c > 1)} requests ran more than once, "
            f"{sum(c - 1 for c in counter.executions.values() if c > 1)} extra executions (killed or "
            f"duplicated); {sum(counter.archived.values())} redeliveries after the result only archived"
            f"{'; inotify queue OVERFLOWED, counts incomplete' if counter.overflowed else ''}\n"
            f"  ok results counted in status files {counted} (lost: what killed lives did after "
            f"their last heartbeat)\n"
            f"  tmp/ leftovers {len(tmp_left)}, status files of killed lives left in workers/ "
            f"{stale_status}\n"
            f"  reader: {reader.passes} passes, decoded {reader.decoded}, errors {len(reader.errors)}"
        )
        assert figures["kills"] >= min_kills, f"only {figures['kills']} kills: chaos too short to mean much"
    finally:
        chaos_stop.set()
        reader.stopping.set()
        counter.stop.set()
        fleet.cleanup()
        if chaos_thread.is_alive():
            chaos_thread.join(timeout=10)
        if counter.ident is None:  # never started: its inotify descriptor is still ours to close
            os.close(counter.fd)
        for p in producers:
            p.client.close()
