"""One training step of GRPO: the step's sequences, in `train.updates_per_batch` updates, over
this rank's share of each.

    per update (a part of the step's sequences; one part by default):
        per micro-batch: logprobs, correction of the engine/trainer gap (trainer_svc.learning.corrections),
        clipped surrogate with the update's fixed token weights (+ k3 KL) -> backward, accumulate
        -> clip the gradient norm -> optimizer step
    -> scheduler step (the learning rate moves once per training step)

The old policy's logprobs are those of the model before the step's first update: with one
update they are each micro-batch's own logprobs, detached (the model does not change before
every micro-batch has been through it); with several, a no-grad pass computes them first.
The token weights are computed from the whole update (all ranks, all micro-batches), so its
gradient is the same however it is split (see grpo.token_weights and grpo.rank_scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import Config
from ..distributed import Distributed
from ..rollout_types import Group
from . import corrections, grpo, policy_losses
from .batch import Batch, budget_count, collate, micro_batches, rank_share, token_budget_split
from .model import compile_enabled
from .token_logprobs import sequence_logprobs, use_packing

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
    "ratio_mean": 0.0,
    "ratio_max": 0.0,
    "corrected_fraction": 0.0,
    "kl_engine": 0.0,
    "micro_batches": 0,
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
    """The sizes of a whole update (all ranks), which fix its loss denominators."""

    tokens: int
    sequences: int


@torch.no_grad()
def old_logprobs(model, micro: list[Batch], cfg: Config, compiled: bool = False) -> list[torch.Tensor]:
    packed = use_packing(cfg.train.packing, model)
    return [sequence_logprobs(model, mb, cfg.rollout.temperature, compiled, packed=packed)[0] for mb in micro]


def learn(policy: Policy, groups: list[Group], advantages: torch.Tensor, cfg: Config, dist_info: Distributed) -> dict:
    """The step's updates on its sampled groups and their advantages ([P, G]; every rank takes its
    share of each); returns the step's statistics, over all ranks, the same on every rank."""
    batch = collate(groups, advantages, policy.pad_id)
    if int(batch.mask.sum()) == 0:  # nothing was generated: no loss to take, the tripwire judges the step
        policy.scheduler.step()
        return {**_NOTHING_LEARNED, "lr": policy.scheduler.get_last_lr()[0]}
    updates = []
    for part in micro_batches(batch, cfg.train.updates_per_batch):  # whole prompts' groups stay together
        totals = StepTotals(tokens=int(part.mask.sum()), sequences=len(part))
        updates.append((rank_share(part, dist_info.rank, dist_info.world_size).to(dist_info.device), totals))
    return train_step(policy.model, policy.reference, policy.optimizer, policy.scheduler, updates, cfg, dist_info)


def split_share(share: Batch, cfg: Config, dist_info: Distributed) -> list[Batch]:
    """This rank's share of an update as micro-batches of at most train.max_tokens_per_micro_batch
    padded tokens, at least train.grad_accum of them; ranks take the same number (an FSDP2
    forward and backward are collectives), the largest any rank needs."""
    ordered = share.by_length()
    budget = cfg.train.max_tokens_per_micro_batch
    count = min(max(cfg.train.grad_accum, budget_count(ordered, budget)), len(ordered))
    if dist_info.world_size > 1:
        agreed = torch.tensor([count], device=dist_info.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        count = int(agreed.item())
    return token_budget_split(ordered, budget, count)


def train_step(
    model, reference, optimizer, scheduler, updates: list[tuple[Batch, StepTotals]], cfg: Config, dist_info
) -> dict:
    """The step's updates, each on this rank's share of a part of the step with that part's
    totals; returns the step's statistics (sums over updates, micro-batches and ranks)."""
    model.train()
    parts = [split_share(share, cfg, dist_info) for share, _ in updates]
    compiled = compile_enabled(cfg.model.compile, dist_info.device)
    old = [old_logprobs(model, micro, cfg, compiled) for micro in parts] if len(parts) > 1 else None
    ref = [old_logprobs(reference, micro, cfg, compiled) for micro in parts] if reference is not None else None
    tally = _Tally()
    for u, ((_, totals), micro) in enumerate(zip(updates, parts, strict=True)):
        tally.micro_batches += len(micro)
        for i, mb in enumerate(micro):
            old_mb = None if old is None else old[u][i]
            loss = _micro_batch_loss(
                model, mb, totals, old_mb, None if ref is None else ref[u][i], cfg, compiled, tally
            )
            (loss * grpo.rank_scale(dist_info.world_size)).backward()
        tally.put("grad_norm", _full(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    tally.read()
    if dist_info.world_size > 1:  # every rank reports the whole step, so every rank judges it alike
        tally.add_over_ranks(dist_info.device)
    return tally.report(len(updates), scheduler.get_last_lr()[0])


def _micro_batch_loss(
    model, mb: Batch, totals: StepTotals, old: torch.Tensor | None, ref: torch.Tensor | None, cfg: Config,
    compiled: bool, tally: _Tally,
) -> torch.Tensor:  # fmt: skip
    """The micro-batch's share of the update's loss (clipped surrogate with the update's token
    weights and the engine-gap correction, + k3 KL); its statistics go into `tally`. `old`: the
    old policy's logprobs, None where they are this pass's own (one update per step)."""
    loss_cfg = cfg.loss
    weights = grpo.token_weights(
        mb.mask,
        loss_cfg.denominator,
        step_tokens=totals.tokens,
        step_sequences=totals.sequences,
        max_tokens=cfg.rollout.max_tokens,
    )
    packed = use_packing(cfg.train.packing, model)
    logp, entropy = sequence_logprobs(model, mb, cfg.rollout.temperature, compiled, packed=packed)
    old = logp.detach() if old is None else old
    log_r = corrections.log_ratio(old, mb.rollout_logprobs, mb.mask)
    c, changed = corrections.correction_weights(
        log_r,
        mb.mask,
        loss_cfg.correction,
        cap=loss_cfg.correction_cap,
        low=loss_cfg.correction_low,
        high=loss_cfg.correction_high,
    )
    loss, stats = policy_losses.policy_loss(
        loss_cfg.policy, logp, old, mb.advantages, weights * c, loss_cfg.clip_low, loss_cfg.clip_high
    )
    if ref is not None:
        kl = grpo.kl_penalty(logp, ref, weights, 1.0)
        loss = loss + loss_cfg.kl_coef * kl
        tally.put("kl", kl)
    tally.add(mb, loss, weights, entropy, stats, old, corrections.correction_stats(log_r, mb.mask, changed))
    return loss


class _Tally:
    """A step's statistics as sums (and maxima) over its micro-batches, then its ranks. They stay
    on the device until the step ends and are read back in one transfer: a read per micro-batch
    would make the host wait for the device each time, so it could not queue the next kernels."""

    SUMS = ("loss", "entropy", "kl", "clip_low", "clip_high", "weight", "tokens", "mismatch")
    SUMS += ("ratio_sum", "changed_sum", "k3_sum", "grad_norm")  # grad_norm: summed over updates only
    PEAKS = ("mismatch_max", "ratio_max")

    def __init__(self) -> None:
        self.parts: dict[str, list[torch.Tensor]] = {key: [] for key in self.SUMS + self.PEAKS}
        self.sums: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self.grad_norm = 0.0
        self.micro_batches = 0  # this rank's forward and backward passes, the same on every rank

    def put(self, key: str, value: torch.Tensor) -> None:
        self.parts[key].append(value.detach().reshape(()).to(torch.float64))

    def add(self, mb: Batch, loss, weights, entropy, stats: dict, old: torch.Tensor, gap: dict) -> None:
        tokens = mb.mask.sum()
        mismatch = (old - mb.rollout_logprobs).abs() * mb.mask
        self.put("loss", loss)
        self.put("entropy", (weights * entropy).sum())
        self.put("weight", weights.sum())
        self.put("clip_low", stats["clip_fraction_low"] * tokens)
        self.put("clip_high", stats["clip_fraction_high"] * tokens)
        self.put("tokens", tokens)
        self.put("mismatch", mismatch.sum())
        for key in ("ratio_sum", "changed_sum", "k3_sum"):
            self.put(key, gap[key])
        self.put("mismatch_max", mismatch.max() if mismatch.numel() else mismatch.new_zeros(()))
        self.put("ratio_max", gap["ratio_max"])

    def read(self) -> None:
        """The step's sums and maxima, read back from the device at once."""
        values = [torch.stack(self.parts[key]).sum() if self.parts[key] else None for key in self.SUMS]
        values += [torch.stack(self.parts[key]).max() if self.parts[key] else None for key in self.PEAKS]
        present = [v for v in values if v is not None]
        read = iter(torch.stack(present).tolist() if present else [])
        numbers = [0.0 if v is None else next(read) for v in values]
        self.sums = dict(zip(self.SUMS, numbers[: len(self.SUMS)], strict=True))
        self.peaks = dict(zip(self.PEAKS, numbers[len(self.SUMS) :], strict=True))
        self.grad_norm = self.sums.pop("grad_norm")  # not added over ranks: clipping reduced it already

    def add_over_ranks(self, device: torch.device) -> None:
        self.sums, self.peaks = _over_ranks(self.sums, self.peaks, device)

    def report(self, updates: int, lr: float) -> dict:
        sums, peaks = self.sums, self.peaks
        tokens = max(sums["tokens"], 1.0)
        return {
            "loss": sums["loss"] / updates,
            # weighted sums over this rank's tokens, reported as weighted means per token
            "entropy": _weighted_mean(sums["entropy"], sums["weight"]),
            "kl": _weighted_mean(sums["kl"], sums["weight"]),
            "clip_fraction_low": sums["clip_low"] / tokens,
            "clip_fraction_high": sums["clip_high"] / tokens,
            "grad_norm": self.grad_norm / updates,
            "lr": lr,
            "mismatch_mean": sums["mismatch"] / tokens,
            "mismatch_max": peaks["mismatch_max"],
            # the engine/trainer gap (trainer_svc.learning.corrections): ratio = p_old / q_engine per token
            "ratio_mean": sums["ratio_sum"] / tokens,
            "ratio_max": peaks["ratio_max"],
            "corrected_fraction": sums["changed_sum"] / tokens,
            "kl_engine": sums["k3_sum"] / tokens,
            "micro_batches": self.micro_batches,  # of the step, all its updates (per rank)
        }


def _over_ranks(sums: dict[str, float], peaks: dict[str, float], device: torch.device):
    """Sums added and maxima taken over all ranks."""
    totals = torch.tensor(list(sums.values()), dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    top = torch.tensor(list(peaks.values()), dtype=torch.float64, device=device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return dict(zip(sums, totals.tolist(), strict=True)), dict(zip(peaks, top.tolist(), strict=True))


def _weighted_mean(weighted_sum: float, total_weight: float) -> float:
    return weighted_sum / total_weight if total_weight > 0 else 0.0


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2) materialised; a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def make_optimizer(model, cfg: Config) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]  # all, or a LoRA adapter's alone
    # On a GPU the fused kernel updates every tensor in a few launches where the default (foreach)
    # takes a dozen passes over all of them; on a CPU the default stays.
    fused = all(p.is_cuda for p in trainable)
    return torch.optim.AdamW(
        trainable, lr=cfg.train.lr, betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay, fused=fused
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
