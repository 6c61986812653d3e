"""The run's configuration: TOML decoded into typed structs, checked at load.

Importable without torch, so `trainer-svc --help` and config errors are instant. Unknown keys,
wrong types and out-of-range values are refused with the key's path and the reason
(`Expected int >= 1 - at $.train.steps`). Validators check; they never fill in values. The
resolved config (defaults included) is written into the run directory.

One module per group of sections; this package's names are the ones the rest of the code imports.
"""

from .base import Fraction, NonNegative, NonNegativeFloat, Positive, PositiveFloat, Struct
from .extensions import DECODER_PROJECTIONS, UNSERVED_LORA_MODULES, USER_CLASS, EnvConfig, LoraConfig
from .loading import ConfigError, dump, load, smoke_shape
from .model_data import DataConfig, ModelConfig, RunConfig, SftConfig
from .rails_log import BandConfig, CanaryConfig, CheckpointConfig, LogConfig, TripwireConfig
from .rollout_publish import PublishConfig, RolloutConfig
from .root import Config
from .train_loss import (
    BUILTIN_REWARDS,
    POLICY_CLIPS,
    RETIRED_REWARD_KEYS,
    USER_REWARD,
    LossConfig,
    RewardConfig,
    TrainConfig,
)

__all__ = [
    "BUILTIN_REWARDS",
    "DECODER_PROJECTIONS",
    "POLICY_CLIPS",
    "RETIRED_REWARD_KEYS",
    "UNSERVED_LORA_MODULES",
    "USER_CLASS",
    "USER_REWARD",
    "BandConfig",
    "CanaryConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "Fraction",
    "LogConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "NonNegative",
    "NonNegativeFloat",
    "Positive",
    "PositiveFloat",
    "PublishConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SftConfig",
    "Struct",
    "TrainConfig",
    "TripwireConfig",
    "dump",
    "load",
    "smoke_shape",
]
