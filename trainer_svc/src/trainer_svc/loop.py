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
from .batch import collate, rank_share
from .config import Config, dump
from .data import PromptStream, arithmetic_problems, read_prompt_file, split
from .model import Distributed, init_distributed, load_policy, load_reference, load_tokenizer, resolve_dtype
from .outputs import STAGE_RESULT, MetricsLog, Progress, read_metrics, summary, write_json_atomic
from .rewards import Verifier
from .sampling import Sampler, StepRollouts, sample_step, summarize
from .train_step import StepTotals, make_optimizer, make_scheduler, train_step

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """Everything a resume restores besides weights, optimizer and RNG."""

    step: int = 0
    stream: dict = field(default_factory=dict)
    scheduler: dict = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)


class StopRequest:
    """SIGTERM/SIGINT ask for a stop at the next step boundary (all ranks agree on it)."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, *_):
        self.requested = True

    def agreed(self, dist_info: Distributed, wall_exceeded: bool) -> bool:
        flag = torch.tensor([1.0 if (self.requested or wall_exceeded) else 0.0])
        if dist_info.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def load_problems(cfg: Config):
    if cfg.data.task == "arithmetic":
        problems = arithmetic_problems(cfg.data.arithmetic_low, cfg.data.arithmetic_high, cfg.data.arithmetic_ops)
    else:
        problems = read_prompt_file(cfg.data.path)
    return split(problems, cfg.data.held_out, cfg.run.seed)


def train(cfg: Config, *, stage: str = "grpo", make_sampler: Callable[[Config, str], Sampler] | None = None) -> int:
    """Run (or resume) the stage; returns its exit code. `make_sampler` replaces the spool
    rollout service (tests use it for a deterministic sampler)."""
    dist_info = init_distributed()
    run_dir = cfg.run_dir
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per checkpoint save would bury the run's own
    if dist_info.device.type == "cpu" and cfg.run.cpu_threads:
        torch.set_num_threads(cfg.run.cpu_threads)
    torch.manual_seed(cfg.run.seed + dist_info.rank)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)
    if dist_info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.resolved.toml").write_bytes(dump(cfg))

    train_problems, _held_out = load_problems(cfg)
    tokenizer = load_tokenizer(cfg.model.path)
    dtype = resolve_dtype(cfg.model.dtype, dist_info.device)
    model = load_policy(cfg.model.path, dtype, dist_info, activation_checkpointing=cfg.model.activation_checkpointing)
    reference = load_reference(cfg.model.path, dtype, dist_info.device) if cfg.loss.kl_coef > 0 else None
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    stream = PromptStream(train_problems, seed=cfg.run.seed)
    state, latest = resume(cfg, model, optimizer, scheduler, stream, dist_info)
    banner = make_banner(cfg, stage, latest, len(train_problems), dist_info)
    log.info("BANNER %s", banner)

    sampler = None
    if dist_info.is_main and state.step < cfg.train.steps:
        launch_id = secrets.token_hex(3)
        if make_sampler is not None:
            sampler = make_sampler(cfg, launch_id)
        else:
            from .rollout import RolloutService

            sampler = RolloutService(cfg, launch_id=launch_id)
    metrics = MetricsLog(run_dir, state.step) if dist_info.is_main else None
    progress = Progress(cfg.train.steps, state.step) if dist_info.is_main else None
    verifier = Verifier()
    stop = StopRequest()
    started = time.monotonic()
    exit_code = exit_codes.OK
    try:
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
            stats["train_s"] = time.monotonic() - train_started
            state.step += 1
            save_s = 0.0
            wall_exceeded = cfg.run.max_wall_seconds > 0 and time.monotonic() - started > cfg.run.max_wall_seconds
            stopping = stop.agreed(dist_info, wall_exceeded)
            if state.step % cfg.checkpoint.every == 0 or state.step == cfg.train.steps or stopping:
                save_started = time.monotonic()
                latest = save_and_publish(cfg, state, model, optimizer, scheduler, stream, dist_info) or latest
                save_s = time.monotonic() - save_started
            if dist_info.is_main:
                row = {"step": state.step, **summarize(rollouts), **stats, "save_s": save_s, "step_s": time.monotonic() - step_started}
                metrics.write(row)
                progress.update(row)
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
        write_stage_result(cfg, stage, banner, latest, exit_code)
    if dist_info.world_size > 1:
        dist.destroy_process_group()
    return exit_code


def learn(model, reference, optimizer, scheduler, rollouts: StepRollouts, tokenizer, cfg: Config, dist_info: Distributed) -> dict:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = collate(rollouts.groups, rollouts.advantages, pad_id)
    totals = StepTotals(tokens=int(batch.mask.sum()), sequences=len(batch))
    share = rank_share(batch, dist_info.rank, dist_info.world_size).to(dist_info.device)
    return train_step(model, reference, optimizer, scheduler, share, totals, cfg, dist_info)


def broadcast(rollouts: StepRollouts | None, dist_info: Distributed) -> StepRollouts:
    """Rank 0's rollouts to every rank (one object; a step's rollouts are small)."""
    if dist_info.world_size == 1:
        return rollouts
    box = [rollouts]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_and_publish(cfg: Config, state: RunState, model, optimizer, scheduler, stream: PromptStream, dist_info: Distributed):
    """Save the checkpoint the next rollout request will name: this is the weight sync."""
    state.stream, state.scheduler = stream.state_dict(), scheduler.state_dict()
    trainer_state = {"step": state.step, "stream": state.stream, "scheduler": state.scheduler, "started_at": state.started_at}
    saved = ckpt.save(
        run_dir=cfg.run_dir, step=state.step, model=model, optimizer=optimizer, base_model=Path(cfg.model.path),
        trainer_state=trainer_state, dist_info=dist_info,
    )
    if dist_info.is_main:
        ckpt.prune(cfg.run_dir, cfg.checkpoint.keep_last)
    if dist_info.world_size > 1:
        dist.barrier()
    return saved


def resume(cfg: Config, model, optimizer, scheduler, stream: PromptStream, dist_info: Distributed):
    """Continue from the newest checkpoint of run_dir, if there is one."""
    latest = ckpt.latest(cfg.run_dir)
    state = RunState()
    if latest is None:
        return state, None
    from safetensors.torch import load_file

    weights = load_file(latest.path / "model.safetensors") if (latest.path / "model.safetensors").exists() else None
    if weights is None:
        raise RuntimeError(f"{latest.path}: sharded checkpoints cannot be resumed yet; keep the model in one file")
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
    state = RunState(step=saved["step"], stream=saved["stream"], scheduler=saved["scheduler"], started_at=saved["started_at"])
    log.info("RESUMED from %s at step %d", latest.path, state.step)
    return state, latest


def make_banner(cfg: Config, stage: str, latest, n_problems: int, dist_info: Distributed) -> dict:
    return {
        "stage": stage,
        "substrate": cfg.model.path,
        "resumed_from": str(latest.path) if latest else None,
        "task": {"kind": cfg.data.task, "train_problems": n_problems, "held_out": cfg.data.held_out},
        "shape": {
            "prompts_per_step": cfg.rollout.prompts_per_step,
            "G": cfg.rollout.samples_per_prompt,
            "max_response_len": cfg.rollout.max_tokens,
            "loss_denominator": cfg.loss.denominator,
            "optimizer_steps": cfg.train.steps,
            "grad_accum": cfg.train.grad_accum,
        },
        "topology": {"train_ranks": dist_info.world_size, "device": str(dist_info.device), "rollout": "spawned worker" if cfg.rollout.spawn else f"workers on {cfg.spool_dir}"},
    }


def write_stage_result(cfg: Config, stage: str, banner: dict, latest, exit_code: int) -> None:
    rows = read_metrics(cfg.run_dir)
    result = {
        "stage": stage,
        "exit_code": exit_code,
        "finished": exit_code == exit_codes.OK,
        "summary": summary(rows),
        "banner": banner,
        "checkpoint": str(latest.path) if latest else None,
        "dead_groups": {"initial": sum(r["dead_groups"] for r in rows), "after_retry": sum(r["dead_groups_after_retry"] for r in rows), "retries": sum(r["retries"] for r in rows)},
        "mismatch": {"mean": summary(rows).get("mismatch_mean"), "max": summary(rows).get("mismatch_max")},
    }
    write_json_atomic(cfg.run_dir / STAGE_RESULT, result)
    log.info("stage result: %s", cfg.run_dir / STAGE_RESULT)
