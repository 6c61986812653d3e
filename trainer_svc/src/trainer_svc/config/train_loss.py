"""[train], [loss] and [reward]: the optimizer, the policy loss and how samples are scored."""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

import msgspec

from .base import Fraction, NonNegative, NonNegativeFloat, Positive, PositiveFloat, Struct


class TrainConfig(Struct):
    """The optimizer (AdamW), its schedule, and how a step's samples are cut into micro-batches."""

    steps: Annotated[Positive, msgspec.Meta(description="optimizer steps")] = 200
    lr: Annotated[PositiveFloat, msgspec.Meta(description="AdamW learning rate, after warm-up")] = 1e-4
    warmup_steps: Annotated[
        NonNegative, msgspec.Meta(description="steps of linear warm-up from lr / warmup_steps to lr; 0: none")
    ] = 0
    schedule: Annotated[
        Literal["constant", "linear", "cosine"],
        msgspec.Meta(description="after warm-up: constant lr, or linear or cosine decay to zero at train.steps"),
    ] = "constant"
    betas: Annotated[tuple[Fraction, Fraction], msgspec.Meta(description="AdamW's (beta1, beta2)")] = (0.9, 0.99)
    weight_decay: Annotated[NonNegativeFloat, msgspec.Meta(description="AdamW's decoupled weight decay")] = 0.0
    max_grad_norm: Annotated[
        PositiveFloat, msgspec.Meta(description="gradients are clipped to this global L2 norm")
    ] = 1.0
    grad_accum: Annotated[
        Positive, msgspec.Meta(description="micro-batches per optimizer step (per rank), at least")
    ] = 1
    max_tokens_per_micro_batch: Annotated[
        Positive | None,
        msgspec.Meta(
            description=(
                "Padded tokens (sequences x the longest of them) per micro-batch, at most: a step's sequences, "
                "sorted by length, are cut into as many micro-batches as that takes (and at least grad_accum). "
                "None: no limit beyond grad_accum. The loss does not change with the split."
            )
        ),
    ] = None
    packing: Annotated[
        Literal["auto", "on", "off"],
        msgspec.Meta(
            description=(
                "A micro-batch's sequences through the model back to back, without padding: auto packs where the "
                "attention is a varlen kernel (flash_attention_2 or 3); sdpa and eager would need a dense mask of "
                "the packed row, so there the sequences are sorted by length instead. on, off: always, never."
            )
        ),
    ] = "auto"
    updates_per_batch: Annotated[
        Positive,
        msgspec.Meta(
            description=(
                "Optimizer steps per batch of rollouts (PPO-style minibatches): the step's sequences are split "
                "into this many parts, one update each, so later parts see a policy that moved and the clipped "
                "ratio acts. 1: one update, whose ratio is exactly 1."
            )
        ),
    ] = 1


# (clip_low, clip_high) of each policy loss when the config leaves them out: DAPO's clip-higher
# for the token ratio; the GSPO paper's for the sequence ratio; for CISPO no lower bound (as
# MiniMax-M1) and the token clip's upper one.
POLICY_CLIPS = {"clip": (0.2, 0.28), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28)}


class LossConfig(Struct):
    """The GRPO loss (trainer_svc.learning.grpo): policy loss, clip range, normalisation, KL and the
    correction for the engine's numerics."""

    policy: Annotated[
        Literal["clip", "gspo", "cispo"],
        msgspec.Meta(
            description=(
                "The policy loss (trainer_svc.learning.policy_losses says which to pick when): clip (PPO's clip "
                "on each token's ratio), gspo (one length-normalised ratio per sequence), cispo (each token's "
                "ratio truncated and detached, a weight on its policy gradient)."
            )
        ),
    ] = "clip"
    clip_low: Annotated[
        Fraction | None,
        msgspec.Meta(
            description=(
                "The ratio is clipped below 1 - clip_low and above 1 + clip_high; left out, the policy's own: 0.2 "
                "and 0.28 (clip), 3e-4 and 4e-4 (gspo), 1 (no lower bound) and 0.28 (cispo)."
            )
        ),
    ] = None
    clip_high: Annotated[
        NonNegativeFloat | None,
        msgspec.Meta(description="the ratio's upper clip (1 + clip_high); left out, the policy's own (see clip_low)"),
    ] = None
    denominator: Annotated[
        Literal["token", "sequence", "constant"],
        msgspec.Meta(
            description=(
                "what a token's loss is divided by: token (all the step's tokens, DAPO), sequence (its "
                "sequence's length, then the sequences, GRPO), constant (sequences x rollout.max_tokens, "
                "Dr. GRPO)"
            )
        ),
    ] = "token"
    advantage_norm: Annotated[
        Literal["std", "mean"],
        msgspec.Meta(description="std: (r - group mean) / group std (GRPO); mean: r - group mean (Dr. GRPO)"),
    ] = "std"
    kl_coef: Annotated[
        NonNegativeFloat, msgspec.Meta(description="k3 KL to the starting model; 0 keeps no reference model")
    ] = 0.0
    dead_group_retries: Annotated[
        NonNegative, msgspec.Meta(description="resamples of all-equal-reward groups per step")
    ] = 1
    correction: Annotated[
        Literal["none", "tis", "icepop", "token_mask", "sequence_mask"],
        msgspec.Meta(
            description=(
                "Correction for the engine sampling with other numerics or older weights than the trainer's old "
                "policy (trainer_svc.learning.corrections): none; tis (weight min(ratio, correction_cap)); icepop "
                "(weight ratio inside [correction_low, correction_high], tokens outside dropped); token_mask "
                "(tokens outside the band dropped, weight 1 inside); sequence_mask (sequences whose "
                "geometric-mean ratio is outside the band dropped). ratio = p_old / q_engine. The band's defaults "
                "are IcePop's."
            )
        ),
    ] = "none"
    correction_cap: Annotated[PositiveFloat, msgspec.Meta(description="tis: the importance weight's cap")] = 2.0
    correction_low: Annotated[
        PositiveFloat, msgspec.Meta(description="icepop, token_mask, sequence_mask: the band's lower end (below 1)")
    ] = 0.5
    correction_high: Annotated[
        PositiveFloat, msgspec.Meta(description="icepop, token_mask, sequence_mask: the band's upper end (above 1)")
    ] = 5.0

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

    functions: Annotated[
        list[str],
        msgspec.Meta(description='Built-in names (correct, format, overlong) or a user\'s "package.module:function".'),
    ] = msgspec.field(default_factory=lambda: list(BUILTIN_REWARDS))
    weights: Annotated[
        list[float],
        msgspec.Meta(
            description=(
                "One per function: total = sum(weight * value). The default is the reward before reward functions "
                "existed: correct answers 1, the format penalty off, the overlong one on (off while "
                "overlong_buffer = 0)."
            )
        ),
    ] = msgspec.field(default_factory=lambda: [1.0, 0.0, 1.0])
    overlong_buffer: Annotated[
        NonNegative, msgspec.Meta(description="DAPO soft overlong penalty width in tokens; 0: off")
    ] = 0
    timeout_s: Annotated[
        PositiveFloat, msgspec.Meta(description="longest one call of a user's function may take; past it the run stops")
    ] = 30.0
    shuffle_control: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "A control experiment, off in real runs: each step's rewards are permuted across its samples, so "
                'updates happen with no reward signal. A run that still "learns" so is learning from something '
                "other than the reward."
            )
        ),
    ] = False

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
