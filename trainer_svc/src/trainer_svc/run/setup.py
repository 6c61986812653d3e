"""A training run's parts, built once by `setup`: the gates passed, the model and optimizer
restored, the rollout sampler, canary, tripwire and outputs in place.

Rank differences live here, not in the loop: rank 0 gets the real sampler, canary and outputs;
other ranks get a sampler that only receives rank 0's rollouts, a canary that never runs and
outputs that write nothing. `Run.close` is the one cleanup path.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import Config, dump
from ..data import PromptStream, check_chat_template, load_problems
from ..distributed import Distributed, init_distributed
from ..learning.lora import AdapterDisabled
from ..learning.model import (
    compile_enabled,
    load_policy,
    load_reference,
    load_tokenizer,
    resolve_dtype,
    use_compile_cache,
)
from ..learning.reward_functions import Rewards
from ..learning.rewards import Verifier
from ..learning.train_step import Policy, make_optimizer, make_scheduler
from ..rails import gates
from ..rails.canary import Canary
from ..rails.memory_gate import check_memory
from ..rails.tripwire import CollapseTripwire
from ..records import write_bytes_atomic
from ..rollout.sampling import Sampler, StepSampler
from ..rollout_types import WeightsRef
from ..weights import checkpoint as ckpt
from ..weights.checkpoint import Checkpoint, RunState
from ..weights.sync import WeightSync
from . import outputs
from .outputs import Outputs
from .trackers import Tracking

log = logging.getLogger(__name__)

MakeSampler = Callable[[Config, str], Sampler]  # (config, launch id) -> sampler; tests pass their own


class StopRequest:
    """SIGTERM/SIGINT, or the wall-clock limit, ask for a stop at the next step boundary."""

    def __init__(self, max_wall_seconds: float):
        self.requested = False
        self.max_wall_seconds = max_wall_seconds
        self.started = time.monotonic()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, *_):
        self.requested = True

    @property
    def wall_exceeded(self) -> bool:
        return self.max_wall_seconds > 0 and time.monotonic() - self.started > self.max_wall_seconds

    def agreed(self, dist_info: Distributed, tripped: bool) -> tuple[bool, bool]:
        """(stop resumably, stop for the tripwire), the same on every rank."""
        # On the rank's device: NCCL reduces only CUDA tensors.
        flags = torch.tensor([float(self.requested or self.wall_exceeded), float(tripped)], device=dist_info.device)
        if dist_info.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), bool(flags[1].item())


@dataclass
class Run:
    cfg: Config
    stage: str
    dist_info: Distributed  # this rank and the world (torch.distributed is `dist`)
    policy: Policy
    stream: PromptStream
    verifier: Verifier
    rewards: Rewards
    tripwire: CollapseTripwire
    state: RunState
    latest: Checkpoint | None  # the newest checkpoint: what a relaunch resumes from
    weights: WeightsRef  # what rollout requests name: the newest published weights
    sync: WeightSync
    sample: StepSampler
    canary: Canary
    out: Outputs
    banner: dict
    stop: StopRequest

    def stage_result(self, exit_code: int) -> dict:
        return outputs.stage_result(
            stage=self.stage,
            banner=self.banner,
            exit_code=exit_code,
            rows=outputs.read_metrics(self.cfg.run_dir),
            checkpoint=self.latest.path if self.latest else None,
            canary_history=self.canary.history,
            tripwire=self.tripwire.as_log_dict(),
        )

    def close(self) -> None:
        self.verifier.close()
        self.rewards.close()
        self.sample.close()  # a spawned worker stops here
        self.sync.close(run_over=self.state.step >= self.cfg.train.steps or self.tripwire.fired)
        self.out.close()
        if self.dist_info.world_size > 1:
            dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End this process with `code`. One of several torchrun ranks skips the interpreter's
    teardown: by then every output is written and the process group destroyed, and gloo's
    threads, torn down with the interpreter, can abort a finished run ("terminate called without
    an active exception", exit -6), which torchrun reports as a failed one."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


def setup(cfg: Config, stage: str, make_sampler: MakeSampler | None = None) -> Run:
    """Everything the loop needs, on this rank. Launch gates refuse with GateRefused.

    Rank 0 starts the rollout sampler first: a spawned worker's engine starts (tens of seconds)
    while the gates run and the model loads. Whatever then fails, a gate's refusal included,
    stops it again; so does a run that turns out to need no rollouts (finished, or its tripwire
    fired)."""
    dist_info = init_distributed()
    setup_process(cfg, dist_info)
    sampler = None
    if dist_info.is_main:
        if cfg.rollout.spawn:  # where the worker would run is checked before it starts there
            gates.check_topology(cfg, dist_info.world_size, torch.cuda.device_count())
        sampler = make_rollout_sampler(cfg, make_sampler, dist_info)
    try:
        return build(cfg, stage, dist_info, sampler)
    except BaseException:
        if sampler is not None:
            sampler.close()
        raise


def build(cfg: Config, stage: str, dist_info: Distributed, sampler: Sampler | None) -> Run:
    train_problems, held_out = load_problems(cfg.data, cfg.run.seed)
    verifier = Verifier()
    # Rows the reward functions cannot score are refused, and the user's functions are imported
    # (in their worker, on the rank that scores), before the gates.
    rewards = Rewards(cfg.reward, verifier, cfg.rollout.max_tokens, train_problems + held_out)
    if dist_info.is_main:
        rewards.start()
    Canary.check(cfg, held_out)
    tokenizer = load_tokenizer(cfg.model.path)
    check_chat_template(train_problems + held_out, tokenizer, cfg.model.path)
    gate_figures = gates.run_all(
        cfg, dist_info.world_size, dist_info.is_main, tokenizer, train_problems + held_out, verifier
    )
    if dist_info.is_main:  # only a config that passed the gates becomes the run's
        write_bytes_atomic(cfg.run_dir / "config.resolved.toml", dump(cfg))

    policy = load_trainable(cfg, dist_info, tokenizer)
    stream = PromptStream(train_problems, seed=cfg.run.seed)
    tripwire = CollapseTripwire(cfg.tripwire, cfg.rollout.max_tokens)
    state, latest = ckpt.restore(
        cfg.run_dir, policy.model, policy.optimizer, policy.scheduler, stream, tripwire, dist_info
    )
    gates.check_horizon(policy.scheduler.total_steps, cfg, state.horizon)
    prompts = [p.prompt for p in train_problems + held_out]
    gate_figures["memory"] = check_memory(cfg, dist_info, policy, tokenizer, prompts)
    sync = WeightSync(cfg, dist_info)
    banner = outputs.banner(cfg, stage, latest.path if latest else None, len(train_problems), gate_figures)
    banner["weight_sync"] = sync.describe()
    log.info("BANNER %s", json.dumps(banner, indent=1))

    if sampler is not None and (state.step >= cfg.train.steps or tripwire.fired):
        sampler.close()  # nothing left to sample
        sampler = None
    weights = sync.resume(policy.model, state.step, state.rollout_weights, latest.path if latest else None)
    scorer = rewards
    if cfg.env is not None:  # episodes of the environment, scored by it
        from ..envs.sampler import EpisodeRewards, EpisodeSampler

        scorer = EpisodeRewards()
        if sampler is not None:
            sampler = EpisodeSampler(cfg, sampler, train_problems + held_out, tokenizer)
    return Run(
        cfg=cfg,
        stage=stage,
        dist_info=dist_info,
        policy=policy,
        stream=stream,
        verifier=verifier,
        rewards=rewards,
        tripwire=tripwire,
        state=state,
        latest=latest,
        weights=weights,
        sync=sync,
        sample=StepSampler(sampler, stream, scorer, cfg, dist_info, state.in_flight, state.spares),
        canary=Canary(cfg, held_out, rewards, sampler, state.step),
        out=Outputs.open(
            cfg.run_dir,
            cfg.train.steps,
            state.step,
            state.row,
            Tracking.open(cfg, state.step, banner),
            line_every_s=cfg.log.every_s,
        )
        if dist_info.is_main
        else Outputs.silent(),
        banner=banner,
        stop=StopRequest(cfg.run.max_wall_seconds),
    )


def setup_process(cfg: Config, dist_info: Distributed) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per checkpoint save would bury the run's own
    if dist_info.device.type == "cpu" and cfg.run.cpu_threads:
        torch.set_num_threads(cfg.run.cpu_threads)
    if compile_enabled(cfg.model.compile, dist_info.device):
        log.info("torch.compile cache: %s", use_compile_cache())  # before anything compiles
    if dist_info.device.type == "cuda" and cfg.rollout.colocate:  # the worker's share stays the worker's
        torch.cuda.set_per_process_memory_fraction(1.0 - cfg.rollout.colocate_gpu_memory, dist_info.device)
    torch.manual_seed(cfg.run.seed + dist_info.rank)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)
    if dist_info.is_main:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)


def load_trainable(cfg: Config, dist_info: Distributed, tokenizer) -> Policy:
    dtype = resolve_dtype(cfg.model.dtype, dist_info.device)
    model = load_policy(
        cfg.model.path,
        dtype,
        dist_info,
        activation_checkpointing=cfg.model.activation_checkpointing,
        compiled=compile_enabled(cfg.model.compile, dist_info.device),
        lora=cfg.lora,
        seed=cfg.run.seed,
        attention=cfg.model.attention,
    )
    reference = None
    if cfg.loss.kl_coef > 0:  # with LoRA the starting model is the policy with its adapter off
        reference = (
            AdapterDisabled(model)
            if cfg.lora.on
            else load_reference(cfg.model.path, dtype, dist_info.device, cfg.model.attention)
        )
    optimizer = make_optimizer(model, cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return Policy(model, reference, optimizer, make_scheduler(optimizer, cfg), pad_id)


def make_rollout_sampler(cfg: Config, make_sampler: MakeSampler | None, dist_info: Distributed) -> Sampler:
    launch_id = secrets.token_hex(3)
    if make_sampler is not None:
        return make_sampler(cfg, launch_id)
    from ..rollout.client import RolloutService

    return RolloutService(cfg, world_size=dist_info.world_size)
