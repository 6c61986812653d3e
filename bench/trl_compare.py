"""Our trainer against TRL's GRPOTrainer on the demo's task, model and batch, side by side in one
run: seconds per step and wall time to reward 0.9.

    make bench-trl                                     # once: .venvs/bench-trl, TRL and torch
    .venvs/trainer/bin/python -m bench.trl_compare [--steps 400] [--rounds 1] [--json OUT]

Both start from the same supervised warm-up (bench/learning_ahead.py's, made once) and train on
the same prompts (the training split of trainer_svc.data's arithmetic task for run.seed), with
configs/demo.toml's batch and optimizer: prompts_per_step prompts x samples_per_prompt samples,
max_tokens, temperature, top_p, lr (constant, no warm-up), Adam betas, max_grad_norm, clip_low
and clip_high, a token-mean loss over the batch (TRL's "dapo"), advantages scaled by the group's
std, no KL, one update per batch. TRL generates with transformers' own generate on this CPU (no
vLLM), in one process with --trl-threads torch threads (1 by default, as the trainer's
run.cpu_threads: on 2 shared cores 2 threads made its steps several times slower); ours is
configs/demo.toml as `make demo` runs it (a vLLM worker through the spool, rollout.ahead = 1,
publish every step, a checkpoint and a canary every 50 steps, dead groups sampled again once,
loss.correction "none"). The reward is correctness by
protocol.answers, the one definition both use: ours is reward_first (each step's first
sampling), TRL's the logged `reward` of its step (TRL never replaces dead groups).

Each launch is timed from the command's start; the orchestrator watches the run's metrics file
and stamps each step's line when it appears (every 0.1 s), so both are timed the same way. Time
to 0.9: launch to the first step whose last-10-step mean reward is >= 0.9. Seconds per step:
median over steps 6..N, and the whole training span over the steps. The two alternate, --rounds
times each (round r uses run.seed r), so both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import synthetic
from bench.common import ROOT, TRAINER, VENVS, emit, git_head, machine_line, sources_first, utc_minute
from bench.trl_side import FIXED_GRPO_ARGS, step_log_class

TRL_PYTHON = VENVS / "bench-trl" / "bin" / "python"
WORK = ROOT / "runs" / "bench-trl-compare"
TARGET_REWARD = 0.9
WINDOW = 10


# -- TRL's side: runs in .venvs/bench-trl -------------------------------------------------------


def trl_worker(spec: dict) -> None:
    """TRL's GRPOTrainer on the demo's settings (`spec`, written by the orchestrator); one JSON line
    per step into spec["metrics"]: step, reward, step_s."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    from protocol.answers import extract_answer, verdict

    def correct(completions, gold, **_) -> list[float]:
        return [float(verdict(extract_answer(text), g) is True) for text, g in zip(completions, gold, strict=True)]

    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines()]
    config = GRPOConfig(
        output_dir=spec["out"],
        seed=spec["seed"],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": torch.float32},
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["prompts_per_step"] * spec["samples_per_prompt"],
        gradient_accumulation_steps=1,
        num_generations=spec["samples_per_prompt"],
        max_completion_length=spec["max_tokens"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        weight_decay=0.0,
        max_grad_norm=spec["max_grad_norm"],
        epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"],
        scale_rewards="group",
        **FIXED_GRPO_ARGS,
    )
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=correct,
        args=config,
        train_dataset=Dataset.from_list(rows),
        callbacks=[step_log_class(TrainerCallback)(spec["metrics"])],
    )
    trainer.train()


# -- the orchestrator: runs in .venvs/trainer ---------------------------------------------------


def timed(command: list[str], metrics: Path, log: Path, env=None) -> tuple[list[dict], float]:
    """Run `command`; each line of `metrics` stamped with `t` (seconds since launch) as it
    appears. Returns the rows and the whole command's seconds."""
    started = time.monotonic()
    rows: list[dict] = []
    seen = 0
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=out, env=env)
        while True:
            finished = proc.poll() is not None
            if metrics.exists():
                text = metrics.read_text()
                complete = text[: text.rfind("\n") + 1]
                for line in complete[seen:].splitlines():
                    rows.append(json.loads(line) | {"t": time.monotonic() - started})
                seen = len(complete)
            if finished:
                break
            time.sleep(0.1)
    if proc.returncode != 0:
        raise SystemExit(f"{command[0]} failed ({proc.returncode}); see {log}")
    return rows, time.monotonic() - started


def reached(rows: list[dict], reward_key: str, level: float) -> dict | None:
    """The first row whose last-WINDOW-step mean reward is >= level; None if none is."""
    rewards = [r[reward_key] for r in rows]
    for i in range(WINDOW - 1, len(rows)):
        if statistics.fmean(rewards[i - WINDOW + 1 : i + 1]) >= level:
            return rows[i]
    return None


def figures(rows: list[dict], reward_key: str, total_s: float) -> dict:
    rewards = [r[reward_key] for r in rows]
    kept = rows[5:]
    levels = {level: reached(rows, reward_key, level) for level in (0.5, 0.7, 0.8, TARGET_REWARD)}
    return {
        "steps": len(rows),
        "median_step_s": statistics.median(r["step_s"] for r in kept),
        "mean_step_s_steps_6_on": (rows[-1]["t"] - rows[4]["t"]) / len(kept),
        "launch_to_first_step_s": rows[0]["t"],
        "launch_to_exit_s": total_s,
        f"step_reaching_{TARGET_REWARD}": levels[TARGET_REWARD]["step"] if levels[TARGET_REWARD] else None,
        f"launch_to_{TARGET_REWARD}_s": levels[TARGET_REWARD]["t"] if levels[TARGET_REWARD] else None,
        "step_and_launch_s_reaching": {
            level: row and [row["step"], round(row["t"], 1)] for level, row in levels.items()
        },
        "reward_first_10": statistics.fmean(rewards[:WINDOW]),
        "reward_last_10": statistics.fmean(rewards[-WINDOW:]),
        "reward_last_20": statistics.fmean(rewards[-20:]),
    }


def ours(work: Path, model: Path, seed: int, steps: int, tiny: bool = False) -> dict:
    from bench.learning_ahead import demo_config

    run_dir = work / f"ours-seed{seed}-{time.monotonic_ns()}"
    config = demo_config(work / f"{run_dir.name}.toml", run_dir, model, run={"seed": seed}, train={"steps": steps})
    command = [str(TRAINER), "train", str(config)]
    if tiny:  # a process that does nothing, for the trainer's, and the run it would have left
        synthetic.stand_in_train(config)
        command = ["true"]
    rows, total_s = timed(command, run_dir / "metrics.jsonl", work / f"{run_dir.name}.log")
    return figures(rows, "reward_first", total_s) | {"rows": rows}


def trl(work: Path, model: Path, seed: int, steps: int, threads: int, tiny: bool = False) -> dict:
    from trainer_svc.config import load
    from trainer_svc.data import load_problems

    cfg = load(ROOT / "configs" / "demo.toml")
    train, _ = load_problems(cfg.data, seed)
    prompts = work / f"prompts-seed{seed}.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p.prompt, "gold": p.gold}) + "\n" for p in train))
    name = f"trl-seed{seed}-{time.monotonic_ns()}"
    spec = {
        "model": str(model),
        "prompts": str(prompts),
        "metrics": str(work / f"{name}.metrics.jsonl"),
        "out": str(work / name),
        "seed": seed,
        "steps": steps,
        "threads": threads,
        "prompts_per_step": cfg.rollout.prompts_per_step,
        "samples_per_prompt": cfg.rollout.samples_per_prompt,
        "max_tokens": cfg.rollout.max_tokens,
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "lr": cfg.train.lr,
        "betas": list(cfg.train.betas),
        "max_grad_norm": cfg.train.max_grad_norm,
        "clip_low": cfg.loss.clip_low,
        "clip_high": cfg.loss.clip_high,
    }
    assert cfg.train.schedule == "constant" and cfg.train.warmup_steps == 0 and cfg.loss.kl_coef == 0
    assert cfg.loss.denominator == "token" and cfg.loss.advantage_norm == "std" and cfg.train.updates_per_batch == 1
    spec_path = work / f"{name}.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    command = [str(TRL_PYTHON), "-m", "bench.trl_compare", "--trl-worker", str(spec_path)]
    if tiny:  # no TRL: the rows its side would log, made up, and a process that does nothing
        made_up = synthetic.metrics_rows(steps)
        rows = [{"step": r["step"], "reward": r["reward_first"], "step_s": r["step_s"]} for r in made_up]
        synthetic.write_jsonl(Path(spec["metrics"]), rows)
        command = ["true"]
    rows, total_s = timed(
        command, Path(spec["metrics"]), work / f"{name}.log", env=sources_first(os.environ, "protocol")
    )  # TRL's venv has none
    return figures(rows, "reward", total_s) | {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--trl-threads", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--trl-worker", metavar="SPEC", help="internal: TRL's side, in .venvs/bench-trl")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: no launch, no TRL, made-up rows")
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(json.loads(Path(args.trl_worker).read_text()))
        return
    from bench.learning_ahead import WORK as WARM_UP_WORK
    from bench.learning_ahead import warm_up

    work, warm_up_work = WORK, WARM_UP_WORK
    if args.tiny:
        args.steps, args.rounds = 12, 1
        work = warm_up_work = Path(tempfile.mkdtemp(prefix="trl-compare-"))
    elif not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: run `make bench-trl` first")
    os.chdir(ROOT)
    work.mkdir(parents=True, exist_ok=True)
    model = warm_up(warm_up_work, args.tiny)
    versions = ["none (--tiny)"] * 3
    if not args.tiny:
        query = "import trl, transformers, torch; print(trl.__version__, transformers.__version__, torch.__version__)"
        versions = subprocess.run(
            [str(TRL_PYTHON), "-c", query], capture_output=True, text=True, check=True
        ).stdout.split()
    load_avg = [os.getloadavg()[0]]
    runs: dict[str, list[dict]] = {"ours": [], "trl": []}
    for seed in range(args.rounds):
        runs["ours"].append(ours(work, model, seed, args.steps, args.tiny))
        runs["trl"].append(trl(work, model, seed, args.steps, args.trl_threads, args.tiny))
    load_avg.append(os.getloadavg()[0])
    (work / "rows.json").write_text(json.dumps({k: [r.pop("rows") for r in v] for k, v in runs.items()}))
    report = {name: found for name, found in runs.items()}
    report["context"] = {
        "steps": args.steps,
        "rounds": args.rounds,
        "trl_threads": args.trl_threads,
        "trl": versions[0],
        "transformers": versions[1],
        "torch": versions[2],
        "commit": git_head(),
        "machine": machine_line(),
        "load_average_1min": [round(x, 2) for x in load_avg],
        "date": utc_minute(),
    }
    emit(report, args.json)


if __name__ == "__main__":
    main()
