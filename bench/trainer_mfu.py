"""The trainer's GRPO step on one GPU at a real shape: tokens per second and model FLOPs
utilisation (MFU) against the card's bf16 peak.

    python -m bench.trainer_mfu [--shape 1.5b] [--sequences 64] [--prompt-tokens 256]
                                [--completion-tokens 768] [--micro 8,16] [--checkpointing on,off]
                                [--compile on,off] [--steps 10] [--max-warmup 8] [--chunk-mib MIB]
                                [--json OUT]

A Qwen2.5-shaped model (config only, random weights, bf16 on the GPU) takes trainer_svc's own
optimizer step (`train_step.train_step`: the clipped GRPO loss over micro-batches, gradient
clipping, AdamW) on a synthetic step of `--sequences` sequences, each a prompt and a completion of
random tokens; completion lengths vary from half to all of `--completion-tokens`, as sampled
completions do. Measured for each micro-batch size, with and without activation checkpointing,
with and without torch.compile (model.compile: the decoder layers and the log-prob math):
seconds per step, tokens per second (real tokens, padding not counted), and MFU, as medians of
--steps timed steps with their spread. `--chunk-mib` sets the float32 logits each chunk of the
log-prob math holds (the positions a chunk takes, `logprob_chunk_rows`, are reported).

Warm-up before timing: steps are taken, untimed for the figures, until one runs within 5% of the
previous one's tokens per second (so at least two; a compiled model compiles in the first and may
meet a shape in the second that it compiles for again; at most --max-warmup). Their seconds are
reported apart (`warmup_s`), with `compile_s`: what the warm-up took beyond as many steady
steps (the compilation, with the allocator's and the kernels' first-use costs).

Model FLOPs per step (what the step must compute, whatever it recomputes): for each sequence of
S tokens of which C were generated, 6 x N_layers x S (forward and backward of every weight matrix
of the decoder layers) plus 6 x N_out x C (the output projection to the vocabulary, needed only
where a generated token is scored; the trainer computes no logits at prompt positions) plus
6 x layers x hidden x S^2 (causal attention: QK^T and AV, forward and backward, half the square).
Activation checkpointing's recomputation is not counted, by the usual definition of MFU.
Peak: the H200's dense bf16 figure, 989.4 TFLOP/s (NVIDIA's data sheet; a matmul-only
microbenchmark reaches about 790 there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.common import gpu_name, say
from bench.models import BENCH_SHAPES, qwen_config
from bench.models import QWEN_VOCAB as VOCAB

PEAK_BF16_FLOPS = 989.4e12
TARGET_MFU = 0.45  # with packing (varlen); 0.37 was measured padded at short lengths
STEADY = 0.05  # warm-up ends at a step within this fraction of the previous one's tokens per second
# A tiny shape for checking the script on a CPU (`--shape tiny --sequences 8 --prompt-tokens 16
# --completion-tokens 16`); its figures mean nothing.
MFU_SHAPES = BENCH_SHAPES


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script only


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_model(shape: str, checkpointing: bool, compiled: bool, attention: str = "sdpa"):
    import torch
    from transformers import Qwen2ForCausalLM

    from trainer_svc.learning.model import attention_implementation

    config = qwen_config(MFU_SHAPES[shape])
    config._attn_implementation = attention_implementation(attention)  # varlen: packed micro-batches
    torch.manual_seed(0)
    with torch.device(device()):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:
        from trainer_svc.learning.model import compile_layers

        compile_layers(model)
    return model


def matmul_parameters(model) -> tuple[int, int]:
    """Weights that take part in a matrix product per token: (every 2-D weight of the decoder
    layers, the output projection: vocabulary x hidden, tied or not); not the embedding lookup."""
    layers = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    return layers, model.lm_head.weight.numel()


def synthetic_step(args, seed: int):
    """Groups of random prompts and completions (lengths from half to all of the maximum)."""
    import torch

    from trainer_svc.rollout_types import Group, Sample

    g = torch.Generator().manual_seed(seed)
    groups = []
    per_group = 8
    for _ in range(args.sequences // per_group):
        prompt = torch.randint(3, VOCAB, (args.prompt_tokens,), generator=g).tolist()
        samples = []
        for _ in range(per_group):
            length = int(torch.randint(args.completion_tokens // 2, args.completion_tokens + 1, (1,), generator=g))
            tokens = torch.randint(3, VOCAB, (length,), generator=g).tolist()
            samples.append(Sample(tokens, [-12.0] * length, "", "length"))
        groups.append(Group(prompt, samples))
    advantages = torch.randn(len(groups), per_group, generator=g)
    return groups, advantages


def step_flops(batch, n_layers: int, n_out: int, layers: int, hidden: int) -> float:
    lengths = batch.attention_mask.sum(dim=1).double()
    generated = batch.mask.sum(dim=1).double()
    return float((6 * n_layers * lengths + 6 * n_out * generated + 6 * layers * hidden * lengths**2).sum())


def run(args, checkpointing: bool, micro: int, compiled: bool, profiled: bool = False) -> dict:
    import msgspec
    import torch

    from trainer_svc.config import Config
    from trainer_svc.distributed import Distributed
    from trainer_svc.learning.batch import collate
    from trainer_svc.learning.token_logprobs import chunk_rows, use_packing
    from trainer_svc.learning.train_step import StepTotals, make_optimizer, make_scheduler, train_step

    cfg = msgspec.convert(
        {
            "run": {"dir": "unused"},
            "model": {
                "path": "unused",
                "dtype": "bfloat16",
                "activation_checkpointing": checkpointing,
                "compile": "on" if compiled else "off",
                "attention": args.attention,
            },
            "rollout": {"max_tokens": args.completion_tokens, "temperature": 1.0},
            "train": {
                "steps": 1000,
                "grad_accum": args.sequences // micro,
                **({"max_tokens_per_micro_batch": args.micro_tokens} if args.micro_tokens else {}),
            },
        },
        Config,
    )
    model = make_model(args.shape, checkpointing, compiled, args.attention)
    optimizer, dist_info = make_optimizer(model, cfg), Distributed(0, 1, torch.device(device()))
    scheduler = make_scheduler(optimizer, cfg)
    shape = MFU_SHAPES[args.shape]
    n_layers, n_out = matmul_parameters(model)

    def step(seed: int) -> tuple[float, int, float]:
        """One optimizer step on a fresh synthetic batch: (seconds, real tokens, model FLOPs)."""
        groups, advantages = synthetic_step(args, seed=seed)
        batch = collate(groups, advantages, pad_id=0).to(dist_info.device)
        totals = StepTotals(tokens=int(batch.mask.sum()), sequences=len(batch))
        synchronize()
        started = time.perf_counter()
        train_step(model, None, optimizer, scheduler, [(batch, totals)], cfg, dist_info)
        synchronize()
        flops = step_flops(batch, n_layers, n_out, shape["num_hidden_layers"], shape["hidden_size"])
        return time.perf_counter() - started, int(batch.attention_mask.sum()), flops

    warmup = warm_up(step, most=args.max_warmup)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if profiled:
        from torch.profiler import ProfilerActivity

        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(len(warmup))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    seconds, tokens, flops = zip(*(step(len(warmup) + i) for i in range(args.steps)), strict=True)
    s = statistics.median(seconds)
    rates = [t / x for t, x in zip(tokens, seconds, strict=True)]
    row = {
        "activation_checkpointing": checkpointing,
        "compiled": compiled,
        "micro_batch": micro,
        "attention": args.attention,
        "packed": use_packing(cfg.train.packing, model),
        "logprob_chunk_rows": chunk_rows(model.config.vocab_size),
        "step_s": round(s, 3),
        "tokens_per_s": round(statistics.median(rates)),
        "mfu": round(statistics.median(f / x for f, x in zip(flops, seconds, strict=True)) / PEAK_BF16_FLOPS, 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else 0,
        # Spread of the timed steps: (slowest - fastest) / median of tokens per second.
        "spread": round((max(rates) - min(rates)) / statistics.median(rates), 3),
        "steps_s": [round(x, 3) for x in seconds],
        "warmup_s": [round(x, 3) for x in warmup],
        "compile_s": round(sum(warmup) - len(warmup) * s, 1),
    }
    return row  # the model, its optimizer and the step that holds them are freed with this frame


def warm_up(step, most: int) -> list[float]:
    """Untimed steps until one's tokens per second is within STEADY of the previous one's (at
    least two, at most `most`); their seconds."""
    seconds, rates = [], []
    while len(seconds) < max(most, 2):
        took, tokens, _ = step(len(seconds))
        seconds.append(took)
        rates.append(tokens / took)
        if len(rates) > 1 and abs(rates[-1] - rates[-2]) <= STEADY * rates[-2]:
            break
    return seconds


def profile(args) -> None:
    """Where one step's GPU time goes, by kernel: the first step after the warm-up."""
    args.steps = 1
    checkpointing = args.checkpointing.split(",")[0] == "on"
    compiled = args.compile.split(",")[0] == "on"
    print(json.dumps(run(args, checkpointing, int(args.micro.split(",")[0]), compiled, profiled=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.5b", choices=sorted(MFU_SHAPES))
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--completion-tokens", type=int, default=768)
    parser.add_argument("--micro", default="8,16", help="sequences per micro-batch, comma-separated")
    parser.add_argument(
        "--micro-tokens", type=int, help="train.max_tokens_per_micro_batch (default: the trainer's automatic budget)"
    )
    parser.add_argument(
        "--attention", default="sdpa", choices=["sdpa", "eager", "varlen"],
        help="model.attention; varlen packs the micro-batches (train.packing = auto)",
    )  # fmt: skip
    parser.add_argument(
        "--chunk-mib", type=int,
        help="float32 logits a log-prob chunk holds, MiB (default: the trainer's, token_logprobs.CHUNK_BYTES)",
    )  # fmt: skip
    parser.add_argument("--checkpointing", default="on,off", help="on, off, or both")
    parser.add_argument("--compile", default="on,off", help="on, off, or both")
    parser.add_argument("--steps", type=int, default=10, help="timed steps, after the warm-up")
    parser.add_argument("--max-warmup", type=int, default=8, help="most untimed steps before timing")
    parser.add_argument("--profile", action="store_true", help="profile one step of the first configuration")
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="the CPU check: --shape tiny, 8 short sequences, a step")
    args = parser.parse_args()
    if args.tiny:
        args.shape, args.sequences, args.prompt_tokens, args.completion_tokens = "tiny", 8, 16, 16
        args.micro, args.checkpointing, args.compile, args.steps, args.max_warmup = "8", "off", "off", 1, 2
    import torch

    if args.chunk_mib:
        from trainer_svc.learning import token_logprobs

        token_logprobs.CHUNK_BYTES = args.chunk_mib * 2**20
    if args.profile:
        profile(args)
        return

    too_big = [m for m in args.micro.split(",") if int(m) > args.sequences or args.sequences % int(m)]
    if too_big:
        parser.error(f"--micro {','.join(too_big)} must divide --sequences {args.sequences}")
    rows = []
    configurations = [
        (checkpointing == "on", compiled == "on", int(micro))
        for compiled in args.compile.split(",")
        for checkpointing in args.checkpointing.split(",")
        for micro in args.micro.split(",")
    ]
    for checkpointing, compiled, micro in configurations:
        try:
            rows.append(run(args, checkpointing, micro, compiled))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the last configuration's memory, for the next
        except torch.cuda.OutOfMemoryError:
            rows.append(
                {"activation_checkpointing": checkpointing, "compiled": compiled, "micro_batch": micro}
                | {"error": "out of memory"}
            )
            torch.cuda.empty_cache()
        say(json.dumps(rows[-1]))
    data = {
        "benchmark": "trainer_mfu",
        "date": time.strftime("%Y-%m-%d"),
        "gpu": gpu_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "step": f"{args.sequences} sequences: {args.prompt_tokens} prompt + "
        f"{args.completion_tokens // 2}..{args.completion_tokens} completion tokens",
        "peak_flops": PEAK_BF16_FLOPS,
        "target_mfu": TARGET_MFU,
        "rows": rows,
    }
    print(
        "| checkpointing | compiled | micro-batch | step s | tokens/s | MFU | spread | warm-up steps | compile s |",
        end="",
    )
    print(" peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        head = f"| {r['activation_checkpointing']} | {r['compiled']} | {r['micro_batch']} |"
        if "error" in r:
            print(f"{head} {r['error']} | | | | | | |")
        else:
            print(
                f"{head} {r['step_s']} | {r['tokens_per_s']:,} | {r['mfu']:.1%} | {r['spread']:.1%} | "
                f"{len(r['warmup_s'])} | {r['compile_s']} | {r['peak_memory_gib']} |"
            )
    print(json.dumps(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data) + "\n")


if __name__ == "__main__":
    main()
