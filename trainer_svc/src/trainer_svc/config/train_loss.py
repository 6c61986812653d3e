"""[train], [loss] and [reward]: the optimizer, the policy loss and how samples are scored."""

from __future__ import annotations

import math
import re
from typing import Literal

import msgspec

from .base import Fraction, NonNegative, NonNegativeFloat, Positive, PositiveFloat, Struct


class TrainConfig(Struct):
    steps: Positive = 200  # optimizer steps
    lr: PositiveFloat = 1e-4
    warmup_steps: NonNegative = 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    betas: tuple[Fraction, Fraction] = (0.9, 0.99)
    weight_decay: NonNegativeFloat = 0.0
    max_grad_norm: PositiveFloat = 1.0
    grad_accum: Positive = 1  # micro-batches per optimizer step (per rank), at least
    # Padded tokens (sequences x the longest of them) per micro-batch, at most: a step's sequences,
    # sorted by length, are cut into as many micro-batches as that takes (and at least grad_accum).
    # None: no limit beyond grad_accum. The loss does not change with the split.
    max_tokens_per_micro_batch: Positive | None = None
    # A micro-batch's sequences through the model back to back, without padding: auto packs where
    # the attention is a varlen kernel (flash_attention_2 or 3); sdpa and eager would need a dense
    # mask of the packed row, so there the sequences are sorted by length instead. on, off: always, never.
    packing: Literal["auto", "on", "off"] = "auto"
    # Optimizer steps per batch of rollouts (PPO-style minibatches): the step's sequences are
    # split into this many parts, one update each, so later parts see a policy that moved and
    # the clipped ratio acts. 1: one update, whose ratio is exactly 1.
    updates_per_batch: Positive = 1


# (clip_low, clip_high) of each policy loss when the config leaves them out: DAPO's clip-higher
# for the token ratio; the GSPO paper's for the sequence ratio; for CISPO no lower bound (as
# MiniMax-M1) and the token clip's upper one.
POLICY_CLIPS = {"clip": (0.2, 0.28), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28)}


class LossConfig(Struct):
    # The policy loss (trainer_svc.learning.policy_losses says which to pick when): clip (PPO's
    # clip on each token's ratio), gspo (one length-normalised ratio per sequence), cispo (each
    # token's ratio truncated and detached, a weight on its policy gradient).
    policy: Literal["clip", "gspo", "cispo"] = "clip"
    # The ratio is clipped below 1 - clip_low and above 1 + clip_high; left out, the policy's
    # own: 0.2 and 0.28 (clip), 3e-4 and 4e-4 (gspo), 1 (no lower bound) and 0.28 (cispo).
    clip_low: Fraction | None = None
    clip_high: NonNegativeFloat | None = None
    denominator: Literal["token", "sequence", "constant"] = "token"
    advantage_norm: Literal["std", "mean"] = "std"
    kl_coef: NonNegativeFloat = 0.0  # k3 KL to the starting model; 0 keeps no reference model
    dead_group_retries: NonNegative = 1  # resamples of all-equal-reward groups per step
    # Correction for the engine sampling with other numerics or older weights than the trainer's
    # old policy (trainer_svc.learning.corrections): none; tis (weight min(ratio, correction_cap)); icepop
    # (weight ratio inside [correction_low, correction_high], tokens outside dropped); token_mask
    # (tokens outside the band dropped, weight 1 inside); sequence_mask (sequences whose
    # geometric-mean ratio is outside the band dropped). ratio = p_old / q_engine. The band's
    # defaults are IcePop's.
    correction: Literal["none", "tis", "icepop", "token_mask", "sequence_mask"] = "none"
    correction_cap: PositiveFloat = 2.0
    correction_low: PositiveFloat = 0.5
    correction_high: PositiveFloat = 5.0

    def __post_init__(self) -> None:
        low, high = POLICY_CLIPS[self.policy]
        self.clip_low = low if self.clip_low is None else self.clip_low
        self.clip_high = high if self.clip_high is None else self.clip_high
        if not self.correction_low < 1 < self.correction_high:
            raise ValueError(
                f"loss.correction_low = {self.correction_low} and loss.correction_high = {self.correction_high} must "
                "bracket 1 (low < 1 < high): a band without ratio 1 would mask the tokens engine and trainer agree on"
            )
        if self.correction_cap < 1:
            raise ValueError(
                f"loss.correction_cap = {self.correction_cap} is below 1: it would shrink the weight of tokens "
                "engine and trainer agree on; use a cap >= 1 (2 is common)"
            )


BUILTIN_REWARDS = ("correct", "format", "overlong")  # trainer_svc.learning.reward_functions.BUILTINS
# A user's reward function: "package.module:function", importable from PYTHONPATH.
USER_REWARD = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
# The keys [reward] had before reward functions, and what replaced them.
RETIRED_REWARD_KEYS = {"correct": "correct", "format_weight": "format", "overlong_weight": "overlong"}


class RewardConfig(Struct):
    """How a sample is scored (trainer_svc.learning.reward_functions): the weighted sum of reward functions,
    each called on a sampling call's completions. The default is the verifier's 0/1 correctness,
    plus the format and overlong penalties, which only ever subtract."""

    # Built-in names (correct, format, overlong) or a user's "package.module:function".
    functions: list[str] = msgspec.field(default_factory=lambda: list(BUILTIN_REWARDS))
    # One per function: total = sum(weight * value). The default is the reward before reward
    # functions existed: correct answers 1, the format penalty off, the overlong one on (off while
    # overlong_buffer = 0).
    weights: list[float] = msgspec.field(default_factory=lambda: [1.0, 0.0, 1.0])
    overlong_buffer: NonNegative = 0  # DAPO soft overlong penalty width in tokens; 0: off
    timeout_s: PositiveFloat = 30.0  # longest one call of a user's function may take; past it the run stops
    # A control experiment, off in real runs: each step's rewards are permuted across its
    # samples, so updates happen with no reward signal. A run that still "learns" so is
    # learning from something other than the reward.
    shuffle_control: bool = False

    def __post_init__(self) -> None:
        # Decoding checks types; code that builds a RewardConfig gets the same refusals.
        if not self.functions:
            raise ValueError('reward.functions is empty: name at least one reward function (default: "correct")')
        if len(self.weights) != len(self.functions):
            raise ValueError(
                f"reward.weights has {len(self.weights)} value{'s' * (len(self.weights) != 1)} for "
                f"{len(self.functions)} reward.functions "
                f"{self.functions}: give one weight per function, in the same order"
            )
        for index, (name, weight) in enumerate(zip(self.functions, self.weights, strict=True)):
            if name not in BUILTIN_REWARDS and not USER_REWARD.fullmatch(name):
                raise ValueError(
                    f"reward.functions[{index}] = {name!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor "
                    'a function of yours written "package.module:function"'
                )
            if not math.isfinite(weight):
                raise ValueError(f"reward.weights[{index}] (for {name!r}) = {weight} is not a finite number")
            # The built-ins' values are 0/1 (correct) and penalties in [-1, 0] (format, overlong): a
            # negative weight would reward wrong answers, bad form or running long.
            if name in BUILTIN_REWARDS and weight < 0:
                raise ValueError(
                    f"reward.weights[{index}] = {weight} for the built-in {name!r} is negative: {name} "
                    + ("is 1 for a correct answer" if name == "correct" else "is a penalty, in [-1, 0]")
                    + ", so a negative weight would reward what it punishes; use a weight >= 0 (0: logged only)"
                )
        if len(set(self.functions)) != len(self.functions):
            raise ValueError(f"reward.functions {self.functions} names a function twice; name each once")
