"""Spare prompts (rollout.spare_prompts): a step's first sampling carries extra prompts whose live
groups replace its dead ones at once; retries are sent only for what the spares cannot cover.
With rollout.spare_prompts_max, as many spares as the measured dead rate asks for.
The sampler here is scripted: which prompts come back dead (every sample wrong, so all rewards
equal) and which live (half right) is fixed by the test."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from conftest import make_config

from trainer_svc.data import Problem, PromptStream
from trainer_svc.distributed import Distributed
from trainer_svc.learning.reward_functions import Rewards
from trainer_svc.learning.rewards import Verifier
from trainer_svc.rollout.sampling import StepSampler, summarize
from trainer_svc.rollout.spares import SpareSizer
from trainer_svc.rollout_types import Group, Sample, Ticket, WeightsRef

WEIGHTS = WeightsRef("unused")


class ScriptedSampler:
    """Groups of 4 samples: all wrong for a dead prompt, two right for a live one."""

    def __init__(self, live: set[str]):
        self.live = live
        self.submitted: list[Ticket] = []

    def submit(self, call: Ticket) -> Ticket:
        self.submitted.append(call)
        return self.submitted[-1]

    def collect(self, ticket: Ticket) -> list[Group]:
        groups = []
        for prompt in ticket.prompts:
            gold = prompt.removeprefix("q")
            texts = [gold, "no", gold, "no"] if prompt in self.live else ["no"] * 4
            groups.append(Group([1], [Sample([2], [-1.0], text, "stop") for text in texts]))
        return groups

    def restore(self, ticket: Ticket) -> None:
        raise AssertionError("nothing to restore here")

    def close(self) -> None:
        pass


def step_of(tmp_path, live: list[int], spares: int, retries: int = 1):
    """Step 0's rollouts, its problems drawn in order q0, q1, ... (an unshuffled stream)."""
    cfg = make_config(
        tmp_path,
        tmp_path,
        rollout={"prompts_per_step": 4, "samples_per_prompt": 4, "spare_prompts": spares},
        loss={"dead_group_retries": retries},
    )
    problems = [Problem(str(i), f"q{i}", str(i)) for i in range(40)]
    stream = PromptStream(problems, seed=0)
    stream._order = list(range(len(problems)))  # q0, q1, ... in order: the test says which come back live
    sampler = ScriptedSampler({f"q{i}" for i in live})
    rewards = Rewards(cfg.reward, Verifier(use_math_verify=False), cfg.rollout.max_tokens, problems)
    steps = StepSampler(sampler, stream, rewards, cfg, Distributed(0, 1, torch.device("cpu")))
    return steps(0, WEIGHTS), sampler


def test_dead_groups_are_replaced_by_live_spares_without_a_second_request(tmp_path):
    # own: q0 dead, q1 live, q2 dead, q3 live; spares: q4 live, q5 dead, q6 live
    rollouts, sampler = step_of(tmp_path, live=[1, 3, 4, 6], spares=3)
    assert [len(t.prompts) for t in sampler.submitted] == [7]  # the step's 4 and 3 spares, in one call
    assert [p.prompt for p in rollouts.problems] == ["q4", "q1", "q6", "q3"]
    assert (rollouts.dead_initial, rollouts.spares_used, rollouts.dead_final, rollouts.retries) == (2, 2, 0, 0)
    assert rollouts.rewards.shape == (4, 4) and (rollouts.rewards.std(dim=1) > 0).all()
    # The first sampling's reward is over all 7 groups: 4 live ones, half right each (reward 1 right, 0 wrong).
    assert rollouts.rewards.mean().item() == 0.5
    assert rollouts.reward_first == pytest.approx(4 * 0.5 / 7)
    assert summarize(rollouts)["spares_used"] == 2


def test_what_the_spares_cannot_cover_is_retried(tmp_path):
    # own: q0, q1, q2 dead, q3 live; spares: q4 live, q5 q6 dead; the retry draws q7, q8 (q8 live)
    rollouts, sampler = step_of(tmp_path, live=[3, 4, 8], spares=3)
    assert [(t.attempt, t.prompts) for t in sampler.submitted] == [
        (0, ("q0", "q1", "q2", "q3", "q4", "q5", "q6")),
        (1, ("q7", "q8")),
    ]
    assert [p.prompt for p in rollouts.problems] == ["q4", "q1", "q8", "q3"]
    assert (rollouts.dead_initial, rollouts.spares_used, rollouts.dead_final, rollouts.retries) == (3, 1, 1, 1)


def test_without_spares_every_dead_group_is_retried(tmp_path):
    rollouts, sampler = step_of(tmp_path, live=[1, 3, 4], spares=0)
    assert [(t.attempt, t.prompts) for t in sampler.submitted] == [(0, ("q0", "q1", "q2", "q3")), (1, ("q4", "q5"))]
    assert [p.prompt for p in rollouts.problems] == ["q4", "q1", "q2", "q3"]
    assert (rollouts.dead_initial, rollouts.spares_used, rollouts.dead_final) == (2, 0, 1)


def test_without_spares_or_retries_every_group_is_trained_on_as_sampled(tmp_path):
    """spare_prompts = 0 and dead_group_retries = 0: one request, the step's own groups as they
    came back, the dead ones with advantage 0 (nothing for the gradient)."""
    rollouts, sampler = step_of(tmp_path, live=[1, 3], spares=0, retries=0)
    assert [t.prompts for t in sampler.submitted] == [("q0", "q1", "q2", "q3")]
    assert [p.prompt for p in rollouts.problems] == ["q0", "q1", "q2", "q3"]
    assert (rollouts.dead_initial, rollouts.dead_final, rollouts.retries) == (2, 2, 0)
    assert (rollouts.advantages[[0, 2]] == 0).all() and (rollouts.advantages[[1, 3]] != 0).all()


# -- spares sized from the measured dead rate (rollout.spare_prompts_max) --------------------------


def sizer(own: int = 64, low: int = 16, high: int = 200, state: dict | None = None) -> SpareSizer:
    cfg = make_config(
        Path("unused"),
        Path("unused"),
        rollout={"prompts_per_step": own, "spare_prompts": low, "spare_prompts_max": high},
    )
    return SpareSizer(cfg.rollout, state)


def test_the_spares_cover_the_dead_groups_at_the_measured_rate_with_a_margin():
    spares = sizer()
    assert spares.count() == 16  # nothing measured yet: spare_prompts
    spares.observe(40, 80)  # d = 0.5
    # Smallest S with S/2 - 32 >= 1.645 * sqrt((S + 64) / 4), by hand: S = 84 gives 10 < 10.006,
    # S = 85 gives 10.5 >= 10.040.
    assert spares.count() == 85
    assert sizer(high=60, state=spares.state_dict()).count() == 60  # capped at spare_prompts_max


def test_no_dead_groups_need_only_the_floor_and_all_dead_the_cap():
    spares = sizer()
    spares.observe(0, 80)
    assert spares.count() == 16
    spares = sizer()
    spares.observe(80, 80)
    assert spares.count() == 200


def test_the_rate_follows_the_last_eight_first_samplings():
    spares = sizer()
    spares.observe(80, 80)
    for _ in range(7):
        spares.observe(0, 80)
    assert spares.dead_rate() == pytest.approx(1 / 8)
    spares.observe(0, 80)  # the all-dead sampling leaves the window
    assert spares.dead_rate() == 0 and spares.count() == 16


def test_fixed_spares_ignore_the_dead_rate():
    spares = sizer(high=0)
    spares.observe(80, 80)
    assert spares.count() == 16


def test_the_next_steps_first_sampling_carries_the_sized_spares(tmp_path):
    cfg = make_config(
        tmp_path,
        tmp_path,
        rollout={
            "prompts_per_step": 4,
            "samples_per_prompt": 4,
            "spare_prompts": 1,
            "spare_prompts_max": 20,
            "ahead": 1,
            "max_policy_lag": 1,
        },
    )
    problems = [Problem(str(i), f"q{i}", str(i)) for i in range(60)]
    stream = PromptStream(problems, seed=0)
    stream._order = list(range(len(problems)))
    sampler = ScriptedSampler({f"q{i}" for i in range(0, 60, 2)})  # even prompts live
    rewards = Rewards(cfg.reward, Verifier(use_math_verify=False), cfg.rollout.max_tokens, problems)
    steps = StepSampler(sampler, stream, rewards, cfg, Distributed(0, 1, torch.device("cpu")))
    rollouts = steps(0, WEIGHTS)
    # Step 0: q0..q3 and 1 spare (q4); q1, q3 dead: 2 of 5 groups, d = 0.4. The smallest S with
    # 0.6 S - 1.6 >= 1.645 sqrt(0.24 (S + 4)) is 8 (S = 7: 2.6 < 2.67; S = 8: 3.2 >= 2.79).
    assert [(t.step, t.attempt, len(t.prompts)) for t in sampler.submitted] == [(0, 0, 5), (0, 1, 1), (1, 0, 12)]
    assert rollouts.spares == 1 and summarize(rollouts)["spares"] == 1
    # A checkpoint keeps the measurements: a resumed sampler sizes the next spares the same.
    resumed = StepSampler(
        ScriptedSampler(set()), stream, rewards, cfg, Distributed(0, 1, torch.device("cpu")),
        spares=steps.spares_state(),
    )  # fmt: skip
    assert resumed.spares.count() == 8


def test_spare_prompts_max_below_spare_prompts_is_refused():
    with pytest.raises(msgspec.ValidationError, match="spare_prompts_max = 4 is below rollout.spare_prompts = 8"):
        make_config(Path("unused"), Path("unused"), rollout={"spare_prompts": 8, "spare_prompts_max": 4})
