"""The configs we ship load as written, and the rows they name are what their generator writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer_svc.config import load
from trainer_svc.data import load_problems

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.toml")))
def test_a_shipped_config_loads_and_its_rows_read(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # paths in a shipped config are relative to the checkout
    cfg = load(ROOT / "configs" / name)
    train, held_out = load_problems(cfg.data, cfg.run.seed)
    assert len(held_out) == cfg.data.held_out and len(train) > cfg.rollout.prompts_per_step


@pytest.mark.parametrize(
    ("script", "rows"),
    [("two_digit_sums", "two_digit_sums"), ("running_sums", "running_sums"), ("calculator_rows", "calculator")],
)
def test_the_shipped_rows_are_their_generators(script, rows, tmp_path):
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / f"{script}.py"), str(out)], check=True)
    assert out.read_bytes() == (ROOT / "configs" / "data" / f"{rows}.jsonl").read_bytes()


def test_the_long_completion_config_leaves_the_micro_batch_budget_to_the_memory_gate(monkeypatch):
    """The long config differs from the GPU one only where length asks (a step's 512 samples of up
    to 512 tokens): no token budget or grad_accum of its own, so the memory gate sizes micro-batches."""
    monkeypatch.chdir(ROOT)
    long, short = load(ROOT / "configs" / "smollm2-gpu-long.toml"), load(ROOT / "configs" / "smollm2-gpu.toml")
    assert long.rollout.max_tokens == 512 and long.train.max_tokens_per_micro_batch is None
    assert long.train.grad_accum == short.train.grad_accum == 1
    assert (long.rollout.temperature, long.train.lr, long.rollout.ahead) == (0.7, 2e-5, 1)
    assert int(long.rollout.worker_args[1]) >= 512 + 128  # room for the prompt beside the answer


def test_the_gpu_config_has_the_settings_the_readme_gives(monkeypatch):
    """docs/gpus.md: temperature 0.7, lr 2e-5, 16 tokens, no compiling on either side,
    ahead = 1, slots (the default beside a spawned worker), every group trained on."""
    monkeypatch.chdir(ROOT)
    cfg = load(ROOT / "configs" / "smollm2-gpu.toml")
    assert (cfg.rollout.temperature, cfg.train.lr, cfg.rollout.max_tokens) == (0.7, 2e-5, 16)
    assert cfg.model.compile == "off" and "--no-compile" in cfg.rollout.worker_args
    assert (cfg.rollout.colocate, cfg.rollout.ahead, cfg.publish.slots) == (True, 1, "auto")
    assert (cfg.rollout.spare_prompts, cfg.rollout.spare_prompts_max, cfg.loss.dead_group_retries) == (0, 0, 0)
