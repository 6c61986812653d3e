"""The memory gate: before the first step on a GPU, measure what a micro-batch costs and refuse a
run whose longest sequence cannot fit, instead of running out of memory in the middle of it.

The longest sequence a config allows is its longest prompt (tokenized as the worker renders it)
plus rollout.max_tokens; with an [env], an episode's, up to env.max_episode_tokens. The gate runs
the training pass itself (forward, log-probs, loss, backward) on a micro-batch of one synthetic
sequence of that length and on one of two, and reads the device's peak: the difference is what
one more sequence of the longest length costs, the rest what a micro-batch costs whatever its
size (gradients, workspaces). Micro-batches grow by sequences, so this is the line they follow; a
shorter sequence costs no more a token than the longest (attention's cost per token grows with
length), so the line errs high for them. The optimizer's states, allocated at the first step,
are counted in: two per trainable parameter, in float32.

  - one sequence of the longest length does not fit in the memory free for this process: the run
    is refused (exit 3) with the figures and what to change;
  - train.max_tokens_per_micro_batch left out: it is set from the same figures, so that a
    micro-batch's peak stays within SHARE of the memory left once the fixed costs are paid (one
    longest sequence when two of them do not fit), and at most AUTO_MAX_TOKENS (more runs no
    faster);
  - on a CPU nothing is probed (host memory is the system's to manage) and the budget is the
    config's.

Under FSDP2 every rank probes (the passes are collectives) and all take the smallest budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from protocol.rows import is_conversation

from ..config import Config
from ..distributed import Distributed
from ..learning.batch import Batch
from .gates import GateRefused

log = logging.getLogger(__name__)

GIB = 2**30
SHARE = 0.85  # of the memory left after the fixed costs, what micro-batches may take at their peak
# The most padded tokens an automatic budget gives a micro-batch. Past about this many a micro-batch
# runs no faster a token (the GPU's matmuls are already full: 16 sequences of 1,024 tokens at the
# 1.5B shape, docs/BENCHMARKS.md), so memory beyond it only raises the trainer's peak: on one H200
# at 512 tokens the uncapped budget took 3 micro-batches and a device peak of 101.8 GiB.
AUTO_MAX_TOKENS = 16384


@dataclass(frozen=True)
class Costs:
    """What the probes measured (bytes)."""

    per_token: float  # one more token of a micro-batch
    fixed: float  # a micro-batch of no token: gradients, workspaces
    optimizer: int  # the optimizer's states, once allocated
    available: int  # what this process may still allocate: the device's free memory and its own cache


def longest_sequence(cfg: Config, tokenizer, prompts) -> tuple[int, int]:
    """(the longest prompt's tokens, that + rollout.max_tokens; an episode's cap where it is longer)."""
    longest = 0
    for prompt in prompts:
        if is_conversation(prompt):
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            count = len(ids["input_ids"] if isinstance(ids, dict) else ids)
        else:
            count = len(tokenizer(prompt)["input_ids"])
        longest = max(longest, count)
    if cfg.env is not None:  # an episode's whole sequence: its turns end before env.max_episode_tokens
        return longest, max(longest + cfg.rollout.max_tokens, cfg.env.max_episode_tokens)
    return longest, longest + cfg.rollout.max_tokens


def check_memory(
    cfg: Config, dist_info: Distributed, policy, tokenizer, prompts, measure: Callable[[int], int] | None = None
) -> dict:
    """Run the gate; returns its figures for the banner (and sets the token budget where the
    config leaves it out). `measure(sequences)` -> peak bytes of one training pass over a
    micro-batch of that many sequences of the longest length: the device's, unless a test gives
    its own."""
    device = dist_info.device
    prompt_tokens, longest = longest_sequence(cfg, tokenizer, prompts)
    if measure is None and device.type != "cuda":
        return {"skipped": f"on {device.type}: no device memory to probe", "longest_sequence": longest}
    measure = measure or (lambda sequences: probe_peak(policy, cfg, device, longest, sequences))
    try:
        one = measure(1)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise GateRefused("memory", _refusal(cfg, prompt_tokens, longest, None, device)) from None
    try:
        two = measure(2)
    except torch.OutOfMemoryError:  # one fits, two do not: every micro-batch is one sequence
        torch.cuda.empty_cache()
        two = None
    share = 1.0 - cfg.rollout.colocate_gpu_memory if cfg.rollout.colocate else None
    costs = _costs(policy, device, longest, one, two, share)
    need = costs.fixed + costs.per_token * longest + costs.optimizer
    if need > costs.available:
        raise GateRefused("memory", _refusal(cfg, prompt_tokens, longest, (need, costs), device))
    budget = cfg.train.max_tokens_per_micro_batch
    if budget is None:
        spare = costs.available - costs.optimizer - costs.fixed
        fits = int(SHARE * spare / max(costs.per_token, 1.0))
        budget = max(min(fits, AUTO_MAX_TOKENS), longest) if two is not None else longest
        if dist_info.world_size > 1:
            agreed = torch.tensor([budget], device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            budget = int(agreed.item())
        cfg.train.max_tokens_per_micro_batch = budget
        log.info("micro-batches of at most %d padded tokens (set from the memory gate's figures)", budget)
    return {
        "longest_sequence": longest,
        "peak_of_longest_gib": round(need / GIB, 2),
        "per_token_mib": round(costs.per_token / 2**20, 3),
        "available_gib": round(costs.available / GIB, 2),
        "max_tokens_per_micro_batch": budget,
    }


def _costs(
    policy, device: torch.device, longest: int, one: int, two: int | None, colocated_share: float | None
) -> Costs:
    """The line through the peaks of micro-batches of one and two longest sequences (`two` None:
    two did not fit, and a token is charged as if one sequence were all the cost)."""
    per_sequence = two - one if two is not None and two > one else float(one)
    per_token = per_sequence / longest
    fixed = max(one - per_sequence, 0.0)
    trainable = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    states = 0 if policy.optimizer.state else 2 * 4 * trainable  # AdamW's two moments, float32
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        available = free + torch.cuda.memory_reserved(device) - allocated
        if colocated_share is not None:  # the worker beside it may not have taken its share yet
            available = min(available, int(colocated_share * total) - allocated)
        # A process limited to a fraction of the device (torch.cuda.set_per_process_memory_fraction)
        # may hold cached blocks a probe reused, and still not allocate past its fraction.
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _device: 1.0)(device)
        available = min(available, int(fraction * total) - allocated)
    else:  # a test's measure on a CPU: all of the host's memory
        import os

        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Costs(per_token, fixed, states, available)


def probe_peak(policy, cfg: Config, device: torch.device, tokens: int, sequences: int = 1) -> int:
    """Peak bytes above what is allocated now of one training pass over a micro-batch of
    `sequences` sequences of `tokens` tokens each (the last rollout.max_tokens of each generated),
    gradients dropped after it."""
    from ..learning import policy_losses
    from ..learning.train_step import sequence_logprobs

    model = policy.model
    generated = min(cfg.rollout.max_tokens, tokens - 1)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (sequences, tokens), device=device)
    mask = torch.zeros((sequences, tokens - 1), device=device)
    mask[:, tokens - 1 - generated :] = 1.0
    batch = Batch(
        ids,
        torch.ones_like(ids),
        ids[:, 1:].clone(),
        mask,
        torch.zeros_like(mask),
        torch.ones(sequences, device=device),
    )
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model.train()
    logp, _ = sequence_logprobs(model, batch, cfg.rollout.temperature)
    weights = mask / max(generated * sequences, 1)
    loss, _ = policy_losses.policy_loss(
        cfg.loss.policy, logp, logp.detach(), batch.advantages, weights, cfg.loss.clip_low, cfg.loss.clip_high
    )
    loss.backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    model.zero_grad(set_to_none=True)
    del logp, loss
    return peak


def _refusal(cfg: Config, prompt_tokens: int, longest: int, measured, device: torch.device) -> str:
    what = (
        f"one sequence of the longest length this config allows, {longest} tokens (the longest prompt, "
        f"{prompt_tokens} tokens, + rollout.max_tokens = {cfg.rollout.max_tokens}), "
    )
    if measured is None:
        figures = f"ran out of memory on {device} in a training pass of its own"
    else:
        need, costs = measured
        figures = (
            f"needs about {need / GIB:.1f} GiB at its peak on {device} ({costs.per_token / 2**20:.2f} MiB a token, "
            f"{costs.optimizer / GIB:.1f} GiB for the optimizer's states), and {costs.available / GIB:.1f} GiB are free"
        )
    fixes = []
    if not cfg.model.activation_checkpointing:
        fixes.append("set model.activation_checkpointing = true (a token then costs a layer's activations, not all)")
    fixes += [
        "lower rollout.max_tokens or shorten the prompts",
        "use more GPUs (FSDP2 shards the model and the optimizer's states)",
        "free the GPU of other processes (nvidia-smi)",
    ]
    return what + figures + ": " + "; ".join(fixes)
