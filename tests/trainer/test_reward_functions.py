"""Reward functions (trainer_svc.learning.reward_functions): a user's function imported from a module on
the path and called by the convention, in a worker process of its own; each way a function can
fail stops scoring with a message naming the function and the sample; the default functions score
exactly as the reward did before them; each function's mean is a metric, `reward/<name>`."""

from __future__ import annotations

import itertools
import json
import os
import sys
import textwrap
import uuid

import msgspec
import pytest
import torch
from conftest import make_config

from trainer_svc.config import RewardConfig
from trainer_svc.data import DataError, Problem, PromptStream
from trainer_svc.distributed import Distributed
from trainer_svc.learning.reward_functions import RewardFunctionError, Rewards
from trainer_svc.learning.reward_process import import_function
from trainer_svc.learning.rewards import Verifier, format_ok, overlong_penalty
from trainer_svc.rails.canary import Canary
from trainer_svc.rollout.sampling import StepSampler, summarize
from trainer_svc.rollout_types import Group, Sample, Ticket, WeightsRef

pytestmark = pytest.mark.timeout(60)

MAX_TOKENS = 4


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a module of reward functions into a directory on sys.path; returns its name."""
    made = []

    def write(source: str) -> str:
        name = f"user_rewards_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        made.append(name)
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for name in made:
        sys.modules.pop(name, None)


@pytest.fixture
def verifier():
    with Verifier(use_math_verify=False) as verifier:
        yield verifier


@pytest.fixture
def rewards_for(verifier):
    """Rewards of a config over PROBLEMS (or `problems`), closed after the test (their users'
    functions' worker stopped)."""
    made = []

    def make(cfg: RewardConfig, problems=None) -> Rewards:
        made.append(Rewards(cfg, verifier, MAX_TOKENS, PROBLEMS if problems is None else problems))
        return made[-1]

    yield make
    for rewards in made:
        rewards.close()


def reward_config(**values) -> RewardConfig:
    return msgspec.convert(values, RewardConfig)


def group(*samples: tuple[str, str, int]) -> Group:
    """Samples given as (text, finish_reason, token count)."""
    return Group([1], [Sample(list(range(n)), [0.0] * n, text, reason) for text, reason, n in samples])


PROBLEMS = [
    Problem("add-1-2", "1+2=", "3", {"level": 1, "source": "easy"}),
    Problem("add-5-5", "5+5=", "10", {"level": 2}),
]
GROUPS = [group(("3", "stop", 2), ("4", "stop", 2)), group(("10", "stop", 3), ("1", "length", 4))]


# -- a user's function ----------------------------------------------------------------------------


def test_a_users_function_from_a_module_on_the_path_is_called_by_the_convention(user_module, rewards_for, tmp_path):
    calls = tmp_path / "calls.jsonl"
    name = user_module(
        f"""
        import json, os

        def shorter(completions, prompts, **kwargs):
            with open({str(calls)!r}, "a") as calls:
                calls.write(json.dumps({{"completions": completions, "prompts": prompts, **kwargs}}) + "\\n")
            return [-len(text) for text in completions]

        def where(completions, prompts, **kwargs):
            return [os.getpid()] * len(completions)
        """
    )
    function = f"{name}:shorter"
    cfg = reward_config(functions=["correct", function, f"{name}:where"], weights=[1.0, 0.5, 0.0])
    scores = rewards_for(cfg).score(PROBLEMS, GROUPS, "step 1")

    (call,) = map(json.loads, calls.read_text().splitlines())  # one call for the sampling call, flattened
    assert call == {
        "completions": ["3", "4", "10", "1"],
        "prompts": ["1+2=", "1+2=", "5+5=", "5+5="],
        "gold": ["3", "3", "10", "10"],
        "finish_reasons": ["stop", "stop", "stop", "length"],
        "completion_ids": [[0, 1], [0, 1], [0, 1, 2], [0, 1, 2, 3]],
        "max_tokens": MAX_TOKENS,
        "level": [1, 1, 2, 2],  # every field of the rows, None where a row lacks it
        "source": ["easy", "easy", None, None],
    }
    assert [s.values[function] for s in scores] == [[-1.0, -1.0], [-2.0, -1.0]]
    assert [s.values["correct"] for s in scores] == [[1.0, 0.0], [1.0, 0.0]]
    assert [s.totals for s in scores] == [[0.5, -0.5], [0.0, -0.5]]  # correct + 0.5 * shorter + 0 * where
    assert [s.correct for s in scores] == [[True, False], [True, False]]
    assert scores[0].values[f"{name}:where"][0] not in (0, os.getpid())  # in a process of its own


def test_a_function_gets_lists_of_its_own(user_module, rewards_for):
    # One function emptying its arguments leaves the next one's whole.
    name = user_module(
        """
        def greedy(completions, prompts, **kwargs):
            values = [0.0] * len(completions)
            completions.clear()
            kwargs["gold"].clear()
            return values

        def counts(completions, prompts, gold, **kwargs):
            return [float(len(completions) + len(gold))] * len(completions)
        """
    )
    cfg = reward_config(functions=[f"{name}:greedy", f"{name}:counts"], weights=[1.0, 1.0])
    scores = rewards_for(cfg).score(PROBLEMS, GROUPS)
    assert [s.totals for s in scores] == [[8.0, 8.0], [8.0, 8.0]]


def test_a_static_method_and_a_callable_object_are_functions_too(user_module):
    name = user_module(
        """
        class Rewards:
            @staticmethod
            def one(completions, prompts, **kwargs):
                return [1] * len(completions)

        class Scaled:
            def __call__(self, completions, prompts, **kwargs):
                return [True] * len(completions)

        scaled = Scaled()
        """
    )
    assert import_function(f"{name}:Rewards.one")(completions=["a"], prompts=["p"]) == [1]
    assert import_function(f"{name}:scaled")(completions=["a"], prompts=["p"]) == [True]


def test_a_missing_module_is_refused_at_construction_without_running_anything(verifier):
    cfg = reward_config(functions=["correct", "no_such_package_xyz.rewards:f"], weights=[1.0, 1.0])
    with pytest.raises(RewardFunctionError) as info:
        Rewards(cfg, verifier, MAX_TOKENS, PROBLEMS)
    assert str(info.value) == (
        "reward function 'no_such_package_xyz.rewards:f': module 'no_such_package_xyz.rewards' cannot be found; "
        "is its directory on PYTHONPATH?"
    )


def test_the_trainer_never_imports_a_users_module_its_worker_does(user_module, rewards_for):
    name = user_module("def f(completions, prompts, **kwargs):\n    return [0.0] * len(completions)\n")
    rewards = rewards_for(reward_config(functions=[f"{name}:f"], weights=[1.0]))
    rewards.start()
    rewards.score(PROBLEMS, GROUPS)
    assert name not in sys.modules  # a judge model its module loads is loaded once, in the worker


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def g(completions, prompts, **kwargs):\n    return []\n", ["has no 'f'"]),
        ("f = 3\n", ["is a int, not a function", "(completions, prompts, **kwargs)"]),
        ("import no_such_dependency_xyz\n", ["cannot be imported", "no_such_dependency_xyz"]),
        ("raise RuntimeError('bad config')\n", ["importing module", "RuntimeError: bad config", ".py:1)"]),
    ],
    ids=["missing attribute", "not callable", "missing dependency", "module raises"],
)
def test_a_function_that_cannot_be_loaded_is_refused_at_start_with_its_name(user_module, rewards_for, source, expected):
    name = f"{user_module(source)}:f"
    rewards = rewards_for(reward_config(functions=["correct", name], weights=[1.0, 1.0]))
    with pytest.raises(RewardFunctionError) as info:
        rewards.start()
    message = str(info.value)
    assert message.startswith(f"reward function {name!r}"), message
    for part in expected:
        assert part in message, message
    if "dependency" in str(expected):
        assert "PYTHONPATH" not in message  # the module was found; what it imports was not


# -- a function that fails ------------------------------------------------------------------------

BAD_RETURNS = {
    "too few values": (
        "return [0.0] * (len(completions) - 1)",
        ["returned 3 values for 4 completions", "problems add-1-2, add-5-5"],
    ),
    "too many values": ("return [0.0] * (len(completions) + 1)", ["returned 5 values for 4 completions"]),
    "not a list": ("return {'a': 1}", ["returned a dict", "a list of 4 numbers"]),
    "a generator": ("return (0.0 for _ in completions)", ["returned a generator"]),
    "a string value": (
        "return [0.0, 0.0, 'high', 0.0]",
        ["returned 'high' (str) for problem add-5-5, sample 0 (completion '10')", "bool, int or float"],
    ),
    "None for a value": ("return [0.0, None, 0.0, 0.0]", ["returned None (NoneType) for problem add-1-2, sample 1"]),
    "NaN": ("return [0.0, 0.0, 0.0, float('nan')]", ["returned nan for problem add-5-5, sample 1", "finite"]),
    "infinity": ("return [float('-inf'), 0.0, 0.0, 0.0]", ["returned -inf for problem add-1-2, sample 0", "finite"]),
}


@pytest.mark.parametrize("case", list(BAD_RETURNS), ids=list(BAD_RETURNS))
def test_a_bad_return_stops_scoring_naming_the_function_and_the_sample(user_module, rewards_for, case):
    body, expected = BAD_RETURNS[case]
    name = user_module(f"def judge(completions, prompts, **kwargs):\n    {body}\n")
    function = f"{name}:judge"
    rewards = rewards_for(reward_config(functions=["correct", function], weights=[1.0, 1.0]))
    with pytest.raises(RewardFunctionError) as info:
        rewards.score(PROBLEMS, GROUPS, "step 7")
    message = str(info.value)
    assert message.startswith(f"reward function {function!r} (step 7) returned"), message
    for part in expected:
        assert part in message, message


def test_numpys_scalars_and_a_tuple_are_values_too(user_module, rewards_for):
    name = user_module(
        """
        import numpy as np

        def arrays(completions, prompts, **kwargs):
            return (np.float32(0.5), np.int64(2), np.bool_(True), True)
        """
    )
    scores = rewards_for(reward_config(functions=[f"{name}:arrays"], weights=[1.0])).score(PROBLEMS, GROUPS)
    assert [s.totals for s in scores] == [[0.5, 2.0], [1.0, 1.0]]


def test_a_function_that_raises_is_named_with_the_sample_it_raises_on(user_module, rewards_for):
    name = user_module(
        """
        def picky(completions, prompts, **kwargs):
            return [1.0 / (len(text) - 2) for text in completions]
        """
    )
    function = f"{name}:picky"
    rewards = rewards_for(reward_config(functions=[function], weights=[1.0]))
    with pytest.raises(RewardFunctionError) as info:
        rewards.score(PROBLEMS, GROUPS, "step 2")
    message = str(info.value)
    assert f"reward function {function!r} (step 2) raised ZeroDivisionError: float division by zero" in message
    assert f"{name}.py:3)" in message  # where in the user's file
    assert "on problem add-5-5, sample 0 (completion '10')" in message
    assert "relaunch" in message


def test_a_function_that_raises_only_on_the_whole_call_names_the_calls_samples(user_module, rewards_for):
    name = user_module(
        """
        def batch_only(completions, prompts, **kwargs):
            if len(completions) > 1:
                raise ValueError("wants one at a time")
            return [0.0]
        """
    )
    rewards = rewards_for(reward_config(functions=[f"{name}:batch_only"], weights=[1.0]))
    with pytest.raises(RewardFunctionError) as info:
        rewards.score(PROBLEMS, GROUPS)
    message = str(info.value)
    assert "raised ValueError: wants one at a time" in message
    assert "scoring the 4 completions of problems add-1-2, add-5-5 (no one of them alone makes it raise)" in message


@pytest.mark.parametrize(
    "body, expected",
    [("sys.exit(0)", "raised SystemExit: 0"), ("os._exit(3)", "raised its process died during the call")],
    ids=["sys.exit", "os._exit"],
)
def test_a_function_that_exits_fails_scoring(user_module, rewards_for, body, expected):
    name = user_module(f"import os, sys\n\ndef quits(completions, prompts, **kwargs):\n    {body}\n")
    rewards = rewards_for(reward_config(functions=[f"{name}:quits"], weights=[1.0]))
    with pytest.raises(RewardFunctionError, match=expected):
        rewards.score(PROBLEMS, GROUPS)


@pytest.mark.parametrize(
    "body",
    [
        "time.sleep(3600)",
        're.match(r"(a+)+$", "a" * 64 + "b")',  # never lets go of the interpreter lock: no thread could stop it
    ],
    ids=["sleeps", "backtracks in C"],
)
def test_a_function_that_hangs_past_timeout_s_is_stopped_and_stops_scoring(user_module, rewards_for, body):
    name = user_module(f"import re, time\n\ndef stuck(completions, prompts, **kwargs):\n    {body}\n")
    function = f"{name}:stuck"
    rewards = rewards_for(reward_config(functions=["correct", function], weights=[1.0, 1.0], timeout_s=0.5))
    with pytest.raises(RewardFunctionError) as info:
        rewards.score(PROBLEMS, GROUPS, "step 4")
    message = str(info.value)
    assert f"reward function {function!r} (step 4) did not return within reward.timeout_s = 0.5 s" in message
    assert "the 4 completions of problems add-1-2, add-5-5" in message


def test_a_function_may_time_itself_with_signals(user_module, rewards_for):
    # As math-verify's parse and verify do by default (signal.alarm), which only a main thread may.
    name = user_module(
        """
        import signal

        def alarmed(completions, prompts, **kwargs):
            previous = signal.signal(signal.SIGALRM, lambda *_: None)
            signal.alarm(30)
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            return [1.0] * len(completions)
        """
    )
    scores = rewards_for(reward_config(functions=[f"{name}:alarmed"], weights=[1.0])).score(PROBLEMS, GROUPS)
    assert [s.totals for s in scores] == [[1.0, 1.0], [1.0, 1.0]]


# -- rows ----------------------------------------------------------------------------------------


def test_correct_refuses_a_row_without_a_gold_at_construction(verifier):
    rows = [PROBLEMS[0], Problem("chat-7", [{"role": "user", "content": "hi"}], None, {"style": "terse"})]
    with pytest.raises(RewardFunctionError) as info:
        Rewards(RewardConfig(), verifier, MAX_TOKENS, rows)
    message = str(info.value)
    assert "row chat-7 has no gold answer" in message
    assert 'give the rows an answer field, or drop "correct" from reward.functions' in message


def test_rows_without_a_gold_are_scored_by_other_functions_and_have_no_accuracy(user_module, rewards_for):
    name = user_module(
        """
        def terse(completions, prompts, style, gold, **kwargs):
            assert gold == [None] * len(completions)
            return [float(s == "terse" and len(c) < 3) for c, s in zip(completions, style)]
        """
    )
    rows = [Problem("chat-7", [{"role": "user", "content": "hi"}], None, {"style": "terse"})]
    cfg = reward_config(functions=["format", f"{name}:terse"], weights=[0.0, 1.0])
    (scored,) = rewards_for(cfg, rows).score(rows, [GROUPS[1]])
    assert scored.totals == [1.0, 1.0] and scored.correct is None and scored.format_ok is None


def test_a_row_field_named_as_an_argument_is_refused(verifier):
    rows = [Problem("r1", "1+1=", "2", {"max_tokens": 9})]
    with pytest.raises(RewardFunctionError, match="row r1 has a field 'max_tokens'.*rename that field"):
        Rewards(RewardConfig(), verifier, MAX_TOKENS, rows)


def test_an_armed_canary_refuses_held_out_rows_without_a_gold(tmp_path):
    held_out = [Problem("q1", "1+1=", "2"), Problem("chat-3", "hi"), Problem("chat-4", "ho")]
    Canary.check(make_config(tmp_path, tmp_path, canary={"every": 0}), held_out)  # not armed: no need
    Canary.check(make_config(tmp_path, tmp_path, canary={"every": 5, "problems": 1}), held_out)  # q1 only
    with pytest.raises(DataError) as info:
        Canary.check(make_config(tmp_path, tmp_path, canary={"every": 5, "problems": 3}), held_out)
    assert "rows chat-3, chat-4 have none: set canary.every = 0, or give the rows an answer field" in str(info.value)


def test_an_overlong_buffer_wider_than_max_tokens_is_refused(verifier):
    with pytest.raises(RewardFunctionError, match="reward.overlong_buffer = 5 is wider than rollout.max_tokens = 4"):
        Rewards(RewardConfig(overlong_buffer=5), verifier, MAX_TOKENS)


# -- the default: the reward as it was -----------------------------------------------------------


def reward_before_functions(text, reason, n_tokens, gold, correct, format_weight, overlong_weight, buffer, verifier):
    """The reward as rewards.score computed it before reward functions, written out."""
    right = verifier.is_correct(text, gold)
    well_formed = format_ok(text, reason)
    overlong = overlong_penalty(n_tokens, MAX_TOKENS, buffer)
    return correct * right + format_weight * (well_formed - 1) + overlong_weight * overlong


@pytest.mark.parametrize(
    "correct, format_weight, overlong_weight, buffer",
    [(1.0, 0.0, 1.0, 0), (2.0, 0.5, 0.8, 2), (1.0, 0.1, 0.3, 4), (0.7, 0.0, 1.0, 3)],
    ids=["default", "all on", "buffer the cap", "no format"],
)
def test_the_built_ins_score_exactly_as_the_reward_did_before(
    verifier, rewards_for, correct, format_weight, overlong_weight, buffer
):
    texts = ["20", "21", " 20\n", "so 20", "-3", "", "twenty", "#### 20"]
    samples = list(itertools.product(texts, ["stop", "length"], range(MAX_TOKENS + 2)))
    problem = Problem("p", "19+1=", "20")
    cfg = reward_config(
        functions=["correct", "format", "overlong"],
        weights=[correct, format_weight, overlong_weight],
        overlong_buffer=buffer,
    )
    (scored,) = rewards_for(cfg, [problem]).score([problem], [group(*samples)])
    expected = [
        reward_before_functions(*s, "20", correct, format_weight, overlong_weight, buffer, verifier) for s in samples
    ]
    assert list(map(repr, scored.totals)) == list(map(repr, expected))  # bit for bit (repr round-trips a float)
    assert len(set(expected)) > (1 if format_weight == 0 and buffer == 0 else 4)  # the grid reaches every term


def test_the_default_reward_is_exactly_zero_or_one(rewards_for):
    (scored,) = rewards_for(RewardConfig()).score(PROBLEMS[:1], GROUPS[:1])
    assert RewardConfig().functions == ["correct", "format", "overlong"] and RewardConfig().weights == [1.0, 0.0, 1.0]
    assert scored.totals == [1.0, 0.0] and scored.values == {
        "correct": [1.0, 0.0],
        "format": [0.0, 0.0],
        "overlong": [0.0, 0.0],
    }


# -- metrics: reward/<name> ----------------------------------------------------------------------


class ScriptedSampler:
    """Each prompt `q<n>` is answered 4 times: n, n+1, n, and n+1 cut at the cap."""

    def submit(self, call: Ticket) -> Ticket:
        return call

    def collect(self, ticket: Ticket) -> list[Group]:
        groups = []
        for prompt in ticket.prompts:
            n = int(prompt.removeprefix("q"))
            texts = [(str(n), "stop"), (str(n + 1), "stop"), (str(n), "stop"), (str(n + 1), "length")]
            groups.append(Group([1], [Sample([2] * len(t), [-1.0] * len(t), t, r) for t, r in texts]))
        return groups

    def close(self) -> None:
        pass


def step_metrics(tmp_path, user_module, rewards_for, problems) -> tuple[dict, str]:
    name = user_module("def digits(completions, prompts, **kwargs):\n    return [len(c) for c in completions]\n")
    cfg = make_config(
        tmp_path,
        tmp_path,
        rollout={"prompts_per_step": 4, "samples_per_prompt": 4, "spare_prompts": 1},
        reward={"functions": ["format", f"{name}:digits"], "weights": [0.5, 1.0]},
    )
    stream = PromptStream(problems, seed=0)
    stream._order = list(range(len(problems)))  # q0, q1, ... in order
    rewards = rewards_for(cfg.reward, problems)
    steps = StepSampler(ScriptedSampler(), stream, rewards, cfg, Distributed(0, 1, torch.device("cpu")))
    return summarize(steps(0, WeightsRef("unused"))), f"reward/{name}:digits"


def test_each_functions_mean_over_the_first_sampling_is_a_metric(tmp_path, user_module, rewards_for):
    problems = [Problem(str(i), f"q{i}", str(i)) for i in (5, 9, 10, 99, 3)]  # 4 prompts and a spare
    row, digits = step_metrics(tmp_path, user_module, rewards_for, problems)
    # Over the 5 groups of the first sampling, unweighted: format is -1 only for the sample cut at the cap.
    assert row["reward/format"] == -0.25
    lengths = [len(t) for n in (5, 9, 10, 99, 3) for t in (str(n), str(n + 1), str(n), str(n + 1))]
    assert row[digits] == sum(lengths) / 20
    # Accuracy and format rate of the trained batch (gold known): half the answers are n.
    assert row["accuracy"] == 0.5 and row["format_rate"] == 0.75
    assert row["reward_first"] == pytest.approx(0.5 * -0.25 + row[digits])


def test_without_golds_there_is_no_accuracy_metric(tmp_path, user_module, rewards_for):
    problems = [Problem(str(i), f"q{i}") for i in (5, 9, 10, 99, 3)]
    row, digits = step_metrics(tmp_path, user_module, rewards_for, problems)
    assert "accuracy" not in row and "format_rate" not in row
    assert row["reward/format"] == -0.25 and digits in row
