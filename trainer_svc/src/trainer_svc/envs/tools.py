"""Tool calls: finding them in an assistant's text, running them, and their results as messages.

The format is the one the Qwen2.5, Qwen3 and Hermes chat templates teach their models:

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

one block per call, several per turn allowed. Each call's result is one message
{"role": "tool", "name": ..., "content": str(result)}; a call that cannot be made (text that is
no JSON object, an unknown tool, arguments that do not fit the method, the tool's raise) is
answered with a tool message saying so, which the model sees: a tool's error is part of the
task, not the trainer's. A turn with no well-formed block is no tool turn: it goes to `step`.

Runs inside the environment's worker process (trainer_svc.envs.pool), under its time and
memory limits.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def find_calls(text: str) -> list[str]:
    """The bodies of the tool-call blocks of `text`, in order."""
    return CALL.findall(text)


def run_calls(bodies: list[str], tools: dict[str, Callable]) -> list[dict]:
    """One tool message per call body."""
    return [_run(body, tools) for body in bodies]


def _run(body: str, tools: dict[str, Callable]) -> dict:
    try:
        call = json.loads(body)
    except ValueError as exc:
        return _answer("?", f"error: the tool call is not JSON ({exc})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return _answer("?", 'error: a tool call is a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if name not in tools:
        return _answer(name, f"error: no tool named {name!r}; the tools are {sorted(tools)}")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return _answer(name, "error: the arguments of a tool call are a JSON object")
    try:
        result = tools[name](**arguments)
    except TypeError as exc:
        return _answer(name, f"error: {exc}")
    except Exception as exc:  # the tool's failure is an answer the model sees
        return _answer(name, f"error: {type(exc).__name__}: {exc}")
    return _answer(name, result if isinstance(result, str) else json.dumps(result, default=str))


def _answer(name: str, content: str) -> dict:
    return {"role": "tool", "name": name, "content": content}


def schemas(tools: dict[str, Callable]) -> list[dict]:
    """The JSON schemas of the tools (transformers' get_json_schema: typed arguments and a
    docstring with an Args: section)."""
    if not tools:
        return []
    get_json_schema = schema_maker()
    return [get_json_schema(method) for _, method in sorted(tools.items())]


@functools.cache
def schema_maker() -> Callable:
    """transformers' get_json_schema. Its first use imports much of transformers (seconds): an
    environment process makes a schema at its start, never within a call's env.timeout_s."""
    from transformers.utils import get_json_schema

    get_json_schema(_example_tool)
    return get_json_schema


def _example_tool(x: int) -> int:
    """The schema made at a process's start.

    Args:
        x: a number
    """
    return x


def plain_tools_message(tool_schemas: list[dict]) -> dict:
    """For a model without a chat template: the tools and the call format, as a system message."""
    listed = "\n".join(json.dumps(s) for s in tool_schemas)
    return {
        "role": "system",
        "content": 'Tools you may call, one <tool_call>{"name": ..., "arguments": {...}}</tool_call> block a '
        f"call:\n{listed}\n",
    }
