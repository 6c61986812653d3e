"""The whole config: one field per section, and the checks that span sections."""

from __future__ import annotations

from pathlib import Path

import msgspec

from .base import Struct
from .extensions import EnvConfig, LoraConfig
from .model_data import DataConfig, ModelConfig, RunConfig, SftConfig
from .rails_log import BandConfig, CanaryConfig, CheckpointConfig, LogConfig, TripwireConfig
from .rollout_publish import PublishConfig, RolloutConfig
from .train_loss import LossConfig, RewardConfig, TrainConfig


class Config(Struct):
    run: RunConfig
    model: ModelConfig
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    publish: PublishConfig = msgspec.field(default_factory=PublishConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    canary: CanaryConfig = msgspec.field(default_factory=CanaryConfig)
    tripwire: TripwireConfig = msgspec.field(default_factory=TripwireConfig)
    band: BandConfig = msgspec.field(default_factory=BandConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    sft: SftConfig | None = None
    env: EnvConfig | None = None  # multi-turn episodes; None: single-turn sampling

    def __post_init__(self) -> None:
        if self.lora.on:
            for key in ("slots", "delta"):
                if getattr(self.publish, key) == "on":
                    raise ValueError(
                        f'publish.{key} = "on" with lora.rank = {self.lora.rank}: a LoRA publish is the adapter '
                        f"alone (megabytes), its directory is the weight sync; {key} apply to whole weights. Set "
                        f'publish.{key} to "auto" or "off"'
                    )

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)

    @property
    def publish_dir(self) -> Path:
        return Path(self.publish.dir) if self.publish.dir else self.run_dir / "weights"

    @property
    def spool_dir(self) -> Path:
        return Path(self.rollout.spool) if self.rollout.spool else self.run_dir / "spool"
