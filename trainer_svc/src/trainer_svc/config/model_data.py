"""[run], [model], [data] and [sft]: what is trained, on what, and where the run lives."""

from __future__ import annotations

from typing import Literal

from .base import Fraction, NonNegative, NonNegativeFloat, Positive, PositiveFloat, Struct


class RunConfig(Struct):
    dir: str  # run directory: checkpoints, metrics, results; relaunching with it resumes
    seed: int = 0
    deterministic: bool = False  # torch deterministic algorithms (CPU): resumed runs repeat exactly
    max_wall_seconds: NonNegativeFloat = 0.0  # stop (resumable) at the first step boundary past this; 0: none
    cpu_threads: NonNegative = 1  # torch threads per rank on CPU; 0: torch's default. On a small
    # machine shared with a rollout worker, more threads than cores is many times slower.


class ModelConfig(Struct):
    path: str  # HF-format causal LM directory (config.json, safetensors, tokenizer)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    activation_checkpointing: bool = False
    # torch.compile of each decoder layer and of the log-prob math, which fuses their elementwise
    # kernels (norms, rotary, SwiGLU, the float32 softmax over the vocabulary). "auto": on a GPU
    # only; the first steps pay the compilation (tens of seconds).
    compile: Literal["auto", "on", "off"] = "auto"


class DataConfig(Struct):
    task: Literal["arithmetic", "file"] = "arithmetic"
    path: str = ""  # task "file": a JSONL or Parquet file of rows (protocol/rows.py says which field is what)
    # The prompt's field; "": the first of prompt, messages, question. Text, or a conversation
    # (a list of {role, content}) rendered with the model's chat template by the worker.
    prompt_field: str = ""
    answer_field: str = ""  # the gold answer's field; "": the first of gold, answer, solution (none: no golds)
    template: str = ""  # text prompts built from the row's fields, e.g. "{question}\nAnswer:"; "": as written
    system_prompt: str = ""  # a system turn added to each conversation that has none
    chat: bool = False  # text prompts sent as a conversation of one user turn (chat template, system prompt)
    arithmetic_low: NonNegative = 0
    arithmetic_high: NonNegative = 20
    arithmetic_ops: str = "+"
    held_out: NonNegative = 32  # problems kept out of training, for the canary
    band_file: str = ""  # train on the prompts of a band file from `trainer-svc band` instead

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

    base: str  # the model to start from
    problems: Positive = 200  # training problems it sees (the rest are left for GRPO to learn)
    steps: Positive = 1000  # at most
    batch_size: Positive = 32
    lr: PositiveFloat = 3e-4
    stop_at_accuracy: Fraction = 0.3  # stop once sampled accuracy reaches this: GRPO does the rest
    eval_every: Positive = 25
    eval_problems: Positive = 128
