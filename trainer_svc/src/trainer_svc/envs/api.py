"""What a user writes: an environment class, named in the config as `[env] class =
"package.module:Class"`, one instance per episode.

    from trainer_svc.envs import Environment, Step, tool

    class Addition(Environment):
        def __init__(self, row: dict, seed: int):
            self.a, self.b = row["a"], row["b"]

        def reset(self) -> list[dict]:
            return [{"role": "user", "content": f"{self.a}+{self.b}="}]

        def step(self, text: str) -> Step:
            return Step(reward=float(text.strip() == str(self.a + self.b)), done=True)

        @tool
        def add(self, a: int, b: int) -> int:
            \"\"\"Add two integers.

            Args:
                a: the first
                b: the second
            \"\"\"
            return a + b

The contract:
- `__init__(row, seed)`: `row` is the data row (its fields, with "id", "prompt" and "gold"),
  `seed` an integer the trainer derives from the run's seed, the step and the episode. An
  environment must be a deterministic function of its row, its seed and the assistant texts it
  was given: a resume re-creates the episodes in flight by replaying their recorded assistant
  turns into fresh instances (trainer_svc.envs.replay), and the run takes the same steps only
  if the replayed instance answers as the first one did (a difference stops the run).
- `reset()` returns the first messages: a non-empty list of {"role", "content"} dicts, roles
  "system" or "user", contents strings; "assistant" and "tool" turns may come before the last
  message as a worked example (a small model learns a tool's format from one), never as the
  last. They are prompt: no first message is trained on. The G episodes of a row are one GRPO group, compared on
  one prompt: their first messages must be the same (they may not depend on the seed).
- `step(text)` takes the assistant's text (the engine's detokenized completion) and returns a
  Step: the next messages (roles "user" or "tool") unless done, a reward added to the episode's,
  and whether the episode ends. An episode's reward is the sum of its steps' rewards.
- Tools: methods marked `@tool`, with typed arguments and a docstring whose "Args:" section
  describes them (the JSON schema the model sees is made from them by transformers'
  get_json_schema). An assistant turn that calls tools gets their results as "tool" messages,
  and `step` is not called for it; a call the environment cannot run (unknown tool, arguments
  that do not fit) is answered with an error message the model sees, as a tool's raise is.
  The call format is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the format of
  the Qwen2.5, Qwen3 and Hermes chat templates, which are given the schemas and render the
  results); without a chat template the schemas are listed in a system message and results are
  appended as `<tool_response>...</tool_response>` (trainer_svc.envs.tools).

An environment runs in a worker process of its own (trainer_svc.envs.pool), never in the
trainer's. A raise, a wrong return type, a call past `env.timeout_s` or a crash of that process
stops the run (exit 2) naming the environment, the episode and the turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Environment", "Step", "tool"]

TOOL_MARK = "__trainer_svc_tool__"


@dataclass
class Step:
    """What `Environment.step` returns."""

    messages: list[dict] = field(default_factory=list)  # the next {"role", "content"} turns; ignored when done
    reward: float = 0.0  # added to the episode's reward
    done: bool = False  # True: the episode ends after this turn


class Environment:
    """The base of an environment (optional: any class with the same methods will do)."""

    def __init__(self, row: dict, seed: int):
        self.row, self.seed = row, seed

    def reset(self) -> list[dict]:
        raise NotImplementedError("an environment's reset() returns its first messages")

    def step(self, text: str) -> Step:
        raise NotImplementedError("an environment's step(text) returns a Step")


def tool(method: Callable) -> Callable:
    """Mark a method of an environment as a tool the model may call."""
    setattr(method, TOOL_MARK, True)
    return method


def tool_names(cls: type) -> list[str]:
    """The names of an environment class's tool methods."""
    return [name for name in dir(cls) if getattr(getattr(cls, name, None), TOOL_MARK, False)]


def tool_methods(env: object) -> dict[str, Callable]:
    """The bound tool methods of an environment instance, by name."""
    return {name: getattr(env, name) for name in tool_names(type(env))}
