"""Environments for the episode tests, as a user would write them (imported by the environment
worker processes from a directory on sys.path: `user_envs` writes this module's ENVS there)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

ENVS = '''
import os
import time

from trainer_svc.envs import Environment, Step, tool


class Chat(Environment):
    """Three assistant turns: after the first two the environment says ok<turn>."""

    def reset(self):
        self.t = 0
        return [{"role": "user", "content": self.row["prompt"]}]

    def step(self, text):
        self.t += 1
        if self.t >= 3:
            return Step(reward=float(len(text)), done=True)
        return Step([{"role": "user", "content": f"ok{self.t}"}], reward=1.0)


class Digits(Environment):
    """Two turns, each rewarded by its share of digits: what the untrained tiny model learns."""

    def reset(self):
        self.t = 0
        return [{"role": "user", "content": self.row["prompt"]}]

    def step(self, text):
        self.t += 1
        share = sum(ch.isdigit() for ch in text) / max(1, len(text))
        if self.t == 1:
            return Step([{"role": "user", "content": "+1="}], reward=share / 2)
        return Step(reward=share / 2, done=True)


class Gated(Chat):
    """Chat whose first step waits until a file named gate exists beside this module."""

    def step(self, text):
        from pathlib import Path

        while self.t == 0 and not (Path(__file__).parent / "gate").exists():
            time.sleep(0.01)
        return super().step(text)


class Raises(Chat):
    def step(self, text):
        if self.t == 1:
            raise ValueError("cannot read " + repr(text))
        return super().step(text)


class Hangs(Chat):
    def step(self, text):
        if self.t == 1:
            time.sleep(3600)
        return super().step(text)


class WrongType(Chat):
    def step(self, text):
        return {"reward": 1.0}


class Crashes(Chat):
    def step(self, text):
        os._exit(3)


class Greedy(Chat):
    def step(self, text):
        self.hoard = bytearray(2 << 30)
        return super().step(text)


class Seeded(Chat):
    def reset(self):
        self.t = 0
        return [{"role": "user", "content": f"{self.seed}:"}]


class EndsAnswered(Chat):
    def reset(self):
        self.t = 0
        return [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]


class WorkedExample(Chat):
    def reset(self):
        self.t = 0
        return [
            {"role": "user", "content": "1+1="},
            {"role": "assistant", "content": "2"},
            {"role": "tool", "content": "right"},
            {"role": "user", "content": self.row["prompt"]},
        ]


class Clock(Chat):
    def step(self, text):
        self.t += 1
        return Step([{"role": "user", "content": str(time.time_ns())}], reward=1.0)


class Calculator(Environment):
    """The model may call add; a turn without a call ends the episode."""

    def reset(self):
        return [{"role": "user", "content": self.row["prompt"]}]

    def step(self, text):
        return Step(reward=1.0, done=True)

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b
'''


@pytest.fixture
def user_envs(tmp_path, monkeypatch) -> Path:
    """A directory holding the module `user_envs`, on sys.path (the pool's processes take it)."""
    path = tmp_path / "user"
    path.mkdir()
    (path / "user_envs.py").write_text(textwrap.dedent(ENVS))
    monkeypatch.syspath_prepend(str(path))
    yield path
    sys.modules.pop("user_envs", None)
