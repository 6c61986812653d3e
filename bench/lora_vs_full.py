"""LoRA against full fine-tuning on the demo: the same run (configs/demo.toml: its warm-up, a
spawned vLLM worker, 16 prompts x 8 samples, ahead = 1, spare prompts, tis), once training the
whole model and once a LoRA adapter; the weight sync's cost and the rewards side by side.

    PYTHONPATH=protocol/src:rollout_svc/src:trainer_svc/src \\
        .venvs/rollout/bin/python -m bench.lora_vs_full [--steps 200] [--rank 8] [--lora-lr 1e-3]
                                                        [--out /tmp/bench-lora] [--png docs/lora_vs_full.png]
                                                        [--json OUT]

Variants, each a fresh run on the same warmed-up model (one `trainer-svc sft` first):
- `full`: the demo as it is; its publishes go into shared-memory slots (the default beside a
  spawned worker: the fastest full-weight sync on this host);
- `full-dirs`: the same with `publish.slots = "off"`: a weights directory per step;
- `lora`: `[lora] rank = --rank` (alpha 2 x rank, the decoder's linear projections), at
  `--lora-lr` (an adapter starts at zero and takes larger steps: 1e-3 where the full model takes
  the demo's 1e-4); a publish is the adapter directory;
- `lora-demo-lr` (asked for by name in --variants): the same at the demo's lr, 1e-4.

Reported per variant: publish bytes (the last step's directory: what one publish writes) and
seconds per step (metrics.jsonl's publish_s, median), the worker's load seconds per publish (its
Prometheus textfile: reloading seconds over reloads; for LoRA the adapter's check, copy and
vLLM's add_lora), step time (median), the trainer's peak resident memory (VmHWM of its process)
and the reward of the first and last 20 steps; the reward curves of all three go into --png.
Target: LoRA publish + load <= 5% of the full one's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import synthetic
from bench.common import ROOT, TRAINER, report, say
from tests.run_config import merge, to_toml  # the tests' trainer configs

TARGET = 0.05
LABELS = {
    "full": "full model, lr 1e-4, shared-memory slots",
    "full-dirs": "full model, lr 1e-4, weights directories",
    "lora": "LoRA rank 8, lr 1e-3, adapter directories",
    "lora-demo-lr": "LoRA rank 8, lr 1e-4 (the demo's), adapter directories",
}


def demo_sections() -> dict[str, dict]:
    import tomllib

    return tomllib.loads((ROOT / "configs" / "demo.toml").read_text())


def write_config(path: Path, *layers: dict[str, dict]) -> Path:
    path.write_text(to_toml(merge(*layers)))
    return path


def warm_model(out: Path, tiny_mode: bool = False) -> Path:
    """The demo's warm-up (its [sft]), once: the model every variant starts from (with
    `tiny_mode`, its config checked and an empty model in its place)."""
    model = out / "sft-model"
    if not (model / "config.json").is_file():
        tiny = ROOT / "build" / "tiny-model"
        if tiny_mode:
            from trainer_svc.config import load

            sections = demo_sections() | {"run": {"dir": str(out / "sft-run")}, "model": {"path": str(model)}}
            load(write_config(out / "sft.toml", sections))
            model.mkdir()
            (model / "config.json").write_text("{}\n")
            return model
        if not (tiny / "config.json").is_file():
            subprocess.run(["make", "tiny-model"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        sections = demo_sections()
        sections["sft"]["base"] = str(tiny)
        config = write_config(out / "sft.toml", sections, {"run": {"dir": out / "sft-run"}, "model": {"path": model}})
        say("warm-up (trainer-svc sft)")
        subprocess.run([str(TRAINER), "sft", str(config)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return model


def peak_rss_kib(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(found.group(1)) if found else None


def textfile_value(metrics_dir: Path, name: str) -> float:
    for path in metrics_dir.glob("*.prom"):
        for line in path.read_text().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} not in {metrics_dir}")


def stand_in_run(config: Path, metrics_dir: Path, steps: int) -> None:
    """--tiny: a made-up run of `config`, with the last publish's manifest and the worker's textfile."""
    run_dir = synthetic.stand_in_train(config)
    last = run_dir / "weights" / f"step_{steps:08d}"
    last.mkdir(parents=True)
    (last / "manifest.json").write_text(json.dumps({"bytes": 1_000_000}))
    metrics_dir.mkdir()
    (metrics_dir / "worker.prom").write_text(
        'rollout_reloads_total{worker="w"} 3\nrollout_reloading_seconds_total{worker="w"} 0.3\n'
    )


def run_variant(name: str, out: Path, model: Path, steps: int, extra: dict[str, dict], tiny: bool = False) -> dict:
    run_dir = out / name
    metrics_dir = out / f"{name}-worker-metrics"
    sections = demo_sections()
    sections.pop("sft")
    worker_args = [*sections["rollout"]["worker_args"], "--metrics-dir", str(metrics_dir)]
    config = write_config(
        out / f"{name}.toml",
        sections,
        {
            "run": {"dir": run_dir},
            "model": {"path": model},
            "train": {"steps": steps},
            "rollout": {"worker_args": worker_args},
            "checkpoint": {"every": steps},
            "canary": {"every": 0},
        },
        extra,
    )
    say(f"{name}: trainer-svc train ({steps} steps)")
    log = open(out / f"{name}.log", "wb")
    started = time.monotonic()
    command = [str(TRAINER), "train", str(config)]
    if tiny:  # a process that does nothing, for the trainer's: the watch below runs as it would
        stand_in_run(config, metrics_dir, steps)
        command = ["true"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, peak_rss_kib(proc.pid) or 0)
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: trainer-svc train exited {proc.returncode}; see {out / f'{name}.log'}")
    wall = time.monotonic() - started
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = json.loads(((run_dir / "weights" / f"step_{steps:08d}") / "manifest.json").read_text())
    reloads = textfile_value(metrics_dir, "rollout_reloads_total")
    loading = textfile_value(metrics_dir, "rollout_reloading_seconds_total")
    banner = json.loads((run_dir / "stage_result.json").read_text())["banner"]
    publish_s = statistics.median(r["publish_s"] for r in rows)
    load_s = loading / reloads if reloads else 0.0
    return {
        "weight_sync": banner["weight_sync"],
        "publish_bytes": last["bytes"],
        "publish_s_median": round(publish_s, 5),
        "worker_load_s_mean": round(load_s, 5),
        "worker_loads": int(reloads),
        "sync_s": round(publish_s + load_s, 5),
        "step_s_median": round(statistics.median(r["step_s"] for r in rows), 4),
        "train_s_median": round(statistics.median(r["train_s"] for r in rows), 4),
        "trainer_peak_rss_mib": round(peak / 1024, 1),
        "reward_first_20": round(statistics.fmean(r["reward_first"] for r in rows[:20]), 3),
        "reward_last_20": round(statistics.fmean(r["reward_first"] for r in rows[-20:]), 3),
        "mismatch_max": max(r["mismatch_max"] for r in rows),
        "wall_s": round(wall, 1),
        "rewards": [r["reward_first"] for r in rows],
    }


PLOT = """
import json, statistics, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
figures, path, window = json.loads(sys.argv[1]), sys.argv[2], 10
fig, ax = plt.subplots(figsize=(7, 4))
for name, (label, rewards) in figures.items():
    smooth = [statistics.fmean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
    ax.plot(range(1, len(rewards) + 1), smooth, label=f"{name}: {label}")
ax.set_xlabel("GRPO step")
ax.set_ylabel(f"reward of the step's samples ({window}-step mean)")
ax.set_title("The demo: LoRA against full fine-tuning")
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(path, dpi=110)
"""


def plot(figures: dict, path: Path) -> None:
    """The reward curves, drawn by the trainer's venv (matplotlib lives there)."""
    labels = {name: (found["label"], found["rewards"]) for name, found in figures.items()}
    python = ROOT / ".venvs" / "trainer" / "bin" / "python"
    subprocess.run([str(python), "-c", PLOT, json.dumps(labels), str(path)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--out", default="/tmp/bench-lora")
    parser.add_argument("--png", default=str(ROOT / "docs" / "lora_vs_full.png"))
    parser.add_argument("--variants", default="full,full-dirs,lora")
    parser.add_argument("--reuse", action="store_true", help="report the variants already run in --out")
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: no launch, made-up runs, the plot")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.out = 12, tempfile.mkdtemp(prefix="bench-lora-")
        args.png = str(Path(args.out) / "lora_vs_full.png")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = warm_model(out, args.tiny)
    extras = {
        "full": {},
        "full-dirs": {"publish": {"slots": "off"}},
        "lora": {"lora": {"rank": args.rank, "alpha": 2.0 * args.rank}, "train": {"lr": args.lora_lr}},
        "lora-demo-lr": {"lora": {"rank": args.rank, "alpha": 2.0 * args.rank}},
    }
    figures = {}
    for name in args.variants.split(","):
        import shutil

        kept = out / f"{name}.json"  # a variant's figures, kept: --reuse reports them without a run
        if args.reuse and kept.is_file():
            figures[name] = json.loads(kept.read_text())
            continue
        shutil.rmtree(out / name, ignore_errors=True)
        shutil.rmtree(out / f"{name}-worker-metrics", ignore_errors=True)
        figures[name] = run_variant(name, out, model, args.steps, extras[name], args.tiny) | {"label": LABELS[name]}
        kept.write_text(json.dumps(figures[name]))
        say(f"{name}: {json.dumps({k: v for k, v in figures[name].items() if k != 'rewards'})}")
    plot(figures, Path(args.png))
    if "lora" in figures:
        for name in ("full", "full-dirs"):
            if name in figures and figures[name]["sync_s"]:
                share = figures["lora"]["sync_s"] / figures[name]["sync_s"]
                figures[f"lora_sync_share_of_{name}"] = round(share, 4)
                figures[f"lora_sync_target_met_against_{name}"] = share <= TARGET
    report("lora_vs_full", {"steps": args.steps, "rank": args.rank, "lora_lr": args.lora_lr, **figures}, args.json)


if __name__ == "__main__":
    main()
