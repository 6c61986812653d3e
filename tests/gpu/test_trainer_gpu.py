"""The trainer on GPUs, end to end as a user runs it: `trainer-svc sft`, then `trainer-svc train`,
which spawns a vLLM worker and talks to it through the spool.

    one GPU     rollout.colocate: trainer and worker share GPU 0; the worker stays awake on its
                share of the GPU (the trainer is capped at the rest), so both fit at once
    two GPUs    the trainer on GPU 0, the worker on GPU 1 (the topology gate's default)

Each learns for real in float32 (the tiny model learns at lr 1e-4; a bf16 update of that size is
mostly lost to rounding): the reward rises. A short bf16 run, the GPU default (trainer, published
weights and engine all bf16), checks that path end to end and reports its logprob mismatch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))  # run_config, shared with the e2e tier and the benches

from run_config import LEARNING, write_run_config  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / ".venvs" / "trainer" / "bin" / "trainer-svc"
ROLLOUT = ROOT / ".venvs" / "rollout"
STEPS = 150
WINDOW = 30


def write_config(
    path: Path, run_dir: Path, model: Path, base: Path, *, steps: int, colocate: bool = False, dtype: str = "float32"
) -> Path:
    """LEARNING, warmed up from `base`, with trainer, published weights and engine all in `dtype`."""
    rollout = {"worker_args": ["--max-model-len", "64", "--dtype", dtype]}
    if colocate:
        rollout["colocate"] = True
    ours = {
        "run": {"dir": run_dir},
        "model": {"path": model, "dtype": dtype},
        "sft": {"base": base},
        "rollout": rollout,
        "train": {"steps": steps},
        "publish": {"dtype": dtype},
    }
    return write_run_config(path, LEARNING, ours)


def trainer(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(TRAINER), *args], capture_output=True, text=True, timeout=1100, cwd=ROOT, env={**os.environ, **(env or {})}
    )


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def gain(run_dir: Path) -> float:
    rewards = [r["reward_mean"] for r in rows(run_dir)]
    return sum(rewards[-WINDOW:]) / WINDOW - sum(rewards[:WINDOW]) / WINDOW


def summary(name: str, run_dir: Path) -> str:
    r = rows(run_dir)
    mid = sorted(r, key=lambda x: x["step_s"])[len(r) // 2]
    split = ", ".join(f"{k} {mid[k]:.3f}" for k in ("generate_s", "score_s", "train_s", "publish_s", "step_s"))
    result = json.loads((run_dir / "stage_result.json").read_text())
    return (
        f"{name}: {len(r)} steps, reward gain {gain(run_dir):+.3f}, mismatch max "
        f"{result['summary']['mismatch_max']:.2e}; median step: {split}"
    )


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """The tiny model and its supervised warm-up (on the CPU; it takes seconds)."""
    base_dir = tmp_path_factory.mktemp("trainer-gpu")
    base = base_dir / "tiny"
    subprocess.run([str(ROLLOUT / "bin" / "rollout-svc"), "tiny-model", str(base)], check=True, capture_output=True)
    model = base_dir / "sft-model"
    done = trainer("sft", str(write_config(base_dir / "sft.toml", base_dir / "sft-run", model, base, steps=1)))
    assert done.returncode == 0, done.stderr[-3000:]
    return base_dir, base, model


def check_learned(run_dir: Path, done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(rows(run_dir)) == STEPS and gain(run_dir) > 0.08, summary("run", run_dir)
    result = json.loads((run_dir / "stage_result.json").read_text())
    assert result["finished"] and result["summary"]["mismatch_max"] < 1e-2  # float32 engine and trainer agree
    results = [json.loads(p.read_text()) for p in (run_dir / "spool" / "done").glob("*.result.json")]
    # The published weights were served: a directory, or (beside a spawned worker, the default) a
    # slot; either way a content id of the run's step STEPS - 1 (protocol.weights_dir.step_content_id).
    published = f"{run_dir.name}-step_{STEPS - 1:08d}-"
    assert any(r["weights_content_id"].startswith(published) for r in results), {r["weights_dir"] for r in results}
    assert os.listdir(run_dir / "spool" / "claimed") == [] and not list((run_dir / "spool" / "workers").iterdir())


def test_one_gpu_colocated_learns_beside_a_worker_that_stays_awake(warm):
    base_dir, base, model = warm
    run_dir = base_dir / "colocated"
    config = write_config(base_dir / "colocated.toml", run_dir, model, base, steps=STEPS, colocate=True)
    done = trainer("train", str(config), env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")[:1]})
    print("\n" + summary("one GPU, colocated", run_dir))
    check_learned(run_dir, done)
    banner = json.loads((run_dir / "stage_result.json").read_text())["banner"]
    assert "rollout.colocate" in banner["topology"]["rollout_device"]
    log = (run_dir / "rollout-worker.log").read_text()
    # On its share of the GPU, never asleep (rollout.colocate_sleep_s = 0, the default): it
    # generates the next step while the trainer trains. Sleeping and waking: test_sleep_gpu.py.
    assert "'gpu_memory_utilization': 0.3" in log
    assert "'enable_sleep_mode': True" not in log and "engine asleep" not in log


def test_two_gpus_trainer_on_one_worker_on_the_other_learns(warm):
    if torch.cuda.device_count() < 2:
        pytest.fail("this test needs two visible GPUs (run the GPU tier on a two-GPU host for it)")
    base_dir, base, model = warm
    run_dir = base_dir / "split"
    done = trainer("train", str(write_config(base_dir / "split.toml", run_dir, model, base, steps=STEPS)))
    print("\n" + summary("two GPUs", run_dir))
    check_learned(run_dir, done)
    assert json.loads((run_dir / "stage_result.json").read_text())["banner"]["topology"]["rollout_device"] == "cuda:1"


def test_bf16_the_gpu_default_runs_end_to_end(warm):
    base_dir, base, model = warm
    run_dir = base_dir / "bf16"
    colocate = torch.cuda.device_count() < 2
    config = write_config(base_dir / "bf16.toml", run_dir, model, base, steps=20, colocate=colocate, dtype="bfloat16")
    done = trainer("train", str(config))
    print("\n" + summary("bf16", run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((run_dir / "weights" / "step_00000020" / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16"
    # bf16 rounding: the engine's and the trainer's logprobs of the sampled tokens differ by up to
    # a few hundredths on this tiny model (logits of a few units, bf16's 8-bit mantissa).
    assert json.loads((run_dir / "stage_result.json").read_text())["summary"]["mismatch_max"] < 0.5
