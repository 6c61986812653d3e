"""The run's configuration: TOML decoded into typed structs, checked at load.

Importable without torch, so `trainer-svc --help` and config errors are instant. Unknown keys,
wrong types and out-of-range values are refused with the key's path and the reason
(`Expected int >= 1 - at $.train.steps`). Validators check; they never fill in values. The
resolved config (defaults included) is written into the run directory.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from protocol import exit_codes

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class Struct(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


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


class RolloutConfig(Struct):
    spool: str = ""  # spool directory; default <run.dir>/spool
    spawn: bool = True  # start a worker from the rollout venv; false: use workers already serving the spool
    rollout_venv: str = ".venvs/rollout"  # where `rollout-svc` is, when spawning
    worker_args: list[str] = []  # extra `rollout-svc serve` arguments, when spawning
    prompts_per_step: Positive = 16
    samples_per_prompt: Annotated[int, msgspec.Meta(ge=2)] = 8  # G: a group needs two to compare
    max_tokens: Positive = 4
    temperature: PositiveFloat = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    # Steps whose requests stay in flight while the current step trains, each sampled from the
    # newest published weights when sent (so up to `ahead` steps stale); 0: synchronous.
    ahead: NonNegative = 0
    # Steps rollouts may lag the trainer: a result older than this is dropped, counted and asked
    # for again. Must allow ahead + publish.every - 1 (the launch gate checks).
    max_policy_lag: NonNegative = 0
    fan_out: NonNegative = 0  # requests per sampling call; 0: one per live worker (at most one per prompt)
    # Prompts sampled beside a step's own in its first sampling: a dead group (all rewards equal)
    # is replaced by a live spare group at once, instead of by a retry the step must wait for.
    # Spares left over are not trained on.
    spare_prompts: NonNegative = 0
    # 0: spare_prompts spares on every step. Above 0: as many spares as the dead rate measured over
    # the last steps asks for (so that a retry is needed on about 1 step in 20), between
    # spare_prompts and this (trainer_svc.rollout.spares).
    spare_prompts_max: NonNegative = 0
    timeout_s: PositiveFloat = 600.0  # longest wait for one sampling call's results
    # A request that fails for a reason of the moment (engine_error: the engine crashed, ran out
    # of memory or lost its process) is sent again under a fresh id, asking the same, at most this
    # many times per request and launch; 0: the first such error stops the run (exit 69).
    error_retries: Annotated[int, msgspec.Meta(ge=0, le=100)] = 3
    no_worker_grace_s: PositiveFloat = 120.0  # how long no live worker is tolerated (engine start included)
    # One GPU for both: the spawned worker shares training rank 0's GPU and takes at most
    # colocate_gpu_memory of it; the trainer is capped at the rest, so both always fit and the
    # worker generates the next steps (rollout.ahead) while the trainer trains.
    colocate: bool = False
    colocate_gpu_memory: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.3
    # Seconds without a request after which the colocated worker sleeps (its weights and KV cache
    # freed, for other processes on the GPU: the trainer stays capped) until the next request
    # wakes it; 0: it never sleeps. A sleep costs a wake on the next request.
    colocate_sleep_s: NonNegativeFloat = 0.0

    def __post_init__(self) -> None:
        if self.spare_prompts_max and self.spare_prompts_max < self.spare_prompts:
            raise ValueError(
                f"rollout.spare_prompts_max = {self.spare_prompts_max} is below rollout.spare_prompts = "
                f"{self.spare_prompts}: the spares are sized between the two; raise spare_prompts_max, or set it "
                "to 0 for a fixed spare_prompts"
            )


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


class PublishConfig(Struct):
    """Published weights: what rollout workers load. Publishing them is the weight sync."""

    every: Positive = 1  # optimizer steps between publishes: rollouts lag the trainer by up to every - 1
    dir: str = ""  # where they go; default <run.dir>/weights. A tmpfs or local NVMe root is fastest
    keep_last: Positive = 3  # newest kept; older ones too while a pending or claimed request names them
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # serving dtype; auto: bfloat16 on GPU, else the model's
    # Sparse deltas (trainer_svc.weights.deltas): a publish holds only the elements that changed since
    # the previous one when that is under half the bytes. auto: on over a network filesystem.
    delta: Literal["auto", "on", "off"] = "auto"
    delta_anchor_every: Positive = 8  # a full publish at least every this many, so a chain stays short
    # The same-host fast path: a ring of shared-memory slots the worker copies straight into its
    # engine (weights/slots.py). auto: on where the worker is spawned on this host and slots_dir has room.
    slots: Literal["auto", "on", "off"] = "auto"
    slots_dir: str = "/dev/shm"  # a tmpfs the trainer and its workers share; the ring is <slots_dir>/<run>-<hash>
    slots_count: Annotated[int, msgspec.Meta(ge=2)] = 2  # slots in the ring, each the weights' size in memory
    slots_wait_s: NonNegativeFloat = 10.0  # wait for a free slot this long, then publish a directory instead
    dir_every: NonNegative = 0  # with slots: also a directory (the portable form) every N steps; 0: the last step only


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


# The linear projections of a Llama, Qwen or Mistral decoder layer (attention and MLP).
DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Modules a served adapter may not change: the rollout engine (vLLM) applies LoRA to linear layers
# of the decoder; an adapter of these would train a model no worker serves.
UNSERVED_LORA_MODULES = ("lm_head", "embed_tokens")


class LoraConfig(Struct):
    """LoRA (learning/lora.py): train a PEFT adapter on the frozen base model; a publish is the
    adapter alone, which workers serve on the base they hold (rollout-svc serve --max-lora-rank)."""

    rank: NonNegative = 0  # LoRA rank r; 0: off (the whole model trains)
    alpha: PositiveFloat = 16.0  # the update is scaled by alpha / rank
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0  # on the adapter's input, in training only
    # The modules the adapter changes, by the last part of their names.
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(DECODER_PROJECTIONS))

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

    class_: str = msgspec.field(name="class")  # "package.module:Class", importable from PYTHONPATH
    max_turns: Positive = 4  # assistant turns per episode, at most (tool calls count as turns)
    # Tokens of a whole episode (first prompt, every assistant and environment turn), at most: an
    # episode whose next environment turn would pass it ends before that turn.
    max_episode_tokens: Positive = 1024
    timeout_s: PositiveFloat = 30.0  # longest one call of the environment (its creation, a step, a tool) may take
    concurrency: Positive = 2  # environment worker processes (each holds many episodes, one call at a time)
    memory_mb: NonNegative = 0  # address-space limit of each environment process (RLIMIT_AS); 0: none
    # When the chat template renders the conversation so far differently from the ids the engine
    # saw (Qwen3-style templates drop earlier reasoning): "end" ends the episode there (its sample is
    # the ids the engine saw, counted in env_drift_ends); "refuse" stops the run (exit 2).
    drift: Literal["end", "refuse"] = "end"

    def __post_init__(self) -> None:
        if not USER_CLASS.fullmatch(self.class_):
            raise ValueError(
                f'env.class = {self.class_!r} does not name a class: write it "package.module:Class", the module '
                "importable from PYTHONPATH"
            )


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
        if self.env is not None and self.canary.every:
            raise ValueError(
                f"canary.every = {self.canary.every} with an [env] section: the canary asks single-turn questions "
                "and checks the answer against a gold, which an environment's episodes do not have; set canary.every "
                "= 0 and evaluate the environment with `trainer-svc eval-env`"
            )
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


class ConfigError(ValueError):
    """The config cannot be used; the message names the file, the key and the reason."""

    exit_code = exit_codes.USAGE


def load(path: str | Path, *, smoke: bool = False) -> Config:
    path = Path(path)
    try:
        text = path.read_bytes()
        config = msgspec.toml.decode(text, type=Config)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from None
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {_retired_reward_keys(text) or exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    config = _resolve_paths(config)
    return smoke_shape(config) if smoke else config


def _retired_reward_keys(text: bytes) -> str | None:
    """What to write instead, for a [reward] section with the keys reward functions replaced."""
    section = msgspec.toml.decode(text).get("reward")
    retired = [key for key in RETIRED_REWARD_KEYS if isinstance(section, dict) and key in section]
    if not retired:
        return None
    defaults = {"correct": 1.0, "format_weight": 0.0, "overlong_weight": 1.0}
    weights = [float(section.get(key, default)) for key, default in defaults.items()]
    return (
        f"reward.{', reward.'.join(retired)}: replaced by reward.functions and reward.weights (one weight per "
        f"function). The same reward is: functions = {list(BUILTIN_REWARDS)}, weights = {weights}".replace("'", '"')
    )


def _resolve_paths(config: Config) -> Config:
    """Relative paths are taken from the working directory (where the command runs), resolved
    once here so that every later reader, and the resolved config, sees absolute paths."""

    def resolve(value: str) -> str:
        return str(Path(value).absolute()) if value else value

    return msgspec.structs.replace(
        config,
        sft=msgspec.structs.replace(config.sft, base=resolve(config.sft.base)) if config.sft else None,
        run=msgspec.structs.replace(config.run, dir=resolve(config.run.dir)),
        model=msgspec.structs.replace(config.model, path=resolve(config.model.path)),
        data=msgspec.structs.replace(
            config.data, path=resolve(config.data.path), band_file=resolve(config.data.band_file)
        ),
        band=msgspec.structs.replace(config.band, out=resolve(config.band.out)),
        publish=msgspec.structs.replace(
            config.publish, dir=resolve(config.publish.dir), slots_dir=resolve(config.publish.slots_dir)
        ),
        rollout=msgspec.structs.replace(
            config.rollout, spool=resolve(config.rollout.spool), rollout_venv=resolve(config.rollout.rollout_venv)
        ),
    )


def smoke_shape(config: Config) -> Config:
    """`--smoke`: the same run, tiny: a few small steps, to check a setup end to end.

    It never touches the run's files: it has a run directory of its own (`<run.dir>-smoke`), its
    own published weights (`<publish.dir>-smoke`; a publish.dir inside run.dir moves into the
    smoke's) and, spawning its own worker, its own spool the same way. With rollout.spawn = false
    it uses the run's spool, where the workers are; its request ids start with its own run
    directory's name. A smoke directory that would be, hold or lie in one of the run's is refused."""
    run_dir = config.run_dir
    smoke_dir = run_dir.with_name(run_dir.name + "-smoke")

    def own(path: Path) -> Path:
        if path.is_relative_to(run_dir):
            return smoke_dir / path.relative_to(run_dir)
        return path.with_name(path.name + "-smoke")

    spool = str(config.spool_dir)  # without a worker of its own: the workers' spool
    if config.rollout.spawn:
        spool = str(own(config.spool_dir)) if config.rollout.spool else ""
    smoke = msgspec.structs.replace(
        config,
        run=msgspec.structs.replace(config.run, dir=str(smoke_dir)),
        rollout=msgspec.structs.replace(config.rollout, spool=spool, prompts_per_step=4, samples_per_prompt=4),
        train=msgspec.structs.replace(
            config.train,
            steps=3,
            grad_accum=min(config.train.grad_accum, 2),
            updates_per_batch=min(config.train.updates_per_batch, 2),
            warmup_steps=0,
        ),
        publish=msgspec.structs.replace(
            config.publish, every=1, dir=str(own(config.publish_dir)) if config.publish.dir else ""
        ),
        checkpoint=msgspec.structs.replace(config.checkpoint, every=1),
    )
    _check_apart(config, smoke)
    return smoke


def _check_apart(config: Config, smoke: Config) -> None:
    """Refuse a smoke directory that is, holds or lies in one of the run's directories."""
    theirs = {"run.dir": config.run_dir, "publish.dir": config.publish_dir, "rollout.spool": config.spool_dir}
    ours = {"run directory": smoke.run_dir, "published weights": smoke.publish_dir}
    if config.rollout.spawn:
        ours["spool"] = smoke.spool_dir
    for what, mine in ours.items():
        for key, path in theirs.items():
            if mine.is_relative_to(path) or path.is_relative_to(mine):
                raise ConfigError(
                    f"--smoke would write its {what} into {mine}, which is or shares a directory with the run's {key} "
                    f"({path}); a smoke run never touches the run's files. Give the run a {key} apart from "
                    f"{mine} (the smoke run's directories are named after the run's, ending in -smoke)"
                )


def dump(config: Config) -> bytes:
    """TOML of the resolved config; sections and keys that are not set (None) are left out, as
    TOML has no null (loaded again, they are None: their default)."""

    def unset_left_out(value):
        if isinstance(value, dict):
            return {k: unset_left_out(v) for k, v in value.items() if v is not None}
        return value

    return msgspec.toml.encode(unset_left_out(msgspec.to_builtins(config)))
