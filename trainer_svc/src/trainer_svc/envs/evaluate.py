"""Evaluating an environment: its episodes over a dataset, through the same workers, the same
runner and the same exact-token rules as training (`trainer-svc eval-env`).

    report = evaluate(cfg, rows, weights=WeightsRef("/ckpt/step_00000100"), samples=1)
    write_rows("out.jsonl", report.rows)

`spoolctl eval` stays the single-turn eval of the spool's own package (protocol, no trainer
code); an environment needs the trainer's side (the environment pool, the tokenizer, the
episode runner), so its eval is a trainer command. One output row per input row: its fields, its
prompt, and per episode its text (every turn after the first prompt, decoded), the reward, the
turns and why it ended; the report's `reward` is the mean over every episode. Sampling is `--temperature` (default 0,
greedy) with the run's `rollout.max_tokens`; episodes are seeded from `--seed`, so an eval made
again asks the same. A fault of the environment stops it as in training (EnvError, exit 2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..config import Config
from ..rollout_types import Ticket, WeightsRef
from .sampler import EpisodeSampler


@dataclass
class EnvEvalReport:
    rows: list[dict]  # one per input row
    reward: float  # mean over every episode
    seconds: float


def evaluate(
    cfg: Config, service, rows: list, tokenizer, *, weights: WeightsRef, samples: int = 1, temperature: float = 0.0,
    seed: int = 0, rows_per_call: int = 64,
) -> EnvEvalReport:  # fmt: skip
    """`samples` episodes of each row (the problems `rows`, data.Problem), with `weights`;
    `service` makes the TurnBatcher (rollout.client.RolloutService)."""
    started = time.monotonic()
    sampler = EpisodeSampler(cfg, service, rows, tokenizer)
    out: list[dict] = []
    try:
        calls = []
        for start in range(0, len(rows), rows_per_call):
            part = rows[start : start + rows_per_call]
            call = Ticket(
                tuple(r.prompt for r in part), weights, start // rows_per_call, 0, seed + start, n=samples,
                temperature=temperature, tag="evalenv", problem_ids=tuple(r.id for r in part),
            )  # fmt: skip
            calls.append((part, sampler.submit(call)))  # all in flight at once: the workers see every row's turns
        for part, call in calls:
            for row, group in zip(part, sampler.collect(call), strict=True):
                episodes = [
                    {"text": s.text, "reward": s.reward, "turns": s.turns, "ended": s.ended} for s in group.samples
                ]
                out.append(dict(row.fields, id=row.id, prompt=row.prompt, episodes=episodes))
    finally:
        sampler.close()
    rewards = [e["reward"] for row in out for e in row["episodes"]]
    return EnvEvalReport(out, sum(rewards) / len(rewards) if rewards else 0.0, time.monotonic() - started)
