"""The GRPO run: one short loop over named steps.

    for each optimizer step:
        sample      rank 0 collects G samples of each prompt from the rollout service (sent now,
                    or `rollout.ahead` steps ago), scores them, computes group advantages, and
                    sends the next steps' requests; every rank gets the result
        learn       clipped policy gradient over grad_accum micro-batches (and ranks), AdamW
        publish     the weights, every `publish.every` steps: the next requests name them (the sync)
        canary      held-out accuracy every `canary.every` steps
        save        a resume checkpoint every `checkpoint.every` steps, and at every stop
        log         metrics.jsonl, progress bar

`run.setup` builds everything first (rank differences live there), so this module reads the
same on every rank. A relaunch with the same run directory resumes from the newest checkpoint.
SIGTERM or `run.max_wall_seconds` stop at a step boundary with a checkpoint and exit code 75.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import asdict

import torch

from protocol import exit_codes

from ..cadence import on_cadence
from ..config import Config
from ..learning.train_step import learn
from ..rollout.sampling import summarize
from ..weights import checkpoint as ckpt
from .out_of_memory import OutOfDeviceMemory
from .setup import MakeSampler, Run, setup

log = logging.getLogger(__name__)


def train(cfg: Config, *, stage: str = "grpo", make_sampler: MakeSampler | None = None) -> int:
    """Run (or resume) the stage; returns its exit code. Launch gates raise GateRefused.
    `make_sampler` replaces the spool rollout service (tests use a deterministic sampler)."""
    run = setup(cfg, stage, make_sampler)
    try:
        exit_code = steps(run)
        run.out.stage_result(run.stage_result(exit_code))
        return exit_code
    finally:
        run.close()


def steps(run: Run) -> int:
    """The optimizer steps left to take; returns the exit code."""
    cfg, state = run.cfg, run.state
    if run.tripwire.fired:
        log.error("the collapse tripwire fired before this resume (%s); not training further", run.tripwire.reason)
        return exit_codes.TRIPWIRE
    run.canary.maybe_run(state.step, run.weights)  # the starting point, or one a stop left undone
    while state.step < cfg.train.steps:
        timer, taking = StepTimer("rollout", "train", "publish", "save"), state.step + 1
        try:
            code = one_step(run, timer)
        except torch.OutOfMemoryError as exc:
            resume_from = run.latest.path.name if run.latest is not None else None
            phase = timer.current or "canary or logging"
            raise OutOfDeviceMemory(taking, phase, run.dist_info.device, resume_from, str(exc)) from None
        if code is not None:
            return code
    return exit_codes.OK


def one_step(run: Run, timer: StepTimer) -> int | None:
    """One optimizer step; the exit code when the run stops after it, else None."""
    cfg, state = run.cfg, run.state
    with timer.phase("rollout"):
        rollouts = run.sample(state.step, run.weights)
    with timer.phase("train"):
        stats = learn(run.policy, rollouts.groups, rollouts.advantages, cfg, run.dist_info)
    state.step += 1
    if on_cadence(state.step, cfg.publish.every, cfg.train.steps):
        with timer.phase("publish"):
            run.weights = run.sync.publish(run.policy.model, state.step)
    row = {"step": state.step, **summarize(rollouts), **stats}
    tripped = run.tripwire.observe(state.step, row["reward_mean"], row["entropy"], row["response_length"])
    stopping, tripping = run.stop.agreed(run.dist_info, tripped is not None)
    row.update(run.canary.maybe_run(state.step, run.weights))
    if on_cadence(state.step, cfg.checkpoint.every, cfg.train.steps) or stopping or tripping:
        with timer.phase("save"):
            pin_reason = (run.tripwire.reason or "collapse tripwire") if tripping else None
            save(run, {**row, **timer.seconds()}, pin_reason)
    run.out.step({**row, **timer.seconds()})
    if tripping:
        log.error("collapse tripwire: %s; checkpoint %s pinned", run.tripwire.reason, run.latest.path)
        return exit_codes.TRIPWIRE
    if stopping and state.step < cfg.train.steps:
        why = "wall-clock limit" if run.stop.wall_exceeded else "signal"
        log.warning("stopping at step %d (%s); relaunch to resume", state.step, why)
        return exit_codes.RESUMABLE_STOP
    return None


def save(run: Run, row: dict, pin_reason: str | None = None) -> None:
    """Save a resume checkpoint; one saved as the tripwire fires is pinned (never pruned). It
    keeps the step's metrics row (for a log that loses it to a full disk after the save) and the
    weights the next requests name (older than the checkpoint's own between two publishes)."""
    trainer_state = {
        "step": run.state.step,
        "horizon": run.cfg.train.steps,
        "stream": run.stream.state_dict(),
        "scheduler": run.policy.scheduler.state_dict(),
        "tripwire": run.tripwire.state_dict(),
        "started_at": run.state.started_at,
        "in_flight": run.sample.state_dict(),  # the stream's cursor is past their prompts
        "spares": run.sample.spares_state(),
        "rollout_weights": asdict(run.weights),
        "row": row,  # timings as of the save's start
    }
    run.latest = ckpt.save_and_prune(
        run.cfg, run.state.step, run.policy, trainer_state, run.dist_info, pin_reason, run.weights
    )


class StepTimer:
    """Wall seconds of a step's phases (`<phase>_s`, 0 for a phase skipped) and of the step."""

    def __init__(self, *phases: str):
        self.started = time.monotonic()
        self.spent = {phase: 0.0 for phase in phases}
        self.current: str | None = None  # the phase under way (an error names it)

    @contextmanager
    def phase(self, name: str):
        began, self.current = time.monotonic(), name
        yield
        self.spent[name] += time.monotonic() - began
        self.current = None

    def seconds(self) -> dict[str, float]:
        return {**{f"{k}_s": v for k, v in self.spent.items()}, "step_s": time.monotonic() - self.started}
