"""One optimizer step of GRPO over this rank's share of the step's sequences.

    old logprobs (no grad, the policy before the update) -> per micro-batch: logprobs,
    clipped surrogate with the step's fixed token weights (+ k3 KL) -> backward, accumulate
    -> clip the gradient norm -> optimizer and scheduler step

The token weights are computed from the whole step (all ranks, all micro-batches), so the
gradient is the same however the step is split (see grpo.token_weights and grpo.rank_scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import grpo
from .batch import Batch, micro_batches
from .config import Config
from .model import Distributed


@dataclass
class StepTotals:
    """The whole step's sizes, which fix the loss denominators."""

    tokens: int
    sequences: int


def sequence_logprobs(model, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [N, L-1], entropy [N, L-1]) of each target token under `model`."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    return grpo.token_logprobs(logits, batch.targets, temperature), grpo.entropy(logits, temperature)


@torch.no_grad()
def old_logprobs(model, batch: Batch, cfg: Config) -> torch.Tensor:
    parts = [sequence_logprobs(model, mb, cfg.rollout.temperature)[0] for mb in micro_batches(batch, cfg.train.grad_accum)]
    return torch.cat(parts)


def train_step(model, reference, optimizer, scheduler, batch: Batch, totals: StepTotals, cfg: Config, dist_info: Distributed) -> dict:
    """Update the policy on `batch` (this rank's share); returns the step's statistics."""
    model.train()
    old = old_logprobs(model, batch, cfg)
    ref = old_logprobs(reference, batch, cfg) if reference is not None else None
    scale = grpo.rank_scale(dist_info.world_size)
    sums = {"loss": 0.0, "entropy": 0.0, "kl": 0.0, "clip_low": 0.0, "clip_high": 0.0, "weight": 0.0}
    offset = 0
    for mb in micro_batches(batch, cfg.train.grad_accum):
        rows = slice(offset, offset + len(mb))
        offset += len(mb)
        weights = grpo.token_weights(
            mb.mask, cfg.loss.denominator, step_tokens=totals.tokens, step_sequences=totals.sequences, max_tokens=cfg.rollout.max_tokens
        )
        logp, entropy = sequence_logprobs(model, mb, cfg.rollout.temperature)
        loss, stats = grpo.clipped_policy_loss(logp, old[rows], mb.advantages, weights, cfg.loss.clip_low, cfg.loss.clip_high)
        if ref is not None:
            kl = grpo.kl_penalty(logp, ref[rows], weights, 1.0)
            loss = loss + cfg.loss.kl_coef * kl
            sums["kl"] += float(kl)
        (loss * scale).backward()
        sums["loss"] += float(loss.detach())
        sums["entropy"] += float((weights * entropy.detach()).sum())
        sums["weight"] += float(weights.sum())
        sums["clip_low"] += float(stats["clip_fraction_low"]) * float(mb.mask.sum())
        sums["clip_high"] += float(stats["clip_fraction_high"]) * float(mb.mask.sum())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = max(float(batch.mask.sum()), 1.0)
    mismatch = (old - batch.rollout_logprobs).abs() * batch.mask
    return {
        "loss": sums["loss"],
        # weighted sums over this rank's tokens, reported as weighted means per token
        "entropy": _weighted_mean(sums["entropy"], sums["weight"]),
        "kl": _weighted_mean(sums["kl"], sums["weight"]),
        "clip_fraction_low": sums["clip_low"] / tokens,
        "clip_fraction_high": sums["clip_high"] / tokens,
        "grad_norm": float(_full(grad_norm)),
        "lr": scheduler.get_last_lr()[0],
        "mismatch_mean": float(mismatch.sum()) / tokens,
        "mismatch_max": float(mismatch.max()) if batch.mask.any() else 0.0,
    }


def _weighted_mean(weighted_sum: float, total_weight: float) -> float:
    return weighted_sum / total_weight if total_weight > 0 else 0.0


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2) materialised; a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def make_optimizer(model, cfg: Config) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay)


def make_scheduler(optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over `warmup_steps`, then constant, linear or cosine decay to zero at
    `steps`. Its horizon is exactly cfg.train.steps (a launch gate checks it)."""
    import math

    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        if t.schedule == "linear":
            return max(0.0, 1.0 - progress)
        if t.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    scheduler.total_steps = t.steps  # the horizon the factor was built for (a launch gate checks it)
    return scheduler
