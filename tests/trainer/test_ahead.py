"""Generating ahead (rollout.ahead): the next steps' first samplings are sent before the current
step trains, from the newest published weights; staleness is measured, bounded and logged; a
resume takes over the calls in flight instead of sending them again (CPU, deterministic)."""

from __future__ import annotations

import json

import pytest
from conftest import make_config
from local_sampler import TorchSampler

from protocol import exit_codes
from trainer_svc.run.loop import train

TIMING_KEYS = {"rollout_s", "generate_s", "score_s", "train_s", "publish_s", "save_s", "step_s"}

pytestmark = pytest.mark.timeout(300)


class Launches:
    """make_sampler for loop.train that keeps every launch's sampler."""

    def __init__(self):
        self.samplers: list[TorchSampler] = []

    def __call__(self, cfg, launch_id):
        self.samplers.append(TorchSampler(cfg))
        return self.samplers[-1]

    def submitted(self) -> list[tuple[int, int]]:
        """(step, attempt) of every training call sent, over all launches."""
        return [(t.step, t.attempt) for s in self.samplers for t in s.submitted if t.tag == "train"]


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timings(found: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in found]


def ahead_config(path, model, ahead: int = 1, lag: int = 1, **sections):
    rollout = {"ahead": ahead, "max_policy_lag": lag, **sections.pop("rollout", {})}
    return make_config(path, model, rollout=rollout, **sections)


def test_ahead_sends_the_next_step_before_training_and_logs_its_staleness(warm_model, tmp_path):
    cfg = ahead_config(tmp_path / "run", warm_model, train={"steps": 4}, checkpoint={"every": 50})
    launches = Launches()
    assert train(cfg, make_sampler=launches) == exit_codes.OK
    [sampler] = launches.samplers
    firsts = [t for t in sampler.submitted if t.attempt == 0]
    assert [t.step for t in firsts] == [0, 1, 2, 3]
    # Step s + 1 was sent while step s was the newest trained on: with the weights of step s.
    assert [t.weights.step for t in firsts] == [None, None, 1, 2]
    assert firsts[1].weights.dir == str(warm_model)
    # Each step's first sampling is sent once, before the previous step's first sampling is
    # trained on (ahead of it in the call order), and its retries after it.
    order = [(t.step, t.attempt) for t in sampler.submitted]
    assert order.index((1, 0)) < min([order.index(k) for k in order if k[0] == 1 and k[1] > 0], default=len(order))
    assert len(order) == len(set(order))

    found = rows(cfg.run_dir)
    assert [r["dropped_stale"] for r in found] == [0, 0, 0, 0]
    assert found[0]["staleness_mean"] == 0.0
    # Later steps train on samples one step old, except dead groups replaced from fresh weights.
    for row in found[1:]:
        fresh = row["dead_groups"] - row["dead_groups_after_retry"]
        assert row["staleness_mean"] == pytest.approx((4 - fresh) / 4)
    for row in found:
        assert row["reward_mean"] == row["reward_first"]
        if row["dead_groups"] == row["dead_groups_after_retry"]:  # nothing replaced: the batch is the first sampling
            assert row["reward_trained"] == pytest.approx(row["reward_first"])
    assert any(row["dead_groups"] > row["dead_groups_after_retry"] for row in found)
    assert any(row["reward_trained"] != pytest.approx(row["reward_first"]) for row in found)


@pytest.mark.parametrize(
    "spares",
    [{}, {"spare_prompts": 1, "spare_prompts_max": 12}],
    ids=["no-spares", "spares-sized-from-the-dead-rate"],
)
def test_a_resume_takes_over_the_calls_in_flight_and_sends_none_twice(warm_model, tmp_path, spares):
    straight = ahead_config(tmp_path / "straight", warm_model, rollout=spares)
    assert train(straight, make_sampler=Launches()) == exit_codes.OK
    expected = without_timings(rows(straight.run_dir))
    assert len(expected) == 6
    if spares:  # sized: the dead rate moved them off the floor, so a resume must know it
        assert len({row["spares"] for row in expected}) > 1

    # Every launch takes one step, saves with the next step's call in flight, and stops (75).
    interrupted = ahead_config(tmp_path / "interrupted", warm_model, run={"max_wall_seconds": 1e-6}, rollout=spares)
    launches, codes = Launches(), []
    while not codes or codes[-1] == exit_codes.RESUMABLE_STOP:
        codes.append(train(interrupted, make_sampler=launches))
        assert len(codes) <= 7
    assert codes == [exit_codes.RESUMABLE_STOP] * 5 + [exit_codes.OK]
    assert without_timings(rows(interrupted.run_dir)) == expected
    sent = launches.submitted()
    assert len(sent) == len(set(sent)) and {step for step, _ in sent} == set(range(6))
    # Each relaunch took over the call the previous launch left in flight (the next step's).
    assert [[t.step for t in s.restored] for s in launches.samplers] == [[], [1], [2], [3], [4], [5]]
    assert all(
        (t.step, 0) not in [(u.step, u.attempt) for u in s.submitted] for s in launches.samplers for t in s.restored
    )


def test_results_staler_than_the_policy_lag_are_dropped_counted_and_sampled_again(warm_model, tmp_path):
    # A first launch with ahead = 2 stops after one step, leaving steps 1 and 2 in flight, both
    # sampled by the starting weights; the relaunch allows a lag of 1 only.
    first = ahead_config(tmp_path / "run", warm_model, ahead=2, lag=2, run={"max_wall_seconds": 1e-6})
    launches = Launches()
    assert train(first, make_sampler=launches) == exit_codes.RESUMABLE_STOP
    assert [(t.step, t.weights.step) for t in launches.samplers[0].submitted if t.attempt == 0] == [
        (0, None),
        (1, None),
        (2, None),
    ]
    assert train(ahead_config(tmp_path / "run", warm_model, ahead=1, lag=1), make_sampler=launches) == exit_codes.OK
    found = rows(first.run_dir)
    assert [r["dropped_stale"] for r in found] == [0, 0, 4, 0, 0, 0]  # step 2: 2 steps old > 1
    assert all(r["staleness_mean"] <= 1 for r in found)
    again = [t for t in launches.samplers[1].submitted if (t.step, t.attempt) == (2, 0)]
    assert [t.weights.step for t in again] == [2]  # the same prompts, from the newest weights
    stale = [t for t in launches.samplers[1].restored if t.step == 2]
    assert [t.prompts for t in stale] == [again[0].prompts]
