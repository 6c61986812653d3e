"""[run], [model], [data] and [sft]: what is trained, on what, and where the run lives."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .base import Fraction, NonNegative, NonNegativeFloat, Positive, PositiveFloat, Struct


class RunConfig(Struct):
    """The run: its directory (which a relaunch resumes from), its seed and its limits."""

    dir: Annotated[
        str, msgspec.Meta(description="run directory: checkpoints, metrics, results; relaunching with it resumes")
    ]
    seed: Annotated[
        int,
        msgspec.Meta(
            description=(
                "the run's seed: the held-out split, prompt order, sampling seeds and the shuffle control "
                "derive from it"
            )
        ),
    ] = 0
    deterministic: Annotated[
        bool, msgspec.Meta(description="torch deterministic algorithms (CPU): resumed runs repeat exactly")
    ] = False
    max_wall_seconds: Annotated[
        NonNegativeFloat, msgspec.Meta(description="stop (resumable) at the first step boundary past this; 0: none")
    ] = 0.0
    cpu_threads: Annotated[
        NonNegative,
        msgspec.Meta(
            description=(
                "torch threads per rank on CPU; 0: torch's default. On a small machine shared with a rollout "
                "worker, more threads than cores is many times slower."
            )
        ),
    ] = 1


class ModelConfig(Struct):
    """The policy model trained, and how it runs in the trainer."""

    path: Annotated[
        str, msgspec.Meta(description="HF-format causal LM directory (config.json, safetensors, tokenizer)")
    ]
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16"], msgspec.Meta(description="auto: float32 on CPU, bfloat16 on GPU")
    ] = "auto"
    activation_checkpointing: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "recompute each decoder layer's activations in the backward pass: a token then costs one "
                "layer's activations in memory, not all, for more compute"
            )
        ),
    ] = False
    compile: Annotated[
        Literal["auto", "on", "off"],
        msgspec.Meta(
            description=(
                "torch.compile of each decoder layer and of the log-prob math, which fuses their elementwise "
                'kernels (norms, rotary, SwiGLU, the float32 softmax over the vocabulary). "auto": on a GPU only; '
                "the first steps pay the compilation (tens of seconds)."
            )
        ),
    ] = "auto"
    attention: Annotated[
        Literal["sdpa", "eager", "varlen"],
        msgspec.Meta(
            description=(
                "The trainer's attention. sdpa: torch's scaled_dot_product_attention over padded micro-batches "
                "(sorted by length). varlen: micro-batches packed without padding, each sequence attending to "
                "itself alone through torch's varlen kernel on a GPU (torch >= 2.10; no flash-attn package), "
                "a sequence at a time on a CPU; train.packing = auto then packs. eager: transformers' own."
            )
        ),
    ] = "sdpa"


class DataConfig(Struct):
    """The prompts trained on: the built-in arithmetic task or a file of rows (trainer_svc.data)."""

    task: Annotated[
        Literal["arithmetic", "file"],
        msgspec.Meta(
            description="arithmetic: generated equations a{op}b= (the arithmetic_* keys); file: prompts from data.path"
        ),
    ] = "arithmetic"
    path: Annotated[
        str,
        msgspec.Meta(
            description='task "file": a JSONL or Parquet file of rows (protocol/rows.py says which field is what)'
        ),
    ] = ""
    prompt_field: Annotated[
        str,
        msgspec.Meta(
            description=(
                'The prompt\'s field; "": the first of prompt, messages, question. Text, or a conversation (a list '
                "of {role, content}) rendered with the model's chat template by the worker."
            )
        ),
    ] = ""
    answer_field: Annotated[
        str,
        msgspec.Meta(description='the gold answer\'s field; "": the first of gold, answer, solution (none: no golds)'),
    ] = ""
    template: Annotated[
        str,
        msgspec.Meta(
            description='text prompts built from the row\'s fields, e.g. "{question}\\nAnswer:"; "": as written'
        ),
    ] = ""
    system_prompt: Annotated[
        str, msgspec.Meta(description="a system turn added to each conversation that has none")
    ] = ""
    chat: Annotated[
        bool,
        msgspec.Meta(description="text prompts sent as a conversation of one user turn (chat template, system prompt)"),
    ] = False
    arithmetic_low: Annotated[
        NonNegative, msgspec.Meta(description="smallest operand of the arithmetic task's equations")
    ] = 0
    arithmetic_high: Annotated[
        NonNegative,
        msgspec.Meta(
            description="largest operand of the arithmetic task's equations (every pair in [low, high] is a problem)"
        ),
    ] = 20
    arithmetic_ops: Annotated[
        str, msgspec.Meta(description='the arithmetic task\'s operations, distinct characters of "+-*"')
    ] = "+"
    held_out: Annotated[NonNegative, msgspec.Meta(description="problems kept out of training, for the canary")] = 32
    band_file: Annotated[
        str, msgspec.Meta(description="train on the prompts of a band file from `trainer-svc band` instead")
    ] = ""

    def __post_init__(self) -> None:
        if self.task == "file" and not self.path:
            raise ValueError("data.path must name a JSONL or Parquet file when data.task = 'file'")
        if self.task == "arithmetic" and (self.chat or self.system_prompt):
            raise ValueError(
                "data.chat and data.system_prompt apply to prompt files (data.task = 'file'); the arithmetic task's "
                "prompts are bare equations for a base model"
            )
        if self.arithmetic_high < self.arithmetic_low:
            raise ValueError("data.arithmetic_high must be >= data.arithmetic_low")
        if (
            not self.arithmetic_ops
            or len(set(self.arithmetic_ops)) != len(self.arithmetic_ops)
            or not set(self.arithmetic_ops) <= set("+-*")
        ):
            raise ValueError(f"data.arithmetic_ops must be distinct characters of '+-*', got {self.arithmetic_ops!r}")


class SftConfig(Struct):
    """The supervised warm-up `trainer-svc sft` runs before GRPO; it writes model.path."""

    base: Annotated[str, msgspec.Meta(description="the model to start from")]
    problems: Annotated[
        Positive, msgspec.Meta(description="training problems it sees (the rest are left for GRPO to learn)")
    ] = 200
    steps: Annotated[Positive, msgspec.Meta(description="at most")] = 1000
    batch_size: Annotated[Positive, msgspec.Meta(description="problems per optimizer step")] = 32
    lr: Annotated[PositiveFloat, msgspec.Meta(description="AdamW learning rate")] = 3e-4
    stop_at_accuracy: Annotated[
        Fraction, msgspec.Meta(description="stop once sampled accuracy reaches this: GRPO does the rest")
    ] = 0.3
    eval_every: Annotated[Positive, msgspec.Meta(description="steps between measurements of sampled accuracy")] = 25
    eval_problems: Annotated[Positive, msgspec.Meta(description="training problems sampled to measure accuracy")] = 128
