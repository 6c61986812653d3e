"""[lora] and [env]: training an adapter, and multi-turn episodes with an environment of yours."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from .base import NonNegative, Positive, PositiveFloat, Struct

# The linear projections of a Llama, Qwen or Mistral decoder layer (attention and MLP).
DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Modules a served adapter may not change: the rollout engine (vLLM) applies LoRA to linear layers
# of the decoder; an adapter of these would train a model no worker serves.
UNSERVED_LORA_MODULES = ("lm_head", "embed_tokens")


class LoraConfig(Struct):
    """LoRA (learning/lora.py): train a PEFT adapter on the frozen base model; a publish is the
    adapter alone, which workers serve on the base they hold (rollout-svc serve --max-lora-rank)."""

    rank: Annotated[NonNegative, msgspec.Meta(description="LoRA rank r; 0: off (the whole model trains)")] = 0
    alpha: Annotated[PositiveFloat, msgspec.Meta(description="the update is scaled by alpha / rank")] = 16.0
    dropout: Annotated[
        Annotated[float, msgspec.Meta(ge=0, lt=1)], msgspec.Meta(description="on the adapter's input, in training only")
    ] = 0.0
    target_modules: Annotated[
        list[str], msgspec.Meta(description="The modules the adapter changes, by the last part of their names.")
    ] = msgspec.field(default_factory=lambda: list(DECODER_PROJECTIONS))

    def __post_init__(self) -> None:
        if self.rank and not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the modules the adapter changes, e.g. q_proj, v_proj")
        unserved = [name for name in self.target_modules if name in UNSERVED_LORA_MODULES]
        if self.rank and unserved:
            raise ValueError(
                f"lora.target_modules names {unserved}: the rollout engine serves adapters of the decoder's linear "
                f"layers only, so an adapter of these could not be sampled from; leave them out (the default is "
                f"{list(DECODER_PROJECTIONS)})"
            )

    @property
    def on(self) -> bool:
        return self.rank > 0


USER_CLASS = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")  # "package.module:Class"


class EnvConfig(Struct):
    """Multi-turn episodes (trainer_svc.envs): an environment class of yours, one instance per
    episode, talks with the policy turn by turn; its reward is the sample's. Left out: one turn,
    scored by [reward]."""

    class_: Annotated[str, msgspec.Meta(description='"package.module:Class", importable from PYTHONPATH')] = (
        msgspec.field(name="class")
    )
    max_turns: Annotated[
        Positive, msgspec.Meta(description="assistant turns per episode, at most (tool calls count as turns)")
    ] = 4
    max_episode_tokens: Annotated[
        Positive,
        msgspec.Meta(
            description=(
                "Tokens of a whole episode (first prompt, every assistant and environment turn), at most: an "
                "episode whose next environment turn would pass it ends before that turn."
            )
        ),
    ] = 1024
    timeout_s: Annotated[
        PositiveFloat,
        msgspec.Meta(description="longest one call of the environment (its creation, a step, a tool) may take"),
    ] = 30.0
    concurrency: Annotated[
        Positive,
        msgspec.Meta(description="environment worker processes (each holds many episodes, one call at a time)"),
    ] = 2
    memory_mb: Annotated[
        NonNegative, msgspec.Meta(description="address-space limit of each environment process (RLIMIT_AS); 0: none")
    ] = 0
    drift: Annotated[
        Literal["end", "refuse"],
        msgspec.Meta(
            description=(
                "When the chat template renders the conversation so far differently from the ids the engine saw "
                '(Qwen3-style templates drop earlier reasoning): "end" ends the episode there (its sample is the '
                'ids the engine saw, counted in env_drift_ends); "refuse" stops the run (exit 2).'
            )
        ),
    ] = "end"

    def __post_init__(self) -> None:
        if not USER_CLASS.fullmatch(self.class_):
            raise ValueError(
                f'env.class = {self.class_!r} does not name a class: write it "package.module:Class", the module '
                "importable from PYTHONPATH"
            )
