"""Environments run in a pool of worker processes, never in the trainer's.

`env.concurrency` processes, started by forkserver with the trainer's sys.path (a script must
keep its top-level code under `if __name__ == "__main__":`); each imports the environment class
and holds the instances of the episodes given to it (an episode lives in one process from its
creation to its end), running one call at a time. They ignore SIGINT and SIGTERM: the trainer
decides when to stop and stops them.

Guarantees:
- Every call (an instance's creation and `reset`, a `step`, the tool calls of a turn) either
  returns plain, checked data or raises EnvError (exit 2) naming the environment, the episode
  and the turn, with the reason: the environment raised (its message and line), returned the
  wrong type, did not return within `env.timeout_s` of its start (its process is killed,
  whatever it is stuck in), or its process died (a crash, os._exit, the memory limit). Nothing
  is ever scored from a failed call, and no fault makes the trainer wait past the timeout.
- `env.memory_mb` caps each process's address space (RLIMIT_AS): an allocation past it fails in
  the environment (MemoryError, reported as its raise) or kills its process (reported as a
  crash). The time limit is the timeout above.

What this does not give: a process is not a security sandbox. Environment and tool code runs
as the trainer's user, with its files, network and environment variables; run code you do not
trust in a container or VM of its own.
"""

from __future__ import annotations

import importlib
import math
import resource
import sys
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context

from ..config import EnvConfig
from ..learning.reward_process import describe, ignore_stop_signals, kill_pool
from .api import Step, tool_methods, tool_names
from .errors import EnvError
from .tools import find_calls, run_calls, schema_maker, schemas

STARTUP_TIMEOUT_S = 300.0  # a process's start and the import of the user's module
# a worked example (assistant and tool turns) may come before the question; the generation prompt
# follows the last message, which the assistant answers, so it is no assistant turn of its own
FIRST_ROLES = ("system", "user", "assistant", "tool")
NEXT_ROLES = ("user", "tool", "system")


@dataclass(frozen=True)
class EnvCall:
    """One call of an episode's environment; `turn` is the assistant turn it follows (0: creation)."""

    episode: str
    turn: int
    kind: str  # "create" (args: row, seed) | "step" (args: text)
    args: tuple


@dataclass
class _Worker:
    pool: ProcessPoolExecutor
    queue: deque  # EnvCalls waiting for this process
    running: tuple[EnvCall, Future, float] | None = None  # the call under way and its deadline (monotonic)
    episodes: int = 0


class EnvPool:
    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg
        self.name = cfg.class_
        self._workers: list[_Worker] = []
        self._home: dict[str, _Worker] = {}  # episode -> the process that holds it

    def start(self) -> None:
        """Start the processes and import the class in each: EnvError when it cannot be used."""
        if self._workers:
            return
        context = get_context("forkserver")
        for _ in range(self.cfg.concurrency):
            pool = ProcessPoolExecutor(
                max_workers=1, mp_context=context, initializer=_prepare, initargs=(list(sys.path), self.cfg.memory_mb)
            )
            self._workers.append(_Worker(pool, deque()))
        loads = [w.pool.submit(_load, self.name) for w in self._workers]
        for future in loads:
            try:
                outcome, value = future.result(timeout=STARTUP_TIMEOUT_S)
            except Exception as exc:
                self.close()
                raise EnvError(
                    f"environment {self.name}: its worker process did not start ({exc}). Its processes import "
                    "the main module: a script that starts training must keep its top-level code under "
                    '`if __name__ == "__main__":`'
                ) from None
            if outcome != "ok":
                self.close()
                raise EnvError(f"environment {self.name}: {value}")

    def submit(self, call: EnvCall) -> None:
        """Queue a call; it starts once its episode's process is free."""
        self.start()
        if call.kind == "create":
            worker = min(self._workers, key=lambda w: (w.episodes, self._workers.index(w)))
            worker.episodes += 1
            self._home[call.episode] = worker
        self._home[call.episode].queue.append(call)
        self._dispatch(self._home[call.episode])

    def end(self, episode: str) -> None:
        """Forget an episode's instance (after its last call)."""
        worker = self._home.pop(episode)
        worker.episodes -= 1
        worker.queue.append(EnvCall(episode, -1, "drop", ()))
        self._dispatch(worker)

    def busy(self) -> bool:
        return any(w.running or w.queue for w in self._workers)

    def poll(self) -> list[tuple[EnvCall, dict]]:
        """The calls that finished, with their checked values; EnvError on a fault."""
        finished, now = [], time.monotonic()
        for worker in self._workers:
            if worker.running is None:
                continue
            call, future, deadline = worker.running
            if future.done():
                worker.running = None
                value = self._value(call, future)
                if call.kind != "drop":
                    finished.append((call, value))
                self._dispatch(worker)
            elif now >= deadline:
                raise EnvError(
                    f"{self._naming(call)} did not return within env.timeout_s = {self.cfg.timeout_s:g} s; its "
                    "process was killed. Make it faster (or raise env.timeout_s), then relaunch: the run resumes "
                    "from its newest checkpoint"
                )
        return finished

    def close(self) -> None:
        """Kill the processes, whatever they are doing (the run is over or stopping)."""
        for worker in self._workers:
            kill_pool(worker.pool)
        self._workers, self._home = [], {}

    def _dispatch(self, worker: _Worker) -> None:
        if worker.running is not None or not worker.queue:
            return
        call = worker.queue.popleft()
        future = worker.pool.submit(_CALLS[call.kind], call.episode, *call.args)
        worker.running = (call, future, time.monotonic() + self.cfg.timeout_s)

    def _value(self, call: EnvCall, future: Future) -> dict:
        try:
            outcome, value = future.result()
        except BrokenProcessPool:
            raise EnvError(
                f"{self._naming(call)}: its process died during the call (a crash in C code, os._exit, a signal, or "
                f"env.memory_mb = {self.cfg.memory_mb} reached). Fix it, then relaunch: the run resumes from its "
                "newest checkpoint"
            ) from None
        if outcome == "raised":
            raise EnvError(
                f"{self._naming(call)} raised {value}. Fix it, then relaunch: the run resumes from its newest "
                "checkpoint"
            )
        if outcome == "wrong":
            raise EnvError(f"{self._naming(call)} {value}")
        return value

    def _naming(self, call: EnvCall) -> str:
        what = {"create": "creating it and its reset()", "step": "step()", "drop": "ending it"}[call.kind]
        return f"environment {self.name} (episode {call.episode}, turn {call.turn}, {what})"


# -- in the worker -------------------------------------------------------------------------------

_CLASS: list[type] = []
_INSTANCES: dict[str, object] = {}


def _prepare(sys_path: list[str], memory_mb: int) -> None:
    sys.path[:] = sys_path  # the forkserver kept the sys.path it started with
    ignore_stop_signals()
    if memory_mb:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _load(name: str) -> tuple[str, str | None]:
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:
        hint = "; is its directory on PYTHONPATH?" if isinstance(exc, ModuleNotFoundError) else ""
        return "failed", f"importing module {module_name!r} failed: {describe(exc)}{hint}"
    found = getattr(module, attribute, None)
    if not isinstance(found, type):
        return "failed", f"module {module_name!r} has no class {attribute!r} (found {type(found).__name__})"
    if tool_names(found):
        schema_maker()  # its import takes seconds: here, within the start's time, not a call's env.timeout_s
    _CLASS[:] = [found]
    return "ok", None


def _create(episode: str, row: dict, seed: int) -> tuple[str, object]:
    try:
        env = _CLASS[0](row, seed)
        messages = env.reset()
        tools = schemas(tool_methods(env))
    except BaseException as exc:
        return "raised", describe(exc)
    wrong = _wrong_messages(messages, FIRST_ROLES, "reset()", empty_ok=False)
    if not wrong and messages[-1]["role"] == "assistant":
        wrong = "returned an assistant message last from reset(): the assistant answers the last message"
    if wrong:
        return "wrong", wrong
    _INSTANCES[episode] = env
    return "returned", {"messages": messages, "tools": tools}


def _step(episode: str, text: str) -> tuple[str, object]:
    env = _INSTANCES[episode]
    tools = tool_methods(env)
    calls = find_calls(text) if tools else []
    try:
        if calls:
            return "returned", {"messages": run_calls(calls, tools), "reward": 0.0, "done": False, "tools": len(calls)}
        step = env.step(text)
    except BaseException as exc:
        return "raised", describe(exc)
    if not isinstance(step, Step):
        return "wrong", f"returned a {type(step).__name__}: step() returns a trainer_svc.envs.Step"
    if isinstance(step.reward, bool) or not isinstance(step.reward, (int, float)) or not math.isfinite(step.reward):
        return "wrong", f"returned Step(reward={step.reward!r}): the reward must be a finite number"
    if not isinstance(step.done, bool):
        return "wrong", f"returned Step(done={step.done!r}): done must be True or False"
    wrong = None if step.done else _wrong_messages(step.messages, NEXT_ROLES, "Step.messages", empty_ok=False)
    if wrong:
        return "wrong", wrong
    messages = [] if step.done else [dict(m) for m in step.messages]
    return "returned", {"messages": messages, "reward": float(step.reward), "done": step.done, "tools": 0}


def _drop(episode: str) -> tuple[str, object]:
    _INSTANCES.pop(episode, None)
    return "returned", {}


def _wrong_messages(messages: object, roles: tuple[str, ...], what: str, *, empty_ok: bool) -> str | None:
    """Why `messages` is not a list of {"role", "content"} turns of these roles; None if it is."""
    if not isinstance(messages, list) or (not messages and not empty_ok):
        return f"returned {type(messages).__name__} {str(messages)[:80]!r} as {what}: give a non-empty list of messages"
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in roles
            or not isinstance(message.get("content"), str)
        ):
            return (
                f"returned {str(message)[:80]!r} as message {i} of {what}: each is a dict "
                f'{{"role": one of {list(roles)}, "content": a string}}'
            )
    return None


_CALLS = {"create": _create, "step": _step, "drop": _drop}
