"""Pieces shared by the vLLM benchmarks: models, worker processes, machine facts, reporting."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from protocol.spool import Spool

BIN = Path(sys.executable).parent


def build_models(root: Path, names: list[str], *, hidden: int, layers: int) -> dict[str, Path]:
    """Tiny models of one architecture, one seed per name."""
    from rollout_svc.tiny_model import build

    return {
        name: build(root / name, seed=seed, hidden=hidden, layers=layers, intermediate=3 * hidden, init_std=0.3)
        for seed, name in enumerate(names)
    }


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                total += count
    return total


def start_worker(spool: Spool, worker_id: str, args: list[str], log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{worker_id}.log", "ab")
    return subprocess.Popen(
        [str(BIN / "rollout-svc"), "serve", "--spool", str(spool.root), "--worker-id", worker_id, *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_until(spool: Spool, worker_id: str, predicate, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s is not None and s.worker_id == worker_id and predicate(s) for _, s in spool.statuses()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"worker {worker_id} not ready after {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    import vllm

    return {"cores": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "vllm": vllm.__version__}


def report(name: str, figures: dict, json_path: str | None) -> None:
    data = {"benchmark": name, "date": time.strftime("%Y-%m-%d"), "machine": machine(), "figures": figures}
    print(json.dumps(data, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(data, indent=2) + "\n")
