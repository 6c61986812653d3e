"""[rollout] and [publish]: how samples are asked for, and how weights reach the workers."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .base import NonNegative, NonNegativeFloat, Positive, PositiveFloat, Struct


class RolloutConfig(Struct):
    spool: str = ""  # spool directory; default <run.dir>/spool
    spawn: bool = True  # start a worker from the rollout venv; false: use workers already serving the spool
    rollout_venv: str = ".venvs/rollout"  # where `rollout-svc` is, when spawning
    worker_args: list[str] = []  # extra `rollout-svc serve` arguments, when spawning
    prompts_per_step: Positive = 16
    samples_per_prompt: Annotated[int, msgspec.Meta(ge=2)] = 8  # G: a group needs two to compare
    max_tokens: Positive = 4
    temperature: PositiveFloat = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    # Steps whose requests stay in flight while the current step trains, each sampled from the
    # newest published weights when sent (so up to `ahead` steps stale); 0: synchronous.
    ahead: NonNegative = 0
    # Steps rollouts may lag the trainer: a result older than this is dropped, counted and asked
    # for again. Must allow ahead + publish.every - 1 (the launch gate checks).
    max_policy_lag: NonNegative = 0
    fan_out: NonNegative = 0  # requests per sampling call; 0: one per live worker (at most one per prompt)
    # Prompts sampled beside a step's own in its first sampling: a dead group (all rewards equal)
    # is replaced by a live spare group at once, instead of by a retry the step must wait for.
    # Spares left over are not trained on.
    spare_prompts: NonNegative = 0
    # 0: spare_prompts spares on every step. Above 0: as many spares as the dead rate measured over
    # the last steps asks for (so that a retry is needed on about 1 step in 20), between
    # spare_prompts and this (trainer_svc.rollout.spares).
    spare_prompts_max: NonNegative = 0
    timeout_s: PositiveFloat = 600.0  # longest wait for one sampling call's results
    # A request that fails for a reason of the moment (engine_error: the engine crashed, ran out
    # of memory or lost its process) is sent again under a fresh id, asking the same, at most this
    # many times per request and launch; 0: the first such error stops the run (exit 69).
    error_retries: Annotated[int, msgspec.Meta(ge=0, le=100)] = 3
    no_worker_grace_s: PositiveFloat = 120.0  # how long no live worker is tolerated (engine start included)
    # One GPU for both: the spawned worker shares training rank 0's GPU and takes at most
    # colocate_gpu_memory of it; the trainer is capped at the rest, so both always fit and the
    # worker generates the next steps (rollout.ahead) while the trainer trains.
    colocate: bool = False
    colocate_gpu_memory: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.3
    # Seconds without a request after which the colocated worker sleeps (its weights and KV cache
    # freed, for other processes on the GPU: the trainer stays capped) until the next request
    # wakes it; 0: it never sleeps. A sleep costs a wake on the next request.
    colocate_sleep_s: NonNegativeFloat = 0.0

    def __post_init__(self) -> None:
        if self.spare_prompts_max and self.spare_prompts_max < self.spare_prompts:
            raise ValueError(
                f"rollout.spare_prompts_max = {self.spare_prompts_max} is below rollout.spare_prompts = "
                f"{self.spare_prompts}: the spares are sized between the two; raise spare_prompts_max, or set it "
                "to 0 for a fixed spare_prompts"
            )


class PublishConfig(Struct):
    """Published weights: what rollout workers load. Publishing them is the weight sync."""

    every: Positive = 1  # optimizer steps between publishes: rollouts lag the trainer by up to every - 1
    dir: str = ""  # where they go; default <run.dir>/weights. A tmpfs or local NVMe root is fastest
    keep_last: Positive = 3  # newest kept; older ones too while a pending or claimed request names them
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # serving dtype; auto: bfloat16 on GPU, else the model's
    # Sparse deltas (trainer_svc.weights.deltas): a publish holds only the elements that changed since
    # the previous one when that is under half the bytes. auto: on over a network filesystem.
    delta: Literal["auto", "on", "off"] = "auto"
    delta_anchor_every: Positive = 8  # a full publish at least every this many, so a chain stays short
    # The same-host fast path: a ring of shared-memory slots the worker copies straight into its
    # engine (weights/slots.py). auto: on where the worker is spawned on this host and slots_dir has room.
    slots: Literal["auto", "on", "off"] = "auto"
    slots_dir: str = "/dev/shm"  # a tmpfs the trainer and its workers share; the ring is <slots_dir>/<run>-<hash>
    slots_count: Annotated[int, msgspec.Meta(ge=2)] = 2  # slots in the ring, each the weights' size in memory
    slots_wait_s: NonNegativeFloat = 10.0  # wait for a free slot this long, then publish a directory instead
    dir_every: NonNegative = 0  # with slots: also a directory (the portable form) every N steps; 0: the last step only
