"""The canary: every `canary.every` steps, greedy answers to held-out problems through the
spool, from the newest weights, rendered as training renders them. Its accuracy (canary.jsonl,
stage_result.json) shows whether the policy improves on problems it never trained on, not only
on its training prompts. Each check also scores the greedy answers with the run's own reward
functions (`reward`, the mean total): where the reward gives partial credit (steps of a multi-step
answer right), the held-out reward moves before the all-or-nothing accuracy does.

With an [env] section the canary runs one greedy episode of each held-out row, beside the training
episodes and through the same workers: `accuracy` grades the episode's last assistant turn (its
final answer) against the row's gold with the run's verifier, `reward` is the environment's.

The canary of step 0 answers from the starting model; a later one only from trained weights (a
canary due before the first trained weights exist is skipped, not run on the starting model).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from ..config import Config
from ..data import DataError, Problem
from ..learning.reward_functions import Rewards
from ..records import StepLog
from ..rollout.sampling import Sampler
from ..rollout_types import Group, Ticket, WeightsRef

CANARY_FILE = "canary.jsonl"


class Canary:
    def __init__(
        self, cfg: Config, held_out: list[Problem], rewards: Rewards, sampler: Sampler | None, resumed_step: int = 0
    ):
        """`sampler` None: a canary that never runs (ranks other than 0)."""
        self.every = cfg.canary.every if sampler is not None else 0
        self.problems = held_out[: cfg.canary.problems]  # with gold answers: `check` saw to it at launch
        self.rewards = rewards
        self.sampler = sampler
        self.episodes = cfg.env is not None
        # Rows after the resumed step are dropped (those canaries run again); written whole or not at all.
        self.log = StepLog(Path(cfg.run_dir) / CANARY_FILE, resumed_step) if sampler is not None else None
        self.history: list[dict] = self.log.rows if self.log is not None else []

    @staticmethod
    def check(cfg: Config, held_out: list[Problem]) -> None:
        """An armed canary grades against gold answers: DataError, at launch, where its problems lack one."""
        unknown = [p.id for p in held_out[: cfg.canary.problems] if p.gold is None] if cfg.canary.every else []
        if unknown:
            raise DataError(
                f"the canary (canary.every = {cfg.canary.every}) grades greedy answers to held-out rows against "
                f"their gold answers, and rows {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} have "
                "none: set canary.every = 0, or give the rows an answer field"
            )

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and not any(h["step"] == step for h in self.history)

    def maybe_run(self, step: int, weights: WeightsRef) -> dict:
        """The canary's metrics ({"canary_accuracy": ..., "canary_reward": ...}) when it is due at
        `step`, else {}."""
        if not self.due(step) or (step > 0 and weights.step is None):
            return {}
        record = self.run(step, weights)
        return {"canary_accuracy": record["accuracy"], "canary_reward": record["reward"]}

    def run(self, step: int, weights: WeightsRef) -> dict:
        call = Ticket(
            tuple(p.prompt for p in self.problems), weights, step, 0, 0, n=1, temperature=0.0, tag="canary",
            problem_ids=tuple(p.id for p in self.problems),
        )  # fmt: skip
        groups = self.sampler.collect(self.sampler.submit(call))
        where = f"the canary of step {step}"
        if self.episodes:  # the final answer graded; the reward the environment's
            finals = [Group(g.prompt_ids, [replace(s, text=s.last_text) for s in g.samples]) for g in groups]
            scores = self.rewards.score(self.problems, finals, where)
            rewards = [g.samples[0].reward for g in groups]
        else:  # the verifier's verdict (the rows have golds) and the reward, as a training sample's are scored
            scores = self.rewards.score(self.problems, groups, where)
            rewards = [s.totals[0] for s in scores]
        correct = [s.correct[0] for s in scores]
        record = {
            "step": step,
            "accuracy": sum(correct) / len(correct),
            "reward": sum(rewards) / len(rewards),
            "n": len(correct),
            "weights_dir": weights.dir,
            "time": time.time(),
        }
        self.log.write(record)  # and into self.history, which is its rows
        return record
