"""The rollout worker a run spawns (`rollout.spawn`, the default): one `rollout-svc serve` from
the rollout venv, in its own process session, preloaded with the starting weights.

Guarantees: it is stopped on every exit path of the trainer (the caller's `close` and `atexit`; a
trainer SIGKILLed leaves it to its idle exit, and the next launch of the run stops it before
spawning its own, so two engines never fight for one GPU). While the trainer waits, a worker that
exited, or whose heartbeat stood still for its lease while its process lives (frozen), is an
error within seconds (RolloutUnavailable), and a frozen one is stopped.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from protocol.spool import Spool
from protocol.weight_slots import ring_dir

from ..config import Config
from ..rollout_types import RolloutUnavailable
from .placement import rollout_gpu

log = logging.getLogger(__name__)

WORKER_IDLE_EXIT_S = 7200  # an orphaned worker (trainer SIGKILLed) frees its device after this


class SpawnedWorker:
    def __init__(self, cfg: Config, spool: Spool, worker_id: str, *, world_size: int, cuda_devices: int):
        """Stop the worker an earlier launch left running, then start this launch's, on the GPU
        the topology gate approved (placement.rollout_gpu) among `cuda_devices`."""
        self.cfg, self.spool, self.worker_id = cfg, spool, worker_id
        self.log_path = cfg.run_dir / "rollout-worker.log"
        self.seen_live = False  # its heartbeat was seen fresh at least once
        self._stop_orphan()
        self.proc: subprocess.Popen | None = self._spawn(world_size, cuda_devices)
        atexit.register(self.close)

    def _spawn(self, world_size: int, cuda_devices: int) -> subprocess.Popen:
        cfg = self.cfg
        executable = Path(cfg.rollout.rollout_venv) / "bin" / "rollout-svc"
        if not executable.exists():
            raise RolloutUnavailable(
                f"{executable} does not exist: create the rollout venv with `make venvs`, or set rollout.rollout_venv"
            )
        ring = None  # the run's slot ring, where its weights may be published (weights.sync)
        if cfg.publish.slots != "off" and not cfg.lora.on and Path(cfg.publish.slots_dir).is_dir():
            ring = ring_dir(cfg.publish.slots_dir, cfg.run_dir)
            ring.mkdir(exist_ok=True)  # an allowed root must exist when the worker starts
        command = [
            str(executable),
            "serve",
            "--engine",
            "vllm",
            "--spool",
            str(cfg.spool_dir),
            "--worker-id",
            self.worker_id,
            "--weights",
            cfg.model.path,
            "--allowed-root",
            str(Path(cfg.model.path).parent),
            "--allowed-root",
            str(cfg.publish_dir),
            *(["--allowed-root", str(ring)] if ring is not None else []),
            "--idle-exit",
            str(WORKER_IDLE_EXIT_S),
            # LoRA: the engine serves the run's adapters on the base it loaded (its own limits
            # cache them: the adapters of a step's requests and of those ahead).
            *(["--max-lora-rank", str(cfg.lora.rank)] if cfg.lora.on else []),
            *cfg.rollout.worker_args,
        ]
        cfg.publish_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        gpu = rollout_gpu(world_size, cuda_devices, colocate=cfg.rollout.colocate)
        if gpu is not None and cfg.rollout.colocate:
            # Its share of the GPU (the trainer is capped at the rest), awake by default: it
            # generates the next steps while the trainer steps.
            command += ["--gpu-memory-utilization", str(cfg.rollout.colocate_gpu_memory)]
            if cfg.rollout.colocate_sleep_s:
                command += ["--sleep-when-idle", str(cfg.rollout.colocate_sleep_s)]
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        log.info("starting rollout worker: %s (log: %s)", " ".join(command), self.log_path)
        with open(self.log_path, "ab") as out:
            # Its own session: torchrun's or a terminal's signals do not reach it; we stop it.
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def close(self) -> None:
        """Stop the worker (SIGTERM, then SIGKILL of its session). Idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_session(proc.pid, wait=proc.wait)

    def check(self) -> None:
        """Raise RolloutUnavailable if the worker exited, or if its heartbeat stood still for its
        lease while its process lives (frozen: SIGSTOP, a hung host call)."""
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            raise RolloutUnavailable(f"the rollout worker exited with code {self.proc.returncode}; see {self.log_path}")
        statuses = [s for s in self.spool.live_workers() if s.worker_id == self.worker_id]
        if any(s.pid == self.proc.pid for s in statuses):
            self.seen_live = True
        elif self.seen_live:
            raise RolloutUnavailable(
                f"the rollout worker (pid {self.proc.pid}) is alive but its heartbeat stood still for longer than its "
                f"lease: it is frozen or hung, and is stopped now; see {self.log_path}"
            )

    def _stop_orphan(self) -> None:
        """A worker this run spawned before (its trainer SIGKILLed) may still hold the device until
        its idle exit: found by its status file (this run's worker id, this host, a live pid
        running rollout-svc on this spool), it is stopped."""
        for _, status in self.spool.statuses():
            if status is None or status.worker_id != self.worker_id or status.host != socket.gethostname():
                continue
            if not _is_worker_process(status.pid, self.cfg.spool_dir):
                continue
            log.warning(
                "stopping the rollout worker an earlier launch of this run left running (pid %d, %s)",
                status.pid,
                self.worker_id,
            )
            stop_session(status.pid, wait=lambda timeout, pid=status.pid: _wait_gone(pid, timeout))


def stop_session(pid: int, wait, timeout_s: float = 60.0) -> None:
    """Stop a worker that leads its own process session: SIGTERM to it (it stops its engine and
    gives back what it holds), SIGCONT to the session (a frozen worker must run to act on it),
    `wait(timeout)` for it, then SIGKILL of the whole session (its engine processes share it)."""
    try:
        os.kill(pid, signal.SIGTERM)
        os.killpg(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    try:
        wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int, timeout: float) -> None:
    """Wait for a process that is not our child to exit."""
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(str(pid), timeout)
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _is_worker_process(pid: int, spool_dir: Path) -> bool:
    """`pid` is a live `rollout-svc serve` on this spool (not a pid reused by another program)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return _alive(pid) and "serve" in args and str(spool_dir) in args and any("rollout-svc" in a for a in args)
