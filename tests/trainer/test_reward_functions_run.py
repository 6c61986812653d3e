"""Reward functions from the user's side: a module of reward functions written to a directory on
PYTHONPATH, named in the config, used by `trainer-svc train`.

- A function whose module cannot be found stops the launch with exit 2 before anything loads.
- A function that raises or hangs on a step's samples stops the run with exit 2 and a message
  naming the function and the sample (or, for a hang, the call's samples); no step is logged.
- A function that rewards a property is logged as `reward/<name>` and is what the policy learns:
  the property's rate rises within a few steps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import make_config
from failing_server import FailingSpoolServer
from local_sampler import TorchSampler

from protocol import exit_codes
from trainer_svc.config import dump
from trainer_svc.run.loop import train

TRAINER = str(Path(sys.executable).parent / "trainer-svc")

USER_MODULE = """
import time

def digits(completions, prompts, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(1, len(text)) for text in completions]

def no_plus(completions, prompts, **kwargs):
    for text in completions:
        if "+" in text:
            raise ValueError(f"cannot read {text!r}")
    return [0.0] * len(completions)

def stuck(completions, prompts, **kwargs):
    time.sleep(3600)
"""


@pytest.fixture
def user_path(tmp_path, monkeypatch) -> Path:
    """A directory holding the module `my_rewards`, on sys.path here and on PYTHONPATH for processes."""
    path = tmp_path / "user"
    path.mkdir()
    (path / "my_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(path))
    yield path
    sys.modules.pop("my_rewards", None)


def trainer(config: Path, user_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(user_path), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([TRAINER, "train", str(config)], capture_output=True, text=True, timeout=240, env=env)


def write_config(tmp_path: Path, model: Path, **sections):
    """The config (make_config's small shape) and the file it is written to."""
    cfg = make_config(tmp_path / "run", model, **sections)
    path = tmp_path / "run.toml"
    path.write_bytes(dump(cfg))
    return cfg, path


@pytest.mark.timeout(60)
def test_a_function_whose_module_cannot_be_found_stops_the_launch_with_exit_2(tmp_path, user_path):
    _, config = write_config(
        tmp_path, tmp_path / "no-model", reward={"functions": ["correct", "my_rewardz:digits"], "weights": [1.0, 1.0]}
    )
    result = trainer(config, user_path)
    assert result.returncode == exit_codes.USAGE, result.stderr[-3000:]
    assert "reward function 'my_rewardz:digits': module 'my_rewardz' cannot be found" in result.stderr
    assert not (tmp_path / "run").exists()  # before anything else: the missing model is not even looked at


@pytest.mark.timeout(300)
@pytest.mark.parametrize("function", ["no_plus", "stuck"])
def test_a_function_that_fails_on_a_step_stops_the_run_with_exit_2_naming_it(tiny_model, tmp_path, user_path, function):
    # Echoed completions: each is its prompt ("3+4="), so `no_plus` raises on the first sample it reads.
    spool = tmp_path / "spool"
    cfg, config = write_config(
        tmp_path,
        tiny_model,
        rollout={"spawn": False, "spool": str(spool)},
        reward={"functions": ["format", f"my_rewards:{function}"], "weights": [1.0, 1.0], "timeout_s": 1.0},
    )
    server = FailingSpoolServer(spool, cfg, lambda request: None, echo=True)
    server.start()
    try:
        result = trainer(config, user_path)
    finally:
        server.stop()
    assert result.returncode == exit_codes.USAGE, result.stderr[-3000:]
    message = result.stderr[result.stderr.index("error: ") :]
    assert message.startswith(f"error: reward function 'my_rewards:{function}' (step 1) "), message
    if function == "no_plus":
        assert "raised ValueError: cannot read" in message and "my_rewards.py:" in message
        a, b, prompt = re.search(r"on problem add-(\d)-(\d), sample 0 \(completion '([^']*)'\)", message).groups()
        assert prompt == f"{a}+{b}="  # the problem named is the one whose completion it could not read
    else:
        assert "did not return within reward.timeout_s = 1 s, scoring the 16 completions of problems add-" in message
    assert "relaunch" in message
    # Nothing was scored as 0 and trained on: no step was logged.
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""


@pytest.mark.timeout(300)
def test_a_users_reward_is_logged_and_is_what_the_policy_learns(tiny_model, tmp_path, user_path):
    # The untrained model writes about one digit in ten characters; `digits` rewards their share,
    # and `correct` is weighted 0 (logged only), so nothing else rewards digits.
    cfg = make_config(
        tmp_path / "run",
        tiny_model,
        train={"steps": 6, "lr": 1e-2, "grad_accum": 1},
        checkpoint={"every": 100},
        tripwire={"armed": False},
        reward={"functions": ["correct", "my_rewards:digits"], "weights": [0.0, 1.0]},
    )
    assert train(cfg, make_sampler=lambda cfg, launch_id: TorchSampler(cfg)) == exit_codes.OK
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    share = [row["reward/my_rewards:digits"] for row in rows]
    assert all(row["reward_first"] == row["reward/my_rewards:digits"] for row in rows)  # the weighted sum, 0 * correct
    assert all("reward/correct" in row and "accuracy" in row for row in rows)
    print(f"\nshare of digits per step: {[round(s, 3) for s in share]}")
    assert share[0] < 0.2 and sum(share[-2:]) / 2 > share[0] + 0.2
