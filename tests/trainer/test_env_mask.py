"""Environment tokens weigh 0 in the loss: collate's mask leaves them out of every weight and
count, the gradient of each policy loss with respect to their log-probabilities is exactly 0
(and not at the assistant's), and the model's gradient does not depend on what is predicted at
their positions."""

from __future__ import annotations

import pytest
import torch
from conftest import make_config

from trainer_svc.learning import corrections, grpo, policy_losses
from trainer_svc.learning.batch import collate
from trainer_svc.learning.train_step import StepTotals, _micro_batch_loss, _Tally
from trainer_svc.rollout_types import Group, Sample

# An episode after a 3-id prompt: assistant (2 ids), environment (3), assistant (2).
EPISODE = Sample(
    [11, 12, 20, 21, 22, 13, 2], [-0.4, -0.6, 0.0, 0.0, 0.0, -0.3, -0.2], "", "stop", [1, 1, 0, 0, 0, 1, 1]
)
SINGLE = Sample([14, 15, 2], [-0.5, -0.1, -0.9], "", "stop")


def batch():
    groups = [Group([5, 6, 7], [EPISODE, SINGLE])]
    return collate(groups, torch.tensor([[1.0, -1.0]]), pad_id=0)


def test_collate_masks_the_environment_turns_positions():
    b = batch()
    # Position t predicts token t + 1: the episode's ids start at position 2 (after the prompt's last).
    assert b.mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert b.mask[1].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0]
    assert b.rollout_logprobs[0, 2:9].tolist() == pytest.approx(EPISODE.logprobs)
    assert int(b.mask.sum()) == 7  # the step's token count (the "token" denominator) leaves them out


@pytest.mark.parametrize("policy", ["clip", "gspo", "cispo"])
@pytest.mark.parametrize("denominator", ["token", "sequence", "constant"])
def test_the_loss_gradient_is_zero_on_environment_tokens_and_not_on_the_assistants(policy, denominator):
    b = batch()
    weights = grpo.token_weights(b.mask, denominator, step_tokens=7, step_sequences=2, max_tokens=4)
    logp = b.rollout_logprobs + 0.05 * torch.randn(b.mask.shape, generator=torch.Generator().manual_seed(0))
    logp.requires_grad_(True)
    old = logp.detach() + 0.01
    c, _ = corrections.correction_weights(
        corrections.log_ratio(old, b.rollout_logprobs, b.mask), b.mask, "tis", cap=2.0, low=0.5, high=5.0
    )
    low, high = {"clip": (0.2, 0.28), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28)}[policy]
    loss, _ = policy_losses.policy_loss(policy, logp, old, b.advantages, weights * c, low, high)
    loss.backward()
    environment = torch.tensor([4, 5, 6])
    assert torch.equal(logp.grad[0, environment], torch.zeros(3))
    assert bool((logp.grad[0, torch.tensor([2, 3, 7, 8])] != 0).all())


def test_the_models_gradient_does_not_depend_on_the_environment_positions(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = make_config(tmp_path / "run", tiny_model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)

    def gradient(changed_position: int | None) -> list[torch.Tensor]:
        b = batch()
        if changed_position is not None:  # another token predicted there
            b.targets[0, changed_position] = 40
        model.zero_grad()
        _micro_batch_loss(model, b, StepTotals(tokens=7, sequences=2), None, None, cfg, False, _Tally()).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    base = gradient(None)
    for position in (4, 5, 6):  # the environment turn's
        assert all(torch.equal(a, b) for a, b in zip(base, gradient(position), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(base, gradient(7), strict=True))  # an assistant's
