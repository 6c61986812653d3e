"""`make demo` from scratch, timed, with what it learned: the issue's targets for the main job.

    .venvs/rollout/bin/python -m bench.demo_learning [--json OUT]

Removes runs/demo and build/tiny-model, runs `make demo`, and reports the wall time (venvs
already built), the GRPO stage's mean reward over its first and last 10 steps, and where a
step's time goes. Targets: at most 15 minutes; last-10 mean at least 0.3 above first-10 mean.
The reward is each step's first sampling (reward_first: the policy's own estimate, before dead
groups are replaced); the trained batch's (reward_trained) is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import synthetic
from bench.common import ROOT, emit, read_jsonl

TARGET_MINUTES = 15
TARGET_GAIN = 0.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: a made-up run summarised")
    args = parser.parse_args()
    if args.tiny:  # what `make demo` leaves, made up in a moment
        run = synthetic.write_run(Path(tempfile.mkdtemp(prefix="demo-learning-")) / "demo", steps=12)
        (run / "sft-model").mkdir()
        (run / "sft-model" / "sft_report.json").write_text(json.dumps({"steps": 40, "sampled_accuracy": 0.31}))
        minutes = 0.0
    else:
        run = ROOT / "runs" / "demo"
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(ROOT / "build" / "tiny-model", ignore_errors=True)
        started = time.monotonic()
        subprocess.run(["make", "demo"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        minutes = (time.monotonic() - started) / 60
    emit(figures(run, minutes), args.json)


def figures(run: Path, minutes: float) -> dict:
    """The targets' figures of the demo's run directory `run`, which took `minutes`."""
    result = json.loads((run / "stage_result.json").read_text())
    rows = read_jsonl(run / "metrics.jsonl")
    s = result["summary"]
    sft = json.loads((run / "sft-model" / "sft_report.json").read_text())
    canary = result["canary_history"]
    return {
        "warm_up_steps": sft["steps"],
        "warm_up_sampled_accuracy": round(sft["sampled_accuracy"], 3),
        "canary_held_out_accuracy": {h["step"]: round(h["accuracy"], 3) for h in canary},
        "make_demo_minutes": round(minutes, 2),
        "grpo_steps": s["steps"],
        "reward_first_10": round(s["reward_first"], 3),
        "reward_last_10": round(s["reward_last"], 3),
        "gain": round(s["reward_gain"], 3),
        "reward_trained_last_10": round(statistics.fmean(r["reward_trained"] for r in rows[-10:]), 3),
        "ahead": result["banner"]["shape"].get("ahead"),
        "staleness_mean": round(statistics.fmean(r["staleness_mean"] for r in rows), 3),
        "dropped_stale": sum(r["dropped_stale"] for r in rows),
        "spares_used_per_step": round(statistics.fmean(r.get("spares_used", 0) for r in rows), 3),
        "retries_per_step": round(statistics.fmean(r["retries"] for r in rows), 3),
        "met": minutes <= TARGET_MINUTES and s["reward_gain"] >= TARGET_GAIN,
        "median_step_s": round(statistics.median(r["step_s"] for r in rows), 3),
        "median_rollout_s": round(statistics.median(r["rollout_s"] for r in rows), 3),
        "median_train_s": round(statistics.median(r["train_s"] for r in rows), 3),
        "median_generate_s": round(statistics.median(r["generate_s"] for r in rows), 3),
        "median_publish_s": round(statistics.median(r["publish_s"] for r in rows), 3),
        "median_save_s": round(statistics.median(r["save_s"] for r in rows), 3),
        "checkpoints_saved": sum(r["save_s"] > 0 for r in rows),
        "mismatch_max": s["mismatch_max"],
        "plot": str(run / "training.png"),
    }


if __name__ == "__main__":
    main()
