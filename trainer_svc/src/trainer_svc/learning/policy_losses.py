"""The policy loss a run trains with (`loss.policy`): grpo's token-level clip, GSPO's sequence-level
ratio, or CISPO's clipped importance weights. Pure tensor functions, as in grpo.py, with its shapes
(B sequences in a micro-batch, T positions) and its weights: each loss is sum(weights * l) over the
micro-batch's tokens, weights built from counts of the whole step (grpo.token_weights), so the
step's loss does not change with the split.

    clip   the PPO clipped surrogate on each token's ratio pi / pi_old (grpo.clipped_policy_loss)
    gspo   one ratio per sequence, the geometric mean of its tokens' ratios,
               s_i = exp( mean_t (logp - old_logp) ),
           clipped as PPO clips a ratio, l_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i),
           given to each of the sequence's tokens (Zheng et al. 2025, eq. 5-7)
    cispo  each token's ratio truncated and detached, a weight on the policy gradient:
               l = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi
           (Chen et al. 2025, eq. 4), computed as -sg(clip(r)) * A * r / sg(r), whose value is
           -clip(r) A and whose gradient is the same; no token's gradient is ever cut to 0

Which to pick: `clip` for short answers (the standard; a token's ratio is precise). `gspo` for
long reasoning and for mixture-of-experts models: a sequence's ratio does not grow noisier with
its length as products of token ratios do, and GSPO's clip range is about a thousand times
narrower (3e-4 and 4e-4 in the paper) because a mean of log-ratios moves little. `cispo` when
several updates are taken per batch (`train.updates_per_batch` > 1) or rollouts run far
behind (`rollout.ahead`): PPO's clip drops the gradient of tokens whose ratio left the band,
often the rare tokens that fork a reasoning path; CISPO keeps them, with their weight capped.

Tokens with weight 0 are left out entirely, as in grpo.clipped_policy_loss: whatever logp and
old_logp hold there, they add exactly 0 to the loss and to the gradient. Stats, as that
function's: over the tokens with nonzero weight, "clip_fraction_low" / "clip_fraction_high" (for
gspo, the share of tokens whose sequence's ratio is clipped; for cispo, whose weight is
truncated), "ratio_mean" (of the ratio the loss uses), "log_ratio_abs_max", "tokens".

References
----------
- GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071).
- CISPO: MiniMax (Chen et al.) 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with
  Lightning Attention" (arXiv:2506.13585), sec. 3.1.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from . import grpo

PolicyLoss = Literal["clip", "gspo", "cispo"]  # their default clip ranges: trainer_svc.config.POLICY_CLIPS


def policy_loss(
    kind: PolicyLoss,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss `kind` names: logp, old_logp, weights [B, T]; advantages [B] -> (scalar, stats)."""
    losses = {"clip": grpo.clipped_policy_loss, "gspo": gspo_loss, "cispo": cispo_loss}
    if kind not in losses:
        raise ValueError(f"loss.policy must be one of {', '.join(losses)}, got {kind!r}")
    return losses[kind](logp, old_logp, advantages, weights, clip_low, clip_high)


def _active_log_ratio(logp: Tensor, old_logp: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    active = weights != 0  # [B, T]
    # Masking before any exp keeps padding's inf/NaN out of the forward and the backward pass.
    return active, torch.where(active, logp - old_logp, torch.zeros_like(logp))


def _stats(active: Tensor, ratio: Tensor, log_ratio: Tensor, low: Tensor, high: Tensor) -> dict[str, Tensor]:
    with torch.no_grad():
        tokens = active.sum().to(ratio.dtype)
        per_token = tokens.clamp(min=1)  # shares and means of no token are 0, not NaN
        return {
            "clip_fraction_low": (low & active).sum() / per_token,
            "clip_fraction_high": (high & active).sum() / per_token,
            "ratio_mean": (ratio * active).sum() / per_token,
            "log_ratio_abs_max": log_ratio.abs().max() if log_ratio.numel() else log_ratio.new_zeros(()),
            "tokens": tokens,
        }


def gspo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, weights: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the clipped surrogate on each sequence's length-normalised ratio (module docstring).
    A sequence's length is its tokens with nonzero weight; one with none weighs 0."""
    active, log_ratio = _active_log_ratio(logp, old_logp, weights)
    lengths = active.sum(dim=1).clamp(min=1)  # [B]
    seq_log_ratio = log_ratio.sum(dim=1) / lengths  # [B]
    s = seq_log_ratio.exp()  # [B]
    adv = advantages.to(s.dtype)
    per_sequence = -torch.minimum(s * adv, s.clamp(1 - clip_low, 1 + clip_high) * adv)  # [B]
    loss = (weights * per_sequence.unsqueeze(-1)).sum()
    with torch.no_grad():
        low = ((adv < 0) & (s < 1 - clip_low)).unsqueeze(-1).expand_as(active)
        high = ((adv > 0) & (s > 1 + clip_high)).unsqueeze(-1).expand_as(active)
        ratio = s.unsqueeze(-1).expand_as(active)
        seq_abs = seq_log_ratio.abs().unsqueeze(-1).expand_as(active) * active
    return loss, _stats(active, ratio, seq_abs, low, high)


def cispo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, weights: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: each token's policy gradient weighted by its ratio, truncated to
    [1 - clip_low, 1 + clip_high] and detached (module docstring). clip_low = 1 sets no lower bound."""
    active, log_ratio = _active_log_ratio(logp, old_logp, weights)
    ratio = log_ratio.exp()  # [B, T]
    truncated = ratio.detach().clamp(max(1 - clip_low, 0.0), 1 + clip_high)
    adv = advantages.unsqueeze(-1).to(ratio.dtype)  # [B, 1]
    # ratio / sg(ratio) is 1 with the gradient of log pi: the loss reads -truncated * A.
    per_token_loss = -truncated * adv * (ratio / ratio.detach())
    loss = (weights * per_token_loss).sum()
    with torch.no_grad():
        low, high = ratio < 1 - clip_low, ratio > 1 + clip_high
    return loss, _stats(active, ratio, log_ratio, low, high)
