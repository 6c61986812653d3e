"""Launch to first step: how long `trainer-svc train` takes from its start to its first step's
metrics line, for the trainer code of two git revisions, alternating, in one run.

    .venvs/trainer/bin/python -m bench.startup --before REV [--rounds 2] [--json OUT]

Each launch is a fresh run directory on the demo's config (configs/demo.toml, 2 steps) from the
demo's warm-up model (runs/demo/sft-model: run `make demo` once first). "before" runs the trainer
package of REV (exported with `git archive`, put first on PYTHONPATH) with today's protocol
package, which the worker speaks; "after" runs the working tree. Both spawn the same rollout
worker (the rollout venv). The launch's own log
lines split the time: gates, model load and restore, the spawned worker's engine start, the
step-0 canary, the first step.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import synthetic
from bench.common import ROOT, TRAINER, emit, git_head, machine_line, utc_minute

MODEL = ROOT / "runs" / "demo" / "sft-model"


def export(rev: str, into: Path) -> Path:
    """The trainer sources of `rev`, unpacked under `into`."""
    archive = subprocess.run(
        ["git", "archive", rev, "trainer_svc/src"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def write_config(path: Path, run_dir: Path) -> Path:
    text = (ROOT / "configs" / "demo.toml").read_text()
    text = text.replace('dir = "runs/demo"', f'dir = "{run_dir}"')
    text = text.replace('path = "runs/demo/sft-model"', f'path = "{MODEL}"')
    text = re.sub(r"(?m)^steps = \d+", "steps = 2", text)
    text = re.sub(r"(?m)^(ahead|max_policy_lag) = \d+.*\n", "", text)  # keys the "before" code may not know
    text = text.replace('base = "build/tiny-model"', f'base = "{ROOT / "build" / "tiny-model"}"')
    text = text.replace("[rollout]\n", f'[rollout]\nrollout_venv = "{ROOT / ".venvs" / "rollout"}"\n', 1)
    path.write_text(text)
    return path


def launch(source: Path | None, work: Path, label: str, tiny: bool = False) -> dict:
    """One launch to the end of its 2 steps; seconds from launch to the first metrics line (with
    `tiny`, the config checked and a made-up run in place of the launch)."""
    run_dir = work / f"run-{label}-{time.monotonic_ns()}"
    config = write_config(work / f"{label}.toml", run_dir)
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = str(source / "trainer_svc" / "src")
    log_path = work / f"{run_dir.name}.log"
    started = time.monotonic()
    command = [str(TRAINER), "train", str(config)]
    if tiny:  # a process that does nothing, for the trainer's: the loop below runs as it would
        synthetic.stand_in_train(config)
        command = ["true"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
    metrics = run_dir / "metrics.jsonl"
    first_step = None
    while proc.poll() is None:
        if first_step is None and metrics.exists() and metrics.read_text().strip():
            first_step = time.monotonic() - started
        time.sleep(0.05)
    if proc.returncode != 0:
        raise RuntimeError(f"{label} launch failed ({proc.returncode}): {log_path.read_text()[-3000:]}")
    if first_step is None:  # the two steps were done between two looks
        first_step = time.monotonic() - started
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"launch_to_first_step_s": round(first_step, 2), "exit": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="git revision of the 'before' trainer (required but with --tiny)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: no launch, made-up runs")
    args = parser.parse_args()
    if args.tiny:
        args.before, args.rounds = args.before or "HEAD", 1
    elif not args.before:
        parser.error("--before is required")
    elif not (MODEL / "config.json").exists():
        raise SystemExit(f"{MODEL} is missing: run `make demo` once first")
    with tempfile.TemporaryDirectory(prefix="startup-bench-", dir=None if args.tiny else ROOT / "runs") as tmp:
        work = Path(tmp)
        before = export(args.before, work / "before")
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.rounds):  # alternating, so both see the same machine load
            times["before"].append(launch(before, work, "before", args.tiny)["launch_to_first_step_s"])
            times["after"].append(launch(None, work, "after", args.tiny)["launch_to_first_step_s"])
    report = {
        "before": {"rev": args.before, "launch_to_first_step_s": times["before"]},
        "after": {"rev": f"working tree at {git_head()}", "launch_to_first_step_s": times["after"]},
        "median_before_s": statistics.median(times["before"]),
        "median_after_s": statistics.median(times["after"]),
        "machine": machine_line(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "date": utc_minute(),
    }
    emit(report, args.json)


if __name__ == "__main__":
    main()
