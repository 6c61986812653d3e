"""Step time, synchronous against generating ahead (rollout.ahead = 1), without and with spare
prompts (rollout.spare_prompts), on the demo's config, side by side in one run: the target is a
step of at most 1.15 x max(generation, training).

    .venvs/trainer/bin/python -m bench.step_time [--steps 100] [--rounds 2] [--json OUT]

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
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import synthetic
from bench.common import ROOT, TRAINER, emit, git_head, machine_line, read_jsonl, step_engine_seconds, utc_minute

MODEL = ROOT / "runs" / "demo" / "sft-model"
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


def launch(work: Path, label: str, steps: int, tiny: bool = False) -> dict:
    run_dir = work / f"run-{label.replace(' ', '').replace('=', '')}-{time.monotonic_ns()}"
    config = write_config(work / "bench.toml", run_dir, steps, SETTINGS[label])
    log_path = work / f"{run_dir.name}.log"
    if tiny:
        synthetic.stand_in_train(config)
    else:
        with open(log_path, "w") as log:
            done = subprocess.run([str(TRAINER), "train", str(config)], cwd=ROOT, stdout=log, stderr=log)
        if done.returncode:
            raise SystemExit(f"{label}: the trainer exited {done.returncode}:\n{log_path.read_text()[-4000:]}")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    engine = step_engine_seconds(run_dir / "spool")
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
    parser.add_argument(
        "--tiny", action="store_true", help="a check of the script: no launch, a made-up run summarised"
    )
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.rounds = 8, 1
    elif not (MODEL / "config.json").exists():
        raise SystemExit(f"{MODEL} is missing: run `make demo` once first")
    runs: dict[str, list[dict]] = {label: [] for label in SETTINGS}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="step-time-bench-", dir=None if args.tiny else ROOT / "runs") as tmp:
        for _ in range(args.rounds):
            for label in SETTINGS:
                runs[label].append(launch(Path(tmp), label, args.steps, args.tiny))
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
    report["context"] = {
        "steps": args.steps,
        "rounds": args.rounds,
        "commit": git_head(),
        "machine": machine_line(),
        "load_average_1min": [round(x, 2) for x in load],
        "date": utc_minute(),
    }
    emit(report, args.json)


if __name__ == "__main__":
    main()
