"""The GRPO run: one short loop over named steps.

    for each optimizer step:
        sample            rank 0 asks the rollout service for G samples of each prompt
        score             rewards, group advantages, dead groups replaced
        train_step        clipped policy gradient over grad_accum micro-batches, AdamW
        save_and_publish  a checkpoint every `checkpoint.every` steps: the next request names it
        log               metrics.jsonl, progress bar

A relaunch with the same run directory resumes from the newest checkpoint. SIGTERM or
`run.max_wall_seconds` stop at a step boundary with a checkpoint and exit code 75.
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from protocol import exit_codes

from . import checkpoint as ckpt
from . import gates
from .canary import Canary
from .batch import collate, rank_share
from .config import Config, dump
from .data import DataError, PromptStream, arithmetic_problems, read_prompt_file, split
from .model import Distributed, init_distributed, load_policy, load_reference, load_tokenizer, resolve_dtype
from .outputs import STAGE_RESULT, MetricsLog, Progress, read_metrics, summary, write_json_atomic
from .rewards import Verifier
from .sampling import Sampler, StepRollouts, sample_step, summarize
from .train_step import StepTotals, make_optimizer, make_scheduler, train_step
from .tripwire import CollapseTripwire

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """Everything a resume restores besides weights, optimizer and RNG."""

    step: int = 0
    horizon: int | None = None  # train.steps the run was started with (None: a fresh run)
    started_at: float = field(default_factory=time.time)


class StopRequest:
    """SIGTERM/SIGINT ask for a stop at the next step boundary. All ranks agree on stops."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, *_):
        self.requested = True

    def agreed(self, dist_info: Distributed, wall_exceeded: bool, tripped: bool) -> tuple[bool, bool]:
        """(stop resumably, stop for the tripwire), the same on every rank."""
        # On the rank's device: NCCL reduces only CUDA tensors.
        flags = torch.tensor([float(self.requested or wall_exceeded), float(tripped)], device=dist_info.device)
        if dist_info.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), bool(flags[1].item())


def load_problems(cfg: Config):
    """(training problems, held-out problems). With a band file, training uses its prompts; the
    held-out ones still come from the task (banding only ever saw training problems)."""
    if cfg.data.task == "arithmetic":
        problems = arithmetic_problems(cfg.data.arithmetic_low, cfg.data.arithmetic_high, cfg.data.arithmetic_ops)
    else:
        problems = read_prompt_file(cfg.data.path)
    train_problems, held_out = split(problems, cfg.data.held_out, cfg.run.seed)
    if cfg.data.band_file:
        if not Path(cfg.data.band_file).is_file():
            raise DataError(f"data.band_file {cfg.data.band_file} does not exist; make it with `trainer-svc band`")
        train_problems = read_prompt_file(cfg.data.band_file)
    return train_problems, held_out


def train(cfg: Config, *, stage: str = "grpo", make_sampler: Callable[[Config, str], Sampler] | None = None) -> int:
    """Run (or resume) the stage; returns its exit code. Launch gates raise GateRefused.
    `make_sampler` replaces the spool rollout service (tests use a deterministic sampler)."""
    dist_info = init_distributed()
    run_dir = cfg.run_dir
    setup_process(cfg, dist_info)
    train_problems, held_out = load_problems(cfg)
    tokenizer = load_tokenizer(cfg.model.path)
    verifier = Verifier()
    gate_figures = run_launch_gates(cfg, dist_info, tokenizer, train_problems + held_out, verifier)
    if dist_info.is_main:  # only a config that passed the gates becomes the run's
        (run_dir / "config.resolved.toml").write_bytes(dump(cfg))

    dtype = resolve_dtype(cfg.model.dtype, dist_info.device)
    model = load_policy(cfg.model.path, dtype, dist_info, activation_checkpointing=cfg.model.activation_checkpointing)
    reference = load_reference(cfg.model.path, dtype, dist_info.device) if cfg.loss.kl_coef > 0 else None
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    stream = PromptStream(train_problems, seed=cfg.run.seed)
    tripwire = CollapseTripwire(cfg.tripwire, cfg.rollout.max_tokens)
    state, latest = resume(cfg, model, optimizer, scheduler, stream, tripwire, dist_info)
    gates.check_horizon(scheduler.total_steps, cfg, state.horizon)
    banner = make_banner(cfg, stage, latest, len(train_problems), dist_info, gate_figures)
    log.info("BANNER %s", json.dumps(banner, indent=1))
    canary = Canary(cfg, held_out, verifier, state.step) if dist_info.is_main else None
    if tripwire.fired:
        log.error("the collapse tripwire fired before this resume (%s); not training further", tripwire.reason)
        verifier.close()
        if dist_info.is_main:
            write_stage_result(cfg, stage, banner, latest, exit_codes.TRIPWIRE, canary, tripwire)
        return exit_codes.TRIPWIRE

    sampler = make_rollout_sampler(cfg, make_sampler, dist_info) if dist_info.is_main and state.step < cfg.train.steps else None
    metrics = MetricsLog(run_dir, state.step) if dist_info.is_main else None
    progress = Progress(cfg.train.steps, state.step) if dist_info.is_main else None
    stop = StopRequest()
    started = time.monotonic()
    exit_code = exit_codes.OK
    try:
        if dist_info.is_main and canary.due(state.step) and state.step == 0:  # the starting point
            canary.run(sampler, step=0, weights_dir=cfg.model.path, content_id=None)
        while state.step < cfg.train.steps:
            step_started = time.monotonic()
            weights_dir, content_id = (str(latest.path), latest.content_id) if latest else (cfg.model.path, None)
            rollouts = broadcast(
                sample_step(sampler, stream, verifier, cfg, step=state.step, weights_dir=weights_dir, content_id=content_id)
                if dist_info.is_main else None,
                dist_info,
            )
            train_started = time.monotonic()
            stats = learn(model, reference, optimizer, scheduler, rollouts, tokenizer, cfg, dist_info)
            state.step += 1
            row = {"step": state.step, **summarize(rollouts), **stats, "train_s": time.monotonic() - train_started}
            tripped = tripwire.observe(state.step, row["reward_mean"], row["entropy"], row["response_length"]) if dist_info.is_main else None
            wall_exceeded = cfg.run.max_wall_seconds > 0 and time.monotonic() - started > cfg.run.max_wall_seconds
            stopping, tripping = stop.agreed(dist_info, wall_exceeded, tripped is not None)
            row["save_s"] = 0.0
            if state.step % cfg.checkpoint.every == 0 or state.step == cfg.train.steps or stopping or tripping:
                save_started = time.monotonic()
                latest = save_and_publish(cfg, state, model, optimizer, scheduler, stream, tripwire, dist_info) or latest
                row["save_s"] = time.monotonic() - save_started
            if dist_info.is_main:
                if canary.due(state.step) and latest is not None:
                    row["canary_accuracy"] = canary.run(sampler, step=state.step, weights_dir=str(latest.path), content_id=latest.content_id)["accuracy"]
                row["step_s"] = time.monotonic() - step_started
                metrics.write(row)
                progress.update(row)
            if tripping:
                if dist_info.is_main:
                    ckpt.pin(latest.path, tripwire.reason or "collapse tripwire")
                log.error("collapse tripwire: %s; checkpoint %s pinned", tripwire.reason, latest.path)
                exit_code = exit_codes.TRIPWIRE
                break
            if stopping and state.step < cfg.train.steps:
                log.warning("stopping at step %d (%s); relaunch to resume", state.step, "wall-clock limit" if wall_exceeded else "signal")
                exit_code = exit_codes.RESUMABLE_STOP
                break
    finally:
        verifier.close()
        if sampler is not None:
            sampler.close()
        if progress is not None:
            progress.close()
        if metrics is not None:
            metrics.close()
    if dist_info.is_main:
        write_stage_result(cfg, stage, banner, latest, exit_code, canary, tripwire)
    if dist_info.world_size > 1:
        dist.destroy_process_group()
    return exit_code


def setup_process(cfg: Config, dist_info: Distributed) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per checkpoint save would bury the run's own
    if dist_info.device.type == "cpu" and cfg.run.cpu_threads:
        torch.set_num_threads(cfg.run.cpu_threads)
    torch.manual_seed(cfg.run.seed + dist_info.rank)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)
    if dist_info.is_main:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)


def run_launch_gates(cfg: Config, dist_info: Distributed, tokenizer, problems, verifier: Verifier) -> dict:
    """Cheapest first; each refuses with GateRefused. The horizon gate runs once the schedule exists."""
    gates.check_config(cfg, dist_info.world_size)
    receipt = gates.ceiling_receipt(cfg, problems, tokenizer, verifier)
    if dist_info.is_main:
        gates.check_ceiling(receipt, cfg.run_dir)
    elif receipt["perfect_rate"] < gates.CEILING_PERFECT_MIN or receipt["wrong_rate"] > gates.CEILING_WRONG_MAX:
        raise gates.GateRefused("ceiling", "see rank 0")
    band = gates.check_band(cfg)
    live = None
    if not cfg.rollout.spawn:
        from protocol.spool import Spool

        live = Spool(cfg.spool_dir, create=True).live_workers()
    topology = gates.check_topology(cfg, dist_info.world_size, torch.cuda.device_count(), live)
    return {"ceiling": {"perfect_rate": receipt["perfect_rate"], "wrong_rate": receipt["wrong_rate"], "n": receipt["n"]}, "band": band, "topology": topology}


def make_rollout_sampler(cfg: Config, make_sampler, dist_info: Distributed) -> Sampler:
    launch_id = secrets.token_hex(3)
    if make_sampler is not None:
        return make_sampler(cfg, launch_id)
    from .rollout import RolloutService

    return RolloutService(cfg, launch_id=launch_id, world_size=dist_info.world_size)


def learn(model, reference, optimizer, scheduler, rollouts: StepRollouts, tokenizer, cfg: Config, dist_info: Distributed) -> dict:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = collate(rollouts.groups, rollouts.advantages, pad_id)
    totals = StepTotals(tokens=int(batch.mask.sum()), sequences=len(batch))
    if totals.tokens == 0:  # nothing was generated: no loss to take, the tripwire judges the step
        scheduler.step()
        return {"loss": 0.0, "entropy": 0.0, "kl": 0.0, "clip_fraction_low": 0.0, "clip_fraction_high": 0.0,
                "grad_norm": 0.0, "lr": scheduler.get_last_lr()[0], "mismatch_mean": 0.0, "mismatch_max": 0.0}
    share = rank_share(batch, dist_info.rank, dist_info.world_size).to(dist_info.device)
    return train_step(model, reference, optimizer, scheduler, share, totals, cfg, dist_info)


def broadcast(rollouts: StepRollouts | None, dist_info: Distributed) -> StepRollouts:
    """Rank 0's rollouts to every rank (one object; a step's rollouts are small)."""
    if dist_info.world_size == 1:
        return rollouts
    box = [rollouts]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_and_publish(cfg: Config, state: RunState, model, optimizer, scheduler, stream: PromptStream, tripwire: CollapseTripwire, dist_info: Distributed):
    """Save the checkpoint the next rollout request will name: this is the weight sync."""
    trainer_state = {
        "step": state.step,
        "horizon": cfg.train.steps,
        "stream": stream.state_dict(),
        "scheduler": scheduler.state_dict(),
        "tripwire": tripwire.state_dict(),
        "started_at": state.started_at,
    }
    saved = ckpt.save(
        run_dir=cfg.run_dir, step=state.step, model=model, optimizer=optimizer, base_model=Path(cfg.model.path),
        trainer_state=trainer_state, dist_info=dist_info,
    )
    if dist_info.is_main:
        ckpt.prune(cfg.run_dir, cfg.checkpoint.keep_last)
    if dist_info.world_size > 1:
        dist.barrier()
    return saved


def resume(cfg: Config, model, optimizer, scheduler, stream: PromptStream, tripwire: CollapseTripwire, dist_info: Distributed):
    """Continue from the newest checkpoint of run_dir, if there is one."""
    latest = ckpt.latest(cfg.run_dir)
    if latest is None:
        return RunState(), None
    weights = ckpt.load_weights(latest.path)
    if dist_info.world_size == 1:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"{latest.path} does not match the model: missing {missing}, unexpected {unexpected}")
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    ckpt.load_optimizer_state(model, optimizer, latest.path / ckpt.STATE_DIR / "optimizer.pt", dist_info)
    saved = ckpt.load_trainer_state(latest)
    scheduler.load_state_dict(saved["scheduler"])
    stream.load_state_dict(saved["stream"])
    tripwire.load_state_dict(saved["tripwire"])
    log.info("RESUMED from %s at step %d", latest.path, saved["step"])
    return RunState(step=saved["step"], horizon=saved["horizon"], started_at=saved["started_at"]), latest


def make_banner(cfg: Config, stage: str, latest, n_problems: int, dist_info: Distributed, gate_figures: dict) -> dict:
    band = gate_figures.get("band")
    return {
        "stage": stage,
        "substrate": cfg.model.path,
        "resumed_from": str(latest.path) if latest else None,
        "band_file": cfg.data.band_file or None,
        "band_prompts": band["rows"] if band else None,
        "task": {"kind": cfg.data.task, "train_problems": n_problems, "held_out": cfg.data.held_out},
        "shape": {
            "prompts_per_step": cfg.rollout.prompts_per_step,
            "G": cfg.rollout.samples_per_prompt,
            "max_response_len": cfg.rollout.max_tokens,
            "loss_denominator": cfg.loss.denominator,
            "optimizer_steps": cfg.train.steps,
            "grad_accum": cfg.train.grad_accum,
        },
        "ceiling": gate_figures["ceiling"],
        "topology": {**gate_figures["topology"], "rollout": "spawned worker" if cfg.rollout.spawn else f"workers on {cfg.spool_dir}"},
        "safety": f"grad clip {cfg.train.max_grad_norm}, canary every {cfg.canary.every or 'off'}, "
                  f"tripwire {'armed' if cfg.tripwire.armed else 'off'} (window {cfg.tripwire.window}), policy lag <= {cfg.rollout.max_policy_lag}",
    }


def write_stage_result(cfg: Config, stage: str, banner: dict, latest, exit_code: int, canary: Canary, tripwire: CollapseTripwire) -> None:
    rows = read_metrics(cfg.run_dir)
    totals = summary(rows)
    result = {
        "stage": stage,
        "exit_code": exit_code,
        "finished": exit_code == exit_codes.OK,
        "summary": totals,
        "banner": banner,
        "checkpoint": str(latest.path) if latest else None,
        "canary_history": canary.history,
        "collapse_tripwire": tripwire.as_log_dict(),
        "dead_groups": {"initial": sum(r["dead_groups"] for r in rows), "after_retry": sum(r["dead_groups_after_retry"] for r in rows), "retries": sum(r["retries"] for r in rows)},
        "mismatch": {"mean": totals.get("mismatch_mean"), "max": totals.get("mismatch_max")},
    }
    write_json_atomic(cfg.run_dir / STAGE_RESULT, result)
    log.info("stage result: %s", cfg.run_dir / STAGE_RESULT)
