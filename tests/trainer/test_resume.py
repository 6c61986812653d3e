"""A run stopped at step boundaries and resumed repeats the uninterrupted run exactly (CPU,
deterministic mode), and checkpoints are the weight sync: each step samples from the newest."""

from __future__ import annotations

import json

import pytest

from conftest import make_config
from local_sampler import TorchSampler
from protocol import exit_codes
from trainer_svc.loop import train

TIMING_KEYS = {"rollout_s", "train_s", "save_s", "step_s"}


def step_rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def run(cfg, samplers: list) -> int:
    def make(cfg, launch_id):
        samplers.append(TorchSampler(cfg))
        return samplers[-1]

    return train(cfg, make_sampler=make)


@pytest.mark.timeout(300)
def test_stopped_and_resumed_run_repeats_the_uninterrupted_one(warm_model, tmp_path):
    straight = make_config(tmp_path / "straight", warm_model)
    samplers: list = []
    assert run(straight, samplers) == exit_codes.OK
    expected = step_rows(straight.run_dir)
    assert len(expected) == 6 and any(row["grad_norm"] > 0 for row in expected)

    # A wall-clock limit far below one step: every launch does one step, saves and stops (75).
    interrupted = make_config(tmp_path / "interrupted", warm_model, run={"max_wall_seconds": 1e-6})
    codes = []
    while not codes or codes[-1] == exit_codes.RESUMABLE_STOP:
        codes.append(run(interrupted, samplers))
        assert len(codes) <= 7
    assert codes == [exit_codes.RESUMABLE_STOP] * 5 + [exit_codes.OK]
    assert step_rows(interrupted.run_dir) == expected


def test_each_step_samples_from_the_newest_checkpoint(warm_model, tmp_path):
    cfg = make_config(tmp_path / "sync", warm_model, train={"steps": 3}, checkpoint={"every": 1, "keep_last": 5})
    samplers: list = []
    assert run(cfg, samplers) == exit_codes.OK
    named = [(r["step"], r["weights_dir"]) for r in samplers[0].requests if r["attempt"] == 0]
    assert named[0] == (0, str(warm_model))
    assert named[1:] == [(s, str(cfg.run_dir / "checkpoints" / f"step_{s:08d}")) for s in (1, 2)]
    manifests = [json.loads((cfg.run_dir / "checkpoints" / f"step_{s:08d}" / "manifest.json").read_text()) for s in (1, 2)]
    assert [r["content_id"] for r in samplers[0].requests if r["attempt"] == 0][1:] == [m["content_id"] for m in manifests]
    result = json.loads((cfg.run_dir / "stage_result.json").read_text())
    assert result["finished"] and result["summary"]["steps"] == 3 and result["checkpoint"].endswith("step_00000003")
