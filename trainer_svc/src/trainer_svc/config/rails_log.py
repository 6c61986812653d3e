"""[checkpoint], [canary], [tripwire], [band] and [log]: what keeps a run safe, resumable and followed."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .base import Fraction, NonNegative, NonNegativeFloat, Positive, PositiveFloat, Struct


class CheckpointConfig(Struct):
    """Resume checkpoints: weights, optimizer, RNG, scheduler, data cursor, tripwire. Also written at
    every stop, at the end, and when the tripwire fires."""

    every: Positive = 50  # optimizer steps between checkpoints
    keep_last: Positive = 3


class CanaryConfig(Struct):
    """Greedy answers to held-out problems through the spool, every `every` steps."""

    every: NonNegative = 0  # 0: no canary
    problems: Positive = 32  # taken from the held-out problems


class BandConfig(Struct):
    """`trainer-svc band`: keep prompts the starting model solves sometimes, not never or always."""

    samples: Annotated[int, msgspec.Meta(ge=2)] = 16  # completions per candidate prompt
    low: Fraction = 0.1  # keep prompts whose pass rate is >= low...
    high: Fraction = 0.9  # ...and <= high
    candidates: NonNegative = 0  # training problems to try; 0: all
    out: str = ""  # band file; default <run.dir>/band.jsonl

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError("band.low must be <= band.high")


class TripwireConfig(Struct):
    """The collapse tripwire's signals (rails.tripwire)."""

    armed: bool = True  # false: judge and report (would_fire) but never stop the run
    window: Annotated[int, msgspec.Meta(ge=2)] = 20  # steps averaged per judgement; one step is noise
    min_entropy: NonNegativeFloat = 0.02  # nats per token; fires below it. 0 switches this signal off
    # in reward units; fires when the window mean is more than this below the best window mean.
    # Must be > 0: at 0 any dip of a noisy reward below its best would stop the run.
    max_reward_drop: PositiveFloat = 0.3
    min_response_length: NonNegativeFloat = 0.5  # tokens; fires below it. 0 switches this signal off
    # of rollout.max_tokens; fires when the mean length reaches it. Must be > 0: at 0 every run fires.
    max_length_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.98


class LogConfig(Struct):
    """Where each step's metrics row, the banner and the resolved config go beside metrics.jsonl,
    which stays the record and is written first (trainer_svc.run.trackers). A backend that fails is
    turned off with one warning; the run goes on."""

    tensorboard: bool = True  # event files under <run.dir>/tensorboard (extra trainer_svc[tensorboard])
    wandb: bool = False  # Weights & Biases (extra trainer_svc[wandb])
    wandb_project: str = "trainer-svc"
    wandb_entity: str = ""  # "": the account's default entity
    # auto: WANDB_MODE where set; else online where an API key is known and the server answers,
    # offline otherwise (the run is kept under <run.dir>/wandb; `wandb sync` uploads it later).
    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    mlflow: bool = False  # MLflow (extra trainer_svc[mlflow])
    # "": MLFLOW_TRACKING_URI where set, else a file store in <run.dir>/mlruns.
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = "trainer-svc"
    run_name: str = ""  # the run's name in W&B and MLflow; "": the run directory's name
    # Rows a backend may fall behind (a slow server) before further rows to it are dropped,
    # counted and warned of: the training loop never waits on a backend.
    queue: Positive = 1000
    close_timeout_s: NonNegativeFloat = 60.0  # longest wait at the end for a backend to send what it holds
