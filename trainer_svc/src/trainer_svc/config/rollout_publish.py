"""[rollout] and [publish]: how samples are asked for, and how weights reach the workers."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .base import NonNegative, NonNegativeFloat, Positive, PositiveFloat, Struct


class RolloutConfig(Struct):
    """Sampling through the spool: how many samples a step asks for, from which workers, and how long it waits."""

    spool: Annotated[str, msgspec.Meta(description="spool directory; default <run.dir>/spool")] = ""
    spawn: Annotated[
        bool,
        msgspec.Meta(description="start a worker from the rollout venv; false: use workers already serving the spool"),
    ] = True
    rollout_venv: Annotated[str, msgspec.Meta(description="where `rollout-svc` is, when spawning")] = ".venvs/rollout"
    worker_args: Annotated[
        list[str], msgspec.Meta(description="extra `rollout-svc serve` arguments, when spawning")
    ] = []
    prompts_per_step: Annotated[
        Positive,
        msgspec.Meta(description="prompts trained on per optimizer step (each sampled samples_per_prompt times)"),
    ] = 16
    samples_per_prompt: Annotated[
        Annotated[int, msgspec.Meta(ge=2)], msgspec.Meta(description="G: a group needs two to compare")
    ] = 8
    max_tokens: Annotated[Positive, msgspec.Meta(description="completion tokens per sample, at most")] = 4
    temperature: Annotated[PositiveFloat, msgspec.Meta(description="sampling temperature")] = 1.0
    top_p: Annotated[
        Annotated[float, msgspec.Meta(gt=0, le=1)],
        msgspec.Meta(
            description="nucleus sampling: the smallest set of tokens whose probability reaches top_p; 1: all"
        ),
    ] = 1.0
    ahead: Annotated[
        NonNegative,
        msgspec.Meta(
            description=(
                "Steps whose requests stay in flight while the current step trains, each sampled from the newest "
                "published weights when sent (so up to `ahead` steps stale); 0: synchronous."
            )
        ),
    ] = 0
    max_policy_lag: Annotated[
        NonNegative,
        msgspec.Meta(
            description=(
                "Steps rollouts may lag the trainer: a result older than this is dropped, counted and asked for "
                "again. Must allow ahead + publish.every - 1 (the launch gate checks)."
            )
        ),
    ] = 0
    fan_out: Annotated[
        NonNegative,
        msgspec.Meta(description="requests per sampling call; 0: one per live worker (at most one per prompt)"),
    ] = 0
    spare_prompts: Annotated[
        NonNegative,
        msgspec.Meta(
            description=(
                "Prompts sampled beside a step's own in its first sampling: a dead group (all rewards equal) is "
                "replaced by a live spare group at once, instead of by a retry the step must wait for. Spares "
                "left over are not trained on."
            )
        ),
    ] = 0
    spare_prompts_max: Annotated[
        NonNegative,
        msgspec.Meta(
            description=(
                "0: spare_prompts spares on every step. Above 0: as many spares as the dead rate measured over "
                "the last steps asks for (so that a retry is needed on about 1 step in 20), between spare_prompts "
                "and this (trainer_svc.rollout.spares)."
            )
        ),
    ] = 0
    timeout_s: Annotated[PositiveFloat, msgspec.Meta(description="longest wait for one sampling call's results")] = (
        600.0
    )
    error_retries: Annotated[
        Annotated[int, msgspec.Meta(ge=0, le=100)],
        msgspec.Meta(
            description=(
                "A request that fails for a reason of the moment (engine_error: the engine crashed, ran out of "
                "memory or lost its process) is sent again under a fresh id, asking the same, at most this many "
                "times per request and launch; 0: the first such error stops the run (exit 69)."
            )
        ),
    ] = 3
    no_worker_grace_s: Annotated[
        PositiveFloat, msgspec.Meta(description="how long no live worker is tolerated (engine start included)")
    ] = 120.0
    colocate: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "One GPU for both: the spawned worker shares training rank 0's GPU and takes at most "
                "colocate_gpu_memory of it; the trainer is capped at the rest, so both always fit and the worker "
                "generates the next steps (rollout.ahead) while the trainer trains."
            )
        ),
    ] = False
    colocate_gpu_memory: Annotated[
        Annotated[float, msgspec.Meta(gt=0, lt=1)],
        msgspec.Meta(
            description=(
                "with colocate: the fraction of the GPU's memory the worker takes; the trainer is capped at the rest"
            )
        ),
    ] = 0.3
    colocate_sleep_s: Annotated[
        NonNegativeFloat,
        msgspec.Meta(
            description=(
                "Seconds without a request after which the colocated worker sleeps (its weights and KV cache "
                "freed, for other processes on the GPU: the trainer stays capped) until the next request wakes "
                "it; 0: it never sleeps. A sleep costs a wake on the next request."
            )
        ),
    ] = 0.0

    def __post_init__(self) -> None:
        if self.spare_prompts_max and self.spare_prompts_max < self.spare_prompts:
            raise ValueError(
                f"rollout.spare_prompts_max = {self.spare_prompts_max} is below rollout.spare_prompts = "
                f"{self.spare_prompts}: the spares are sized between the two; raise spare_prompts_max, or set it "
                "to 0 for a fixed spare_prompts"
            )


class PublishConfig(Struct):
    """Published weights: what rollout workers load. Publishing them is the weight sync."""

    every: Annotated[
        Positive,
        msgspec.Meta(description="optimizer steps between publishes: rollouts lag the trainer by up to every - 1"),
    ] = 1
    dir: Annotated[
        str, msgspec.Meta(description="where they go; default <run.dir>/weights. A tmpfs or local NVMe root is fastest")
    ] = ""
    keep_last: Annotated[
        Positive, msgspec.Meta(description="newest kept; older ones too while a pending or claimed request names them")
    ] = 3
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16"],
        msgspec.Meta(description="serving dtype; auto: bfloat16 on GPU, else the model's"),
    ] = "auto"
    delta: Annotated[
        Literal["auto", "on", "off"],
        msgspec.Meta(
            description=(
                "Sparse deltas (trainer_svc.weights.deltas): a publish holds only the elements that changed since "
                "the previous one when that is under half the bytes. auto: on over a network filesystem."
            )
        ),
    ] = "auto"
    delta_anchor_every: Annotated[
        Positive, msgspec.Meta(description="a full publish at least every this many, so a chain stays short")
    ] = 8
    slots: Annotated[
        Literal["auto", "on", "off"],
        msgspec.Meta(
            description=(
                "The same-host fast path: a ring of shared-memory slots the worker copies straight into its "
                "engine (weights/slots.py). auto: on where the worker is spawned on this host and slots_dir has "
                "room."
            )
        ),
    ] = "auto"
    slots_dir: Annotated[
        str, msgspec.Meta(description="a tmpfs the trainer and its workers share; the ring is <slots_dir>/<run>-<hash>")
    ] = "/dev/shm"
    slots_count: Annotated[
        Annotated[int, msgspec.Meta(ge=2)],
        msgspec.Meta(description="slots in the ring, each the weights' size in memory"),
    ] = 2
    slots_wait_s: Annotated[
        NonNegativeFloat, msgspec.Meta(description="wait for a free slot this long, then publish a directory instead")
    ] = 10.0
    dir_every: Annotated[
        NonNegative,
        msgspec.Meta(
            description="with slots: also a directory (the portable form) every N steps; 0: the last step only"
        ),
    ] = 0
