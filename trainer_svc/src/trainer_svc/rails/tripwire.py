"""The collapse tripwire: stop a GRPO run whose policy has collapsed, before it overwrites the
last good checkpoint.

Each optimizer step the loop passes the step's mean reward, mean per-token entropy and mean
response length (tokens). The tripwire keeps the last `window` values of each and judges the
window's means against four signals, in this order (the first that holds is the reason):

    entropy          mean entropy < min_entropy                   the policy became deterministic
    reward drop      best window reward - mean > max_reward_drop  it got worse and is not recovering
    short answers    mean length < min_response_length            it stopped answering
    answers at cap   mean length >= max_length_fraction * max_tokens   every answer hits the cap

Guarantees:
- Only full windows are judged, so the first `window - 1` steps never fire, and the best window
  reward is the best over full windows (a lucky first step is not a baseline).
- It latches: once fired, every later `observe` returns the same reason, whatever it is fed.
- Not armed, it never fires, but judges all the same: `would_fire` says what it would have done.
- `state_dict()` is plain JSON; a tripwire restored with `load_state_dict` returns what the
  original would have returned for every later observation, an already-fired latch included.

The caller acts on a firing (pins the checkpoint, stops the run with exit code TRIPWIRE); this
module only decides. Pure Python, importable without torch.
"""

from __future__ import annotations

import math
from collections import deque

from ..config import TripwireConfig


class CollapseTripwire:
    """Rolling windows over (reward, entropy, response length) and a latch; see the module doc."""

    def __init__(self, cfg: TripwireConfig, max_tokens: int):
        self.cfg = cfg
        self.max_tokens = max_tokens  # rollout.max_tokens: the response length cap
        self._rewards: deque[float] = deque(maxlen=cfg.window)
        self._entropies: deque[float] = deque(maxlen=cfg.window)
        self._lengths: deque[float] = deque(maxlen=cfg.window)
        self.best_window_reward: float | None = None
        # What the tripwire would have fired with, armed or not: the first reason seen.
        self.would_fire: str | None = None
        self.would_fire_at_step: int | None = None
        # The latch the run acts on: set only while armed.
        self.fired = False
        self.reason: str | None = None
        self.fired_at_step: int | None = None

    @property
    def length_cap(self) -> float:
        """Mean response length (tokens) at which the 'answers at cap' signal fires."""
        return self.cfg.max_length_fraction * self.max_tokens

    def observe(self, step: int, reward_mean: float, entropy: float, response_length: float) -> str | None:
        """Record one optimizer step; return the latched reason when armed and fired, else None.

        Values must be finite: a NaN compares false against every threshold and would silently
        blind the tripwire for a whole window, so it is refused with ValueError.
        """
        for name, value in (("reward_mean", reward_mean), ("entropy", entropy), ("response_length", response_length)):
            if not math.isfinite(value):
                raise ValueError(f"tripwire: {name} at step {step} is {value}; observations must be finite")
        self._rewards.append(float(reward_mean))
        self._entropies.append(float(entropy))
        self._lengths.append(float(response_length))
        if len(self._rewards) == self.cfg.window:
            current = self._judge(step)
            if current is not None and self.would_fire is None:
                self.would_fire, self.would_fire_at_step = current, step
            if current is not None and self.cfg.armed and not self.fired:
                self.fired, self.reason, self.fired_at_step = True, current, step
        return self.reason

    def _judge(self, step: int) -> str | None:
        """The reason the current full window is a collapse, or None. Updates the best reward."""
        n = self.cfg.window
        reward, entropy, length = (math.fsum(w) / n for w in (self._rewards, self._entropies, self._lengths))
        self.best_window_reward = reward if self.best_window_reward is None else max(self.best_window_reward, reward)
        over = f"at step {step}, the mean over the last {n} steps"
        if entropy < self.cfg.min_entropy:
            return (
                f"entropy collapsed: {over} of per-token entropy ({entropy:.4g}) is below "
                f"min_entropy = {self.cfg.min_entropy:g}; the policy became deterministic"
            )
        drop = self.best_window_reward - reward
        if drop > self.cfg.max_reward_drop:
            return (
                f"reward dropped: {over} of reward ({reward:.4g}) is {drop:.4g} below the best window "
                f"mean ({self.best_window_reward:.4g}), more than max_reward_drop = {self.cfg.max_reward_drop:g}; "
                "the policy got worse and is not recovering"
            )
        if length < self.cfg.min_response_length:
            return (
                f"response length collapsed: {over} of response length ({length:.4g} tokens) is below "
                f"min_response_length = {self.cfg.min_response_length:g}; the policy stopped answering"
            )
        if length >= self.length_cap:
            return (
                f"response length at the cap: {over} of response length ({length:.4g} tokens) reached "
                f"max_length_fraction = {self.cfg.max_length_fraction:g} of max_tokens = {self.max_tokens} "
                f"({self.length_cap:.4g} tokens); every answer runs into the cap"
            )
        return None

    def window_means(self) -> dict | None:
        """The current window's means (for metrics), or None until the window is full."""
        if len(self._rewards) < self.cfg.window:
            return None
        n = self.cfg.window
        return {
            "reward_mean": math.fsum(self._rewards) / n,
            "entropy": math.fsum(self._entropies) / n,
            "response_length": math.fsum(self._lengths) / n,
        }

    def state_dict(self) -> dict:
        """Everything `observe` depends on besides the config, as JSON-serialisable values."""
        return {
            "window": self.cfg.window,
            "rewards": list(self._rewards),
            "entropies": list(self._entropies),
            "response_lengths": list(self._lengths),
            "best_window_reward": self.best_window_reward,
            "would_fire": self.would_fire,
            "would_fire_at_step": self.would_fire_at_step,
            "fired": self.fired,
            "reason": self.reason,
            "fired_at_step": self.fired_at_step,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`. Thresholds and `armed` come from this tripwire's config, so a
        resume may change them: a fired latch is restored only into an armed tripwire (disarming
        is how an operator lets a run continue past a firing; `would_fire` keeps the record).
        The window length may not change: the saved windows would no longer mean the same."""
        if state["window"] != self.cfg.window:
            raise ValueError(
                f"tripwire state was saved with window = {state['window']}, "
                f"but the config has window = {self.cfg.window}"
            )
        self._rewards = deque(state["rewards"], maxlen=self.cfg.window)
        self._entropies = deque(state["entropies"], maxlen=self.cfg.window)
        self._lengths = deque(state["response_lengths"], maxlen=self.cfg.window)
        self.best_window_reward = state["best_window_reward"]
        self.would_fire, self.would_fire_at_step = state["would_fire"], state["would_fire_at_step"]
        if self.cfg.armed:
            self.fired, self.reason, self.fired_at_step = state["fired"], state["reason"], state["fired_at_step"]

    def as_log_dict(self) -> dict:
        """The tripwire's outcome and settings, for stage_result.json."""
        return {
            "armed": self.cfg.armed,
            "fired": self.fired,
            "reason": self.reason,
            "fired_at_step": self.fired_at_step,
            "would_fire": self.would_fire,
            "would_fire_at_step": self.would_fire_at_step,
            "best_window_reward": self.best_window_reward,
            "last_window": self.window_means(),
            "thresholds": {
                "window": self.cfg.window,
                "min_entropy": self.cfg.min_entropy,
                "max_reward_drop": self.cfg.max_reward_drop,
                "min_response_length": self.cfg.min_response_length,
                "max_length_fraction": self.cfg.max_length_fraction,
                "max_tokens": self.max_tokens,
            },
        }
