"""The collapse tripwire: a healthy run never fires; each signal fires on its collapse at the step
the window arithmetic predicts, never before the window is full; the latch holds; unarmed it only
reports; its state survives a JSON round trip mid-run; bad thresholds are refused at load."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_svc.rails.tripwire import CollapseTripwire, TripwireConfig

MAX_TOKENS = 16
HEALTHY = {"reward_mean": 0.5, "entropy": 1.0, "response_length": 8.0}


def feed(tripwire: CollapseTripwire, rows: list[dict], first_step: int = 1) -> list[str | None]:
    """Observe `rows` as consecutive steps; the list of what each `observe` returned."""
    return [tripwire.observe(first_step + i, **row) for i, row in enumerate(rows)]


def first_firing(outputs: list[str | None]) -> int | None:
    """1-based step of the first non-None output."""
    return next((i + 1 for i, out in enumerate(outputs) if out is not None), None)


def healthy_run(steps: int) -> list[dict]:
    """Reward rising 0.1 -> 0.8 with step-to-step noise, entropy slowly falling 1.5 -> 0.3,
    length wandering around 8 of 16 tokens."""
    return [
        {
            "reward_mean": 0.1 + 0.7 * t / steps + 0.15 * math.sin(1.7 * t),
            "entropy": 1.5 - 1.2 * t / steps + 0.05 * math.cos(0.9 * t),
            "response_length": 8.0 + 3.0 * math.sin(0.3 * t),
        }
        for t in range(steps)
    ]


def collapse(signal: str, value: float, steps: int) -> list[dict]:
    return [{**HEALTHY, signal: value} for _ in range(steps)]


def test_a_healthy_run_never_fires():
    tripwire = CollapseTripwire(TripwireConfig(), max_tokens=MAX_TOKENS)
    assert feed(tripwire, healthy_run(300)) == [None] * 300
    assert not tripwire.fired and tripwire.reason is None and tripwire.would_fire is None
    assert tripwire.best_window_reward > 0.6  # the windows were judged: the best tracks the rise


# Each case: the healthy steady state for 40 steps, then one signal collapses for good. With
# window 20, k collapsed steps into the window give (by hand):
#   entropy 1 -> 0:      mean (20 - k) / 20 < 0.02 first at k = 20          -> step 60
#   reward 0.8 -> 0:     drop 0.8 k / 20 > 0.3 first at k = 8 (0.32)        -> step 48
#   length 8 -> 0:       8 (20 - k) / 20 < 0.5 first at k = 19 (0.4)        -> step 59
#   length 8 -> 16:      8 + 0.4 k >= 0.98 * 16 = 15.68 first at k = 20     -> step 60
COLLAPSES = {
    "entropy": ({**HEALTHY}, "entropy", 0.0, 60, "entropy"),
    "reward drop": ({**HEALTHY, "reward_mean": 0.8}, "reward_mean", 0.0, 48, "reward dropped"),
    "short answers": ({**HEALTHY}, "response_length", 0.0, 59, "min_response_length"),
    "answers at cap": ({**HEALTHY}, "response_length", 16.0, 60, "max_tokens = 16"),
}


@pytest.mark.parametrize("name", COLLAPSES)
def test_each_collapse_fires_at_the_predicted_step_with_its_reason(name):
    before, signal, value, expected_step, named = COLLAPSES[name]
    tripwire = CollapseTripwire(TripwireConfig(), max_tokens=MAX_TOKENS)
    rows = [before] * 40 + [{**before, signal: value}] * 40
    outputs = feed(tripwire, rows)
    assert first_firing(outputs) == expected_step
    assert tripwire.fired and tripwire.fired_at_step == expected_step
    assert named in tripwire.reason and f"at step {expected_step}," in tripwire.reason
    assert outputs[expected_step - 1] == tripwire.reason


def test_reasons_give_the_window_value_and_the_threshold():
    tripwire = CollapseTripwire(TripwireConfig(window=4, min_entropy=0.25), max_tokens=MAX_TOKENS)
    feed(tripwire, [{**HEALTHY, "entropy": 0.125}] * 4)
    assert "(0.125)" in tripwire.reason and "min_entropy = 0.25" in tripwire.reason


@pytest.mark.parametrize(
    "signal, value",
    [("entropy", 0.0), ("response_length", 0.0), ("response_length", float(MAX_TOKENS))],
)
def test_a_collapse_from_the_first_step_waits_for_a_full_window(signal, value):
    tripwire = CollapseTripwire(TripwireConfig(window=5), max_tokens=MAX_TOKENS)
    assert first_firing(feed(tripwire, collapse(signal, value, 10))) == 5


# Exactly at a threshold: "below" and "more than" are strict, "reaches" is not (values chosen to
# be exact in binary, so the comparison is the one under test).
EDGES = {
    "entropy at min_entropy": ({"min_entropy": 0.25}, [{**HEALTHY, "entropy": 0.25}] * 2, False),
    "length at min_response_length": ({"min_response_length": 0.5}, [{**HEALTHY, "response_length": 0.5}] * 2, False),
    "drop of max_reward_drop": (
        {"max_reward_drop": 0.5},
        [{**HEALTHY, "reward_mean": r} for r in (1.0, 1.0, 0.0)],
        False,
    ),
    "length at the cap": ({"max_length_fraction": 0.5}, [{**HEALTHY, "response_length": 8.0}] * 2, True),
}


@pytest.mark.parametrize("name", EDGES)
def test_values_exactly_at_a_threshold(name):
    settings_, rows, fires = EDGES[name]
    tripwire = CollapseTripwire(TripwireConfig(window=2, **settings_), max_tokens=MAX_TOKENS)
    assert (feed(tripwire, rows)[-1] is not None) == fires


def test_the_best_reward_counts_full_windows_only():
    # One great first step is not a baseline: the first full window (mean 0.25) is the best, and
    # falling from it to 0 is within max_reward_drop; measured from the lone 1.0 it would not be.
    tripwire = CollapseTripwire(TripwireConfig(window=4, max_reward_drop=0.3), max_tokens=MAX_TOKENS)
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0]
    assert feed(tripwire, [{**HEALTHY, "reward_mean": r} for r in rewards]) == [None] * 5
    assert tripwire.best_window_reward == 0.25
    assert tripwire.window_means()["reward_mean"] == 0.0


def test_the_latch_holds_through_later_healthy_steps():
    tripwire = CollapseTripwire(TripwireConfig(window=3), max_tokens=MAX_TOKENS)
    feed(tripwire, collapse("entropy", 0.0, 3))
    reason = tripwire.reason
    assert reason is not None
    assert feed(tripwire, healthy_run(50), first_step=4) == [reason] * 50
    assert tripwire.fired and tripwire.reason == reason and tripwire.fired_at_step == 3


def test_the_first_signal_in_order_is_the_reason():
    # entropy and length collapse together: entropy is judged first
    tripwire = CollapseTripwire(TripwireConfig(window=2), max_tokens=MAX_TOKENS)
    feed(tripwire, [{**HEALTHY, "entropy": 0.0, "response_length": 0.0}] * 2)
    assert tripwire.reason.startswith("entropy collapsed")


def test_unarmed_never_fires_but_reports_what_it_would_have_done():
    tripwire = CollapseTripwire(TripwireConfig(armed=False, window=4), max_tokens=MAX_TOKENS)
    outputs = feed(tripwire, collapse("entropy", 0.0, 10) + healthy_run(10))
    assert outputs == [None] * 20
    assert not tripwire.fired and tripwire.reason is None and tripwire.fired_at_step is None
    assert "entropy" in tripwire.would_fire and tripwire.would_fire_at_step == 4
    log = tripwire.as_log_dict()
    assert log["armed"] is False and log["fired"] is False and log["would_fire"] == tripwire.would_fire


def test_as_log_dict_is_json_and_names_the_thresholds():
    tripwire = CollapseTripwire(TripwireConfig(window=3), max_tokens=MAX_TOKENS)
    feed(tripwire, collapse("response_length", 0.0, 3))
    log = json.loads(json.dumps(tripwire.as_log_dict(), allow_nan=False))
    assert log["fired"] is True and log["fired_at_step"] == 3 and "response length" in log["reason"]
    assert log["best_window_reward"] == 0.5
    assert log["thresholds"] == {
        "window": 3,
        "min_entropy": 0.02,
        "max_reward_drop": 0.3,
        "min_response_length": 0.5,
        "max_length_fraction": 0.98,
        "max_tokens": MAX_TOKENS,
    }


def test_a_non_finite_observation_is_refused():
    tripwire = CollapseTripwire(TripwireConfig(), max_tokens=MAX_TOKENS)
    with pytest.raises(ValueError, match="entropy at step 7 is nan"):
        tripwire.observe(7, reward_mean=0.5, entropy=float("nan"), response_length=8.0)


# ---------------------------------------------------------------- state round trip


def round_tripped(original: CollapseTripwire, cfg: TripwireConfig) -> CollapseTripwire:
    restored = CollapseTripwire(cfg, max_tokens=original.max_tokens)
    restored.load_state_dict(json.loads(json.dumps(original.state_dict(), allow_nan=False)))
    return restored


observation = st.fixed_dictionaries(
    {
        "reward_mean": st.floats(-1.0, 2.0),
        "entropy": st.floats(0.0, 0.1),  # near min_entropy, so some windows fire and some do not
        "response_length": st.floats(0.0, float(MAX_TOKENS)),
    }
)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(observation, min_size=1, max_size=40),
    split_fraction=st.floats(0.0, 1.0),
    window=st.integers(2, 6),
    armed=st.booleans(),
)
def test_a_restored_tripwire_continues_exactly_as_the_original(rows, split_fraction, window, armed):
    cfg = TripwireConfig(armed=armed, window=window, max_reward_drop=0.5)
    split = int(split_fraction * len(rows))
    original = CollapseTripwire(cfg, max_tokens=MAX_TOKENS)
    feed(original, rows[:split])
    restored = round_tripped(original, cfg)
    assert restored.state_dict() == original.state_dict()
    assert feed(restored, rows[split:], first_step=split + 1) == feed(original, rows[split:], first_step=split + 1)
    assert restored.as_log_dict() == original.as_log_dict()
    assert restored.state_dict() == original.state_dict()


def test_a_fired_latch_survives_the_round_trip():
    cfg = TripwireConfig(window=3)
    original = CollapseTripwire(cfg, max_tokens=MAX_TOKENS)
    feed(original, collapse("entropy", 0.0, 3))
    restored = round_tripped(original, cfg)
    assert restored.fired and restored.fired_at_step == 3
    assert restored.observe(4, **HEALTHY) == original.reason


def test_disarming_on_resume_releases_the_latch_and_keeps_the_record():
    original = CollapseTripwire(TripwireConfig(window=3), max_tokens=MAX_TOKENS)
    feed(original, collapse("entropy", 0.0, 3))
    restored = round_tripped(original, TripwireConfig(window=3, armed=False))
    assert not restored.fired and restored.observe(4, entropy=0.0, reward_mean=0.5, response_length=8.0) is None
    assert restored.would_fire == original.reason and restored.would_fire_at_step == 3


def test_arming_on_resume_fires_only_when_a_signal_holds_again():
    unarmed = CollapseTripwire(TripwireConfig(window=3, armed=False), max_tokens=MAX_TOKENS)
    feed(unarmed, collapse("entropy", 0.0, 3))
    armed = round_tripped(unarmed, TripwireConfig(window=3))
    assert not armed.fired
    # one healthy step lifts the restored window's mean entropy to 1/3: nothing holds
    assert armed.observe(4, **HEALTHY) is None
    assert feed(armed, collapse("entropy", 0.0, 3), first_step=5)[-1] is not None
    assert armed.fired_at_step == 7


def test_a_state_saved_with_another_window_is_refused():
    original = CollapseTripwire(TripwireConfig(window=3), max_tokens=MAX_TOKENS)
    with pytest.raises(ValueError, match="window = 3.*window = 4"):
        round_tripped(original, TripwireConfig(window=4))


# ---------------------------------------------------------------- config


def test_defaults():
    cfg = msgspec.convert({}, TripwireConfig)
    assert cfg == TripwireConfig(
        armed=True, window=20, min_entropy=0.02, max_reward_drop=0.3, min_response_length=0.5, max_length_fraction=0.98
    )


@pytest.mark.parametrize(
    "values, message",
    [
        ({"window": 1}, ">= 2 - at `$.window`"),
        ({"window": 2.5}, "Expected `int`, got `float` - at `$.window`"),
        ({"min_entropy": -0.1}, ">= 0.0 - at `$.min_entropy`"),
        ({"max_reward_drop": 0.0}, "> 0.0 - at `$.max_reward_drop`"),
        ({"min_response_length": -1.0}, ">= 0.0 - at `$.min_response_length`"),
        ({"max_length_fraction": 1.5}, "<= 1.0 - at `$.max_length_fraction`"),
        ({"max_length_fraction": 0.0}, "> 0.0 - at `$.max_length_fraction`"),
        ({"armed": "yes"}, "Expected `bool`, got `str` - at `$.armed`"),
        ({"windw": 20}, "unknown field `windw`"),
    ],
)
def test_bad_values_are_refused_at_load(values, message):
    with pytest.raises(msgspec.ValidationError) as error:
        msgspec.convert(values, TripwireConfig)
    assert message in str(error.value)
