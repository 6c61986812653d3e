"""An environment's fault stops the run with EnvError (exit 2) naming the environment, the
episode and the turn: a raise, a hang past env.timeout_s (its process killed: never a hang of the
trainer), a wrong return type, a crash of its process, an allocation past env.memory_mb; so do a
class that cannot be imported (at launch) and first messages that differ within a row's group."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import make_config
from env_modules import user_envs  # noqa: F401 (a fixture)
from local_turns import ScriptedTurns, Service

from trainer_svc.data import arithmetic_problems
from trainer_svc.envs.errors import EnvError
from trainer_svc.envs.sampler import EpisodeSampler
from trainer_svc.rollout_types import Ticket, WeightsRef

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("user_envs")]

PROBLEMS = arithmetic_problems(0, 9)[:2]
EPISODE = r"episode train-s00000000-a0-\w+\.p\dg\d"


def episodes(tiny_model, tmp_path, name: str, **env):
    from transformers import AutoTokenizer

    cfg = make_config(
        tmp_path / "run", tiny_model, rollout={"samples_per_prompt": 2}, env={"class": name, "max_turns": 3, **env}
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    sampler = EpisodeSampler(cfg, Service(ScriptedTurns(tokenizer, ["7"] * 3)), PROBLEMS, tokenizer)
    try:
        call = Ticket(
            tuple(p.prompt for p in PROBLEMS),
            WeightsRef(str(tiny_model)),
            0,
            0,
            1,
            problem_ids=tuple(p.id for p in PROBLEMS),
        )
        return sampler.collect(sampler.submit(call))
    finally:
        sampler.close()


@pytest.mark.parametrize(
    ("name", "env", "turn", "why"),
    [
        ("Raises", {}, 2, r"step\(\)\) raised ValueError: cannot read '7' \(.*user_envs\.py:\d+\)"),
        (
            "Hangs",
            {"timeout_s": 1.0},
            2,
            r"step\(\)\) did not return within env\.timeout_s = 1 s; its process was killed",
        ),
        ("WrongType", {}, 1, r"step\(\)\) returned a dict: step\(\) returns a trainer_svc\.envs\.Step"),
        ("Crashes", {}, 1, r"step\(\)\): its process died during the call"),
        ("Greedy", {"memory_mb": 400}, 1, r"step\(\)\) raised MemoryError"),
        ("EndsAnswered", {}, 0, r"creating it and its reset\(\)\) returned an assistant message last"),
    ],
)
def test_a_fault_of_the_environment_stops_the_run_naming_it_the_episode_and_the_turn(
    tiny_model, tmp_path, name, env, turn, why
):
    with pytest.raises(EnvError) as stopped:
        episodes(tiny_model, tmp_path, f"user_envs:{name}", **env)
    message = str(stopped.value)
    assert re.match(rf"environment user_envs:{name} \({EPISODE}, turn {turn}, {why}", message), message
    assert stopped.value.exit_code == 2


def test_a_class_that_cannot_be_imported_stops_the_launch(tiny_model, tmp_path):
    with pytest.raises(EnvError, match=r"environment user_envs:Nope: module 'user_envs' has no class 'Nope'"):
        episodes(tiny_model, tmp_path, "user_envs:Nope")
    with pytest.raises(EnvError, match=r"importing module 'no_such_envs' failed: ModuleNotFoundError.*PYTHONPATH"):
        episodes(tiny_model, tmp_path, "no_such_envs:Chat")


def test_first_messages_that_depend_on_the_seed_are_refused(tiny_model, tmp_path):
    with pytest.raises(EnvError, match=r"the 2 episodes of row add-0-0 start with different first messages"):
        episodes(tiny_model, tmp_path, "user_envs:Seeded")


def test_a_worked_example_before_the_question_is_prompt(tiny_model, tmp_path):
    """Assistant and tool turns before reset()'s last message are accepted as prompt: the group's
    prompt ids hold them and the row's question; no sample trains on them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    groups = episodes(tiny_model, tmp_path, "user_envs:WorkedExample")
    assert [tokenizer.decode(g.prompt_ids) for g in groups] == [
        f"1+1=2<tool_response>right</tool_response>\n{p.prompt}" for p in PROBLEMS
    ]
    assert all(tokenizer.decode(s.token_ids).startswith("7") for g in groups for s in g.samples)


def test_the_first_episode_with_tools_is_not_charged_the_import_of_the_schema_maker(tiny_model, tmp_path):
    # Describing the tools to the model takes transformers' get_json_schema, whose import takes
    # seconds in a fresh process: done at the process's start, no episode's creation times out.
    [group, _] = episodes(tiny_model, tmp_path, "user_envs:Calculator", timeout_s=1.0, concurrency=2)
    assert all(s.ended == "done" and s.reward == 1.0 for s in group.samples)


def test_a_script_without_a_main_guard_is_told_what_stopped_the_environments_processes(tmp_path):
    # The environment processes start by forkserver and import the main module: a script that
    # starts them at its top level starts them again in each child, which Python refuses.
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import msgspec\n"
        "from trainer_svc.config import EnvConfig\n"
        "from trainer_svc.envs.pool import EnvPool\n"
        "EnvPool(msgspec.convert({'class': 'user_envs:Chat', 'concurrency': 1}, EnvConfig)).start()\n"
    )
    user = tmp_path / "user"  # where user_envs wrote the module
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "its worker process did not start" in done.stderr and 'if __name__ == "__main__":' in done.stderr
