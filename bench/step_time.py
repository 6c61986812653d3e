"""Step time, synchronous against generating ahead (rollout.ahead = 1), without and with spare
prompts (rollout.spare_prompts), on the demo's config, side by side in one run: the target is a
step of at most 1.15 x max(generation, training).

    .venvs/trainer/bin/python bench/step_time.py [--steps 100] [--rounds 2] [--json OUT]

Each launch is a fresh run directory on configs/demo.toml (train.steps = --steps) from the demo's
warm-up model (runs/demo/sft-model: run `make demo` once first); the two settings alternate,
--rounds times each, so both see the same machine load. Per step:
- step: the trainer's `step_s` (rollout wait, scoring, training, publishing, saving, canary);
- generation: the engine's own time for the step's requests (their results' generate_s plus
  reload_s: the weight reload a new publish costs), read from the spool;
- training: the trainer's train_s + publish_s + save_s + score_s (its own work in the step).
Medians over steps 5..N (the first steps include engine warm-up) are reported per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / ".venvs" / "trainer" / "bin" / "trainer-svc"
MODEL = ROOT / "runs" / "demo" / "sft-model"
STEP_IN_ID = re.compile(r"-train-s(\d{8})-a\d+-p\d+-")
SETTINGS = {
    "synchronous": "ahead = 0\nmax_policy_lag = 0\nspare_prompts = 0\n",
    "ahead = 1": "ahead = 1\nmax_policy_lag = 1\nspare_prompts = 0\n",
    # dead groups replaced from spares sampled with the step, instead of by a retry it waits for
    "ahead = 1, 8 spare prompts": "ahead = 1\nmax_policy_lag = 1\nspare_prompts = 8\n",
}


def write_config(path: Path, run_dir: Path, steps: int, rollout_keys: str) -> Path:
    text = (ROOT / "configs" / "demo.toml").read_text()
    text = text.replace('dir = "runs/demo"', f'dir = "{run_dir}"')
    text = text.replace('path = "runs/demo/sft-model"', f'path = "{MODEL}"')
    text = re.sub(r"(?m)^steps = \d+", f"steps = {steps}", text)
    text = re.sub(r"(?m)^(ahead|max_policy_lag|spare_prompts) = \d+.*\n", "", text)  # set below, per setting
    text = text.replace('base = "build/tiny-model"', f'base = "{ROOT / "build" / "tiny-model"}"')
    rollout = f'[rollout]\nrollout_venv = "{ROOT / ".venvs" / "rollout"}"\n{rollout_keys}'
    path.write_text(text.replace("[rollout]\n", rollout, 1))
    return path


def engine_seconds(spool_dir: Path) -> dict[int, float]:
    """Engine seconds (generate + reload) of each training step's requests, by step index."""
    per_step: dict[int, float] = defaultdict(float)
    for path in (spool_dir / "done").glob("*.result.json"):
        found = STEP_IN_ID.search(path.name)
        if found:
            timings = json.loads(path.read_text())["timings"]
            per_step[int(found.group(1))] += timings["generate_s"] + timings["reload_s"]
    return per_step


def launch(work: Path, label: str, steps: int) -> dict:
    run_dir = work / f"run-{label.replace(' ', '').replace('=', '')}-{time.monotonic_ns()}"
    config = write_config(work / "bench.toml", run_dir, steps, SETTINGS[label])
    log_path = work / f"{run_dir.name}.log"
    with open(log_path, "w") as log:
        done = subprocess.run([str(TRAINER), "train", str(config)], cwd=ROOT, stdout=log, stderr=log)
    if done.returncode:
        raise SystemExit(f"{label}: the trainer exited {done.returncode}:\n{log_path.read_text()[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    engine = engine_seconds(run_dir / "spool")
    shutil.rmtree(run_dir, ignore_errors=True)
    kept = [r for r in rows if r["step"] > 5]
    return {
        "step_s": statistics.median(r["step_s"] for r in kept),
        "generation_s": statistics.median(engine[r["step"] - 1] for r in kept),
        "training_s": statistics.median(r["train_s"] + r["publish_s"] + r["save_s"] + r["score_s"] for r in kept),
        "rollout_wait_s": statistics.median(r["rollout_s"] for r in kept),
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in kept),
        "dropped_stale": sum(r["dropped_stale"] for r in rows),
        "retries_mean": statistics.fmean(r["retries"] for r in kept),
        "wall_s": sum(r["step_s"] for r in rows),
        "reward_first_last_10": statistics.fmean(r["reward_first"] for r in rows[-10:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not (MODEL / "config.json").exists():
        raise SystemExit(f"{MODEL} is missing: run `make demo` once first")
    runs: dict[str, list[dict]] = {label: [] for label in SETTINGS}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="step-time-bench-", dir=ROOT / "runs") as tmp:
        for _ in range(args.rounds):
            for label in SETTINGS:
                runs[label].append(launch(Path(tmp), label, args.steps))
    load.append(os.getloadavg()[0])
    report = {}
    for label, found in runs.items():
        medians = {key: round(statistics.median(run[key] for run in found), 4) for key in found[0]}
        medians["step_over_max_generation_training"] = round(
            medians["step_s"] / max(medians["generation_s"], medians["training_s"]), 3
        )
        report[label] = {"median_of_runs": medians, "runs": found}
    report["speedup_step_s"] = round(
        report["synchronous"]["median_of_runs"]["step_s"] / report["ahead = 1"]["median_of_runs"]["step_s"], 3
    )
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    report["context"] = {
        "steps": args.steps,
        "rounds": args.rounds,
        "commit": head.strip(),
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "load_average_1min": [round(x, 2) for x in load],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
