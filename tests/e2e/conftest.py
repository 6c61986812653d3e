"""Real rollout workers for end-to-end tests: processes, spools and tiny models.

A vLLM engine takes tens of seconds to start on a CPU, so workers are shared per module
(ServedWorker) and tests are written to run against a worker that has already served other
requests. A test may stop or kill a shared worker: the next test that needs it gets it
restarted (`keep_running`), so every test can run alone, first, last or in any order.
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
TESTS = Path(__file__).resolve().parent.parent
REAL_MODEL = TESTS.parent / "build" / "smollm2-135m-instruct"  # `make real-model`
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))  # helpers shared with the other tiers (torn_reads)


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


def wait_for_status(
    spool: Spool, worker_id: str, predicate, timeout_s: float, proc: subprocess.Popen | None = None
) -> WorkerStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, status in spool.statuses():
            if status is not None and status.worker_id == worker_id and predicate(status):
                return status
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"worker {worker_id} exited with {proc.returncode} before reaching the state")
        time.sleep(0.2)
    raise AssertionError(f"worker {worker_id} did not reach the state within {timeout_s} s")


def poll(probe, until, timeout_s: float = 30.0, interval_s: float = 0.2):
    """probe() again and again until until(value) holds or the deadline passes; returns the last
    value, for the test to judge. For what a worker does just after a result appears (archiving
    its claim, rewriting its metrics)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if until(value) or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def engine_process(worker_pid: int) -> int:
    """The worker's child that holds its vLLM engine (`python -m rollout_svc.engines.vllm_host`)."""
    for proc in Path("/proc").iterdir():
        try:
            parent = int(proc.joinpath("stat").read_text().rpartition(")")[2].split()[1])
            cmdline = proc.joinpath("cmdline").read_bytes()
        except (OSError, ValueError):
            continue  # not a process, or one that just exited
        if parent == worker_pid and b"rollout_svc.engines.vllm_host" in cmdline:
            return int(proc.name)
    raise AssertionError(f"worker {worker_pid} has no engine process")


def hanging_call(spool: Spool, frozen_at: float, settle_s: float = 5.0) -> None:
    """Wait until the worker is inside a call that the frozen engine cannot answer: a request
    claimed after the freeze, or one claimed before it that is still unanswered `settle_s` later.
    A call whose answer left the engine just before the freeze ends with a result and does not
    count (killing the engine then would fail nothing)."""
    before = set(os.listdir(spool.claimed))

    def hanging(claims: set[str]) -> bool:
        return bool(claims - before) or bool(claims & before and time.monotonic() - frozen_at > settle_s)

    claims = poll(lambda: set(os.listdir(spool.claimed)), hanging, timeout_s=300)
    assert hanging(claims), "the worker claimed nothing while its engine was frozen"


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


class ServedWorker:
    """A `rollout-svc serve` process that the tests of a module share, and that any test may end
    (stop, kill, or leave idle until it exits by itself).

    Nothing runs until `keep_running` starts it; it starts again, under the same id and with the
    same arguments, whenever a test needs it and finds it gone."""

    def __init__(self, spool: Spool, worker_id: str, args: list[str], log_dir: Path):
        self.spool = spool
        self.worker_id = worker_id
        self.args = args
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.ready: WorkerStatus | None = None  # its status when its engine was first ready

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.proc = start_worker(self.spool.root, self.worker_id, *self.args, log_dir=self.log_dir)
        self.ready = None

    def wait_ready(self, timeout_s: float = ENGINE_START_TIMEOUT_S) -> WorkerStatus:
        """Until this life (not an earlier one, whose status file may linger) is idle with weights."""
        pid = self.proc.pid
        self.ready = wait_for_status(
            self.spool, self.worker_id, lambda s: s.pid == pid and s.state == "idle" and bool(s.weights_dir),
            timeout_s, self.proc,
        )  # fmt: skip
        return self.ready

    def stop(self) -> int | None:
        """SIGTERM and wait, as systemd does; None when it was never started."""
        return None if self.proc is None else stop_worker(self.proc)

    def kill(self) -> None:
        if self.proc is not None:
            kill_session(self.proc)
            self.proc.wait(timeout=30)


def keep_running(*workers: ServedWorker, attempts: int = 3) -> None:
    """Start those of `workers` that are not running and wait until each is ready. They start
    together (an engine start is slow); one that exits meanwhile (idle exit while another
    was still starting) is started again, up to `attempts` rounds."""
    for _ in range(attempts):
        down = [w for w in workers if not w.running()]
        if not down:
            return
        for w in down:
            w.start()
        for w in down:
            w.wait_ready()
    down = [w.worker_id for w in workers if not w.running()]
    assert not down, f"workers {down} did not stay up in {attempts} starts; see their logs"


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
def real_model() -> Path:
    """SmolLM2-135M-Instruct as `make real-model` builds it (`make test` does first)."""
    if not (REAL_MODEL / "manifest.json").is_file():
        pytest.fail(f"{REAL_MODEL} is missing: run `make real-model` (`make test` builds it first)")
    return REAL_MODEL


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


@pytest.fixture(scope="session")
def storages(tmp_path_factory):
    """Filesystems a spool can live on (tests/netfs.py): mounted at first use, unmounted at the end."""
    from netfs import Storages

    storages = Storages(tmp_path_factory.mktemp("storages"))
    yield storages
    storages.close()


TRAINER = TESTS.parent / ".venvs" / "trainer" / "bin" / "trainer-svc"


class TrainerFleet:
    """What the modules that run `trainer-svc` as a process share: an allowed root, the tiny model
    warmed up once by `trainer-svc sft` (LEARNING's warm-up: its samples are sometimes right, so
    steps have gradients), and one vLLM worker serving a shared spool under that root. Each
    module keeps its runs in a folder of its own (`room`)."""

    def __init__(self, root: Path, base: Path, model: Path, worker: ServedWorker):
        self.root, self.base, self.model, self.worker = root, base, model, worker
        self.spool = worker.spool
        self.worker_log = worker.log_dir / f"{worker.worker_id}.log"

    def room(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(exist_ok=True)
        return path


@pytest.fixture(scope="session")
def trainer_fleet(tmp_path_factory):
    """One engine start and one warm-up for every module that runs the trainer: the engine starts
    (on the tiny model; each run's requests name its own weights) while the warm-up trains."""
    from run_config import LEARNING, write_run_config

    root = tmp_path_factory.mktemp("trainer-fleet")
    base = root / "tiny"
    subprocess.run([str(BIN / "rollout-svc"), "tiny-model", str(base)], check=True, capture_output=True)
    spool = Spool(root / "shared-spool", create=True)
    args = ["--engine", "vllm", "--allowed-root", str(root), "--weights", str(base), "--max-model-len", "64"]
    worker = ServedWorker(spool, "trainer-fleet", [*args, "--idle-exit", "0"], log_dir=root)
    worker.start()
    try:
        model = root / "sft-model"
        sections = {"run": {"dir": root / "sft-run"}, "model": {"path": model}, "sft": {"base": base}}
        config = write_run_config(root / "sft.toml", LEARNING, sections)
        done = subprocess.run([str(TRAINER), "sft", str(config)], capture_output=True, text=True, timeout=800)
        assert done.returncode == 0, done.stderr[-3000:]
        keep_running(worker)
        yield TrainerFleet(root, base, model, worker)
    finally:
        worker.kill()
