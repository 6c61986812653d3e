"""GSPO's sequence ratio and CISPO's truncated weights against values worked out by hand, and a run
that trains with each: trainer_svc.learning.policy_losses."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_config
from local_sampler import TorchSampler

from protocol import exit_codes
from trainer_svc.config import POLICY_CLIPS, LossConfig
from trainer_svc.learning import grpo
from trainer_svc.learning.policy_losses import cispo_loss, gspo_loss, policy_loss
from trainer_svc.run.loop import train


def leaf(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def test_gspo_clips_the_sequences_mean_log_ratio_by_hand():
    # Sequence 0: log-ratios 0.2 and 0.0 -> s = e^0.1 = 1.10517 > 1 + 0.05 with A = +1: clipped,
    # l = -1.05, no gradient. Sequence 1: log-ratios 0.02 and 0.0 -> s = e^0.01 = 1.01005 with
    # A = -1: inside the band, l = -min(-s, -s) = s; d l / d logp_t = s / 2 on each of its 2 tokens.
    # Sequence 2: its third position is padding (weight 0, logp NaN): left out of the length.
    old = torch.zeros(3, 3, dtype=torch.float64)
    logp = leaf([[0.2, 0.0, 0.0], [0.02, 0.0, 0.0], [0.0, 0.0, float("nan")]])
    weights = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.5, 0.5, 0.0]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    loss, stats = gspo_loss(logp, old, advantages, weights, 0.05, 0.05)
    s1 = math.exp(0.01)
    # sum over tokens of weight * l_i: each sequence's two tokens weigh 0.5 + 0.5 = 1
    assert loss.item() == pytest.approx(-1.05 + s1 + -2.0 * 1.0, abs=1e-12)
    loss.backward()
    expected_grad = [[0.0, 0.0, 0.0], [s1 / 2, s1 / 2, 0.0], [-1.0, -1.0, 0.0]]  # seq 2: s = 1, A = 2: -A/2 each
    assert torch.allclose(logp.grad, torch.tensor(expected_grad, dtype=torch.float64), atol=1e-12)
    assert stats["clip_fraction_high"].item() == pytest.approx(2 / 6) and stats["clip_fraction_low"].item() == 0


def test_cispo_keeps_the_gradient_of_tokens_that_the_token_clip_drops_by_hand():
    # Token 0: ratio 1.5 with A = +1: PPO's clip (0.2, 0.28) cuts its gradient to 0; CISPO's weight
    # is min(1.5, 1.28) = 1.28, l = -1.28, d l / d logp = -1.28. Token 1: ratio 0.5 with A = -1:
    # PPO's low clip cuts it; CISPO (no lower bound, clip_low = 1) weighs it 0.5: l = 0.5 and
    # d l / d logp = +0.5. Token 2: ratio 1 with A = +1: l = -1, gradient -1 under both.
    old = torch.zeros(3, 1, dtype=torch.float64)
    logp = leaf([[math.log(1.5)], [math.log(0.5)], [0.0]])
    weights = torch.ones(3, 1, dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    loss, stats = cispo_loss(logp, old, advantages, weights, 1.0, 0.28)
    assert loss.item() == pytest.approx(-1.28 + 0.5 - 1.0, abs=1e-12)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.28], [0.5], [-1.0]], dtype=torch.float64), atol=1e-12)
    assert stats["clip_fraction_high"].item() == pytest.approx(1 / 3) and stats["clip_fraction_low"].item() == 0

    clipped = leaf([[math.log(1.5)], [math.log(0.5)], [0.0]])
    grpo.clipped_policy_loss(clipped, old, advantages, weights, 0.2, 0.28)[0].backward()
    assert clipped.grad[:2].abs().sum().item() == 0.0 and clipped.grad[2].item() == pytest.approx(-1.0)


def test_with_ratio_one_every_policy_gives_the_same_gradient():
    """One update per batch: logp equals old_logp, every ratio is 1, and the three losses are
    the same policy gradient, -sum(w A grad logp)."""
    torch.manual_seed(0)
    base = torch.randn(4, 6, dtype=torch.float64)
    weights = (torch.rand(4, 6) > 0.3).double() / 10
    advantages = torch.randn(4, dtype=torch.float64)
    grads = {}
    for kind in ("clip", "gspo", "cispo"):
        logp = base.clone().requires_grad_(True)
        low, high = POLICY_CLIPS[kind]
        loss, _ = policy_loss(kind, logp, base.detach(), advantages, weights, low, high)
        loss.backward()
        grads[kind] = logp.grad
    assert torch.allclose(grads["clip"], grads["cispo"], atol=1e-12)
    # GSPO spreads each sequence's advantage over its tokens by the sequence's own token count.
    lengths = (weights != 0).sum(dim=1, keepdim=True).clamp(min=1)
    gspo_expected = -(weights.sum(dim=1, keepdim=True) * advantages.unsqueeze(-1) / lengths) * (weights != 0)
    assert torch.allclose(grads["gspo"], gspo_expected, atol=1e-12)


def test_a_policy_left_out_of_the_config_takes_its_own_clip_range():
    assert (LossConfig().clip_low, LossConfig().clip_high) == (0.2, 0.28)
    assert (LossConfig(policy="gspo").clip_low, LossConfig(policy="gspo").clip_high) == (3e-4, 4e-4)
    assert (LossConfig(policy="cispo").clip_low, LossConfig(policy="cispo").clip_high) == (1.0, 0.28)
    assert LossConfig(policy="gspo", clip_high=0.01).clip_high == 0.01


def run_rows(cfg) -> list[dict]:
    assert train(cfg, make_sampler=lambda cfg, launch_id: TorchSampler(cfg)) == exit_codes.OK
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.mark.timeout(300)
def test_a_run_trains_with_each_policy_loss_and_the_choice_reaches_the_loss(warm_model, tmp_path):
    """Two updates per batch, so the second update's ratio moves off 1 and the losses part ways:
    the same run under each policy has the same first update and other losses after it."""
    rows = {}
    for policy in ("clip", "gspo", "cispo"):
        train_cfg = {"steps": 3, "updates_per_batch": 2}
        cfg = make_config(tmp_path / policy, warm_model, train=train_cfg, loss={"policy": policy})
        rows[policy] = run_rows(cfg)
        assert len(rows[policy]) == 3
        assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows[policy]), rows[policy]
    for policy in ("gspo", "cispo"):
        assert [r["loss"] for r in rows[policy]] != [r["loss"] for r in rows["clip"]], policy
