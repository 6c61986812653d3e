"""Training on episodes (CPU, deterministic): the tiny model learns a two-turn task; a run
stopped in the middle of episodes (steps generated ahead) and relaunched takes exactly the steps
of the run never stopped, replaying the journaled turns instead of asking for them again; the
README's example environment runs as written; an environment's fault stops `trainer-svc train`
with exit 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_config
from echo_workers import EchoWorkers
from env_modules import user_envs  # noqa: F401 (a fixture)
from local_turns import ScriptedTurns, Service, TorchTurnService

from protocol import exit_codes
from trainer_svc.config import dump
from trainer_svc.run.loop import train

ROOT = Path(__file__).resolve().parents[2]
TRAINER = str(Path(sys.executable).parent / "trainer-svc")
TIMING_KEYS = {"rollout_s", "generate_s", "score_s", "train_s", "publish_s", "save_s", "step_s"}

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("user_envs")]


def rows(run_dir: Path) -> list[dict]:
    found = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in found]


def without_digest(key: str) -> str:
    return re.sub(r"-[0-9a-f]{12}\.", ".", key)


def digits_config(run_dir: Path, model: Path, **sections):
    return make_config(
        run_dir,
        model,
        train={"steps": 6, "lr": 1e-2, "grad_accum": 1},
        tripwire={"armed": False},
        env={"class": "user_envs:Digits", "max_turns": 2},
        **sections,
    )


def test_the_tiny_model_learns_a_two_turn_task(tiny_model, tmp_path):
    # Each turn's reward is its share of digits: about one in ten characters for the untrained model.
    cfg = digits_config(tmp_path / "run", tiny_model, checkpoint={"every": 100})
    assert train(cfg, make_sampler=TorchTurnService()) == exit_codes.OK
    found = rows(cfg.run_dir)
    reward = [row["reward/env"] for row in found]
    print(f"\nreward per step: {[round(r, 3) for r in reward]}")
    assert all(row["episode_turns"] == 2.0 and row["episode_ends/done"] == 16 for row in found)
    assert reward[0] < 0.2 and sum(reward[-2:]) / 2 > reward[0] + 0.2


def test_a_run_stopped_in_the_middle_of_episodes_resumes_exactly(tiny_model, tmp_path):
    straight_asked: list[str] = []
    straight = digits_config(tmp_path / "straight", tiny_model, rollout={"ahead": 1, "max_policy_lag": 1})
    assert train(straight, make_sampler=TorchTurnService(straight_asked)) == exit_codes.OK
    expected = rows(straight.run_dir)
    assert len(expected) == 6

    # A wall-clock limit far below one step: every launch takes one step and stops (75) with the
    # next step's episodes in flight, half done: their first turns answered, their second asked and
    # not answered (held). The relaunch takes them over: the first turns replayed from the journal,
    # the second asked again.
    interrupted = digits_config(
        tmp_path / "interrupted", tiny_model, rollout={"ahead": 1, "max_policy_lag": 1}, run={"max_wall_seconds": 1e-6}
    )
    asked: list[str] = []
    codes, journaled = [], []
    while not codes or codes[-1] == exit_codes.RESUMABLE_STOP:
        ahead = f"-s{len(codes) + 1:08d}-"
        service = TorchTurnService(asked, hold=lambda key, ahead=ahead: ahead in key and not key.endswith(".t0"))
        codes.append(train(interrupted, make_sampler=service))
        journal = list((interrupted.run_dir / "episodes").glob("*.jsonl"))
        journaled.append(sum(1 for path in journal for line in path.read_text().splitlines() if '"turn"' in line))
        assert len(codes) <= 7
    assert codes == [exit_codes.RESUMABLE_STOP] * 5 + [exit_codes.OK]
    assert rows(interrupted.run_dir) == expected
    # Each stop left some of the next step's 16 episodes with their first turn answered (how many
    # depends on how far they got while the step trained), never a second; the end, none.
    print(f"\nfirst turns journaled at each stop: {journaled}")
    assert all(n <= 16 for n in journaled) and journaled[-1] == 0
    # No turn was asked twice, and the turns asked are the run's never stopped (the call's digest
    # differs: its weights' directory is the run's).
    assert len(asked) == len(set(asked))
    assert sorted(map(without_digest, asked)) == sorted(map(without_digest, straight_asked))


def readme_example() -> tuple[str, str]:
    section = (ROOT / "docs" / "environments.md").read_text()
    (module,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (config,) = re.findall(r"```toml\n(.*?)```", section, flags=re.S)
    return module, config


def test_the_readme_example_environment_runs_as_written(tiny_model, tmp_path, monkeypatch):
    module, config = readme_example()
    user = tmp_path / "readme"
    user.mkdir()
    (user / "my_envs.py").write_text(module)
    monkeypatch.syspath_prepend(str(user))
    import msgspec

    section = msgspec.toml.decode(config.encode())["env"]
    cfg = make_config(tmp_path / "run", tiny_model, train={"steps": 2}, env=section)
    assert train(cfg, make_sampler=TorchTurnService()) == exit_codes.OK
    found = rows(cfg.run_dir)
    assert len(found) == 2 and all("reward/env" in row and row["episode_turns"] >= 1 for row in found)
    sys.modules.pop("my_envs", None)


def test_an_environment_that_raises_stops_trainer_svc_train_with_exit_2(tiny_model, tmp_path):
    spool = tmp_path / "spool"
    cfg = make_config(
        tmp_path / "run",
        tiny_model,
        rollout={"spool": str(spool), "max_tokens": 4},
        env={"class": "user_envs:Raises", "max_turns": 3},
    )
    path = tmp_path / "run.toml"
    path.write_bytes(dump(cfg))
    workers = EchoWorkers(spool, tmp_path / "logs")
    try:
        workers.start("echo")
        user = tmp_path / "user"  # where user_envs wrote the module
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user), os.environ.get("PYTHONPATH", "")])}
        result = subprocess.run([TRAINER, "train", str(path)], capture_output=True, text=True, timeout=240, env=env)
    finally:
        workers.close()
    assert result.returncode == exit_codes.USAGE, result.stderr[-3000:]
    message = result.stderr[result.stderr.index("error: ") :]
    assert re.match(
        r"error: environment user_envs:Raises \(episode train-s00000000-a0-\w+\.p\dg\d, turn 2, step", message
    )
    assert "raised ValueError: cannot read" in message
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""


def test_trainer_svc_eval_env_runs_the_environment_over_rows_through_the_workers(tiny_model, tmp_path):
    spool = tmp_path / "spool"
    cfg = make_config(tmp_path / "run", tiny_model, rollout={"spool": str(spool)}, env={"class": "user_envs:Chat"})
    path = tmp_path / "run.toml"
    path.write_bytes(dump(cfg))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(5)))
    workers = EchoWorkers(spool, tmp_path / "logs")
    try:
        workers.start("echo")
        user = tmp_path / "user"  # where user_envs wrote the module
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user), os.environ.get("PYTHONPATH", "")])}
        command = [TRAINER, "eval-env", str(path), "--weights", str(tiny_model), "--out", str(tmp_path / "out.jsonl")]
        result = subprocess.run(command + ["--rows", str(rows), "--samples", "2"], capture_output=True, text=True,
                                timeout=240, env=env)  # fmt: skip
    finally:
        workers.close()
    assert result.returncode == 0, result.stderr[-3000:]
    found = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in found] == [f"{a}+1=" for a in range(5)]
    # Echoed answers are each prompt's first 4 ids: 1 + 1 for the first two turns, then the text's length.
    assert all(e == {**e, "reward": 6.0, "turns": 3, "ended": "done"} for row in found for e in row["episodes"])
    assert all(len(row["episodes"]) == 2 for row in found)
    assert "reward 6.0000 over 5 rows x 2 episodes" in result.stdout
    # Greedy by default, whatever the run's own temperature: every turn's request asked for 0.
    assert cfg.rollout.temperature > 0
    asked = [json.loads(p.read_bytes())["temperature"] for p in (spool / "done").glob("*.request.json")]
    assert asked and set(asked) == {0.0}


@pytest.mark.parametrize("final, accuracy", [("42", 1.0), ("7", 0.0)])
def test_the_canary_of_an_environment_grades_greedy_episodes_by_their_last_turn(tiny_model, tmp_path, final, accuracy):
    # Every row's gold is 42; the scripted engine says 42 in the first turns, `final` in the last: only
    # the last turn is the episode's answer. Chat's reward is 1 + 1 + the last text's length.
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a} and 42?", "answer": "42"}) + "\n" for a in range(20)))
    cfg = make_config(
        tmp_path / "run",
        tiny_model,
        data={"task": "file", "path": str(data), "held_out": 6},
        train={"steps": 2},
        canary={"every": 1, "problems": 6},
        env={"class": "user_envs:Chat"},
    )
    from transformers import AutoTokenizer

    turns = ScriptedTurns(AutoTokenizer.from_pretrained(tiny_model), ["42", "42", final])
    assert train(cfg, make_sampler=lambda cfg, launch_id: Service(turns)) == exit_codes.OK
    checks = [json.loads(line) for line in (cfg.run_dir / "canary.jsonl").read_text().splitlines()]
    assert [c["step"] for c in checks] == [0, 1, 2]
    assert all(c["accuracy"] == accuracy and c["reward"] == 2.0 + len(final) and c["n"] == 6 for c in checks)
    # The canary's turns are greedy, the training episodes' sampled at the run's temperature.
    canary = {key: t.temperature for key, t in turns.turns.items() if key.startswith("canary-")}
    training = {key: t.temperature for key, t in turns.turns.items() if not key.startswith("canary-")}
    assert len(canary) == 3 * 3 * 6 and set(canary.values()) == {0.0}
    assert training and set(training.values()) == {None}
