"""[checkpoint], [canary], [tripwire], [band] and [log]: what keeps a run safe, resumable and followed."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .base import Fraction, NonNegative, NonNegativeFloat, Positive, PositiveFloat, Struct


class CheckpointConfig(Struct):
    """Resume checkpoints: weights, optimizer, RNG, scheduler, data cursor, tripwire. Also written at
    every stop, at the end, and when the tripwire fires."""

    every: Annotated[Positive, msgspec.Meta(description="optimizer steps between checkpoints")] = 50
    keep_last: Annotated[Positive, msgspec.Meta(description="newest checkpoints kept; older ones are deleted")] = 3


class CanaryConfig(Struct):
    """Greedy answers to held-out problems through the spool, every `every` steps."""

    every: Annotated[NonNegative, msgspec.Meta(description="0: no canary")] = 0
    problems: Annotated[Positive, msgspec.Meta(description="taken from the held-out problems")] = 32


class BandConfig(Struct):
    """`trainer-svc band`: keep prompts the starting model solves sometimes, not never or always."""

    samples: Annotated[
        Annotated[int, msgspec.Meta(ge=2)], msgspec.Meta(description="completions per candidate prompt")
    ] = 16
    low: Annotated[Fraction, msgspec.Meta(description="keep prompts whose pass rate is >= low...")] = 0.1
    high: Annotated[Fraction, msgspec.Meta(description="...and <= high")] = 0.9
    candidates: Annotated[NonNegative, msgspec.Meta(description="training problems to try; 0: all")] = 0
    out: Annotated[str, msgspec.Meta(description="band file; default <run.dir>/band.jsonl")] = ""

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError("band.low must be <= band.high")


class TripwireConfig(Struct):
    """The collapse tripwire's signals (rails.tripwire)."""

    armed: Annotated[bool, msgspec.Meta(description="false: judge and report (would_fire) but never stop the run")] = (
        True
    )
    window: Annotated[
        Annotated[int, msgspec.Meta(ge=2)], msgspec.Meta(description="steps averaged per judgement; one step is noise")
    ] = 20
    min_entropy: Annotated[
        NonNegativeFloat, msgspec.Meta(description="nats per token; fires below it. 0 switches this signal off")
    ] = 0.02
    max_reward_drop: Annotated[
        PositiveFloat,
        msgspec.Meta(
            description=(
                "in reward units; fires when the window mean is more than this below the best window mean. Must "
                "be > 0: at 0 any dip of a noisy reward below its best would stop the run."
            )
        ),
    ] = 0.3
    min_response_length: Annotated[
        NonNegativeFloat, msgspec.Meta(description="tokens; fires below it. 0 switches this signal off")
    ] = 0.5
    max_length_fraction: Annotated[
        Annotated[float, msgspec.Meta(gt=0, le=1)],
        msgspec.Meta(
            description=(
                "of rollout.max_tokens; fires when the mean length reaches it. Must be > 0: at 0 every run fires."
            )
        ),
    ] = 0.98


class LogConfig(Struct):
    """Where each step's metrics row, the banner and the resolved config go beside metrics.jsonl,
    which stays the record and is written first (trainer_svc.run.trackers). A backend that fails is
    turned off with one warning; the run goes on. On a terminal a progress bar shows the steps;
    where stderr is a file, a line per step (`every_s`)."""

    every_s: Annotated[
        NonNegativeFloat,
        msgspec.Meta(
            description=(
                "where stderr is not a terminal (nohup, systemd, a scheduler's log), the fewest seconds between "
                "two step lines in the log (step, reward, accuracy, seconds, generated tokens per second, the "
                "longest phase); the first and last steps and each canary step are always logged. 0: every step"
            )
        ),
    ] = 10.0

    tensorboard: Annotated[
        bool, msgspec.Meta(description="event files under <run.dir>/tensorboard (extra trainer_svc[tensorboard])")
    ] = True
    wandb: Annotated[bool, msgspec.Meta(description="Weights & Biases (extra trainer_svc[wandb])")] = False
    wandb_project: Annotated[str, msgspec.Meta(description="the W&B project runs are logged to")] = "trainer-svc"
    wandb_entity: Annotated[str, msgspec.Meta(description='"": the account\'s default entity')] = ""
    wandb_mode: Annotated[
        Literal["auto", "online", "offline"],
        msgspec.Meta(
            description=(
                "auto: WANDB_MODE where set; else online where an API key is known and the server answers, "
                "offline otherwise (the run is kept under <run.dir>/wandb; `wandb sync` uploads it later)."
            )
        ),
    ] = "auto"
    mlflow: Annotated[bool, msgspec.Meta(description="MLflow (extra trainer_svc[mlflow])")] = False
    mlflow_tracking_uri: Annotated[
        str, msgspec.Meta(description='"": MLFLOW_TRACKING_URI where set, else a file store in <run.dir>/mlruns.')
    ] = ""
    mlflow_experiment: Annotated[str, msgspec.Meta(description="the MLflow experiment runs are logged to")] = (
        "trainer-svc"
    )
    run_name: Annotated[
        str, msgspec.Meta(description="the run's name in W&B and MLflow; \"\": the run directory's name")
    ] = ""
    queue: Annotated[
        Positive,
        msgspec.Meta(
            description=(
                "Rows a backend may fall behind (a slow server) before further rows to it are dropped, counted "
                "and warned of: the training loop never waits on a backend."
            )
        ),
    ] = 1000
    close_timeout_s: Annotated[
        NonNegativeFloat, msgspec.Meta(description="longest wait at the end for a backend to send what it holds")
    ] = 60.0
