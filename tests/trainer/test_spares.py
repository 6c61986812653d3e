"""Spare prompts (rollout.spare_prompts): a step's first sampling carries extra prompts whose live
groups replace its dead ones at once; retries are sent only for what the spares cannot cover.
The sampler here is scripted: which prompts come back dead (every sample wrong, so all rewards
equal) and which live (half right) is fixed by the test."""

from __future__ import annotations

import pytest
import torch
from conftest import make_config

from trainer_svc.data import Problem, PromptStream
from trainer_svc.model import Distributed
from trainer_svc.rewards import Verifier
from trainer_svc.rollout import Group, Sample, Ticket, WeightsRef
from trainer_svc.sampling import StepSampler, summarize

WEIGHTS = WeightsRef("unused")


class ScriptedSampler:
    """Groups of 4 samples: all wrong for a dead prompt, two right for a live one."""

    def __init__(self, live: set[str]):
        self.live = live
        self.submitted: list[Ticket] = []

    def submit(self, prompts, *, weights, step, attempt, seed, n=None, temperature=None, tag="train") -> Ticket:
        self.submitted.append(Ticket(tuple(prompts), weights, step, attempt, seed, n, temperature, tag))
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
    steps = StepSampler(sampler, stream, Verifier(use_math_verify=False), cfg, Distributed(0, 1, torch.device("cpu")))
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
