"""A run stopped at step boundaries and resumed repeats the uninterrupted run exactly (CPU,
deterministic mode); published weights are the weight sync: each step samples from the newest,
and resume checkpoints keep their own cadence."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import make_config
from local_sampler import TorchSampler

from protocol import exit_codes
from protocol.weight_slots import ring_dir
from trainer_svc.run.loop import train

TIMING_KEYS = {"rollout_s", "generate_s", "score_s", "train_s", "publish_s", "save_s", "step_s"}


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


def published(cfg, step: int):
    return cfg.run_dir / "weights" / f"step_{step:08d}"


def test_each_step_samples_from_the_newest_published_weights(warm_model, tmp_path):
    cfg = make_config(tmp_path / "sync", warm_model, train={"steps": 3}, checkpoint={"every": 50})
    samplers: list = []
    assert run(cfg, samplers) == exit_codes.OK
    named = [(r["step"], r["weights_dir"]) for r in samplers[0].requests if r["attempt"] == 0]
    assert named[0] == (0, str(warm_model))
    assert named[1:] == [(s, str(published(cfg, s))) for s in (1, 2)]
    manifests = [json.loads((published(cfg, s) / "manifest.json").read_text()) for s in (1, 2)]
    assert [r["content_id"] for r in samplers[0].requests if r["attempt"] == 0][1:] == [
        m["content_id"] for m in manifests
    ]
    # one resume checkpoint, at the end; published weights carry no optimizer state
    assert sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir()) == ["step_00000003"]
    assert sorted(p.name for p in published(cfg, 3).iterdir()) == [
        "config.json",
        "generation_config.json",
        "manifest.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    result = json.loads((cfg.run_dir / "stage_result.json").read_text())
    assert result["finished"] and result["summary"]["steps"] == 3 and result["checkpoint"].endswith("step_00000003")
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(row["publish_s"] > 0 for row in rows) and [row["save_s"] > 0 for row in rows] == [False, False, True]


def test_publish_cadence_sets_the_policy_lag(warm_model, tmp_path):
    cfg = make_config(
        tmp_path / "lag", warm_model, train={"steps": 5}, publish={"every": 2}, rollout={"max_policy_lag": 1}
    )
    samplers: list = []
    assert run(cfg, samplers) == exit_codes.OK
    named = [r["weights_dir"] for r in samplers[0].requests if r["attempt"] == 0]
    start, one, three = str(warm_model), str(published(cfg, 2)), str(published(cfg, 4))
    assert named == [start, start, one, one, three]  # steps 0..4; the last step (5) is published too
    assert sorted(p.name for p in (cfg.run_dir / "weights").iterdir()) == [
        "step_00000002",
        "step_00000004",
        "step_00000005",
    ]


def test_resume_discards_weights_published_after_its_checkpoint(warm_model, tmp_path):
    straight = make_config(tmp_path / "straight", warm_model, checkpoint={"every": 50})
    assert run(straight, []) == exit_codes.OK
    expected = step_rows(straight.run_dir)

    # Stopped after step 2 (its checkpoint), then weights of steps 3..5 appear, as if the run had
    # published them and died before its next checkpoint; the relaunch must not use them.
    cfg = make_config(tmp_path / "crashed", warm_model, checkpoint={"every": 50}, train={"steps": 6})
    stopper = make_config(tmp_path / "crashed", warm_model, checkpoint={"every": 50}, run={"max_wall_seconds": 1e-6})
    assert run(stopper, []) == exit_codes.RESUMABLE_STOP  # step 1
    assert run(stopper, []) == exit_codes.RESUMABLE_STOP  # step 2
    planted = json.loads((published(cfg, 2) / "manifest.json").read_text())["content_id"]
    for step in (3, 4, 5):
        shutil.copytree(published(cfg, 2), published(cfg, step))
    samplers: list = []
    assert run(cfg, samplers) == exit_codes.OK
    named = [r["weights_dir"] for r in samplers[0].requests if r["attempt"] == 0]
    assert named[0] == str(published(cfg, 2))
    assert named[1:] == [str(published(cfg, s)) for s in (3, 4, 5)]
    fresh = [r["content_id"] for r in samplers[0].requests if r["attempt"] == 0][1:]
    assert planted not in fresh  # the planted copies were discarded, then published anew
    assert step_rows(cfg.run_dir) == expected


def first_samplings(samplers: list) -> list[tuple[int, str]]:
    """(step, weights_dir) of each step's first sampling, over all launches, in order."""
    return [(r["step"], r["weights_dir"]) for s in samplers for r in s.requests if r["attempt"] == 0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "ahead, lose_published, slots",
    [(0, False, False), (1, False, False), (0, True, False), (1, False, True), (0, True, True)],
)
def test_a_stop_between_two_publishes_resumes_from_the_weights_the_rollouts_used(
    warm_model, tmp_path, ahead, lose_published, slots
):
    """With publish.every = 2 a checkpoint taken between two publishes holds newer weights than
    the rollouts sample from; the resumed run must sample from the published ones, as the
    uninterrupted run does, not from the checkpoint's own; also when the publish directory lost
    them between launches (a tmpfs emptied by a reboot): the checkpoint keeps a copy. `slots`:
    published into shared-memory slots (publish.slots = on), a directory at the last step."""
    publishing = {"every": 2} | ({"slots": "on", "slots_dir": str(tmp_path / "shm")} if slots else {})
    (tmp_path / "shm").mkdir()
    settings = dict(train={"steps": 5}, publish=publishing, rollout={"ahead": ahead, "max_policy_lag": 1 + ahead})
    straight = make_config(tmp_path / "straight", warm_model, **settings)
    straight_samplers: list = []
    assert run(straight, straight_samplers) == exit_codes.OK
    expected = step_rows(straight.run_dir)

    # One step a launch: launches stop after steps 1 and 3 too, each between two publishes.
    interrupted = make_config(tmp_path / "interrupted", warm_model, run={"max_wall_seconds": 1e-6}, **settings)
    samplers: list = []
    codes = []
    for _ in range(5):
        codes.append(run(interrupted, samplers))
        if lose_published:
            shutil.rmtree(interrupted.run_dir / "weights", ignore_errors=True)
            shutil.rmtree(ring_dir(tmp_path / "shm", interrupted.run_dir), ignore_errors=True)  # a reboot
    assert codes == [exit_codes.RESUMABLE_STOP] * 4 + [exit_codes.OK]

    def named(found, run_dir):
        ring = str(ring_dir(tmp_path / "shm", run_dir))
        return sorted({(step, d.replace(ring, "RING").replace(str(run_dir), "RUN")) for step, d in found})

    # each step sampled from the same weights as in the uninterrupted run (and no more were published)
    assert named(first_samplings(samplers), interrupted.run_dir) == named(
        first_samplings(straight_samplers), straight.run_dir
    )
    assert lose_published or sorted(p.name for p in (interrupted.run_dir / "weights").iterdir()) == (
        ["step_00000005"] if slots else ["step_00000002", "step_00000004", "step_00000005"]
    )
    if slots:  # the steps sampled from slots of the ring, once they stopped sampling the starting model
        sampled = {d for _, d in first_samplings(samplers)} - {str(warm_model)}
        assert sampled and all("/slot_" in d for d in sampled), sampled
    assert step_rows(interrupted.run_dir) == expected
