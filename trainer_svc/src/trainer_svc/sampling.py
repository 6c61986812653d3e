"""One step's rollouts: prompts -> samples -> rewards -> group advantages, made on rank 0 and
sent to every rank (StepSampler).

A group whose G rewards are all equal has zero advantage everywhere and teaches nothing. Such
dead groups are counted and, up to `loss.dead_group_retries` times per step, replaced by
groups of fresh prompts; what is still dead after that stays in the batch (it adds nothing to
the gradient, and the step's size stays what the config says).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from . import grpo
from .config import Config
from .data import Problem, PromptStream
from .model import Distributed
from .rewards import RewardBreakdown, Verifier, score
from .rollout import Group


@dataclass(frozen=True)
class WeightsRef:
    """The weights a request names: a directory, its content id, and the step that wrote them
    (None for the starting model)."""

    dir: str
    content_id: str | None = None
    step: int | None = None


class Sampler(Protocol):
    def sample(
        self,
        prompts: list[str],
        *,
        weights_dir: str,
        content_id: str | None,
        step: int,
        attempt: int,
        seed: int,
        n: int | None = None,
        temperature: float | None = None,
        tag: str = "train",
    ) -> list[Group]: ...

    def close(self) -> None: ...


@dataclass
class StepRollouts:
    problems: list[Problem]
    groups: list[Group]
    rewards: torch.Tensor  # [P, G]
    breakdowns: list[list[RewardBreakdown]]
    advantages: torch.Tensor  # [P, G]
    dead_initial: int  # dead groups in the first sampling
    dead_final: int  # dead groups left after the retries
    retries: int  # extra requests made
    generate_s: float = 0.0  # waiting for the rollout service (generation, queueing, reloads)
    score_s: float = 0.0  # rewards: answer extraction, verifier, shaping


class StepSampler:
    """Rank 0 samples and scores each step through `sampler`; every rank gets the same rollouts.
    Other ranks pass `sampler=None` and only receive."""

    def __init__(
        self, sampler: Sampler | None, stream: PromptStream, verifier: Verifier, cfg: Config, dist_info: Distributed
    ):
        self.sampler, self.stream, self.verifier, self.cfg, self.dist = sampler, stream, verifier, cfg, dist_info

    def __call__(self, step: int, weights: WeightsRef) -> StepRollouts:
        local = None
        if self.cfg.rollout.colocate and self.dist.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks the trainer cached are the memory a waking worker needs
        if self.sampler is not None:
            local = sample_step(self.sampler, self.stream, self.verifier, self.cfg, step=step, weights=weights)
        return self.dist.from_rank0(local)  # one object: a step's rollouts are small

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()


def sample_step(
    sampler: Sampler,
    stream: PromptStream,
    verifier: Verifier,
    cfg: Config,
    *,
    step: int,
    weights: WeightsRef,
) -> StepRollouts:
    problems = stream.take(cfg.rollout.prompts_per_step)
    spent = {"generate": 0.0, "score": 0.0}

    def sample_and_score(batch: list[Problem], attempt: int):
        began = time.monotonic()
        groups = sampler.sample(
            [p.prompt for p in batch],
            weights_dir=weights.dir,
            content_id=weights.content_id,
            step=step,
            attempt=attempt,
            seed=cfg.run.seed * 1_000_003 + step * 101 + attempt,
        )
        sampled = time.monotonic()
        scored = [
            score(
                [(s.text, s.finish_reason, len(s.token_ids)) for s in g.samples],
                p.gold,
                cfg.reward,
                verifier,
                cfg.rollout.max_tokens,
            )
            for p, g in zip(batch, groups, strict=True)
        ]
        spent["generate"] += sampled - began
        spent["score"] += time.monotonic() - sampled
        return groups, scored

    groups, breakdowns = sample_and_score(problems, 0)
    dead = [i for i, b in enumerate(breakdowns) if _is_dead(b)]
    dead_initial, retries = len(dead), 0
    for attempt in range(1, cfg.loss.dead_group_retries + 1):
        if not dead:
            break
        fresh = stream.take(len(dead))
        new_groups, new_breakdowns = sample_and_score(fresh, attempt)
        retries += 1
        still_dead = []
        for slot, problem, group, scored in zip(dead, fresh, new_groups, new_breakdowns, strict=False):
            if _is_dead(scored):
                still_dead.append(slot)
            else:
                problems[slot], groups[slot], breakdowns[slot] = problem, group, scored
        dead = still_dead
    rewards = torch.tensor([[b.total for b in group] for group in breakdowns], dtype=torch.float32)
    if cfg.reward.shuffle_control:
        order = torch.randperm(rewards.numel(), generator=torch.Generator().manual_seed(cfg.run.seed * 7919 + step))
        rewards = rewards.flatten()[order].view_as(rewards)
    advantages = grpo.group_advantages(rewards, cfg.loss.advantage_norm)
    return StepRollouts(
        problems,
        groups,
        rewards,
        breakdowns,
        advantages,
        dead_initial,
        len(dead),
        retries,
        spent["generate"],
        spent["score"],
    )


def _is_dead(breakdowns: list[RewardBreakdown]) -> bool:
    return len({b.total for b in breakdowns}) == 1


def summarize(r: StepRollouts) -> dict:
    flat = [b for group in r.breakdowns for b in group]
    # Answer tokens: the end-of-sequence token that closes a finished sample is not part of it.
    lengths = [len(s.token_ids) - (s.finish_reason == "stop") for g in r.groups for s in g.samples]
    return {
        "reward_mean": float(r.rewards.mean()),
        "reward_std": float(r.rewards.std()) if r.rewards.numel() > 1 else 0.0,
        "accuracy": sum(b.correct for b in flat) / len(flat),
        "format_rate": sum(b.format_ok for b in flat) / len(flat),
        "response_length": sum(lengths) / len(lengths),
        "dead_groups": r.dead_initial,
        "dead_groups_after_retry": r.dead_final,
        "retries": r.retries,
        "generate_s": r.generate_s,
        "score_s": r.score_s,
    }
