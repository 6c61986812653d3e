"""Learning with rollout.ahead = 1 against synchronous (ahead = 0) on the demo, seed by seed, with
the engine/trainer correction on (loss.correction = "tis") and off ("none").

    .venvs/trainer/bin/python -m bench.learning_ahead [--seeds 0 1 2] [--steps 400] [--work DIR]
                                                      [--corrections tis none] [--json OUT]

One supervised warm-up (`trainer-svc sft` on configs/demo.toml, into the work directory), then
one GRPO run of configs/demo.toml from it per (seed, ahead, correction), one at a time; only
run.seed, train.steps, rollout.ahead, rollout.max_policy_lag (= ahead) and loss.correction
differ. The runs go correction by correction ("tis" first), seed by seed, a seed's two settings
of ahead back to back, so a shortage of time costs whole pairs, never one side of a pair. Each
finished run appends a line to <work>/runs.jsonl and a relaunch skips the runs
already there (a run that did not finish is started again from scratch, never counted).

The figure is reward_first (each step's first sampling, before dead groups are replaced: the
policy's own estimate) averaged over the last 20 steps; the last 10 are reported beside it. The
issue's target: with the correction on, ahead = 1 no more than 0.03 below synchronous.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import msgspec

from bench import synthetic
from bench.common import ROOT, TRAINER, emit, git_head, machine_line, read_jsonl, utc_minute
from trainer_svc.config import dump, load

WORK = ROOT / "runs" / "bench-learning-ahead"
SETTINGS = [(0, "tis"), (1, "tis"), (0, "none"), (1, "none")]  # (rollout.ahead, loss.correction)
WINDOW = 20
TARGET_GAP = 0.03


def demo_config(path: Path, run_dir: Path, model: Path, **sections: dict) -> Path:
    """configs/demo.toml with run.dir and model.path replaced and `sections` ({"train": {"steps":
    400}, ...}) laid over it; written to `path` as the trainer's own resolved TOML."""
    cfg = load(ROOT / "configs" / "demo.toml")
    cfg = msgspec.structs.replace(
        cfg,
        run=msgspec.structs.replace(cfg.run, dir=str(run_dir)),
        model=msgspec.structs.replace(cfg.model, path=str(model)),
    )
    for name, fields in sections.items():
        cfg = msgspec.structs.replace(cfg, **{name: msgspec.structs.replace(getattr(cfg, name), **fields)})
    path.write_bytes(dump(cfg))
    return path


def warm_up(work: Path, tiny: bool = False) -> Path:
    """The demo's supervised warm-up, once, into work/sft-model (with `tiny`, its config checked
    and a made-up report in its place)."""
    model = work / "sft-model"
    if not (model / "config.json").exists():
        config = demo_config(work / "sft.toml", work / "sft-run", model)
        if tiny:
            load(config)
            model.mkdir(parents=True)
            (model / "config.json").write_text("{}\n")
            (model / "sft_report.json").write_text(json.dumps({"steps": 40, "sampled_accuracy": 0.31}))
        else:
            subprocess.run(["nice", "-n", "10", str(TRAINER), "sft", str(config)], cwd=ROOT, check=True)
    return model


def grpo(work: Path, model: Path, seed: int, ahead: int, correction: str, steps: int, tiny: bool = False) -> dict:
    """One GRPO run from the warm-up; its figures (the run directory is removed after)."""
    name = f"seed{seed}-ahead{ahead}-{correction}"
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short earlier is started again
    config = demo_config(
        work / f"{name}.toml",
        run_dir,
        model,
        run={"seed": seed},
        train={"steps": steps},
        rollout={"ahead": ahead, "max_policy_lag": ahead},
        loss={"correction": correction},
    )
    started = time.monotonic()
    if tiny:
        synthetic.stand_in_train(config)
    else:
        with open(work / f"{name}.log", "w") as log:
            command = ["nice", "-n", "10", str(TRAINER), "train", str(config)]
            subprocess.run(command, cwd=ROOT, stdout=log, stderr=log, check=True)
    wall_s = time.monotonic() - started
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == steps, f"{name}: {len(rows)} steps logged, {steps} asked for"
    shutil.copy(run_dir / "metrics.jsonl", work / f"{name}.metrics.jsonl")
    shutil.rmtree(run_dir)
    return {
        "seed": seed,
        "ahead": ahead,
        "correction": correction,
        "steps": steps,
        f"reward_first_last_{WINDOW}": statistics.fmean(r["reward_first"] for r in rows[-WINDOW:]),
        "reward_first_last_10": statistics.fmean(r["reward_first"] for r in rows[-10:]),
        "reward_first_first_10": statistics.fmean(r["reward_first"] for r in rows[:10]),
        f"reward_trained_last_{WINDOW}": statistics.fmean(r["reward_trained"] for r in rows[-WINDOW:]),
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in rows),
        "dropped_stale": sum(r["dropped_stale"] for r in rows),
        "ratio_mean": statistics.fmean(r["ratio_mean"] for r in rows),
        "corrected_fraction": statistics.fmean(r["corrected_fraction"] for r in rows),
        "kl_engine": statistics.fmean(r["kl_engine"] for r in rows),
        "median_step_s": statistics.median(r["step_s"] for r in rows),
        "wall_s": wall_s,
    }


def compare(done: list[dict]) -> dict:
    """Per setting: the mean over seeds and each seed's figure; per correction: ahead = 1 minus
    synchronous, paired by seed, over the seeds both settings finished."""
    key = f"reward_first_last_{WINDOW}"
    figures: dict = {}
    for ahead, correction in SETTINGS:
        runs = sorted(
            (r for r in done if (r["ahead"], r["correction"]) == (ahead, correction)), key=lambda r: r["seed"]
        )
        if runs:
            figures[f"ahead={ahead} correction={correction}"] = {
                "seeds": [r["seed"] for r in runs],
                key: [round(r[key], 4) for r in runs],
                f"mean_{key}": round(statistics.fmean(r[key] for r in runs), 4),
                "mean_reward_first_last_10": round(statistics.fmean(r["reward_first_last_10"] for r in runs), 4),
                "staleness_mean": round(statistics.fmean(r["staleness_mean"] for r in runs), 3),
                "dropped_stale": sum(r["dropped_stale"] for r in runs),
                "ratio_mean": round(statistics.fmean(r["ratio_mean"] for r in runs), 4),
                "corrected_fraction": round(statistics.fmean(r["corrected_fraction"] for r in runs), 5),
                "kl_engine": round(statistics.fmean(r["kl_engine"] for r in runs), 5),
                "median_step_s": round(statistics.median(r["median_step_s"] for r in runs), 3),
            }
    for correction in ("tis", "none"):
        by_seed = {(r["seed"], r["ahead"]): r[key] for r in done if r["correction"] == correction}
        seeds = sorted(s for s, a in by_seed if a == 0 and (s, 1) in by_seed)
        if seeds:
            gaps = [by_seed[(s, 1)] - by_seed[(s, 0)] for s in seeds]
            mean_gap = statistics.fmean(gaps)
            figures[f"ahead1_minus_sync correction={correction}"] = {
                "seeds": seeds,
                "per_seed": [round(g, 4) for g in gaps],
                "mean": round(mean_gap, 4),
                "target": f">= -{TARGET_GAP}" if correction == "tis" else "reported",
                "met": mean_gap >= -TARGET_GAP if correction == "tis" else None,
            }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--work", type=Path, default=WORK, help="its runs.jsonl: runs already done are skipped")
    parser.add_argument("--corrections", nargs="+", default=["tis", "none"], choices=["tis", "none"])
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: no launch, made-up runs summarised")
    args = parser.parse_args()
    if args.tiny:
        args.seeds, args.steps, args.work = [0], 12, Path(tempfile.mkdtemp(prefix="learning-ahead-"))
    os.chdir(ROOT)  # the config's relative paths (the base model, the rollout venv) are the checkout's
    args.work.mkdir(parents=True, exist_ok=True)
    load_avg = [os.getloadavg()[0]]
    model = warm_up(args.work, args.tiny)
    ledger = args.work / "runs.jsonl"
    done = [json.loads(line) for line in ledger.read_text().splitlines()] if ledger.exists() else []
    for correction in args.corrections:
        for seed in args.seeds:
            for ahead in (0, 1):
                if any(
                    (r["seed"], r["ahead"], r["correction"], r["steps"]) == (seed, ahead, correction, args.steps)
                    for r in done
                ):
                    continue
                run = grpo(args.work, model, seed, ahead, correction, args.steps, args.tiny)
                with open(ledger, "a") as f:
                    f.write(json.dumps(run) + "\n")
                done.append(run)
                print(json.dumps(run), flush=True)
    load_avg.append(os.getloadavg()[0])
    done = [r for r in done if r["seed"] in args.seeds and r["steps"] == args.steps]
    report = {
        "figures": compare(done),
        "context": {
            "steps": args.steps,
            "window": WINDOW,
            "warm_up": json.loads((model / "sft_report.json").read_text())["sampled_accuracy"],
            "commit": git_head(),
            "machine": machine_line(),
            "load_average_1min": [round(x, 2) for x in load_avg],
            "date": utc_minute(),
        },
    }
    emit(report, args.json)


if __name__ == "__main__":
    main()
