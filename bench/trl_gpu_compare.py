"""Ours against TRL's GRPOTrainer on one GPU, the real model, the same task and settings: seconds per
step, generated tokens per second, held-out greedy accuracy against wall time from launch, launch
to first step and peak GPU memory.

    python -m bench.trl_gpu_compare --side ours [--config configs/smollm2-gpu.toml] [--steps 120] --json ours.json
    python -m bench.trl_gpu_compare --side trl  [--config configs/smollm2-gpu.toml] [--steps 120] --json trl.json
    python -m bench.trl_gpu_compare --plot ours.json trl.json --png docs/smollm2_gpu_vs_trl.png

One side per command (each is one launch, timed from the command that starts it; the GPU host
allows 10 minutes a command). On a machine without a GPU a small mode checks the script:
`--model build/smollm2-135m-instruct --prompts 4 --samples 4 --tokens 4 --steps 3
--eval-every 1` (figures meaningless; ours runs its worker apart, TRL generates with transformers).

Ours: `trainer-svc train` of --config (configs/smollm2-gpu.toml: the worker colocated on the
trainer's GPU, `ahead = 1`, tis, every group trained on), with only these changed: the
run directory, train.steps, canary.every (--eval-every) and, where given, the model, batch and
token overrides. Its canary (canary.jsonl) is the held-out greedy accuracy: the first
canary.problems held-out rows, answered greedily through the spool from the newest weights.

TRL: GRPOTrainer (TRL 1.16.0) in one process, `use_vllm=True, vllm_mode="colocate"` on a GPU
(vLLM inside the trainer process, on vllm_gpu_memory_utilization = the config's
rollout.colocate_gpu_memory), on the config's own settings: the same model (bf16 weights, as ours
trains on a GPU), the same training rows (trainer_svc.data's split for run.seed: TRL never sees the
held-out rows), chat rows rendered by the model's chat template, reward = correctness by
protocol.answers (the config's reward: `correct` weighted 1, the format penalty weighted 0, the
overlong penalty off), rollout.prompts_per_step x samples_per_prompt completions per optimizer step
(one update per batch, in --trl-micro-batches micro-batches of equal size, by default
train.grad_accum: TRL's per_device_train_batch_size and gradient_accumulation_steps, one generation
of the step's samples per optimizer step), max_tokens, temperature, top_p, lr with the config's
linear warm-up and then constant, Adam betas, weight decay, max_grad_norm, clip_low / clip_high,
token-mean loss over the batch (TRL's "dapo"), rewards scaled by the group's std, no KL, and
truncated importance sampling against vLLM's logprobs per token capped at loss.correction_cap
(TRL's "token_truncate"; ours corrects samples one step old by the same weight). What differs by
design: TRL generates each step's samples right before training on them (on-policy, one process);
ours generates the next step's while this one trains (`ahead = 1`) in a worker process (and,
where a config asks for spare prompts, replaces groups whose samples all scored alike by them).
The held-out greedy accuracy on TRL's side: every --eval-every steps (and before the first), the
same rows rendered the same way, answered greedily by the training model with transformers'
generate, graded by the same verifier.

Tool use: with a config that has an [env] of trainer_svc.tasks.calculator
(configs/smollm2-gpu-tools.toml), TRL's side is GRPOTrainer(tools=[calculate]) on the
environment's own prompts, tool and reward, its held-out accuracy from greedy episodes
(bench/trl_tools.py says what is mirrored and how).

Timing: each side's metrics lines (ours metrics.jsonl, TRL's per-step rows) are stamped as they
appear (every 20 ms), from the launch; held-out accuracies carry their wall-clock time. Per step:
median seconds over the steps after --skip, generated tokens per second (the trained samples'
tokens over the step's seconds; ours also generates spare prompts, counted apart). Peak GPU
memory: `nvidia-smi`'s memory.used of the whole device every 250 ms (both of ours processes and
TRL's one, vLLM's reserved share included) and, on TRL's side, torch's own peak in its process.
Ours also reports, from its worker's log: the engine's build, and per step the reload and the
engine call (with its `LLM.generate` part); the step over max(the worker's reload and call, train
and publish) says how well generation overlaps training.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import tomllib

from bench import synthetic
from bench.common import ROOT, sources_first
from bench.models import BENCH_SHAPES, random_model
from bench.trl_side import trl_spec, trl_worker

CPU_TRL_PYTHON = ROOT / ".venvs" / "bench-trl" / "bin" / "python"
PROMPT_ROOM = 512  # tokens of context --tokens leaves the prompt (the shipped tasks' prompts are under 200)
LEVELS = (0.8, 0.85)


def gpu_available() -> bool:
    return (
        shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi"], capture_output=True).returncode == 0
    )


class MemoryWatch:
    """The device's memory.used (MiB) every 250 ms through nvidia-smi, its peak kept."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self.proc = None
        if gpu_available():
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "250"],
                stdout=subprocess.PIPE,
                text=True,
            )
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.peak_mib = max(self.peak_mib, int(line.strip()))

    def stop(self) -> float | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        self.proc.wait(10)
        return round(self.peak_mib / 1024, 2)


def watch(command: list[str], files: dict[str, Path], log: Path, timeout_s: float, env=None) -> dict:
    """Run `command`; every line of each file in `files` stamped with `t` (seconds from launch) as
    it appears. Returns {"exit": code, "launched": epoch, "rows": {name: [rows]}, "total_s": s}."""
    launched = time.time()
    started = time.monotonic()
    rows: dict[str, list[dict]] = {name: [] for name in files}
    seen = dict.fromkeys(files, 0)
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        while True:
            finished = proc.poll() is not None
            if not finished and time.monotonic() - started > timeout_s:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                finished = True
            now = time.monotonic() - started
            for name, path in files.items():
                if path.exists():
                    text = path.read_text()
                    complete = text[: text.rfind("\n") + 1]
                    for line in complete[seen[name] :].splitlines():
                        rows[name].append(json.loads(line) | {"t": round(now, 3)})
                    seen[name] = len(complete)
            if finished:
                break
            time.sleep(0.02)
    return {"exit": proc.returncode, "launched": launched, "rows": rows, "total_s": time.monotonic() - started}


# -- the shared settings ---------------------------------------------------------------------------


def load_settings(args) -> dict:
    """The config's TOML as a dict, with this run's overrides; paths made absolute."""
    raw = tomllib.loads(Path(args.config).read_text())
    raw["model"]["path"] = str((ROOT / (args.model or raw["model"]["path"])).resolve())
    if raw["data"].get("path"):
        raw["data"]["path"] = str((ROOT / raw["data"]["path"]).resolve())
    rollout = raw.setdefault("rollout", {})
    for key, value in (("prompts_per_step", args.prompts), ("samples_per_prompt", args.samples),
                       ("max_tokens", args.tokens)):  # fmt: skip
        if value:
            rollout[key] = value
    if args.tokens:  # the worker's context must hold a prompt beside the longest answer
        rollout["worker_args"] = with_max_model_len(rollout.get("worker_args", []), args.tokens + PROMPT_ROOM)
    raw.setdefault("train", {})["steps"] = args.steps
    canary = raw.setdefault("canary", {})
    if canary.get("every", 1):  # a config that turns its canary off has rows without gold answers
        canary["every"] = args.eval_every
    return raw


def with_max_model_len(worker_args: list[str], least: int) -> list[str]:
    """`worker_args` whose --max-model-len is at least `least`: raised (first, the only one) where
    lower or absent, left as they are otherwise."""
    from trainer_svc.rails.gates import worker_max_model_len

    if (worker_max_model_len(worker_args) or 0) >= least:
        return list(worker_args)
    kept, skip = [], False
    for arg in worker_args:
        if skip or arg.startswith("--max-model-len="):
            skip = False
        elif arg == "--max-model-len":
            skip = True  # and its value
        else:
            kept.append(arg)
    return ["--max-model-len", str(least), *kept]


def problems(raw: dict, work: Path) -> tuple[Path, Path, int]:
    """The training rows and the canary's held-out rows as TRL reads them ({"prompt", "gold"}), from
    trainer_svc.data's split for run.seed: the rows ours trains and is graded on."""
    from trainer_svc.config import load
    from trainer_svc.data import load_problems

    config_path = work / "settings.toml"
    write_toml(raw, config_path)
    cfg = load(config_path)
    train, held_out = load_problems(cfg.data, cfg.run.seed)
    held_out = held_out[: cfg.canary.problems]
    paths = (work / "train.jsonl", work / "held_out.jsonl")
    for path, rows in zip(paths, (train, held_out), strict=True):
        path.write_text("".join(json.dumps({"prompt": p.prompt, "gold": p.gold, **p.fields}) + "\n" for p in rows))
    return paths[0], paths[1], len(held_out)


def write_toml(raw: dict, path: Path) -> None:
    import msgspec

    path.write_bytes(msgspec.toml.encode(raw))


# -- ours ------------------------------------------------------------------------------------------


def trainer_command() -> list[str]:
    for candidate in (ROOT / ".venvs" / "trainer" / "bin" / "trainer-svc", Path(sys.executable).parent / "trainer-svc"):
        if candidate.exists():
            return [str(candidate)]
    return [sys.executable, "-m", "trainer_svc.cli"]


def run_ours(raw: dict, work: Path, args) -> dict:
    run_dir = work / "ours-run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a run an earlier launch left in --work would be resumed
    raw["run"]["dir"] = str(run_dir)
    gpu = gpu_available()
    raw["rollout"]["colocate"] = gpu and raw["rollout"].get("colocate", False)
    raw["rollout"].setdefault("rollout_venv", str(ROOT / ".venvs" / "rollout"))
    if not gpu:  # a check of the script: the worker on the CPU, as the demo runs it
        longest = raw["env"].get("max_episode_tokens", 1024) if raw.get("env") else 128  # an episode's turns
        raw["rollout"]["worker_args"] = ["--max-model-len", str(longest)]
        raw["run"]["cpu_threads"] = 1
    config_path = work / "ours.toml"
    write_toml(raw, config_path)
    memory = MemoryWatch()
    files = {"steps": run_dir / "metrics.jsonl", "evals": run_dir / "canary.jsonl"}
    command = [*trainer_command(), "train", str(config_path)]
    if args.tiny:  # the config loaded as the trainer loads it, the run it would leave made up, no launch
        synthetic.stand_in_train(config_path)
        command = ["true"]
    found = watch(command, files, work / "ours.log", args.timeout)
    peak = memory.stop()
    steps = [
        {
            "step": r["step"],
            "t": r["t"],
            "step_s": r["step_s"],
            "reward": r["reward_first"],
            "completion_tokens": r["response_length"]
            * raw["rollout"]["prompts_per_step"]
            * raw["rollout"]["samples_per_prompt"],
            "spare_tokens": r["response_length"] * r.get("spares", 0) * raw["rollout"]["samples_per_prompt"],
            "wait_s": r["rollout_s"],
            "train_s": r["train_s"],
            "publish_s": r["publish_s"],
            "retries": r["retries"],
            "micro_batches": r.get("micro_batches"),
            "turns": r["episode_turns"] * raw["rollout"]["prompts_per_step"] * raw["rollout"]["samples_per_prompt"]
            if "episode_turns" in r
            else None,
            "prefix_cache_hit": r.get("prefix_cache_hit"),
        }
        for r in found["rows"]["steps"]
    ]
    evals = [  # the canary's held-out reward too: the run's own score of its greedy answers
        {
            "step": r["step"],
            "accuracy": r["accuracy"],
            "reward": r.get("reward"),
            "t": round(r["time"] - found["launched"], 2),
        }
        for r in found["rows"]["evals"]
    ]
    worker_log = run_dir / "rollout-worker.log"
    sequences = raw["rollout"]["prompts_per_step"] * raw["rollout"]["samples_per_prompt"]
    worker = worker_figures(worker_log.read_text(errors="replace"), sequences) if worker_log.exists() else {}
    return {"exit": found["exit"], "total_s": found["total_s"], "steps": steps, "evals": evals, "peak_gpu_gib": peak,
            "worker": worker}  # fmt: skip


WORKER_LINES = {
    "reload": re.compile(
        r"reloaded \S+ in ([\d.]+) s \(weights and check ([\d.]+) s, of it waiting for the files' sums ([\d.]+) s; "
        r"prefix cache ([\d.]+) s\)"
    ),
    "call": re.compile(r"generated (\d+) sequences in ([\d.]+) s \(LLM\.generate ([\d.]+) s\)"),
    "llm": re.compile(r"vllm_host\[\d+\]: engine built for \S+ in ([\d.]+) s"),
    "process": re.compile(r"engine process \d+ built for \S+ in ([\d.]+) s"),
}


def worker_figures(log: str, sequences: int) -> dict:
    """Medians of the worker's in-place reloads (all, the weights with their check, the wait for
    the files' sums after the engine answered, the prefix-cache reset) and of its engine calls of a
    step's `sequences` (all, LLM.generate), and its engine build (the engine process from its
    start, vLLM's LLM(...) in it), from its log lines."""
    found = {name: [m.groups() for m in pattern.finditer(log)] for name, pattern in WORKER_LINES.items()}
    calls = [(float(a), float(b)) for n, a, b in found["call"] if int(n) == sequences]
    figures = {}
    if found["reload"]:
        for i, key in enumerate(("reload_s", "reload_weights_and_check_s", "reload_file_sums_wait_s",
                                 "reload_prefix_cache_s")):  # fmt: skip
            figures[key] = round(statistics.median(float(r[i]) for r in found["reload"]), 4)
    if calls:
        figures["call_s"] = round(statistics.median(c for c, _ in calls), 4)
        figures["call_llm_generate_s"] = round(statistics.median(g for _, g in calls), 4)
    if found["process"] and found["llm"]:
        figures["engine_process_build_s"] = float(found["process"][0][0])
        figures["engine_llm_s"] = float(found["llm"][0][0])
    return figures


# -- TRL -------------------------------------------------------------------------------------------


def trl_python(args) -> str:
    """The interpreter with TRL: --trl-python, else the CPU venv of `make bench-trl` where it exists
    (a machine without a GPU), else this one (the GPU host, TRL on PYTHONPATH from its bundle)."""
    if args.trl_python:
        return args.trl_python
    if not gpu_available() and CPU_TRL_PYTHON.exists():
        return str(CPU_TRL_PYTHON)
    return sys.executable


def run_trl(raw: dict, work: Path, args) -> dict:
    train, held_out, _ = problems(raw, work)
    spec = trl_spec(raw, train, held_out, work, args)
    spec_path = work / "trl.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    # for a venv of TRL's without the checkout's packages (trainer_svc: an environment's own code)
    env = sources_first(os.environ, "protocol", "trainer_svc")
    if not gpu_available():
        env.setdefault("OMP_NUM_THREADS", "1")
    memory = MemoryWatch()
    files = {"steps": Path(spec["metrics"]), "evals": Path(spec["evals"])}
    for path in files.values():  # TRL's side appends: rows an earlier launch left in --work would count
        path.unlink(missing_ok=True)
    command = [trl_python(args), "-m", "bench.trl_gpu_compare", "--trl-worker", str(spec_path)]
    if args.tiny:  # no TRL: the rows its side would log, made up
        rows = synthetic.metrics_rows(args.steps)
        synthetic.write_jsonl(
            files["steps"],
            [
                {
                    "step": r["step"],
                    "reward": r["reward_first"],
                    "step_s": r["step_s"],
                    "completion_mean_length": 4.0,
                    "peak_torch_gib": None,
                }
                for r in rows
            ],
        )
        synthetic.write_jsonl(files["evals"], [{"step": 0, "accuracy": 0.1, "n": 64, "time": time.time()}])
        command = ["true"]
    found = watch(command, files, work / "trl.log", args.timeout, env=env)
    peak = memory.stop()
    steps = [
        {
            "step": r["step"],
            "t": r["t"],
            "step_s": r["step_s"],
            "reward": r["reward"],
            "completion_tokens": (r["completion_mean_length"] or 0)
            * spec["prompts_per_step"]
            * spec["samples_per_prompt"],
            "turns": r.get("turns"),
        }
        for r in found["rows"]["steps"]
    ]
    evals = [
        {"step": r["step"], "accuracy": r["accuracy"], "t": round(r["time"] - found["launched"], 2)}
        for r in found["rows"]["evals"]
    ]
    torch_peak = max((r.get("peak_torch_gib") or 0 for r in found["rows"]["steps"]), default=None)
    return {
        "exit": found["exit"],
        "total_s": found["total_s"],
        "steps": steps,
        "evals": evals,
        "peak_gpu_gib": peak,
        "peak_torch_gib": round(torch_peak, 2) if torch_peak else None,
        "spec": spec,
    }


# -- figures ---------------------------------------------------------------------------------------


def summary(found: dict, skip: int) -> dict:
    steps = found["steps"]
    kept = [s for s in steps if s["step"] > skip] or steps
    figures = {"steps_done": len(steps), "exit": found["exit"], "peak_gpu_gib": found.get("peak_gpu_gib")}
    if kept:
        figures |= {
            "median_step_s": round(statistics.median(s["step_s"] for s in kept), 3),
            "median_generated_tokens_per_s": round(
                statistics.median(s["completion_tokens"] / s["step_s"] for s in kept)
            ),
            "median_completion_tokens": round(statistics.median(s["completion_tokens"] for s in kept)),
            "launch_to_first_step_s": round(steps[0]["t"], 1),
            "launch_to_last_step_s": round(steps[-1]["t"], 1),
            "reward_first_10": round(statistics.fmean(s["reward"] for s in steps[:10]), 3),
            "reward_last_10": round(statistics.fmean(s["reward"] for s in steps[-10:]), 3),
            "reward_last_10_steps": f"{steps[-10:][0]['step']}-{steps[-1]['step']}",
            "completion_tokens_first_step": steps[0]["completion_tokens"],
            "completion_tokens_last_step": steps[-1]["completion_tokens"],
        }
        if kept[0].get("turns") is not None:  # episodes: assistant turns a second
            figures["median_turns_per_s"] = round(statistics.median(s["turns"] / s["step_s"] for s in kept), 1)
        hits = [s["prefix_cache_hit"] for s in kept if s.get("prefix_cache_hit") is not None]
        if hits:  # ours, episodes: the share of later turns' prompt tokens the worker's cache served
            figures["median_prefix_cache_hit"] = round(statistics.median(hits), 3)
        if "spare_tokens" in kept[0]:
            all_tokens = [(s["completion_tokens"] + s["spare_tokens"]) / s["step_s"] for s in kept]
            figures["median_tokens_per_s_with_spares"] = round(statistics.median(all_tokens))
            figures["steps_with_a_retry"] = sum(s["retries"] > 0 for s in kept)
            for part in ("wait_s", "train_s", "publish_s"):
                figures[f"median_{part}"] = round(statistics.median(s[part] for s in kept), 3)
            if kept[0].get("micro_batches") is not None:
                figures["median_micro_batches"] = statistics.median(s["micro_batches"] for s in kept)
                figures["median_trained_tokens_per_train_s"] = round(
                    statistics.median(s["completion_tokens"] / s["train_s"] for s in kept if s["train_s"])
                )
        last = steps[-1]["step"]
        ranges = [(skip + 1, last // 3), (last // 3 + 1, 2 * last // 3), (2 * last // 3 + 1, last)]
        figures["median_step_s_by_range"] = {
            f"{a}-{b}": round(statistics.median(s["step_s"] for s in steps if a <= s["step"] <= b), 3)
            for a, b in ranges
            if any(a <= s["step"] <= b for s in steps)
        }
        worker = found.get("worker") or {}
        if "reload_s" in worker and "call_s" in worker and "median_train_s" in figures:
            generation = worker["reload_s"] + worker["call_s"]
            bound = max(generation, figures["median_train_s"] + figures["median_publish_s"])
            figures["step_over_max_generation_train_publish"] = round(figures["median_step_s"] / bound, 3)
            figures["worker"] = worker
    if found.get("peak_torch_gib") is not None:
        figures["peak_torch_gib"] = found["peak_torch_gib"]
    evals = found["evals"]
    if evals:
        figures["accuracy_first"] = evals[0]["accuracy"]
        figures["accuracy_best"] = max(e["accuracy"] for e in evals)
        figures["accuracy_last"] = evals[-1]["accuracy"]
        for level in LEVELS:
            hit = next((e for e in evals if e["accuracy"] >= level), None)
            figures[f"launch_to_accuracy_{level}_s"] = hit and hit["t"]
            figures[f"step_reaching_accuracy_{level}"] = hit and hit["step"]
        within = [e["accuracy"] for e in evals if e["t"] <= 300]
        figures["best_accuracy_within_300_s"] = max(within) if within else None
        held_out = [e for e in evals if e.get("reward") is not None]
        if held_out:
            figures["held_out_reward_first"] = round(held_out[0]["reward"], 3)
            figures["held_out_reward_best"] = round(max(e["reward"] for e in held_out), 3)
            figures["held_out_reward_last"] = round(held_out[-1]["reward"], 3)
            within = [e["reward"] for e in held_out if e["t"] <= 600]
            figures["best_held_out_reward_within_600_s"] = round(max(within), 3) if within else None
    return figures


def plot(paths: list[str], png: str, task: str = "two-digit sums") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    for path in paths:
        data = json.loads(Path(path).read_text())
        label = {"ours": "ours (trainer-svc, colocated, ahead = 1)", "trl": "TRL GRPOTrainer (vLLM colocate)"}
        evals = data["run"]["evals"]
        ax.plot([e["t"] for e in evals], [e["accuracy"] for e in evals], marker="o", markersize=3,
                label=label.get(data["side"], data["side"]))  # fmt: skip
    for level in LEVELS:
        ax.axhline(level, color="grey", linewidth=0.6, linestyle=":")
    ax.axvline(300, color="grey", linewidth=0.6, linestyle="--")
    ax.set_xlabel("seconds from launch")
    ax.set_ylabel("held-out greedy accuracy (64 rows)")
    ax.set_ylim(0, 1)
    ax.set_xlim(left=0)  # from launch: the start-up is part of the time to an accuracy
    save(fig, ax, paths, f"{task}, ", png)


def save(fig, ax, paths: list[str], task: str, png: str) -> None:
    """The title (the first run's machine), legend and grid both plots share; then the file."""
    first = json.loads(Path(paths[0]).read_text())
    ax.set_title(f"SmolLM2-135M-Instruct, {task}one {first.get('machine', 'GPU')}", fontsize=10)
    ax.legend(loc="lower right", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}")


def plot_reward(paths: list[str], png: str) -> None:
    """Each side's training reward (a ten-step running mean) against seconds from launch: the curve
    of a task whose held-out grade is too strict to move within minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    for path in paths:
        data = json.loads(Path(path).read_text())
        steps = data["run"]["steps"]
        rewards = [s["reward"] for s in steps]
        mean = [sum(rewards[max(0, i - 9) : i + 1]) / len(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
        ax.plot([s["t"] for s in steps], mean, label=f"{data['side']}: {data['config']}")
    ax.set_xlabel("seconds from launch")
    ax.set_ylabel("training reward (ten-step running mean)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    save(fig, ax, paths, "", png)


def run_tiny(args) -> None:
    """--tiny, the CPU check of the script: both sides on the config's settings without a launch
    (made-up runs), their summaries, then both plots."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="trl-gpu-tiny-"))
    args.steps, args.eval_every, args.skip = 6, 3, 1
    paths, summaries = [], {}
    for side in ("ours", "trl"):
        work = base / side
        work.mkdir()
        raw = load_settings(args)
        found = run_ours(raw, work, args) if side == "ours" else run_trl(raw, work, args)
        summaries[side] = summary(found, args.skip)
        paths.append(str(base / f"{side}.json"))
        Path(paths[-1]).write_text(json.dumps({"side": side, "config": str(args.config), "machine": "CPU",
                                               "run": found}))  # fmt: skip
    plot(paths, str(base / "accuracy.png"))
    plot_reward(paths, str(base / "reward.png"))
    print(json.dumps(summaries, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "trl_gpu_compare", "summaries": summaries}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["ours", "trl"])
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2-gpu.toml"))
    parser.add_argument("--model", help="override model.path (a small model checks the script on a CPU)")
    parser.add_argument("--prompts", type=int, help="override rollout.prompts_per_step")
    parser.add_argument("--samples", type=int, help="override rollout.samples_per_prompt")
    parser.add_argument("--tokens", type=int, help="override rollout.max_tokens")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--random-weights", action="store_true",
                        help="random weights of the model's shape (seeded, the same on both sides): every answer "
                             "runs to --tokens")  # fmt: skip
    parser.add_argument(
        "--shape",
        choices=sorted(BENCH_SHAPES),
        help="random weights of this Qwen2.5 shape at the model's tokenizer (implies --random-weights)",
    )
    parser.add_argument("--eval-every", type=int, default=10, help="held-out greedy accuracy every N steps")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds the launch may take")
    parser.add_argument("--work", type=Path, help="directory for the run (default: a fresh one under /tmp)")
    parser.add_argument("--trl-python", help="the interpreter with TRL (default: see trl_python)")
    parser.add_argument("--trl-micro-batches", type=int, help="TRL's micro-batches a step (default: train.grad_accum)")
    parser.add_argument("--json")
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="draw these sides' accuracy against time")
    parser.add_argument("--plot-reward", nargs="+", metavar="JSON", help="draw these sides' reward against time")
    parser.add_argument("--png", default=str(ROOT / "docs" / "smollm2_gpu_vs_trl.png"))
    parser.add_argument("--task", default="two-digit sums", help="the task, as --plot's title names it")
    parser.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)  # internal: TRL's process
    parser.add_argument("--tiny", action="store_true", help="the CPU check: both sides without a launch, the plots")
    args = parser.parse_args()
    if args.tiny:
        run_tiny(args)
        return
    if args.trl_worker:
        trl_worker(json.loads(Path(args.trl_worker).read_text()))
        return
    if args.plot:
        plot(args.plot, args.png, args.task)
        return
    if args.plot_reward:
        plot_reward(args.plot_reward, args.png)
        return
    if not args.side:
        parser.error("give --side ours or --side trl (or --plot)")
    import tempfile

    random_weights = args.random_weights or bool(args.shape)
    work = args.work or Path(tempfile.mkdtemp(prefix=f"trl-gpu-{args.side}-"))
    work.mkdir(parents=True, exist_ok=True)
    if random_weights:  # built before the launch: its time is no side's
        source = ROOT / (args.model or tomllib.loads(Path(args.config).read_text())["model"]["path"])
        args.model = str(random_model(source, work / "model", shape=args.shape))
    raw = load_settings(args)
    found = run_ours(raw, work, args) if args.side == "ours" else run_trl(raw, work, args)
    machine = "CPU"
    if gpu_available():
        machine = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True).stdout.strip().splitlines()[0]  # fmt: skip
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    report = {
        "benchmark": "trl_gpu_compare",
        "side": args.side,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine,
        "cores": os.cpu_count(),
        "commit": head.strip(),
        "config": str(args.config),
        "weights": f"random, {args.shape or 'the model'}'s shape" if random_weights else "the model's",
        "settings": {k: v for k, v in raw.items() if k in ("model", "rollout", "train", "loss", "canary")},
        "run": found,
    }
    if args.json:  # the raw rows first: a figure that cannot be computed must not lose the run
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    report["summary"] = summary(found, args.skip)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))
    if found["exit"] not in (0, None) and not found["steps"]:
        log = work / f"{args.side}.log"
        raise SystemExit(f"{args.side}: no step finished (exit {found['exit']}); {log}:\n{log.read_text()[-6000:]}")


if __name__ == "__main__":
    main()
