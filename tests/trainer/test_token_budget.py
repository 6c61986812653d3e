"""Micro-batches by a token budget (train.max_tokens_per_micro_batch), from a run's side: the same
run split by a small budget takes many more micro-batches and trains as the run split by
grad_accum alone, up to float rounding (the loss's denominators are the whole step's)."""

from __future__ import annotations

import json

import pytest
from conftest import make_config
from local_sampler import TorchSampler

from protocol import exit_codes
from trainer_svc.run.loop import train

COMPARED = ("loss", "grad_norm", "entropy", "reward_mean", "clip_fraction_high", "response_length")


def rows(cfg) -> list[dict]:
    assert train(cfg, make_sampler=lambda cfg, launch_id: TorchSampler(cfg)) == exit_codes.OK
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.mark.timeout(300)
def test_a_token_budget_splits_the_step_further_and_trains_as_without_it(warm_model, tmp_path):
    shape = {"steps": 3, "grad_accum": 2, "updates_per_batch": 2}
    plain = rows(make_config(tmp_path / "plain", warm_model, train=shape))
    budgeted = rows(make_config(tmp_path / "budget", warm_model, train={**shape, "max_tokens_per_micro_batch": 24}))
    assert all(row["micro_batches"] == 2 * 2 for row in plain)  # grad_accum per update, two updates
    assert all(row["micro_batches"] > 2 * 2 for row in budgeted), [row["micro_batches"] for row in budgeted]
    for a, b in zip(plain, budgeted, strict=True):
        assert {k: b[k] for k in COMPARED} == pytest.approx({k: a[k] for k in COMPARED}, rel=1e-4, abs=1e-6)


@pytest.mark.timeout(300)
def test_a_run_on_packed_micro_batches_trains_as_one_on_padded_ones(warm_model, tmp_path):
    shape = {"steps": 3, "grad_accum": 2, "updates_per_batch": 2}
    padded = rows(make_config(tmp_path / "padded", warm_model, train={**shape, "packing": "off"}))
    packed = rows(make_config(tmp_path / "packed", warm_model, train={**shape, "packing": "on"}))
    for a, b in zip(padded, packed, strict=True):
        assert {k: b[k] for k in COMPARED} == pytest.approx({k: a[k] for k in COMPARED}, rel=1e-4, abs=1e-6)


@pytest.mark.timeout(300)
def test_a_run_on_packed_micro_batches_by_a_token_budget_resumes_exactly(warm_model, tmp_path):
    """Packing on and a token budget: a run stopped at every step (a wall-clock limit below one
    step) and relaunched takes exactly the steps of the run never stopped."""
    shape = {"steps": 4, "grad_accum": 2, "packing": "on", "max_tokens_per_micro_batch": 24}
    expected = [without_timings(r) for r in rows(make_config(tmp_path / "straight", warm_model, train=shape))]
    cfg = make_config(tmp_path / "stopped", warm_model, train=shape, run={"max_wall_seconds": 1e-6})
    codes = []
    while not codes or codes[-1] == exit_codes.RESUMABLE_STOP:
        codes.append(train(cfg, make_sampler=lambda cfg, launch_id: TorchSampler(cfg)))
        assert len(codes) <= 5
    assert codes == [exit_codes.RESUMABLE_STOP] * 3 + [exit_codes.OK]
    lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [without_timings(json.loads(line)) for line in lines if line] == expected


TIMING_KEYS = {"rollout_s", "generate_s", "score_s", "train_s", "publish_s", "save_s", "step_s"}


def without_timings(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMING_KEYS}
