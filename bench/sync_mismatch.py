"""Trainer/engine logprob mismatch with a fresh weight sync and with one a step stale: the figures
behind the bound of tests/e2e/test_trainer_smoke.py.

    .venvs/rollout/bin/python -m bench.sync_mismatch [--steps 20] [--keep DIR]

The smoke test's setting (tiny model warmed up by `trainer-svc sft`, 16 prompts x 8 samples,
lr 1e-4, a spawned vLLM worker). "fresh" publishes every step, so each step samples from the
weights it trains; "stale" publishes every second step (publish.every = 2, max_policy_lag = 1),
so every second step samples from weights one optimizer step old. Per step: mismatch_max, the
largest |trainer logprob - engine sampling logprob| over the step's tokens. A bound on the
smoke test's mismatch_max must sit above every fresh figure and below every stale step's.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from bench import synthetic
from bench.common import ROLLOUT_VENV, ROOT, TRAINER, emit, read_jsonl
from tests.run_config import LEARNING, write_run_config  # the tests' trainer configs


def config(path: Path, run_dir: Path, model: Path, base: Path, steps: int, publish_every: int) -> Path:
    """The smoke test's setting (LEARNING), publishing every `publish_every` steps."""
    ours = {
        "run": {"dir": run_dir},
        "model": {"path": model},
        "sft": {"base": base},
        "rollout": {"max_policy_lag": publish_every - 1},
        "train": {"steps": steps},
        "publish": {"every": publish_every},
    }
    return write_run_config(path, LEARNING, ours)


def trainer(*args: str, tiny: bool = False) -> None:
    """`trainer-svc ARGS`; with `tiny`, a made-up run for `train` and nothing for `sft` (both configs
    checked)."""
    if tiny:
        from trainer_svc.config import load

        load(args[1])
        if args[0] == "train":
            synthetic.stand_in_train(Path(args[1]))
        return
    done = subprocess.run([str(TRAINER), *args], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"trainer-svc {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--keep", type=Path, default=None, help="work here and keep the runs")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: no launch, made-up runs")
    args = parser.parse_args()
    if args.tiny:
        args.steps = 4
    base_dir = args.keep or Path(tempfile.mkdtemp(prefix="sync-mismatch-"))
    tiny, model = base_dir / "tiny", base_dir / "sft-model"
    if args.tiny:
        tiny.mkdir(exist_ok=True)
    elif not tiny.exists():
        subprocess.run([str(ROLLOUT_VENV / "bin" / "rollout-svc"), "tiny-model", str(tiny)], check=True)
    if not model.exists():
        sft = config(base_dir / "sft.toml", base_dir / "sft-run", model, tiny, args.steps, 1)
        trainer("sft", str(sft), tiny=args.tiny)
    figures = {}
    for name, every in (("fresh", 1), ("stale", 2)):
        run_dir = base_dir / name
        run = config(base_dir / f"{name}.toml", run_dir, model, tiny, args.steps, every)
        trainer("train", str(run), tiny=args.tiny)
        figures[name] = {row["step"]: row["mismatch_max"] for row in read_jsonl(run_dir / "metrics.jsonl")}
    fresh = list(figures["fresh"].values())
    # With publish.every = 2, the steps after an odd step sample from weights one step old.
    stale = [v for step, v in figures["stale"].items() if step % 2 == 0]
    emit(figures, args.json, indent=1)
    print(f"fresh sync: mismatch_max {min(fresh):.2e} to {max(fresh):.2e} over {len(fresh)} steps")
    print(f"one step stale: mismatch_max {min(stale):.2e} to {max(stale):.2e} over its {len(stale)} stale steps")


if __name__ == "__main__":
    main()
