"""One step's rollouts: prompts -> samples -> rewards -> group advantages, made on rank 0 and
sent to every rank (StepSampler).

A group whose G rewards are all equal has zero advantage everywhere and teaches nothing. Such
dead groups are counted and replaced: first by the live groups of spare prompts sampled with the
step's own (no wait; `rollout.spare_prompts` of them, or as many as the measured dead rate asks
for: spares.py), then, up to `loss.dead_group_retries` times per
step, by groups of fresh prompts sampled again (the step waits for each); what is still dead
after that stays in the batch (it adds nothing to the gradient, and the step's size stays what
the config says). The first sampling's reward (`reward_first`, over the step's prompts and its
spares) is the policy's own estimate; the trained batch's (`reward_trained`) understates the
policy once it is good, since its all-correct groups are swapped for live ones.

Generating ahead (`rollout.ahead = k`): while step s trains, the first sampling of steps
s+1..s+k is in flight, each sent with the newest published weights of its time, so a step's
samples are up to k steps (and publish.every - 1 more) behind the weights that train on them.
Guarantees:
- Each group carries the weights step it was sampled from; a step reports its mean staleness
  (step - weights step) and how many groups it dropped as staler than `rollout.max_policy_lag`.
  Those are sampled again, the same prompts from the newest weights, before the step trains.
- The order of draws from the prompt stream does not depend on timing: a step's first sampling
  draws when it is sent, its retries when its first sampling is scored.
- The calls in flight are part of a checkpoint (`state_dict`), with their prompts: the stream's
  saved cursor is past them, and a resume takes them over (Sampler.restore) instead of drawing
  or sending them again.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from ..config import Config
from ..data import Problem, PromptStream
from ..distributed import Distributed
from ..learning import grpo
from ..learning.reward_functions import GroupScores, Rewards
from ..rollout_types import Group, Sample, Ticket, WeightsRef
from .spares import SpareSizer

__all__ = ["InFlight", "Sampler", "StepRollouts", "StepSampler", "summarize"]


class Sampler(Protocol):
    """Samples prompts: `submit` sends a call and returns at once, with what it sent, `collect`
    waits for its groups (in prompt order, each with its weights step), `restore` takes over a call
    a previous launch sent."""

    def submit(self, call: Ticket) -> Ticket: ...

    def restore(self, ticket: Ticket) -> None: ...

    def collect(self, ticket: Ticket) -> list[Group]: ...

    def close(self) -> None: ...


@dataclass
class InFlight:
    """A step's first sampling, sent and not yet trained on, with the problems it asks about."""

    ticket: Ticket
    problems: list[Problem]

    def state_dict(self) -> dict:
        return {"ticket": self.ticket.state_dict(), "problems": [asdict(p) for p in self.problems]}

    @classmethod
    def from_state(cls, state: dict) -> InFlight:
        return cls(Ticket.from_state(state["ticket"]), [Problem(**p) for p in state["problems"]])


@dataclass
class StepRollouts:
    problems: list[Problem]
    groups: list[Group]
    rewards: torch.Tensor  # [P, G]
    scores: list[GroupScores]  # [P]: each group's totals and each reward function's values
    advantages: torch.Tensor  # [P, G]
    dead_initial: int  # dead groups among the step's own prompts in the first sampling
    dead_final: int  # dead groups left after the spares and the retries
    retries: int  # extra requests made
    reward_first: float = 0.0  # mean reward of the first sampling, before dead groups were replaced
    staleness_mean: float = 0.0  # mean over the batch's groups of (step - the weights step that sampled it)
    dropped_stale: int = 0  # groups dropped as staler than rollout.max_policy_lag (and sampled again)
    spares_used: int = 0  # dead groups replaced by spare groups of the first sampling
    spares: int = 0  # spare prompts the first sampling carried
    generate_s: float = 0.0  # waiting for the rollout service (generation, queueing, reloads)
    score_s: float = 0.0  # rewards: the reward functions' calls
    # Each reward function's mean value (unweighted) over the first sampling, by its name.
    reward_terms: dict[str, float] = field(default_factory=dict)


class StepSampler:
    """Rank 0 samples and scores each step through `sampler`, keeping `rollout.ahead` steps in
    flight; every rank gets the same rollouts. Other ranks pass `sampler=None` and only receive.
    `in_flight`: the calls a checkpoint recorded (`state_dict`), taken over at a resume;
    `spares`: the dead-rate measurements it recorded (`spares_state`)."""

    def __init__(
        self,
        sampler: Sampler | None,
        stream: PromptStream,
        rewards: Rewards,
        cfg: Config,
        dist_info: Distributed,
        in_flight: list[dict] = (),
        spares: dict | None = None,
    ):
        self.sampler, self.stream, self.rewards, self.cfg, self.dist_info = sampler, stream, rewards, cfg, dist_info
        self.spares = SpareSizer(cfg.rollout, spares)
        self.in_flight: dict[int, InFlight] = {}
        if sampler is not None:
            for state in in_flight:
                flight = InFlight.from_state(state)
                sampler.restore(flight.ticket)
                self.in_flight[flight.ticket.step] = flight

    def __call__(self, step: int, weights: WeightsRef) -> StepRollouts:
        """Step `step`'s rollouts; `weights` are the newest published ones."""
        local = None
        if self.cfg.rollout.colocate and self.cfg.rollout.colocate_sleep_s and self.dist_info.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks the trainer cached are the memory a waking worker needs
        if self.sampler is not None:
            local = self._sample(step, weights)
        return self.dist_info.from_rank0(local)  # one object: a step's rollouts are small

    def _first_size(self) -> int:
        """Prompts in a step's first sampling sent now: its own and the spares."""
        return self.cfg.rollout.prompts_per_step + self.spares.count()

    def state_dict(self) -> list[dict]:
        """The calls in flight, oldest step first (empty on ranks other than 0)."""
        return [self.in_flight[step].state_dict() for step in sorted(self.in_flight)]

    def spares_state(self) -> dict:
        """The dead-rate measurements that size the next spares (spares.SpareSizer)."""
        return self.spares.state_dict()

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()

    # -- rank 0 ------------------------------------------------------------------------------

    def _send(self, step: int, weights: WeightsRef, attempt: int, problems: list[Problem]) -> InFlight:
        seed = self.cfg.run.seed * 1_000_003 + step * 101 + attempt
        call = Ticket(
            tuple(p.prompt for p in problems), weights, step, attempt, seed, problem_ids=tuple(p.id for p in problems)
        )
        ticket = self.sampler.submit(call)
        return InFlight(ticket, problems)

    def _top_up(self, step: int, weights: WeightsRef) -> None:
        """Send the first sampling of the next `rollout.ahead` steps that are not in flight yet."""
        last = min(step + self.cfg.rollout.ahead, self.cfg.train.steps - 1)
        for ahead in range(step + 1, last + 1):
            if ahead not in self.in_flight:
                self.in_flight[ahead] = self._send(ahead, weights, 0, self.stream.take(self._first_size()))

    def _sample(self, step: int, weights: WeightsRef) -> StepRollouts:
        spent = {"generate": 0.0, "score": 0.0}
        first, dropped = self._first_sampling(step, weights)
        groups, scores = self._collect_and_score(first, spent)
        self.spares.observe(sum(_is_dead(s) for s in scores), len(scores))
        batch, dead, spares_used = self._replace_dead_by_spares(first.problems, groups, scores)
        dead_initial = len(dead) + spares_used
        dead, retries = self._retry_dead(step, weights, batch, dead, spent)
        rewards, advantages = self._advantages(step, batch.scores)
        return StepRollouts(
            batch.problems,
            batch.groups,
            rewards,
            batch.scores,
            advantages,
            dead_initial,
            len(dead),
            retries,
            reward_first=_mean([t for s in scores for t in s.totals]),
            staleness_mean=sum(step - g.weights_step for g in batch.groups) / len(batch.groups),
            dropped_stale=dropped,
            spares_used=spares_used,
            spares=len(first.problems) - self.cfg.rollout.prompts_per_step,
            generate_s=spent["generate"],
            score_s=spent["score"],
            reward_terms={name: _mean([v for s in scores for v in s.values[name]]) for name in self.rewards.names},
        )

    def _first_sampling(self, step: int, weights: WeightsRef) -> tuple[InFlight, int]:
        """The step's first sampling (sent ahead, or now), and how many prompts were sent again
        because it was sampled by weights older than `rollout.max_policy_lag` allows."""
        first = self.in_flight.pop(step, None)
        if first is None:
            first = self._send(step, weights, 0, self.stream.take(self._first_size()))
        if step - first.ticket.weights_step <= self.cfg.rollout.max_policy_lag:
            return first, 0
        # Sampled by weights too old to train on: the same prompts again, from the newest.
        return self._send(step, weights, 0, first.problems), len(first.problems)

    def _collect_and_score(self, flight: InFlight, spent: dict[str, float]) -> tuple[list[Group], list[GroupScores]]:
        began = time.monotonic()
        groups = self.sampler.collect(flight.ticket)
        sampled = time.monotonic()
        ticket = flight.ticket
        # Numbered as metrics.jsonl numbers steps (the first is 1).
        where = f"step {ticket.step + 1}" + (f", dead-group retry {ticket.attempt}" if ticket.attempt else "")
        scored = self.rewards.score(flight.problems, groups, where)
        spent["generate"] += sampled - began
        spent["score"] += time.monotonic() - sampled
        return groups, scored

    def _replace_dead_by_spares(
        self, problems: list[Problem], groups: list[Group], scores: list[GroupScores]
    ) -> tuple[_Batch, list[int], int]:
        """The step's own groups, each dead one replaced by a live spare group while there are
        any; the slots still dead, and how many spares were used."""
        own = self.cfg.rollout.prompts_per_step
        batch = _Batch(list(problems[:own]), list(groups[:own]), list(scores[:own]))
        live_spares = [i for i in range(own, len(problems)) if not _is_dead(scores[i])]
        dead = [i for i in range(own) if _is_dead(scores[i])]
        used = min(len(dead), len(live_spares))
        for slot, spare in zip(dead[:used], live_spares[:used], strict=True):
            batch.put(slot, problems[spare], groups[spare], scores[spare])
        return batch, dead[used:], used

    def _retry_dead(
        self, step: int, weights: WeightsRef, batch: _Batch, dead: list[int], spent: dict[str, float]
    ) -> tuple[list[int], int]:
        """Fresh prompts for the dead slots, up to `loss.dead_group_retries` rounds, each waited
        for; the next steps' first samplings are sent once the first round is. Returns the slots
        still dead and the rounds made."""
        most = self.cfg.loss.dead_group_retries
        retry = self._send(step, weights, 1, self.stream.take(len(dead))) if dead and most else None
        self._top_up(step, weights)  # after the retry: a worker serves that first, the next steps meanwhile
        rounds = 0
        while retry is not None:
            groups, scores = self._collect_and_score(retry, spent)
            rounds += 1
            still_dead = []
            for slot, problem, group, scored in zip(dead, retry.problems, groups, scores, strict=False):
                if _is_dead(scored):
                    still_dead.append(slot)
                else:
                    batch.put(slot, problem, group, scored)
            dead = still_dead
            attempt = retry.ticket.attempt + 1
            retry = None
            if dead and attempt <= most:
                retry = self._send(step, weights, attempt, self.stream.take(len(dead)))
        return dead, rounds

    def _advantages(self, step: int, scores: list[GroupScores]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rewards as a (groups, samples) tensor (shuffled within the step for the control run)
        and their group advantages."""
        cfg = self.cfg
        rewards = torch.tensor([s.totals for s in scores], dtype=torch.float32)
        if cfg.reward.shuffle_control:
            order = torch.randperm(rewards.numel(), generator=torch.Generator().manual_seed(cfg.run.seed * 7919 + step))
            rewards = rewards.flatten()[order].view_as(rewards)
        return rewards, grpo.group_advantages(rewards, cfg.loss.advantage_norm)


@dataclass
class _Batch:
    """The step's own slots: a problem, its sampled group and the group's scores in each."""

    problems: list[Problem]
    groups: list[Group]
    scores: list[GroupScores]

    def put(self, slot: int, problem: Problem, group: Group, scores: GroupScores) -> None:
        self.problems[slot], self.groups[slot], self.scores[slot] = problem, group, scores


def _is_dead(scores: GroupScores) -> bool:
    return len(set(scores.totals)) == 1


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _answer_length(sample: Sample) -> float:
    """Answer tokens: the end-of-sequence token that closes a finished sample is not part of it.
    An episode's: its assistant tokens per assistant turn (as comparable with rollout.max_tokens)."""
    if sample.loss_mask is None:
        return len(sample.token_ids) - (sample.finish_reason == "stop")
    return sum(sample.loss_mask) / max(1, sample.turns)


def _episode_figures(samples: list[Sample]) -> dict:
    """Multi-turn episodes' assistant turns per episode, and how many ended for each reason."""
    episodes = [s for s in samples if s.ended]
    if not episodes:
        return {}
    ends = {why: sum(s.ended == why for s in episodes) for why in sorted({s.ended for s in episodes})}
    figures = {"episode_turns": _mean([s.turns for s in episodes]), **{f"episode_ends/{k}": v for k, v in ends.items()}}
    later = sum(s.later_prompt_tokens for s in episodes)
    if later and all(s.cached_tokens is not None for s in episodes):
        # the share of later turns' prompt tokens the workers' prefix caches served (the sticky rule's gain)
        figures["prefix_cache_hit"] = sum(s.cached_tokens for s in episodes) / later
    return figures


def summarize(r: StepRollouts) -> dict:
    """A step's metrics row (rewards, accuracy, lengths, dead groups, staleness, timings).
    `accuracy` and `format_rate` are over the trained batch's samples whose row has a gold, and
    left out where none has; `reward/<name>` is each reward function's mean over the first sampling."""
    correct = [c for s in r.scores if s.correct is not None for c in s.correct]
    well_formed = [f for s in r.scores if s.format_ok is not None for f in s.format_ok]
    lengths = [_answer_length(s) for g in r.groups for s in g.samples]
    return {
        # reward_mean is the run's reward figure (tripwire, progress, summary, plot): the policy's
        # own estimate, the first sampling's, not the trained batch's (dead groups replaced).
        "reward_mean": r.reward_first,
        "reward_first": r.reward_first,
        "reward_trained": float(r.rewards.mean()),
        "reward_std": float(r.rewards.std()) if r.rewards.numel() > 1 else 0.0,
        **({"accuracy": _mean(correct), "format_rate": _mean(well_formed)} if correct else {}),
        **{f"reward/{name}": value for name, value in r.reward_terms.items()},
        "response_length": sum(lengths) / len(lengths),
        # The engine's tokens: an episode's environment tokens were not generated.
        "generated_tokens": sum(
            len(s.token_ids) if s.loss_mask is None else sum(s.loss_mask) for g in r.groups for s in g.samples
        ),
        **_episode_figures([s for g in r.groups for s in g.samples]),
        "dead_groups": r.dead_initial,
        "dead_groups_after_retry": r.dead_final,
        "retries": r.retries,
        "staleness_mean": r.staleness_mean,
        "dropped_stale": r.dropped_stale,
        "spares_used": r.spares_used,
        "spares": r.spares,
        "generate_s": r.generate_s,
        "score_s": r.score_s,
    }
