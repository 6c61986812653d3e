"""The trainer's peak device memory and step time against completion length: the log-prob math
chunk by chunk (learning/token_logprobs.py) against the whole batch's logits upcast at once (the
trainer before it), side by side.

    python -m bench.trainer_memory [--shape smollm2] [--lengths 128,512,1024,2048]
                                   [--sequences 64] [--micro-batches 2] [--prompt-tokens 64]
                                   [--compile off,on] [--checkpointing off] [--steps 3] [--json OUT]
    python -m bench.trainer_memory --shape tiny --lengths 8,16 --sequences 4 --micro-batches 1 \\
                                   --steps 1 --compile off             # the CPU check of the script

A model of SmolLM2-135M's shape (Llama, 30 layers, hidden 576, vocabulary 49,152, tied
embeddings; config only, random weights, bf16 on a GPU, float32 on a CPU) takes trainer_svc's
own optimizer step (`train_step.train_step`: the clipped GRPO loss over `--micro-batches`
micro-batches, gradient clipping, AdamW) on a synthetic step of `--sequences` sequences, each a
random prompt of `--prompt-tokens` and a completion of exactly the length measured. "whole" is the
trainer's former `sequence_logprobs`, put back for the run: the model's logits at the generated
columns, [sequences, columns, vocabulary], then grpo.logprobs_and_entropy on all of them at once.
"chunked" is the trainer's own.

Per configuration: the median seconds of `--steps` steps after two untimed ones (the first
compiles where compiling is on), the peak device memory allocated over the timed steps, and what
the weights, gradients and optimizer state hold between steps (`resident`). A configuration that
runs out of memory says so. On a CPU there is no device memory to read: the peaks are left out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

SHAPES = {
    # HuggingFaceTB/SmolLM2-135M-Instruct's config.json
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                    rope_theta=100000.0, rms_norm_eps=1e-5),
    # the CPU check: its figures mean nothing
    "tiny": dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
}  # fmt: skip
MATHS = ("whole", "chunked")


def whole_logits_logprobs(model, batch, temperature: float, compiled: bool = False, packed: bool = False):
    """The trainer's sequence_logprobs before chunking: every generated column's logits at once
    (padded micro-batches: the bench sets train.packing = "off" for both maths)."""
    import torch

    assert not packed, "the whole-logits math takes padded micro-batches"

    from trainer_svc.learning import grpo, token_logprobs

    columns = batch.mask.any(dim=0).nonzero().squeeze(-1)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=columns).logits
    math = token_logprobs.compiled_logprob_math() if compiled else grpo.logprobs_and_entropy
    logp, entropy = math(logits, batch.targets[:, columns], temperature)
    zeros = torch.zeros(batch.targets.shape, dtype=logp.dtype, device=logp.device)
    return zeros.index_copy(1, columns, logp), zeros.index_copy(1, columns, entropy)


def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_model(shape: str, checkpointing: bool, compiled: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer_svc.learning.model import compile_layers

    config = LlamaConfig(max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SHAPES[shape])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device().type == "cuda" else torch.float32
    with torch.device(device()):
        model = LlamaForCausalLM(config).to(dtype)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:
        compile_layers(model)
    return model


def synthetic_step(args, length: int, seed: int):
    """Groups of 8 of random prompts and completions of exactly `length` tokens."""
    import torch

    from trainer_svc.learning.batch import collate
    from trainer_svc.rollout_types import Group, Sample

    vocab = SHAPES[args.shape]["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    per_group = min(8, args.sequences)
    groups = []
    for _ in range(args.sequences // per_group):
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
        samples = [
            Sample(torch.randint(3, vocab, (length,), generator=g).tolist(), [-10.0] * length, "", "length")
            for _ in range(per_group)
        ]
        groups.append(Group(prompt, samples))
    return collate(groups, torch.randn(len(groups), per_group, generator=g), pad_id=0).to(device())


def run(args, length: int, math: str, compiled: bool, checkpointing: bool) -> dict:
    import msgspec
    import torch

    from trainer_svc.config import Config
    from trainer_svc.distributed import Distributed
    from trainer_svc.learning import train_step as step_module
    from trainer_svc.learning.train_step import StepTotals, make_optimizer, make_scheduler, train_step

    cfg = msgspec.convert(
        {
            "run": {"dir": "unused"},
            "model": {
                "path": "unused",
                "activation_checkpointing": checkpointing,
                "compile": "on" if compiled else "off",
            },
            "rollout": {"max_tokens": length, "temperature": 1.0},
            "train": {"steps": 1000, "grad_accum": args.micro_batches, "packing": "off"},
        },
        Config,
    )
    row = {"length": length, "math": math, "compiled": compiled, "checkpointing": checkpointing}
    model = make_model(args.shape, checkpointing, compiled)
    optimizer, dist_info = make_optimizer(model, cfg), Distributed(0, 1, device())
    scheduler = make_scheduler(optimizer, cfg)
    own = step_module.sequence_logprobs
    step_module.sequence_logprobs = whole_logits_logprobs if math == "whole" else own
    try:
        seconds = []
        for i in range(2 + args.steps):
            if i == 2 and torch.cuda.is_available():
                synchronize()
                row["resident_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
                torch.cuda.reset_peak_memory_stats()
            batch = synthetic_step(args, length, seed=i)
            totals = StepTotals(tokens=int(batch.mask.sum()), sequences=len(batch))
            synchronize()
            started = time.perf_counter()
            train_step(model, None, optimizer, scheduler, [(batch, totals)], cfg, dist_info)
            synchronize()
            seconds.append(time.perf_counter() - started)
        row["step_s"] = round(statistics.median(seconds[2:]), 4)
        row["first_steps_s"] = [round(s, 2) for s in seconds[:2]]
        row["tokens_per_s"] = round(int(batch.attention_mask.sum()) / row["step_s"])
        if torch.cuda.is_available():
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    except torch.cuda.OutOfMemoryError:
        row["error"] = "out of memory"
    finally:
        step_module.sequence_logprobs = own
        del model, optimizer, scheduler
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| completion tokens | compiled | checkpointing | whole: peak GiB | chunked: peak GiB"
        " | whole: step s | chunked: step s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    keyed = {(r["length"], r["compiled"], r["checkpointing"], r["math"]): r for r in rows}
    settings = dict.fromkeys((r["length"], r["compiled"], r["checkpointing"]) for r in rows)
    for length, compiled, checkpointing in settings:
        cells = []
        for field in ("peak_gib", "step_s"):
            for math in MATHS:
                r = keyed.get((length, compiled, checkpointing, math), {})
                cells.append(r.get("error") or str(r.get(field, "-")))
        lines.append(f"| {length} | {compiled} | {checkpointing} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--lengths", default="128,512,1024,2048", help="completion tokens, comma-separated")
    parser.add_argument("--sequences", type=int, default=64, help="sequences a step")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches a step (train.grad_accum)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--compile", default="off,on", help="model.compile: off, on, or both")
    parser.add_argument("--checkpointing", default="off", help="activation checkpointing: off, on, or both")
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after two untimed ones")
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="the CPU check: --shape tiny at 4 and 8 tokens, one step")
    args = parser.parse_args()
    if args.tiny:
        args.shape, args.lengths, args.sequences, args.micro_batches = "tiny", "4,8", 4, 2
        args.prompt_tokens, args.compile, args.checkpointing, args.steps = 6, "off", "off", 1
    import torch

    rows = []
    for compiled in args.compile.split(","):
        for checkpointing in args.checkpointing.split(","):
            for length in (int(x) for x in args.lengths.split(",")):
                for math in MATHS:
                    rows.append(run(args, length, math, compiled == "on", checkpointing == "on"))
                    print(json.dumps(rows[-1]), flush=True)
    data = {
        "benchmark": "trainer_memory",
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "shape": args.shape,
        "step": f"{args.sequences} sequences of {args.prompt_tokens} prompt + the completion tokens, "
        f"{args.micro_batches} micro-batches",
        "rows": rows,
    }
    print(table(rows))
    print(json.dumps(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data) + "\n")


if __name__ == "__main__":
    main()
