"""GRPO math: group-relative advantages, token log-probabilities, the clipped policy loss.

Every function here is a pure tensor function: no I/O, no globals, no state. Shapes use
P prompts, G samples per prompt, B sequences in a micro-batch, T token positions and V the
vocabulary size.

One optimizer step, split any way
---------------------------------
The loss of an optimizer step is a weighted sum over every completion token of the step,

    L_step = sum_{i, t} w_{i,t} * l_{i,t}

where l is the per-token loss and the weight w (``token_weights``) is built from counts of the
WHOLE step (``step_tokens``, ``step_sequences``, ``max_tokens``), never from the micro-batch at
hand. The step is therefore a plain sum over its micro-batches and ranks,

    L_step = sum_{ranks r} sum_{micro-batches m} L_{r,m},   L_{r,m} = sum_{(i,t) in (r,m)} w * l,

and so is its gradient. Gradient accumulation (one ``.backward()`` per micro-batch) sums, so
one process that runs all micro-batches gets exactly grad L_step, however the sequences were
split. The counts must be those of the whole step on all ranks; the trainer knows them before
it splits the step's batch.

Ranks. DDP and FSDP all-reduce gradients by AVERAGING over the R ranks:

    g = (1 / R) * sum_r grad L_r.

A rank must thus multiply its local loss by R (``rank_scale(R)``) so that
g = (1 / R) * sum_r R * grad L_r = grad L_step, the gradient of one process computing the whole
step: clipping and the optimizer see the same gradient whatever the world size.

The naive alternative, a mean over each micro-batch's own tokens divided by the number of
micro-batches, weighs a token by 1 / (tokens in its micro-batch): the gradient then changes
with the split whenever micro-batches hold different numbers of tokens.

References
----------
- GRPO: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
  Language Models" (arXiv:2402.03300).
- Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
  (arXiv:2503.20783).
- DAPO: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
  (arXiv:2503.14476).
- PPO: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347).
- k3: Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AdvantageNorm = Literal["std", "mean"]
WeightKind = Literal["token", "sequence", "constant"]


def group_advantages(rewards: Tensor, norm: AdvantageNorm, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages of the G samples of each prompt.

    rewards: [P, G] -> advantages [P, G], same dtype.

    With mean_p and std_p the mean and the POPULATION standard deviation (divide by G, not G - 1)
    of row p:

    - "std"  (GRPO, Shao et al. 2024, sec. 4.1.2):  A = (r - mean_p) / (std_p + eps)
    - "mean" (Dr. GRPO, Liu et al. 2025):           A = r - mean_p

    The population std is defined for every G >= 1, so a single-member group needs no special
    case, and the advantages of a group with distinct rewards have population std
    std_p / (std_p + eps), i.e. 1 up to eps.

    A group whose rewards are all equal (G = 1 included) carries no signal; its advantages are
    exactly 0. The mean of equal float values is not always exactly that value (0.1 seven times
    in float32), and r - mean_p divided by a std of the same rounding size would be far from 0.
    """
    if norm not in ("std", "mean"):
        raise ValueError(f"norm must be 'std' or 'mean', got {norm!r}")
    mean = rewards.mean(dim=1, keepdim=True)  # [P, 1]
    centered = rewards - mean  # [P, G]
    all_equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)  # [P, 1]
    centered = torch.where(all_equal, torch.zeros_like(centered), centered)
    if norm == "mean":
        return centered
    std = rewards.std(dim=1, correction=0, keepdim=True)  # [P, 1], population std
    return centered / (std + eps)


def _upcast(logits: Tensor) -> Tensor:
    # bf16 has 8 mantissa bits: a bf16 log-softmax is off by ~1e-2, more than the log-ratio
    # differences PPO clips at. float64 inputs stay float64.
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def logprobs_and_entropy(logits: Tensor, tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Log-probability of each token, and entropy of the distribution it was drawn from, under
    softmax(logits / temperature), in one pass over the logits.

    logits: [B, T, V] (any float dtype), tokens: [B, T] int64 -> (logp [B, T], H [B, T]),
    float32 or wider. With s = logits / temperature and lse = logsumexp(s):

        logp[b, t] = log_softmax(s[b, t])[tokens[b, t]] = s[b, t, tokens[b, t]] - lse[b, t]
        H[b, t]    = -sum_v p_v log p_v = lse[b, t] - sum_v p_v s[b, t, v],   p = softmax(s[b, t])

    computed in at least float32 even for bf16 logits. Gathering minus lse equals gathering the
    log-softmax without a second [B, T, V] tensor, and the entropy reuses lse instead of a second
    log-softmax. The temperature must be the sampling temperature, so that logp matches the
    behaviour policy's log-probabilities. The entropy is a statistic: it is computed without a
    graph (detached), so nothing of it is kept for the backward pass.

    No shifting: logits[b, t] is paired with tokens[b, t]. A causal LM's logits at position t
    predict the token at t + 1, so the caller passes logits[:, :-1] with tokens[:, 1:].
    Every token id must be valid, padding included (the weights mask padding out later).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = _upcast(logits) / temperature  # [B, T, V]
    lse = torch.logsumexp(scaled, dim=-1)  # [B, T]
    logp = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        flat = scaled.detach()
        entropy = lse.detach() - (torch.softmax(flat, dim=-1) * flat).sum(dim=-1)
    return logp, entropy


def logprob_stats(logits: Tensor, tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """``logprobs_and_entropy`` without a graph, with the log-normaliser it computes on the way:
    logits [..., V], tokens [...] -> (logp, H, lse) [...], float32 or wider. What the backward
    pass of logp needs besides the logits is lse alone (``logprob_grad``)."""
    with torch.no_grad():
        scaled = _upcast(logits) / temperature
        lse = torch.logsumexp(scaled, dim=-1)
        logp = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
        entropy = lse - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)
    return logp, entropy, lse


def logprob_grad(logits: Tensor, tokens: Tensor, lse: Tensor, grad_logp: Tensor, temperature: float) -> Tensor:
    """The gradient of sum(grad_logp * logp) with respect to the logits, in their dtype:

        d logp / d logits[v] = (1[v = token] - p_v) / temperature,   p = exp(logits / T - lse)

    one pass over the logits (with ``logprob_stats``'s lse), instead of autograd's several."""
    with torch.no_grad():
        p = torch.exp(_upcast(logits) / temperature - lse.unsqueeze(-1))
        onehot = torch.zeros_like(p).scatter_(-1, tokens.unsqueeze(-1), 1.0)
        return ((onehot - p) * (grad_logp / temperature).unsqueeze(-1)).to(logits.dtype)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per sampled token, elementwise, any shape.

        d = ref_logp - logp,   k3 = exp(d) - d - 1 >= 0

    Unbiased for tokens sampled from pi, and never negative (exp(d) >= 1 + d). It is the
    penalty of GRPO (Shao et al. 2024, eq. 4). expm1 keeps it accurate when d is near 0, where
    exp(d) - 1 would cancel.
    """
    d = ref_logp - logp
    return torch.expm1(d) - d


def _require_positive(**counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1 (a count over the whole optimizer step), got {value}")


def token_weights(
    mask: Tensor,
    kind: WeightKind,
    *,
    step_tokens: int,
    step_sequences: int,
    max_tokens: int,
) -> Tensor:
    """Per-token loss weights whose denominators are fixed for the whole optimizer step.

    mask: [B, T], bool or 0/1, True on completion tokens -> weights [B, T] float32.
    The step's loss is sum(weights * per_token_loss) summed over all its micro-batches and ranks
    (see the module docstring); masked-out tokens weigh 0. With len_i = mask[i].sum():

    - "token"    w = 1 / step_tokens                    DAPO token-level loss (Yu et al. 2025,
                                                        sec. 3.3)
    - "sequence" w = 1 / (len_i * step_sequences)       GRPO's mean of per-sequence means
                                                        (Shao et al. 2024, eq. 3)
    - "constant" w = 1 / (step_sequences * max_tokens)  Dr. GRPO (Liu et al. 2025)

    step_tokens: masked tokens in the whole step; step_sequences: sequences in the whole step;
    max_tokens: the generation budget (a constant of the run, not the padded width). Only the
    counts the kind uses are checked; each must be >= 1. "token" and "sequence" weights sum to 1
    over the step (if no sequence is empty); a sequence with no token weighs 0 everywhere.
    """
    mask = mask.to(torch.float32)  # [B, T]
    if kind == "token":
        _require_positive(step_tokens=step_tokens)
        return mask / step_tokens
    if kind == "sequence":
        _require_positive(step_sequences=step_sequences)
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [B, 1]; 0 / 1 for empty rows
        return mask / (lengths * step_sequences)
    if kind == "constant":
        _require_positive(step_sequences=step_sequences, max_tokens=max_tokens)
        return mask / (step_sequences * max_tokens)
    raise ValueError(f"kind must be 'token', 'sequence' or 'constant', got {kind!r}")


def clipped_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clipping (clip-higher, DAPO).

    logp, old_logp, weights: [B, T]; advantages: [B] (one per sequence, broadcast over T).

        ratio = exp(logp - old_logp)
        l     = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
        loss  = sum(weights * l)                                  (a scalar)

    (Schulman et al. 2017, eq. 7, with one epsilon; clip_high > clip_low is DAPO's clip-higher,
    Yu et al. 2025, sec. 3.1.) The clip is active, and the token's gradient exactly 0, where
    A > 0 and ratio > 1 + clip_high, or A < 0 and ratio < 1 - clip_low.

    Tokens with weight 0 are left out entirely: whatever logp and old_logp hold there (padding
    may hold anything, inf and NaN included), they add exactly 0 to the loss and the gradient.
    An all-zero weights tensor gives a loss of exactly 0 and a zero gradient.

    Stats, detached 0-dim tensors (no host sync here), over the tokens with nonzero weight, each
    token counting once: "clip_fraction_low" / "clip_fraction_high": share of them where the low /
    high clip is active; "ratio_mean": their mean ratio; "log_ratio_abs_max": their largest
    |logp - old_logp|; "tokens": how many they are, to combine micro-batches' shares and means.
    Shares and means are 0 when there is no such token.
    """
    active = weights != 0  # [B, T]
    # Masking before exp keeps padding's inf/NaN out of the forward and the backward pass.
    log_ratio = torch.where(active, logp - old_logp, torch.zeros_like(logp))  # [B, T]
    ratio = log_ratio.exp()  # [B, T]
    adv = advantages.unsqueeze(-1).to(ratio.dtype)  # [B, 1]
    surrogate = ratio * adv
    clipped_surrogate = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    per_token_loss = -torch.minimum(surrogate, clipped_surrogate)  # [B, T]
    loss = (weights * per_token_loss).sum()

    with torch.no_grad():
        clipped_low = active & (adv < 0) & (ratio < 1 - clip_low)  # [B, T]
        clipped_high = active & (adv > 0) & (ratio > 1 + clip_high)  # [B, T]
        tokens = active.sum().to(ratio.dtype)
        per_token = tokens.clamp(min=1)  # shares and means of no token are 0, not NaN
        stats = {
            "clip_fraction_low": clipped_low.sum() / per_token,
            "clip_fraction_high": clipped_high.sum() / per_token,
            "ratio_mean": (ratio * active).sum() / per_token,
            "log_ratio_abs_max": log_ratio.abs().max(),  # log_ratio is 0 off the active tokens
            "tokens": tokens,
        }
    return loss, stats


def kl_penalty(logp: Tensor, ref_logp: Tensor, weights: Tensor, coef: float) -> Tensor:
    """KL penalty toward the reference policy, to add to the policy loss.

    logp, ref_logp, weights: [B, T] -> scalar  coef * sum(weights * kl_k3(logp, ref_logp))
    (GRPO, Shao et al. 2024, eq. 3-4). Tokens with weight 0 are left out as in
    ``clipped_policy_loss``.
    """
    active = weights != 0
    logp = torch.where(active, logp, torch.zeros_like(logp))
    ref_logp = torch.where(active, ref_logp, torch.zeros_like(ref_logp))
    return coef * (weights * kl_k3(logp, ref_logp)).sum()


def rank_scale(world_size: int) -> float:
    """Factor on each rank's local loss when DDP/FSDP average gradients over ranks.

    The all-reduce computes (1 / R) * sum_r g_r; scaling each local loss by R makes that
    sum_r g_r, the gradient of the whole step (see the module docstring).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return float(world_size)
