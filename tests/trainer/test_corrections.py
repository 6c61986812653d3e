"""trainer_svc.learning.corrections against hand-written references (Python loops over tokens), and the
train step's use of them and of several updates per batch, on the tiny model."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from conftest import make_config

from trainer_svc.learning.corrections import correction_stats, correction_weights, log_ratio

OLD = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.1, -4.0, -1.0]])
ENGINE = torch.tensor([[-1.0, -0.5, -2.0, -9.0], [-0.3, -0.1, -1.0, -1.1]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
BAND = dict(cap=2.0, low=0.5, high=2.0)  # a narrower band than the default, so each side is crossed


def ratios() -> list[list[float | None]]:
    """p_old / q per token, None where masked out."""
    return [
        [math.exp(o - e) if m else None for o, e, m in zip(ro, re, rm, strict=True)]
        for ro, re, rm in zip(OLD.tolist(), ENGINE.tolist(), MASK.tolist(), strict=True)
    ]


def reference(kind: str) -> tuple[list[list[float]], list[list[float]]]:
    c, changed = [], []
    for row in ratios():
        if kind == "sequence_mask":
            logs = [math.log(r) for r in row if r is not None]
            g = math.exp(sum(logs) / len(logs))
            keep = BAND["low"] <= g <= BAND["high"]
        c_row, ch_row = [], []
        for r in row:
            if r is None:
                c_row.append(0.0)
                ch_row.append(0.0)
            elif kind == "none":
                c_row.append(1.0)
                ch_row.append(0.0)
            elif kind == "tis":
                c_row.append(min(r, BAND["cap"]))
                ch_row.append(float(r > BAND["cap"]))
            elif kind in ("icepop", "token_mask"):
                inside = BAND["low"] <= r <= BAND["high"]
                weight = r if kind == "icepop" else 1.0
                c_row.append(weight if inside else 0.0)
                ch_row.append(float(not inside))
            else:
                c_row.append(float(keep))
                ch_row.append(float(not keep))
        c.append(c_row)
        changed.append(ch_row)
    return c, changed


@pytest.mark.parametrize("kind", ["none", "tis", "icepop", "token_mask", "sequence_mask"])
def test_corrections_equal_the_hand_written_reference(kind):
    log_r = log_ratio(OLD, ENGINE, MASK)
    c, changed = correction_weights(log_r, MASK, kind, **BAND)
    want_c, want_changed = reference(kind)
    torch.testing.assert_close(c, torch.tensor(want_c), rtol=1e-6, atol=1e-7)
    assert changed.tolist() == want_changed
    assert not c.requires_grad


def test_icepop_keeps_the_importance_weight_inside_its_band_and_drops_the_rest():
    """Ring-1T's IcePop with its defaults (0.5 and 5): a token whose ratio p_old / q lies in
    [0.5, 5] is weighted by that ratio, any other is dropped. Ratios and weights worked out by
    hand: 0.4 and 6 fall outside, the band's edges are inside."""
    from trainer_svc.config import LossConfig

    defaults = LossConfig()
    assert (defaults.correction_low, defaults.correction_high) == (0.5, 5.0)
    ratio = [0.4, 0.5, 0.8, 1.0, 3.0, 5.0, 6.0]
    log_r = torch.tensor([ratio], dtype=torch.float64).log().float()
    mask = torch.ones_like(log_r)
    c, changed = correction_weights(log_r, mask, "icepop", cap=2.0, low=0.5, high=5.0)
    torch.testing.assert_close(c, torch.tensor([[0.0, 0.5, 0.8, 1.0, 3.0, 5.0, 0.0]]), rtol=1e-6, atol=0.0)
    assert changed.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]
    c, _ = correction_weights(log_r, mask, "token_mask", cap=2.0, low=0.5, high=5.0)
    assert c.tolist() == [[0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]]


def test_the_reference_exercises_every_branch():
    """The fixed inputs hold ratios below, inside and above the band, and one sequence of each
    kind for the sequence mask: otherwise the comparisons above could pass vacuously."""
    flat = [r for row in ratios() for r in row if r is not None]
    assert min(flat) < BAND["low"] and max(flat) > BAND["high"] and any(1 <= r <= 2 for r in flat)
    assert reference("sequence_mask")[1] == [[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]]  # kept, masked


def test_stats_are_sums_over_masked_tokens_and_k3_is_the_hand_formula():
    log_r = log_ratio(OLD, ENGINE, MASK)
    _, changed = correction_weights(log_r, MASK, "icepop", **BAND)
    stats = {key: float(value) for key, value in correction_stats(log_r, MASK, changed).items()}
    flat = [r for row in ratios() for r in row if r is not None]
    assert stats["tokens"] == len(flat) == 6
    assert stats["ratio_sum"] == pytest.approx(sum(flat), rel=1e-6)
    assert stats["ratio_max"] == pytest.approx(max(flat), rel=1e-6)
    assert stats["k3_sum"] == pytest.approx(sum(r - 1 - math.log(r) for r in flat), rel=1e-5)
    assert stats["changed_sum"] == sum(not (0.5 <= r <= 2.0) for r in flat)


def test_engine_and_trainer_in_agreement_change_nothing():
    log_r = log_ratio(OLD, OLD, MASK)
    for kind in ("tis", "icepop", "token_mask", "sequence_mask"):
        c, changed = correction_weights(log_r, MASK, kind, **BAND)
        assert torch.equal(c, MASK) and changed.sum() == 0
    assert float(correction_stats(log_r, MASK, torch.zeros_like(MASK))["k3_sum"]) == 0.0


def test_an_unknown_correction_is_refused():
    with pytest.raises(ValueError, match="tis, icepop, token_mask or sequence_mask"):
        correction_weights(log_ratio(OLD, ENGINE, MASK), MASK, "clip", **BAND)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"correction_low": 1.2}, "bracket 1"),
        ({"correction_high": 0.9}, "bracket 1"),
        ({"correction_cap": 0.5}, ">= 1"),
    ],
)
def test_the_config_refuses_bands_and_caps_that_would_correct_agreement(tmp_path, values, match):
    with pytest.raises(msgspec.ValidationError, match=match):
        make_config(tmp_path, tmp_path, loss=values)


# -- the train step --------------------------------------------------------------------------------


def tiny_policy(tiny_model, cfg):
    from trainer_svc.distributed import Distributed
    from trainer_svc.learning.model import load_policy
    from trainer_svc.learning.train_step import Policy, make_optimizer, make_scheduler

    torch.manual_seed(0)
    dist_info = Distributed(0, 1, torch.device("cpu"))
    model = load_policy(str(tiny_model), torch.float32, dist_info)
    optimizer = make_optimizer(model, cfg)
    return Policy(model, None, optimizer, make_scheduler(optimizer, cfg), pad_id=0), dist_info


def rollouts(engine_logprob: float, prompts: int = 4, samples: int = 4):
    """Fixed groups of random tokens and advantages of both signs, the engine's logprobs all
    `engine_logprob`."""
    from trainer_svc.rollout_types import Group, Sample

    g = torch.Generator().manual_seed(1)
    groups = [
        Group(
            torch.randint(3, 20, (3,), generator=g).tolist(),
            [Sample(torch.randint(3, 20, (4,), generator=g).tolist(), [engine_logprob] * 4, "", "length")] * samples,
        )
        for _ in range(prompts)
    ]
    return groups, torch.tensor([[1.0, -1.0, 0.5, -0.5]] * prompts)


def parameters(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_icepop_masks_every_token_the_engine_sampled_from_far_away(tiny_model, tmp_path):
    """Engine logprobs of -30 against the trainer's few units: every ratio is huge, every token
    masked, nothing learned; without a correction the same step moves the weights."""
    from trainer_svc.learning.train_step import learn

    moved = {}
    for kind in ("none", "icepop"):
        cfg = make_config(tmp_path, tiny_model, loss={"correction": kind}, train={"grad_accum": 2})
        policy, dist_info = tiny_policy(tiny_model, cfg)
        before = parameters(policy.model)
        stats = learn(policy, *rollouts(-30.0), cfg, dist_info)
        moved[kind] = float((parameters(policy.model) - before).abs().max())
        assert stats["ratio_max"] > 1e6 and stats["kl_engine"] > 10
        assert stats["corrected_fraction"] == (1.0 if kind == "icepop" else 0.0)
    assert moved["icepop"] == 0.0 and moved["none"] > 0.0


def test_several_updates_per_batch_step_the_optimizer_each_and_the_schedule_once(tiny_model, tmp_path, monkeypatch):
    """Two updates: the second part sees a policy the first moved, so its ratio is not 1 (with
    one update every ratio is exactly 1); the learning rate moves once per training step."""
    import trainer_svc.learning.train_step as train_step
    from trainer_svc.learning import grpo

    seen, real = {}, grpo.clipped_policy_loss
    for updates in (1, 2):
        cfg = make_config(tmp_path, tiny_model, train={"grad_accum": 2, "updates_per_batch": updates, "lr": 5e-2})
        policy, dist_info = tiny_policy(tiny_model, cfg)
        log_ratios = []

        def recorded(*args, seen_here=log_ratios, **kwargs):
            loss, stats = real(*args, **kwargs)
            seen_here.append(float(stats["log_ratio_abs_max"]))
            return loss, stats

        monkeypatch.setattr(train_step.grpo, "clipped_policy_loss", recorded)
        train_step.learn(policy, *rollouts(-1.0), cfg, dist_info)
        monkeypatch.undo()
        steps = {int(state["step"]) for state in policy.optimizer.state.values()}
        assert steps == {updates} and policy.scheduler.last_epoch == 1
        assert len(log_ratios) == 2 * updates  # grad_accum micro-batches per update
        seen[updates] = log_ratios
    assert max(seen[1]) == 0.0 and max(seen[2][:2]) == 0.0 and min(seen[2][2:]) > 1e-4
