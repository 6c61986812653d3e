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
import torch.distributed as dist

from . import grpo
from .batch import Batch, collate, micro_batches, rank_share
from .config import Config
from .model import Distributed
from .sampling import StepRollouts

# What a step that generated no tokens reports: there is no loss to take.
_NOTHING_LEARNED = {
    "loss": 0.0,
    "entropy": 0.0,
    "kl": 0.0,
    "clip_fraction_low": 0.0,
    "clip_fraction_high": 0.0,
    "grad_norm": 0.0,
    "mismatch_mean": 0.0,
    "mismatch_max": 0.0,
}


@dataclass
class Policy:
    """What training updates, and what it is measured against."""

    model: torch.nn.Module
    reference: torch.nn.Module | None  # the frozen starting model, for the KL term; None without it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    pad_id: int


@dataclass
class StepTotals:
    """The whole step's sizes, which fix the loss denominators."""

    tokens: int
    sequences: int


def sequence_logprobs(model, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [N, L-1], entropy [N, L-1]) of each target token under `model`. The entropy is
    a statistic: computed without a graph, so its [N, L-1, V] intermediates are freed at once
    instead of living until the backward pass."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp = grpo.token_logprobs(logits, batch.targets, temperature)
    with torch.no_grad():
        entropy = grpo.entropy(logits.detach(), temperature)
    return logp, entropy


@torch.no_grad()
def old_logprobs(model, micro: list[Batch], cfg: Config) -> list[torch.Tensor]:
    return [sequence_logprobs(model, mb, cfg.rollout.temperature)[0] for mb in micro]


def learn(policy: Policy, rollouts: StepRollouts, cfg: Config, dist_info: Distributed) -> dict:
    """One optimizer step on the step's rollouts (every rank takes its share); returns the step's
    statistics, over all ranks, the same on every rank."""
    batch = collate(rollouts.groups, rollouts.advantages, policy.pad_id)
    totals = StepTotals(tokens=int(batch.mask.sum()), sequences=len(batch))
    if totals.tokens == 0:  # nothing was generated: no loss to take, the tripwire judges the step
        policy.scheduler.step()
        return {**_NOTHING_LEARNED, "lr": policy.scheduler.get_last_lr()[0]}
    share = rank_share(batch, dist_info.rank, dist_info.world_size).to(dist_info.device)
    return train_step(policy.model, policy.reference, policy.optimizer, policy.scheduler, share, totals, cfg, dist_info)


def train_step(
    model, reference, optimizer, scheduler, batch: Batch, totals: StepTotals, cfg: Config, dist_info: Distributed
) -> dict:
    """Update the policy on `batch` (this rank's share); returns the step's statistics.

    The old policy's logprobs (the ratio's denominator) are those of the model before this
    update. The whole batch is one update, so the model does not change until every
    micro-batch has been through it: each micro-batch's own logprobs, detached, ARE the old
    ones, and no separate forward pass is needed (it cost a quarter of the step's compute)."""
    model.train()
    micro = [mb.trimmed() for mb in micro_batches(batch.by_length(), cfg.train.grad_accum)]
    ref = old_logprobs(reference, micro, cfg) if reference is not None else None
    scale = grpo.rank_scale(dist_info.world_size)
    sums = {"loss": 0.0, "entropy": 0.0, "kl": 0.0, "clip_low": 0.0, "clip_high": 0.0, "weight": 0.0}
    sums |= {"tokens": 0.0, "mismatch": 0.0}
    mismatch_max = 0.0
    for i, mb in enumerate(micro):
        weights = grpo.token_weights(
            mb.mask,
            cfg.loss.denominator,
            step_tokens=totals.tokens,
            step_sequences=totals.sequences,
            max_tokens=cfg.rollout.max_tokens,
        )
        logp, entropy = sequence_logprobs(model, mb, cfg.rollout.temperature)
        old = logp.detach()
        loss, stats = grpo.clipped_policy_loss(logp, old, mb.advantages, weights, cfg.loss.clip_low, cfg.loss.clip_high)
        if ref is not None:
            kl = grpo.kl_penalty(logp, ref[i], weights, 1.0)
            loss = loss + cfg.loss.kl_coef * kl
            sums["kl"] += float(kl)
        (loss * scale).backward()
        tokens = float(mb.mask.sum())
        mismatch = (old - mb.rollout_logprobs).abs() * mb.mask
        sums["loss"] += float(loss.detach())
        sums["entropy"] += float((weights * entropy).sum())
        sums["weight"] += float(weights.sum())
        sums["clip_low"] += float(stats["clip_fraction_low"]) * tokens
        sums["clip_high"] += float(stats["clip_fraction_high"]) * tokens
        sums["tokens"] += tokens
        sums["mismatch"] += float(mismatch.sum())
        mismatch_max = max(mismatch_max, float(mismatch.max()) if tokens else 0.0)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if dist_info.world_size > 1:  # every rank reports the whole step, so every rank judges it alike
        sums, mismatch_max = _over_ranks(sums, mismatch_max, dist_info.device)
    tokens = max(sums["tokens"], 1.0)
    return {
        "loss": sums["loss"],
        # weighted sums over this rank's tokens, reported as weighted means per token
        "entropy": _weighted_mean(sums["entropy"], sums["weight"]),
        "kl": _weighted_mean(sums["kl"], sums["weight"]),
        "clip_fraction_low": sums["clip_low"] / tokens,
        "clip_fraction_high": sums["clip_high"] / tokens,
        "grad_norm": float(_full(grad_norm)),
        "lr": scheduler.get_last_lr()[0],
        "mismatch_mean": sums["mismatch"] / tokens,
        "mismatch_max": mismatch_max,
    }


def _over_ranks(sums: dict[str, float], maximum: float, device: torch.device) -> tuple[dict[str, float], float]:
    """Sums added and the maximum taken over all ranks."""
    totals = torch.tensor(list(sums.values()), dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    peak = torch.tensor([maximum], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return dict(zip(sums, totals.tolist(), strict=False)), float(peak.item())


def _weighted_mean(weighted_sum: float, total_weight: float) -> float:
    return weighted_sum / total_weight if total_weight > 0 else 0.0


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2) materialised; a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def make_optimizer(model, cfg: Config) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay
    )


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
