"""GRPO math against hand-written references (Python loops over small tensors), its edges, and
the invariance of the step's gradient to how the step is split into micro-batches and ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from trainer_svc.learning.grpo import (
    clipped_policy_loss,
    group_advantages,
    kl_k3,
    kl_penalty,
    logprobs_and_entropy,
    rank_scale,
    token_weights,
)

torch.set_num_threads(1)


def token_logprobs(logits, tokens, temperature):
    return logprobs_and_entropy(logits, tokens, temperature)[0]


def entropy(logits, temperature):
    return logprobs_and_entropy(logits, torch.zeros(logits.shape[:-1], dtype=torch.long), temperature)[1]


CLIP_LOW, CLIP_HIGH = 0.2, 0.28
WEIGHT_KINDS = ["token", "sequence", "constant"]


# ---------------------------------------------------------------- hand-written references


def ref_group_advantages(rewards: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    out = []
    for row in rewards.tolist():
        g = len(row)
        mean = sum(row) / g
        if all(r == row[0] for r in row):
            out.append([0.0] * g)
            continue
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / g)  # population std
        out.append([(r - mean) / (std + eps) if norm == "std" else r - mean for r in row])
    return torch.tensor(out, dtype=torch.float64)


def ref_log_softmax(row: list[float], temperature: float) -> list[float]:
    z = [x / temperature for x in row]
    top = max(z)
    log_normalizer = top + math.log(sum(math.exp(x - top) for x in z))
    return [x - log_normalizer for x in z]


def ref_token_logprobs(logits, tokens, temperature) -> torch.Tensor:
    out = []
    for rows, toks in zip(logits.double().tolist(), tokens.tolist(), strict=False):
        out.append([ref_log_softmax(row, temperature)[tok] for row, tok in zip(rows, toks, strict=False)])
    return torch.tensor(out, dtype=torch.float64)


def ref_entropy(logits, temperature) -> torch.Tensor:
    out = []
    for rows in logits.double().tolist():
        line = []
        for row in rows:
            log_probs = ref_log_softmax(row, temperature)
            line.append(-sum(math.exp(lp) * lp for lp in log_probs))
        out.append(line)
    return torch.tensor(out, dtype=torch.float64)


def ref_token_weights(mask, kind, step_tokens, step_sequences, max_tokens) -> torch.Tensor:
    out = []
    for row in mask.tolist():
        length = sum(1 for m in row if m)
        line = []
        for m in row:
            if not m:
                line.append(0.0)
            elif kind == "token":
                line.append(1 / step_tokens)
            elif kind == "sequence":
                line.append(1 / (length * step_sequences))
            else:
                line.append(1 / (step_sequences * max_tokens))
        out.append(line)
    return torch.tensor(out, dtype=torch.float64)


def ref_clipped_policy_loss(logp, old_logp, advantages, weights, clip_low, clip_high):
    """PPO by the definition, token by token: the loss, d loss / d logp, and the stats."""
    loss, tokens, low, high, ratio_sum, max_abs = 0.0, 0, 0, 0, 0.0, 0.0
    grad = []
    rows = zip(logp.tolist(), old_logp.tolist(), advantages.tolist(), weights.tolist(), strict=False)
    for lps, olps, adv, ws in rows:
        grad_row = []
        for lp, olp, w in zip(lps, olps, ws, strict=False):
            if w == 0:
                grad_row.append(0.0)
                continue
            ratio = math.exp(lp - olp)
            unclipped = ratio * adv
            clipped = min(max(ratio, 1 - clip_low), 1 + clip_high) * adv
            if unclipped <= clipped:  # the min is the unclipped term: it carries the gradient
                loss -= w * unclipped
                grad_row.append(-w * adv * ratio)  # d(-w * exp(lp - olp) * A) / d lp
            else:  # the clipped term is a constant in lp
                loss -= w * clipped
                grad_row.append(0.0)
            tokens += 1
            low += adv < 0 and ratio < 1 - clip_low
            high += adv > 0 and ratio > 1 + clip_high
            ratio_sum += ratio
            max_abs = max(max_abs, abs(lp - olp))
        grad.append(grad_row)
    per_token = (lambda x: x / tokens) if tokens else (lambda x: 0.0)
    stats = {
        "clip_fraction_low": per_token(low),
        "clip_fraction_high": per_token(high),
        "ratio_mean": per_token(ratio_sum),
        "log_ratio_abs_max": max_abs,
        "tokens": tokens,
    }
    return loss, torch.tensor(grad, dtype=torch.float64), stats


# ---------------------------------------------------------------- advantages


@pytest.mark.parametrize("norm", ["std", "mean"])
def test_group_advantages_match_reference(norm):
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, -1.0, 2.0, 0.25], [3.0, 3.0, 3.0, 3.0]], dtype=torch.float64)
    assert_close(group_advantages(rewards, norm), ref_group_advantages(rewards, norm, 1e-6))


def test_group_advantages_keep_dtype():
    rewards = torch.tensor([[1.0, 0.0, 0.5]])
    out = group_advantages(rewards, "std")
    assert out.dtype == torch.float32
    assert_close(out, ref_group_advantages(rewards, "std", 1e-6).float())


@pytest.mark.parametrize("norm", ["std", "mean"])
@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 1 / 3, 0.0, -2.5])
def test_all_equal_rewards_give_exact_zeros(norm, value):
    # Seven copies of 0.1 in float32 have a mean that differs from 0.1 by one ulp; without the
    # all-equal case the "std" advantages would be about -0.007, not 0.
    rewards = torch.full((2, 7), value)
    out = group_advantages(rewards, norm)
    assert torch.equal(out, torch.zeros_like(rewards))


@pytest.mark.parametrize("norm", ["std", "mean"])
def test_single_member_group_gives_zero(norm):
    rewards = torch.tensor([[0.3], [-1.0], [5.0]])
    assert torch.equal(group_advantages(rewards, norm), torch.zeros_like(rewards))


def test_group_advantages_reject_unknown_norm():
    with pytest.raises(ValueError, match="norm"):
        group_advantages(torch.zeros(1, 2), "max")  # type: ignore[arg-type]


_reward = st.floats(-10, 10, allow_nan=False, allow_infinity=False)


@st.composite
def _groups(draw, min_size: int = 1):
    size = draw(st.integers(min_size, 8))
    n_groups = draw(st.integers(1, 3))
    rows = [draw(st.lists(_reward, min_size=size, max_size=size)) for _ in range(n_groups)]
    return torch.tensor(rows, dtype=torch.float64)


@settings(max_examples=100, deadline=None)
@given(rewards=_groups(), shift=st.floats(-100, 100), norm=st.sampled_from(["std", "mean"]))
def test_advantages_are_shift_invariant(rewards, shift, norm):
    assert_close(
        group_advantages(rewards + shift, norm),
        group_advantages(rewards, norm),
        atol=1e-6,
        rtol=1e-6,
    )


@settings(max_examples=100, deadline=None)
@given(rewards=_groups(min_size=2))
def test_std_advantages_have_mean_zero_and_population_std_one(rewards):
    eps = 1e-6
    spread = rewards.max(dim=1).values - rewards.min(dim=1).values
    rewards = rewards[spread > 1e-3]  # groups with signal; all-equal groups are tested above
    assume(rewards.numel() > 0)
    std = rewards.std(dim=1, correction=0)
    adv = group_advantages(rewards, "std", eps)
    assert_close(adv.mean(dim=1), torch.zeros_like(std), atol=1e-9, rtol=0)
    # Exactly std / (std + eps): within eps / std of 1.
    assert_close(adv.std(dim=1, correction=0), std / (std + eps))
    assert ((adv.std(dim=1, correction=0) - 1).abs() <= eps / std + 1e-12).all()


# ---------------------------------------------------------------- log-probs and entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_token_logprobs_match_reference(temperature):
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 5, 11, generator=gen)
    tokens = torch.randint(0, 11, (2, 5), generator=gen)
    out = token_logprobs(logits, tokens, temperature)
    assert out.shape == (2, 5) and out.dtype == torch.float32
    assert_close(out, ref_token_logprobs(logits, tokens, temperature).float())


def test_token_logprobs_do_not_shift():
    # Position t scores tokens[t] with logits[t]; aligning with the next token is the caller's.
    logits = torch.full((1, 2, 3), -30.0)
    logits[0, 0, 2] = 0.0
    logits[0, 1, 1] = 0.0
    out = token_logprobs(logits, torch.tensor([[2, 1]]), temperature=1.0)
    assert_close(out, torch.zeros(1, 2), atol=1e-12, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_of_bf16_logits_are_float32(temperature):
    gen = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(3, 4, 50, generator=gen)).bfloat16()
    tokens = torch.randint(0, 50, (3, 4), generator=gen)
    out = token_logprobs(logits, tokens, temperature)
    assert out.dtype == torch.float32
    # The reference reads the same bf16 values exactly; a bf16 computation is off by ~1e-2.
    expected = ref_token_logprobs(logits, tokens, temperature)
    assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_token_logprobs_gradient_matches_reference():
    # d logp[b, t] / d logits[b, t, v] = (1[v == token] - p_v) / temperature
    gen = torch.Generator().manual_seed(2)
    temperature = 0.8
    logits = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 6, (2, 3), generator=gen)
    logp, h = logprobs_and_entropy(logits, tokens, temperature)
    assert not h.requires_grad  # the entropy is detached: the gradient is that of the logprobs alone
    logp.sum().backward()
    expected = torch.zeros(2, 3, 6, dtype=torch.float64)
    for b in range(2):
        for t in range(3):
            log_probs = ref_log_softmax(logits[b, t].tolist(), temperature)
            for v in range(6):
                one_hot = float(v == tokens[b, t])
                expected[b, t, v] = (one_hot - math.exp(log_probs[v])) / temperature
    assert_close(logits.grad, expected)


def test_token_logprobs_reject_non_positive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_matches_reference(temperature, dtype):
    gen = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(2, 4, 9, generator=gen)).to(dtype)
    out = entropy(logits, temperature)
    assert out.shape == (2, 4) and out.dtype == torch.float32
    assert_close(out.double(), ref_entropy(logits, temperature), atol=1e-5, rtol=1e-5)


def test_entropy_of_uniform_is_log_vocab():
    assert_close(entropy(torch.zeros(1, 1, 7), 0.5), torch.full((1, 1), math.log(7)))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_logprobs_and_entropy_equal_the_references(temperature, dtype):
    gen = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(2, 5, 13, generator=gen)).to(dtype)
    tokens = torch.randint(0, 13, (2, 5), generator=gen)
    logp, h = logprobs_and_entropy(logits, tokens, temperature)
    assert logp.dtype == h.dtype == torch.float32
    assert_close(logp.double(), ref_token_logprobs(logits, tokens, temperature), atol=1e-5, rtol=1e-5)
    assert_close(h.double(), ref_entropy(logits, temperature), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- KL


def test_kl_k3_matches_reference():
    logp = torch.tensor([[-1.0, -0.5, -3.0], [-0.1, -2.0, -0.7]], dtype=torch.float64)
    ref_logp = torch.tensor([[-1.2, -0.5, -1.0], [-0.3, -4.0, -0.6]], dtype=torch.float64)
    expected = [
        [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(lps, rs, strict=True)]
        for lps, rs in zip(logp.tolist(), ref_logp.tolist(), strict=True)
    ]
    out = kl_k3(logp, ref_logp)
    assert_close(out, torch.tensor(expected, dtype=torch.float64))
    assert out[0, 1] == 0


@settings(max_examples=100, deadline=None)
@given(logp=st.floats(-30, 0), ref_logp=st.floats(-30, 0))
def test_kl_k3_is_non_negative(logp, ref_logp):
    assert kl_k3(torch.tensor(logp), torch.tensor(ref_logp)) >= 0


def test_kl_penalty_matches_reference():
    logp = torch.tensor([[-1.0, -0.5, -3.0], [-0.1, -2.0, -0.7]], dtype=torch.float64)
    ref_logp = torch.tensor([[-1.2, -0.5, float("nan")], [-0.3, -4.0, -0.6]], dtype=torch.float64)
    weights = torch.tensor([[0.25, 0.25, 0.0], [0.1, 0.2, 0.2]], dtype=torch.float64)
    expected = 0.0
    for lps, rs, ws in zip(logp.tolist(), ref_logp.tolist(), weights.tolist(), strict=False):
        for lp, r, w in zip(lps, rs, ws, strict=False):
            if w:  # the NaN sits on padding, which weighs 0
                expected += w * (math.exp(r - lp) - (r - lp) - 1)
    out = kl_penalty(logp, ref_logp, weights, coef=0.04)
    assert_close(out, torch.tensor(0.04 * expected, dtype=torch.float64))


# ---------------------------------------------------------------- token weights

_MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_token_weights_match_reference(kind):
    counts = dict(step_tokens=23, step_sequences=9, max_tokens=6)
    out = token_weights(_MASK, kind, **counts)
    assert out.dtype == torch.float32
    assert_close(out.double(), ref_token_weights(_MASK, kind, **counts))
    assert torch.equal(out[~_MASK], torch.zeros((~_MASK).sum().item()))


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_token_weights_accept_bool_and_01_masks(kind):
    counts = dict(step_tokens=9, step_sequences=4, max_tokens=5)
    expected = token_weights(_MASK, kind, **counts)
    assert torch.equal(token_weights(_MASK.long(), kind, **counts), expected)
    assert torch.equal(token_weights(_MASK.float(), kind, **counts), expected)


@pytest.mark.parametrize("kind", ["token", "sequence"])
def test_token_and_sequence_weights_of_a_step_sum_to_one(kind):
    mask = _MASK[[0, 1, 3]]  # no empty sequence
    out = token_weights(mask, kind, step_tokens=9, step_sequences=3, max_tokens=5)
    assert_close(out.sum(), torch.tensor(1.0))


@pytest.mark.parametrize(
    ("kind", "bad"),
    [
        ("token", "step_tokens"),
        ("sequence", "step_sequences"),
        ("constant", "step_sequences"),
        ("constant", "max_tokens"),
    ],
)
def test_token_weights_reject_empty_counts(kind, bad):
    counts = dict(step_tokens=4, step_sequences=2, max_tokens=3)
    counts[bad] = 0
    with pytest.raises(ValueError, match=bad):
        token_weights(_MASK, kind, **counts)


def test_token_weights_ignore_counts_the_kind_does_not_use():
    out = token_weights(_MASK, "token", step_tokens=9, step_sequences=0, max_tokens=0)
    assert_close(out.sum(), torch.tensor(1.0))


def test_token_weights_reject_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        token_weights(_MASK, "mean", step_tokens=1, step_sequences=1, max_tokens=1)  # type: ignore


# ---------------------------------------------------------------- clipped policy loss


def _check_against_reference(logp, old_logp, advantages, weights):
    logp = logp.clone().requires_grad_(True)
    loss, stats = clipped_policy_loss(logp, old_logp, advantages, weights, CLIP_LOW, CLIP_HIGH)
    loss.backward()
    ref_loss, ref_grad, ref_stats = ref_clipped_policy_loss(
        logp.detach(), old_logp, advantages, weights, CLIP_LOW, CLIP_HIGH
    )
    assert_close(loss, torch.tensor(ref_loss, dtype=loss.dtype))
    assert_close(logp.grad, ref_grad.to(logp.dtype))
    for name, value in ref_stats.items():
        assert not stats[name].requires_grad
        assert_close(stats[name], torch.tensor(value, dtype=stats[name].dtype), msg=name)
    return logp.grad, stats


def test_clipped_policy_loss_matches_reference_on_random_tokens():
    gen = torch.Generator().manual_seed(2)
    logp = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    old_logp = logp + 0.6 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.5, 0.0, 2.0], dtype=torch.float64)
    mask = torch.arange(6) < torch.tensor([[6], [3], [4], [1]])
    weights = token_weights(mask, "sequence", step_tokens=14, step_sequences=4, max_tokens=6)
    _, stats = _check_against_reference(logp, old_logp, advantages, weights.double())
    # The data exercise both sides of the clip.
    assert stats["clip_fraction_low"] > 0 and stats["clip_fraction_high"] > 0


def test_clip_is_active_exactly_where_ppo_says():
    # Ratios 0.5 (below 1 - 0.2), 1.0, 1.5 (above 1 + 0.28), for A = +1 and A = -1.
    ratios = torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64)
    old_logp = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp = (old_logp + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    weights = torch.full((2, 3), 1 / 6, dtype=torch.float64)
    loss, stats = clipped_policy_loss(logp, old_logp, advantages, weights, CLIP_LOW, CLIP_HIGH)
    loss.backward()
    expected_per_token = torch.tensor(
        [
            # A > 0: low ratio keeps its (smaller) unclipped term; high ratio is capped at 1.28.
            [-0.5, -1.0, -(1 + CLIP_HIGH)],
            # A < 0: low ratio is floored at 0.8; high ratio keeps its (smaller) unclipped term.
            [1 - CLIP_LOW, 1.0, 1.5],
        ],
        dtype=torch.float64,
    )
    assert_close(loss, (expected_per_token / 6).sum())
    # d(-w * ratio * A) / d logp = -w * ratio * A where unclipped, exactly 0 where clipped.
    expected_grad = torch.tensor([[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]], dtype=torch.float64) / 6
    assert_close(logp.grad, expected_grad)
    assert logp.grad[0, 2] == 0 and logp.grad[1, 0] == 0
    assert_close(stats["clip_fraction_low"], torch.tensor(1 / 6, dtype=torch.float64))
    assert_close(stats["clip_fraction_high"], torch.tensor(1 / 6, dtype=torch.float64))
    assert_close(stats["ratio_mean"], torch.tensor(1.0, dtype=torch.float64))
    assert_close(stats["log_ratio_abs_max"], torch.tensor(math.log(2), dtype=torch.float64))


def test_on_policy_loss_is_the_plain_policy_gradient():
    # ratio = 1: loss = -sum(w * A), d loss / d logp = -w * A.
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    advantages = torch.tensor([0.5, -2.0])
    weights = torch.tensor([[0.25, 0.25], [0.5, 0.0]])
    loss, stats = clipped_policy_loss(logp, logp.detach(), advantages, weights, CLIP_LOW, CLIP_HIGH)
    loss.backward()
    assert_close(loss, torch.tensor(-(0.25 * 0.5 + 0.25 * 0.5 - 0.5 * 2.0)))
    assert_close(logp.grad, torch.tensor([[-0.125, -0.125], [1.0, 0.0]]))
    assert stats["clip_fraction_low"] == 0 and stats["clip_fraction_high"] == 0


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_empty_mask_gives_zero_loss_and_zero_gradient(kind):
    # Padding may hold anything, inf and NaN included.
    logp = torch.tensor([[-1.0, float("-inf")], [-0.5, -0.2]], requires_grad=True)
    old_logp = torch.tensor([[float("nan"), -3.0], [float("inf"), -40.0]])
    empty = torch.zeros(2, 2, dtype=torch.bool)
    weights = token_weights(empty, kind, step_tokens=5, step_sequences=2, max_tokens=2)
    assert torch.equal(weights, torch.zeros(2, 2))
    advantages = torch.tensor([1.0, -1.0])
    loss, stats = clipped_policy_loss(logp, old_logp, advantages, weights, CLIP_LOW, CLIP_HIGH)
    loss.backward()
    assert torch.equal(loss, torch.tensor(0.0))
    assert torch.equal(logp.grad, torch.zeros(2, 2))
    for name, value in stats.items():
        assert torch.equal(value, torch.tensor(0.0)), name


def test_padding_values_do_not_leak_into_the_loss():
    logp = torch.tensor([[-1.0, -0.3], [-0.5, -0.2]], dtype=torch.float64)
    clean_old = torch.tensor([[-1.1, -0.3], [-0.4, -0.2]], dtype=torch.float64)
    dirty_old = clean_old.clone()
    dirty_old[0, 1], dirty_old[1, 1] = float("nan"), float("-inf")
    weights = torch.tensor([[0.5, 0.0], [0.5, 0.0]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    grad, stats = _check_against_reference(logp, dirty_old, advantages, weights)
    clean_grad, clean_stats = _check_against_reference(logp, clean_old, advantages, weights)
    assert torch.equal(grad, clean_grad)
    assert all(torch.equal(stats[k], clean_stats[k]) for k in stats)


def test_rank_scale():
    assert rank_scale(1) == 1.0 and rank_scale(2) == 2.0 and rank_scale(8) == 8.0
    with pytest.raises(ValueError, match="world_size"):
        rank_scale(0)


# ---------------------------------------------------------------- gradient invariance

B, T, D, V, G = 8, 8, 5, 11, 4
# Ragged lengths, so that micro-batches hold different numbers of tokens.
LENGTHS = [2, 1, 3, 1, 8, 7, 6, 8]
TEMPERATURE = 0.8


@dataclass
class Step:
    """One optimizer step's batch for a linear "policy": features -> logits, per position."""

    features: torch.Tensor  # [B, T, D]
    tokens: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] bool
    advantages: torch.Tensor  # [B]
    old_logp: torch.Tensor  # [B, T]
    ref_logp: torch.Tensor  # [B, T]


def make_policy() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(D, V).double()


def make_step(policy: torch.nn.Linear) -> Step:
    gen = torch.Generator().manual_seed(5)
    features = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.arange(T) < torch.tensor(LENGTHS).unsqueeze(1)
    rewards = torch.rand(B // G, G, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        logp = token_logprobs(policy(features), tokens, TEMPERATURE)
    # Behaviour and reference policies a little off the current one, so that some ratios clip.
    old_logp = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref_logp = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages = group_advantages(rewards, "std").flatten()
    return Step(features, tokens, mask, advantages, old_logp, ref_logp)


def micro_batch_loss(policy, step: Step, rows: list[int], weights_of) -> torch.Tensor:
    mask = step.mask[rows]
    width = int(mask.sum(dim=1).max())  # trimmed to its longest sequence, as a collator pads
    logits = policy(step.features[rows, :width])
    logp = token_logprobs(logits, step.tokens[rows, :width], TEMPERATURE)
    weights = weights_of(mask[:, :width]).to(logp.dtype)
    loss, _ = clipped_policy_loss(
        logp, step.old_logp[rows, :width], step.advantages[rows], weights, CLIP_LOW, CLIP_HIGH
    )
    return loss + kl_penalty(logp, step.ref_logp[rows, :width], weights, coef=0.05)


def accumulated_grads(policy, step: Step, micro_batches: list[list[int]], weights_of, scale=1.0):
    policy.zero_grad()
    for rows in micro_batches:
        (scale * micro_batch_loss(policy, step, rows, weights_of)).backward()
    return [p.grad.clone() for p in policy.parameters()]


def step_weights(kind: str):
    step_tokens = sum(LENGTHS)
    return lambda mask: token_weights(mask, kind, step_tokens=step_tokens, step_sequences=B, max_tokens=T)


def _split(n_micro_batches: int) -> list[list[int]]:
    return [chunk.tolist() for chunk in torch.arange(B).chunk(n_micro_batches)]


def _assert_grads_close(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e)


def test_invariance_fixture_clips_some_tokens():
    policy = make_policy()
    step = make_step(policy)
    weights = step_weights("token")(step.mask).double()
    logp = token_logprobs(policy(step.features), step.tokens, TEMPERATURE)
    _, stats = clipped_policy_loss(logp, step.old_logp, step.advantages, weights, CLIP_LOW, CLIP_HIGH)
    assert stats["clip_fraction_low"] > 0 and stats["clip_fraction_high"] > 0


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize(
    "micro_batches",
    [_split(1), _split(2), _split(4), _split(8), [[0, 5], [3, 1, 7], [2, 4, 6]]],
    ids=["1", "2", "4", "8", "uneven-shuffled"],
)
def test_step_gradient_does_not_depend_on_micro_batches(kind, micro_batches):
    policy = make_policy()
    step = make_step(policy)
    whole = accumulated_grads(policy, step, _split(1), step_weights(kind))
    split = accumulated_grads(policy, step, micro_batches, step_weights(kind))
    _assert_grads_close(split, whole)


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_step_gradient_averaged_over_ranks_times_rank_scale(kind):
    policy = make_policy()
    step = make_step(policy)
    whole = accumulated_grads(policy, step, _split(1), step_weights(kind))
    # Two ranks with two micro-batches each; DDP/FSDP average the ranks' gradients.
    ranks = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    per_rank = [
        accumulated_grads(policy, step, micro_batches, step_weights(kind), scale=rank_scale(2))
        for micro_batches in ranks
    ]
    averaged = [torch.stack(grads).mean(dim=0) for grads in zip(*per_rank, strict=False)]
    _assert_grads_close(averaged, whole)


def test_naive_micro_batch_mean_breaks_invariance():
    """The bug the step-wide denominator avoids: each micro-batch's own token mean."""
    policy = make_policy()
    step = make_step(policy)
    whole = accumulated_grads(policy, step, _split(1), step_weights("token"))

    def naive(n_micro_batches):
        mean_of_own_tokens = lambda mask: mask.float() / mask.sum() / n_micro_batches  # noqa: E731
        return accumulated_grads(policy, step, _split(n_micro_batches), mean_of_own_tokens)

    _assert_grads_close(naive(1), whole)  # identical on the unsplit step...
    token_counts = [sum(LENGTHS[i] for i in rows) for rows in _split(2)]
    assert token_counts[0] != token_counts[1]
    with pytest.raises(AssertionError):  # ...but not once micro-batches differ in tokens
        _assert_grads_close(naive(2), whole)
