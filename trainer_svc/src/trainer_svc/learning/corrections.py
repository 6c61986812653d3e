"""Corrections for the gap between the policy that sampled and the policy that trains.

The engine samples a token with probability q (its own numerics; with `rollout.ahead` also older
weights), the trainer's loss takes the old policy p_old (the trainer's model before this step's
update). GRPO's ratio pi / p_old assumes the samples came from p_old; they came from q. Per
completion token, with masked positions ignored:

    ratio = p_old / q = exp(old_logprob - engine_logprob)

and the token's loss weight is multiplied by a correction c (never differentiated):

    none            c = 1
    tis             c = min(ratio, cap)                         truncated importance sampling
    icepop          c = ratio if low <= ratio <= high else 0    importance weight inside the band, token dropped
                                                                outside (IcePop; its defaults: 0.5 and 5)
    token_mask      c = 1 if low <= ratio <= high else 0        token masking, no reweighting
    sequence_mask   c = 1 for every token of a sequence whose geometric-mean ratio
                    exp(mean_t log ratio) lies in [low, high], else 0

Logged per step (`correction_stats`): the ratio's mean and max, the fraction of tokens the
correction changed (capped or masked), and the k3 estimate of KL(q || p_old) on the engine's
samples, mean over tokens of  ratio - 1 - log(ratio)  (>= 0, 0 iff the two agree).

References
----------
- Truncated importance sampling: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training"; truncated weights as in Espeholt et al. 2018, "IMPALA"
  (arXiv:1802.01561).
- IcePop (double-sided masking with the importance weight kept inside the band): Ling Team 2025,
  "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model" (the
  Ring-1T report, arXiv:2510.18855).
- The sequence-level geometric-mean ratio: Zheng et al. 2025, "Group Sequence Policy
  Optimization" (GSPO).
- k3: Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Correction = Literal["none", "tis", "icepop", "token_mask", "sequence_mask"]


def log_ratio(old_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log(p_old / q) per token [B, T], 0 where mask is 0. Inputs [B, T]; float32 or wider."""
    return (old_logprobs.detach().double() - engine_logprobs.double()).float() * (mask > 0)


def correction_weights(
    log_r: Tensor, mask: Tensor, kind: Correction, *, cap: float, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """(c [B, T], changed [B, T]): the correction of each token's loss weight, and 1 where the
    correction changed it (capped or masked). Both 0 where mask is 0, no gradient."""
    on = mask > 0
    ratio = torch.exp(log_r)
    if kind == "none":
        c = torch.ones_like(ratio)
    elif kind == "tis":
        c = torch.clamp(ratio, max=cap)
    elif kind == "icepop":
        c = torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    elif kind == "token_mask":
        c = ((ratio >= low) & (ratio <= high)).to(ratio.dtype)
    elif kind == "sequence_mask":
        tokens = on.sum(dim=1).clamp(min=1)
        geometric = torch.exp(log_r.sum(dim=1) / tokens)  # [B]
        keep = (geometric >= low) & (geometric <= high)
        c = keep.to(ratio.dtype).unsqueeze(1).expand_as(ratio).clone()
    else:
        raise ValueError(f"correction must be none, tis, icepop, token_mask or sequence_mask, got {kind!r}")
    c = c * on
    if kind == "none":
        changed = torch.zeros_like(on)
    elif kind == "tis":
        changed = (ratio > cap) & on
    else:
        changed = (c == 0) & on
    return c.detach(), changed.to(ratio.dtype)


def correction_stats(log_r: Tensor, mask: Tensor, changed: Tensor) -> dict[str, Tensor]:
    """Sums over the masked tokens, for a step's statistics to add up over micro-batches and
    ranks: ratio_sum, ratio_max, changed_sum, k3_sum, tokens. 0-dim tensors on the batch's device,
    read back once a step: a read per micro-batch would make the host wait for the device."""
    on = mask > 0
    ratio = torch.exp(log_r)
    k3 = ratio - 1 - log_r
    return {
        "ratio_sum": (ratio * on).sum(),
        # ratios are > 0, so 0 stands for "no token" (numel is a shape: no wait for the device)
        "ratio_max": torch.where(on, ratio, 0.0).max() if ratio.numel() else ratio.new_zeros(()),
        "changed_sum": changed.sum(),
        "k3_sum": (k3 * on).sum(),
        "tokens": on.sum(),
    }
