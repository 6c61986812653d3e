"""Reward functions: what scores a sample. `reward.functions` names them, `reward.weights` weighs
them, and a sample's reward is the weighted sum of their values:

    [reward]
    functions = ["correct", "my_rewards.style:brevity"]   # built-ins by name, yours as "module:function"
    weights = [1.0, 0.5]

The calling convention (TRL's `reward_funcs`, with keyword arguments throughout):

    def brevity(completions: list[str], prompts: list, **kwargs) -> list[float]:
        return [-len(text) / 100 for text in completions]

- One call per scoring of a sampling call: every prompt's G completions, flattened in order
  (prompt 0's G, then prompt 1's...). Every argument is a list aligned with `completions`
  (`prompts[i]` is the prompt of completion i, a string or a conversation [{"role", "content"}]),
  except `max_tokens`.
- Keyword arguments: `completions`, `prompts`, `gold` (the row's answer, None where the row has
  none), `finish_reasons` ("stop": ended by itself; "length": cut at max_tokens),
  `completion_ids` (the generated token ids, the end-of-sequence token included where it ended
  by itself), `max_tokens` (the cap on generated tokens, an int), and every other field of the
  rows (None where a row lacks it). Accept **kwargs: more may be passed later. Treat them as
  read-only.
- Return one value per completion, in order: a list (or tuple) of bools, ints or floats (numpy's
  scalars too), each finite.
- A user's function runs in a worker process of its own (trainer_svc.learning.reward_process: its main
  thread, so libraries that time themselves with signals work) and must return within
  `reward.timeout_s`, or the process is killed.

A function that raises, does not return in time, or returns the wrong number or type of values,
or a NaN or infinity, stops the run (RewardFunctionError: exit 2) with a message naming the
function and the sample, or the call's samples where no one sample is to blame; it never scores
as 0. Each function's mean value (unweighted) is logged per step as `reward/<name>`.

The built-ins (trainer_svc.learning.rewards) follow the same convention and run inline: `correct` (the
verifier: 1 for a correct answer, else 0), `format` and `overlong` (penalties in [-1, 0]).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from protocol import exit_codes

from ..config import BUILTIN_REWARDS, RewardConfig
from .reward_process import LoadError, NotAList, NotAValue, Overran, Raised, UserFunctions, describe, find_module
from .rewards import CorrectAnswer, OverlongPenalty, Verifier, format_ok, format_penalty

# The arguments the trainer passes; a row field of one of these names would be hidden by it.
PASSED = ("completions", "prompts", "gold", "finish_reasons", "completion_ids", "max_tokens")
SHOWN = 80  # characters of a completion a message quotes


class RewardFunctionError(Exception):
    """A reward function cannot be used, or failed on a sample: the run stops (exit 2) before
    scoring anything wrong. The message names the function and the sample."""

    exit_code = exit_codes.USAGE


@dataclass(frozen=True)
class RewardFunction:
    name: str  # as reward.functions names it: a built-in's short name, or "package.module:function"
    weight: float
    builtin: Callable[..., Sequence] | None  # a built-in's function, run inline; None: a user's, run by the worker


@dataclass
class GroupScores:
    """One prompt's G samples, scored."""

    totals: list[float]  # the reward of each sample: sum over functions of weight * value
    values: dict[str, list[float]]  # each function's own value per sample, unweighted
    correct: list[bool] | None  # the verifier's verdict per sample; None: the row has no gold
    format_ok: list[bool] | None  # ended by itself and exactly an answer; None: the row has no gold


def find_user_functions(cfg: RewardConfig) -> None:
    """RewardFunctionError unless the module of each user function reward.functions names is
    found: the launch's first check, instant (the modules are imported by the worker, at `start`)."""
    for name in cfg.functions:
        if name not in BUILTIN_REWARDS:
            try:
                find_module(name)
            except LoadError as exc:
                raise RewardFunctionError(str(exc)) from None


class Rewards:
    """The configured reward functions, bound to a verifier: `score` gives each sample's reward.

    Built at launch: rows that a built-in cannot score are refused (RewardFunctionError), before
    any step. Users' functions run in a worker process of their own (reward_process): `start`
    starts it and imports them there (RewardFunctionError when one cannot be used), else the
    first call does; `close` stops it. Not thread-safe."""

    def __init__(self, cfg: RewardConfig, verifier: Verifier, max_tokens: int, problems: Sequence = ()):
        self.verifier = verifier
        self.max_tokens = max_tokens
        self.timeout_s = cfg.timeout_s
        builtins = {
            "correct": CorrectAnswer(verifier),
            "format": format_penalty,
            "overlong": OverlongPenalty(cfg.overlong_buffer),
        }
        find_user_functions(cfg)
        self.functions = [
            RewardFunction(name, weight, builtins.get(name))
            for name, weight in zip(cfg.functions, cfg.weights, strict=True)
        ]
        self.users = UserFunctions([f.name for f in self.functions if f.builtin is None])
        if "overlong" in cfg.functions and not cfg.overlong_buffer <= max_tokens:
            raise RewardFunctionError(
                f"reward.overlong_buffer = {cfg.overlong_buffer} is wider than rollout.max_tokens = {max_tokens}: "
                "the overlong penalty starts max_tokens - overlong_buffer tokens in; narrow the buffer"
            )
        self.field_names = self._check_rows(problems)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    def _check_rows(self, problems: Sequence) -> list[str]:
        """The row fields passed to the functions, in first-seen order. Refuses a row without a
        gold where `correct` scores, and a field named as an argument the trainer passes."""
        names: dict[str, None] = {}
        for problem in problems:
            if problem.gold is None and "correct" in self.names:
                raise RewardFunctionError(
                    f'row {problem.id} has no gold answer, and the built-in reward "correct" compares each '
                    'completion with it: give the rows an answer field, or drop "correct" from reward.functions '
                    "(with its weight) and score with functions of your own"
                )
            for field in problem.fields:
                if field in PASSED:
                    raise RewardFunctionError(
                        f"row {problem.id} has a field {field!r}, the name of an argument the trainer passes reward "
                        f"functions ({', '.join(PASSED)}): rename that field in the data"
                    )
                names[field] = None
        return list(names)

    def score(self, problems: Sequence, groups: Sequence, where: str = "") -> list[GroupScores]:
        """The scores of each problem's group of samples (in order), one call per function.
        `where` says which call this is (e.g. "step 3") for error messages."""
        self.start()  # at launch already, where a run scores
        samples = [(problem, index, sample) for problem, g in zip(problems, groups, strict=True)
                   for index, sample in enumerate(g.samples)]  # fmt: skip
        arguments = {
            "completions": [s.text for _, _, s in samples],
            "prompts": [p.prompt for p, _, _ in samples],
            "gold": [p.gold for p, _, _ in samples],
            "finish_reasons": [s.finish_reason for _, _, s in samples],
            "completion_ids": [s.token_ids for _, _, s in samples],
        }
        fields = self.field_names + [f for p in problems for f in p.fields if f not in self.field_names]
        for field in dict.fromkeys(fields):
            arguments[field] = [p.fields.get(field) for p, _, _ in samples]
        call = Call(arguments, self.max_tokens, samples, where)
        values = {f.name: self._values(f, call) for f in self.functions}
        totals = []
        for i in range(len(samples)):
            # A left fold in the configured order: with the default functions and weights the
            # total is bit for bit 1*correct + 0*(format_ok - 1) + 1*overlong.
            total = self.functions[0].weight * values[self.functions[0].name][i]
            for f in self.functions[1:]:
                total += f.weight * values[f.name][i]
            totals.append(total)
        correct, well_formed = self._observed(call, values)
        scores, start = [], 0
        for problem, group in zip(problems, groups, strict=True):
            end = start + len(group.samples)
            known = problem.gold is not None
            scores.append(
                GroupScores(
                    totals=totals[start:end],
                    values={name: v[start:end] for name, v in values.items()},
                    correct=correct[start:end] if known else None,
                    format_ok=well_formed[start:end] if known else None,
                )
            )
            start = end
        return scores

    def _observed(self, call: Call, values: dict[str, list[float]]) -> tuple[list[bool], list[bool]]:
        """Accuracy and format per sample, where the row has a gold: from `correct` and `format`
        when they score, else asked of the verifier and format_ok directly (logged, not rewarded)."""
        if "correct" in values:
            correct = [v == 1.0 for v in values["correct"]]
        else:
            correct = [
                gold is not None and self.verifier.is_correct(text, gold)
                for text, gold in zip(call.arguments["completions"], call.arguments["gold"], strict=True)
            ]
        if "format" in values:
            well_formed = [v == 0.0 for v in values["format"]]
        else:
            well_formed = [
                format_ok(text, reason)
                for text, reason in zip(call.arguments["completions"], call.arguments["finish_reasons"], strict=True)
            ]
        return correct, well_formed

    def start(self) -> None:
        """Start the users' functions' worker and import them there (at launch, on the rank that
        scores): RewardFunctionError when one is missing, not callable, or its import fails."""
        try:
            self.users.start()
        except (LoadError, Overran) as exc:
            raise RewardFunctionError(str(exc)) from None

    def close(self) -> None:
        """Stop the users' functions' worker, if one was started."""
        self.users.close()

    def __enter__(self) -> Rewards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _values(self, function: RewardFunction, call: Call) -> list[float]:
        """The function's checked values on the call's samples; RewardFunctionError otherwise."""
        try:
            returned = self._run(function, call)
        except Overran:
            raise RewardFunctionError(
                f"{call.naming(function)} did not return within reward.timeout_s = {self.timeout_s:g} s, scoring "
                f"{call.samples_named()}. Make it faster (or raise reward.timeout_s), then relaunch: the run "
                "resumes from its newest checkpoint"
            ) from None
        except Raised as exc:
            fix = "drop it from reward.functions" if function.builtin else "fix it"
            raise RewardFunctionError(
                f"{call.naming(function)} raised {exc}, {self._culprit(function, call)}. {fix.capitalize()}, then "
                "relaunch: the run resumes from its newest checkpoint"
            ) from None
        return call.checked(function, returned)

    def _run(self, function: RewardFunction, call: Call) -> list | NotAList:
        """Call the function: a built-in inline, a user's in the worker under timeout_s."""
        if function.builtin is None:
            return self.users.call(function.name, call.kwargs(), self.timeout_s)
        try:
            return function.builtin(**call.kwargs())
        except Exception as exc:
            raise Raised(describe(exc)) from exc

    def _culprit(self, function: RewardFunction, call: Call) -> str:
        """The first sample the function raises on when called on it alone, to name in the message;
        else (every sample alone passes, or one overruns) the call's samples."""
        for i in range(len(call.samples)):
            try:
                self._run(function, call.single(i))
            except Overran:
                break
            except Raised:
                return f"on {call.sample_named(i)}"
        return f"scoring {call.samples_named()} (no one of them alone makes it raise)"


@dataclass
class Call:
    """One call's arguments and the samples they describe, for checks and messages."""

    arguments: dict[str, list]
    max_tokens: int
    samples: list[tuple]  # (problem, index in its group, sample), aligned with the arguments
    where: str

    def kwargs(self) -> dict:
        """Fresh lists for each function: one that changes its arguments cannot change another's."""
        return {**{k: list(v) for k, v in self.arguments.items()}, "max_tokens": self.max_tokens}

    def single(self, i: int) -> Call:
        return Call({k: v[i : i + 1] for k, v in self.arguments.items()}, self.max_tokens, self.samples[i : i + 1], "")

    def naming(self, function: RewardFunction) -> str:
        return f"reward function {function.name!r}" + (f" ({self.where})" if self.where else "")

    def sample_named(self, i: int) -> str:
        problem, index, sample = self.samples[i]
        text = sample.text if len(sample.text) <= SHOWN else sample.text[:SHOWN] + "..."
        return f"problem {problem.id}, sample {index} (completion {text!r})"

    def samples_named(self) -> str:
        ids = list(dict.fromkeys(p.id for p, _, _ in self.samples))
        shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        return f"the {len(self.samples)} completions of problems {shown}"

    def checked(self, function: RewardFunction, returned: object) -> list[float]:
        """The values as floats, or RewardFunctionError naming what is wrong and where."""
        n = len(self.samples)
        if isinstance(returned, NotAList) or not isinstance(returned, (list, tuple)):
            name = returned.type_name if isinstance(returned, NotAList) else type(returned).__name__
            raise RewardFunctionError(
                f"{self.naming(function)} returned a {name}, scoring {self.samples_named()}: "
                f"return a list of {n} numbers, one per completion (an array: .tolist())"
            )
        if len(returned) != n:
            raise RewardFunctionError(
                f"{self.naming(function)} returned {len(returned)} values for {n} completions, scoring "
                f"{self.samples_named()}: return one value per completion, in order"
            )
        values = []
        for i, value in enumerate(returned):
            if isinstance(value, NotAValue) or not isinstance(value, (bool, int, float)):
                shown, kind = (
                    (value.shown, value.type_name)
                    if isinstance(value, NotAValue)
                    else (repr(value), type(value).__name__)
                )
                raise RewardFunctionError(
                    f"{self.naming(function)} returned {shown} ({kind}) for {self.sample_named(i)}: each value must "
                    "be a number (bool, int or float)"
                )
            value = float(value)
            if not math.isfinite(value):
                raise RewardFunctionError(
                    f"{self.naming(function)} returned {value} for {self.sample_named(i)}: each value must be a "
                    "finite number"
                )
            values.append(value)
        return values
