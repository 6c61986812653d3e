"""TRL's side of bench.trl_gpu_compare: the settings GRPOTrainer gets from a config ours runs
(`trl_spec`, in the orchestrator) and the process that trains with them (`trl_worker`, in the
interpreter that has TRL, started as `python -m bench.trl_gpu_compare --trl-worker SPEC.json`).
bench/trl_gpu_compare.py's docstring says what is mirrored and what differs by design; a config
with an [env] of trainer_svc.tasks.calculator takes bench/trl_tools.py's tool, prompts and reward.
The worker appends one JSON line per step to spec["metrics"] and one per held-out evaluation to
spec["evals"]; the orchestrator stamps them as they appear.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench import trl_tools


def trl_spec(raw: dict, train: Path, held_out: Path, work: Path, args) -> dict:
    from trainer_svc.rails.gates import worker_max_model_len

    rollout, train_cfg, loss = raw["rollout"], raw.get("train", {}), raw.get("loss", {})
    reward = raw.get("reward", {})
    functions = reward.get("functions", ["correct", "format", "overlong"])
    weights = reward.get("weights", [1.0, 0.0, 1.0])
    scoring = {f: w for f, w in zip(functions, weights, strict=True) if w}
    if "overlong" in scoring and not reward.get("overlong_buffer"):
        del scoring["overlong"]  # off while its buffer is 0
    # TRL's side calls the config's own functions ("module:function") and correctness ("correct"),
    # weighted as the config weighs them.
    users = {f: w for f, w in scoring.items() if ":" in f or f == "correct"}
    tools = trl_tools.spec_fields(raw) if raw.get("env") else {}
    if tools:  # the environment's reward, on TRL's side its own function (bench.trl_tools)
        users = {}
    elif not users or users != scoring:
        raise SystemExit(
            "TRL's side scores correctness and the config's own reward functions (TRL's convention, "
            f"weighted as the config weighs them), no other built-in; the config's reward is {scoring}"
        )
    if loss.get("kl_coef", 0) or train_cfg.get("updates_per_batch", 1) != 1:
        raise SystemExit("TRL's side mirrors kl_coef 0 and one update per batch")
    batch = rollout["prompts_per_step"] * rollout["samples_per_prompt"]
    micro_batches = args.trl_micro_batches or train_cfg.get("grad_accum", 1)
    if batch % micro_batches:
        raise SystemExit(f"--trl-micro-batches {micro_batches} does not divide the step's {batch} samples")
    if train_cfg.get("schedule", "constant") != "constant" or loss.get("denominator", "token") != "token":
        raise SystemExit("TRL's side mirrors a constant schedule after the warm-up and the token-mean loss")
    return {
        "model": raw["model"]["path"],
        "train": str(train),
        "held_out": str(held_out),
        "metrics": str(work / "trl.steps.jsonl"),
        "evals": str(work / "trl.evals.jsonl"),
        "out": str(work / "trl-out"),
        "seed": raw["run"].get("seed", 0),
        "steps": args.steps,
        # held-out accuracy needs gold answers, which a config scoring correctness has
        "eval_every": 0 if users and "correct" not in users else args.eval_every,
        "prompts_per_step": rollout["prompts_per_step"],
        "samples_per_prompt": rollout["samples_per_prompt"],
        "micro_batches": micro_batches,
        "max_tokens": rollout["max_tokens"],
        "temperature": rollout.get("temperature", 1.0),
        "top_p": rollout.get("top_p", 1.0),
        "max_model_len": worker_max_model_len(rollout.get("worker_args", [])) or 512,
        "gpu_memory": rollout.get("colocate_gpu_memory", 0.3),
        "lr": train_cfg.get("lr", 1e-4),
        "warmup_steps": train_cfg.get("warmup_steps", 0),
        "betas": train_cfg.get("betas", [0.9, 0.99]),
        "weight_decay": train_cfg.get("weight_decay", 0.0),
        "max_grad_norm": train_cfg.get("max_grad_norm", 1.0),
        "clip_low": loss.get("clip_low", 0.2),
        "clip_high": loss.get("clip_high", 0.28),
        "correction": loss.get("correction", "none"),
        "correction_cap": loss.get("correction_cap", 2.0),
        "advantage_norm": loss.get("advantage_norm", "std"),
        "user_rewards": sorted(users.items()),  # [("module:function" or "correct", weight)]; none: the environment's
        **tools,
    }


# GRPOConfig arguments both TRL workers (this one and bench.trl_compare's) fix the same way: our
# loss (token-mean over the step, no KL term, one update per generation) and no saves, reports,
# progress bars or dataloader processes, which only time the harness.
FIXED_GRPO_ARGS = {
    "loss_type": "dapo",
    "beta": 0.0,
    "num_iterations": 1,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
}


def step_log_class(callback_base: type) -> type:
    """A TRL callback class that appends one JSON line per logged step to a file: the step, its
    logged reward and its seconds (step end to step end). Subclasses add fields (`fields`) and act
    after each line (`after_step`). `callback_base` is transformers' TrainerCallback, passed in
    because only the interpreter that has TRL can import it."""

    class StepLog(callback_base):
        def __init__(self, path: str) -> None:
            self.steps = open(path, "a")
            self.last = time.monotonic()
            self.step_s = None

        def fields(self, logs: dict) -> dict:
            return {}

        def after_step(self, step: int) -> None:
            pass

        def on_step_end(self, args, state, control, **kwargs):
            now = time.monotonic()
            self.step_s, self.last = now - self.last, now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                row = {"step": state.global_step, "reward": logs["reward"], "step_s": self.step_s, **self.fields(logs)}
                self.steps.write(json.dumps(row) + "\n")
                self.steps.flush()
                self.after_step(state.global_step)

    return StepLog


def trl_worker(spec: dict) -> None:
    """TRL's GRPOTrainer on `spec` (written by the orchestrator), in the interpreter that has TRL.
    One JSON line per step into spec["metrics"], one per held-out evaluation into spec["evals"]."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from protocol.answers import extract_answer, verdict

    gpu = torch.cuda.is_available()

    def texts_of(completions) -> list[str]:
        return [c if isinstance(c, str) else c[-1]["content"] for c in completions]

    def correct(completions, gold, **_) -> list[float]:
        return [float(verdict(extract_answer(t), g) is True) for t, g in zip(texts_of(completions), gold, strict=True)]

    def user_reward(name: str):
        """A config's reward function as TRL calls it: the completions' texts, the rows' columns."""
        import importlib

        module, function = name.split(":")
        fn = getattr(importlib.import_module(module), function)

        def reward(completions, **kwargs):
            return [float(v) for v in fn(completions=texts_of(completions), **kwargs)]

        reward.__name__ = function
        return reward

    held_out = [json.loads(line) for line in Path(spec["held_out"]).read_text().splitlines()]

    class Log(step_log_class(TrainerCallback)):
        """Each step's line with its completion length and peak memory; the held-out greedy
        accuracy before the first step and every eval_every steps."""

        def __init__(self) -> None:
            super().__init__(spec["metrics"])
            self.evals = open(spec["evals"], "a")
            self.trainer = None

        def evaluate(self, step: int) -> None:
            trainer = self.trainer
            model, tokenizer = trainer.model, trainer.processing_class
            if env:
                row = trl_tools.held_out_accuracy(model, tokenizer, held_out, env["max_turns"], spec["max_tokens"])
                self.evals.write(json.dumps({"step": step, **row, "time": time.time()}) + "\n")
                self.evals.flush()
                return
            texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
                     for r in held_out]  # fmt: skip
            batch = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
            was_training = model.training
            model.eval()
            with torch.no_grad():
                out = model.generate(
                    **batch.to(model.device),
                    max_new_tokens=spec["max_tokens"],
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id
                    if tokenizer.pad_token_id is not None
                    else tokenizer.eos_token_id,
                )
            model.train(was_training)
            answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            right = [verdict(extract_answer(a), r["gold"]) is True for a, r in zip(answers, held_out, strict=True)]
            row = {"step": step, "accuracy": sum(right) / len(right), "n": len(right), "time": time.time()}
            self.evals.write(json.dumps(row) + "\n")
            self.evals.flush()

        def on_train_begin(self, args, state, control, **kwargs):
            if spec["eval_every"]:
                self.evaluate(0)
            self.last = time.monotonic()

        def fields(self, logs: dict) -> dict:
            row = {
                "completion_mean_length": logs.get("completions/mean_length"),
                "peak_torch_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
            }
            if env:  # the assistant turns of the step's conversations
                row["turns"] = sum(trl_tools.ASSISTANT_TURNS)
                trl_tools.ASSISTANT_TURNS.clear()
            return row

        def after_step(self, step: int) -> None:
            if spec["eval_every"] and step % spec["eval_every"] == 0:
                self.evaluate(step)
                self.last = time.monotonic()  # the next step's seconds leave the evaluation out

    if spec["correction"] not in ("tis", "none"):
        raise SystemExit(f"TRL's side mirrors loss.correction tis or none, not {spec['correction']}")
    rows = [json.loads(line) for line in Path(spec["train"]).read_text().splitlines()]
    batch = spec["prompts_per_step"] * spec["samples_per_prompt"]
    vllm = (
        {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": spec["gpu_memory"],
            "vllm_max_model_length": spec["max_model_len"],
            "vllm_importance_sampling_correction": spec["correction"] == "tis",
            "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_max": spec["correction_cap"],
        }
        if gpu
        else {"use_vllm": False, "use_cpu": True}
    )
    users = spec.get("user_rewards") or []
    env, tool_args, completion = spec.get("env"), {}, spec["max_tokens"]
    if env:  # tool use: the environment's prompts, tool and reward (bench.trl_tools)
        tokenizer, own_template = trl_tools.tool_tokenizer(spec["model"])
        rows = trl_tools.dataset_rows(rows)
        trl_tools.same_prompts(tokenizer, own_template, [r["prompt"] for r in rows[:8]])
        # TRL counts every turn's tokens and the tools' as one completion, as our episode budget does
        completion = env["max_episode_tokens"] - trl_tools.longest_prompt(tokenizer, rows)
        tool_args = {"max_tool_calling_iterations": env["max_turns"] - 1}
    config = GRPOConfig(
        output_dir=spec["out"],
        seed=spec["seed"],
        bf16=gpu,
        model_init_kwargs={"dtype": torch.bfloat16 if gpu else torch.float32},
        gradient_checkpointing=False,
        max_steps=spec["steps"],
        # The step's samples in `micro_batches` forward and backward passes, one optimizer step, one
        # generation of all of them per optimizer step (TRL's steps_per_generation).
        per_device_train_batch_size=batch // spec["micro_batches"],
        gradient_accumulation_steps=spec["micro_batches"],
        steps_per_generation=spec["micro_batches"],
        num_generations=spec["samples_per_prompt"],
        max_completion_length=completion,
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=spec["warmup_steps"],
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        weight_decay=spec["weight_decay"],
        max_grad_norm=spec["max_grad_norm"],
        epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"],
        reward_weights=[w for _, w in users] if users else None,
        scale_rewards="group" if spec["advantage_norm"] == "std" else "none",
        **FIXED_GRPO_ARGS,
        **vllm,
        **tool_args,
    )
    log = Log()
    if env:
        funcs, extra = [trl_tools.reward], {"processing_class": tokenizer, "tools": [trl_tools.calculate]}
    else:
        funcs, extra = [correct if name == "correct" else user_reward(name) for name, _ in users], {}
    trainer = GRPOTrainer(
        model=spec["model"], reward_funcs=funcs, args=config, train_dataset=Dataset.from_list(rows), callbacks=[log],
        **extra,
    )  # fmt: skip
    log.trainer = trainer
    trainer.train()
