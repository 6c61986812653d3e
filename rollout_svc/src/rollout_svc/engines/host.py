"""A child process that holds an engine, so that closing the engine gives back all it held.

Why a process of our own: vLLM forks its engine core from the process that builds the `LLM`.
A second engine forked from a process that already ran one inherits that engine's leftovers
(threads, locks, thread pools, allocator and CUDA driver state); on a GPU such a second engine
hung for minutes in its device set-up. Here each engine lives in a fresh interpreter
(`python -m MODULE`, exec'd, never forked from the worker), and closing it ends that process
and every process it started. Device memory belongs to processes, so once they are gone the
driver has it back; `close` waits for that and checks it.

Parent side (`EngineHost`):
- `call(command, *args)` returns the child's answer, or raises RequestFailed (the child
  refused the request), HostError (the command failed in the child; the child lives on) or
  HostDied (the child is gone, or its pipe is in an unknown state after an interrupted call);
- `close()` returns once the child and all its descendants have exited: an idle child is asked
  to shut down and given `grace_s`, anything left is SIGKILLed; a process that outlives even
  that is named in a HostError.

Child side (`serve`): answers commands one at a time, in order, on the main thread, from the
file descriptors its parent passed (no threads of ours in the child: its engine may fork).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from protocol.messages import ErrorCode

from ..errors import RequestFailed

log = logging.getLogger(__name__)

SHUTDOWN = "shutdown"


class HostError(RuntimeError):
    """A command failed inside the engine process (the message carries its traceback's last line)."""


class HostDied(HostError):
    """The engine process is gone, or can no longer be talked to; its engine is lost."""


class EngineHost:
    """One child process running `python -m module`, spoken to through two pipes."""

    def __init__(
        self, module: str, *, env: dict[str, str] | None = None, grace_s: float = 60.0, exit_wait_s: float = 30.0
    ):
        """`grace_s`: how long `close` waits for the child to shut down; `exit_wait_s`: how long
        after that for what it started to exit; then SIGKILL."""
        self.module = module
        self.grace_s = grace_s
        self.exit_wait_s = exit_wait_s
        commands_read, self._commands_write = os.pipe()
        self._answers_read, answers_write = os.pipe()
        environment = dict(os.environ if env is None else env)
        # The child imports this package and protocol from wherever this process found them.
        roots = [str(Path(__file__).resolve().parents[2]), str(Path(sys.modules["protocol"].__file__).parents[1])]
        environment["PYTHONPATH"] = os.pathsep.join(
            dict.fromkeys([*roots, *filter(None, environment.get("PYTHONPATH", "").split(os.pathsep))])
        )
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, str(commands_read), str(answers_write)],
                pass_fds=(commands_read, answers_write),
                stdin=subprocess.DEVNULL,
                env=environment,
            )
        finally:
            os.close(commands_read)
            os.close(answers_write)
        self._commands = Connection(self._commands_write, readable=False)
        self._answers = Connection(self._answers_read, writable=False)
        self._usable = True  # False once a call was cut short or the child died
        self._known: set[int] = {self.process.pid}  # the child and every descendant seen so far

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self._usable and self.process.poll() is None

    def call(self, command: str, *args):
        """Run `command` in the child and return its answer (see the module docstring for errors)."""
        if not self.alive():
            raise HostDied(self._gone())
        self._usable = False  # until the answer is read: a signal may interrupt us mid-way
        try:
            self._commands.send((command, args))
            kind, *payload = self._answers.recv()
        except (EOFError, OSError):
            try:  # its end of the pipe closed: it is exiting; let its exit status be known
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            raise HostDied(self._gone()) from None
        self._usable = True
        self._known.update(descendants(self.pid))
        if kind == "ok":
            return payload[0]
        if kind == "failed":
            code, message = payload
            raise RequestFailed(ErrorCode(code), message)
        name, message, trace = payload
        log.error("engine process %d: %s failed:\n%s", self.pid, command, trace)
        raise HostError(f"{name}: {message}")

    def close(self) -> None:
        """End the child and all it started; return when every one of them is gone."""
        self._known.update(descendants(self.pid))
        deadline = time.monotonic() + self.grace_s
        wait_s = 0.0  # a child that cannot be asked (gone, or mid-call) is not waited for
        if self.alive():
            try:
                self._commands.send((SHUTDOWN, ()))
                if self._answers.poll(self.grace_s):  # an engine's shutdown may hang: wait no longer
                    self._answers.recv()
            except (EOFError, OSError):
                pass  # it is gone already
            wait_s = max(0.0, deadline - time.monotonic())
        self._usable = False
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            log.warning("engine process %d still running %.0f s after shutdown; killing it", self.pid, self.grace_s)
        left = wait_gone(self._known, self.exit_wait_s if self.process.poll() is not None else 0)
        if left:
            log.warning("killing what is left of engine process %d: %s", self.pid, sorted(left))
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            left = wait_gone(left, self.exit_wait_s)
        self.process.wait()
        for connection in (self._commands, self._answers):
            connection.close()
        if left:
            raise HostError(f"processes {sorted(left)} of engine process {self.pid} survived SIGKILL")

    def _gone(self) -> str:
        code = self.process.poll()
        if code is None:
            return f"engine process {self.pid} no longer answers (a call to it was interrupted)"
        return f"engine process {self.pid} exited with {code}; its log lines precede this one"


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc (children, their children...)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            state = _stat(int(name))
            if state is not None:
                children.setdefault(state[1], []).append(int(name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    """Wait until none of `pids` runs any more (a zombie has already let go of its memory);
    returns those still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {pid for pid in pids if _running(pid)}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _running(pid: int) -> bool:
    state = _stat(pid)
    return state is not None and state[0] != "Z"


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name, in parentheses, may itself hold spaces and parentheses.
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


# -- child side ------------------------------------------------------------------------------------


def serve(handlers: dict[str, Callable], argv: list[str]) -> None:
    """Answer the parent's commands with `handlers[command](*args)` until SHUTDOWN or until the
    parent is gone. `argv` holds the two descriptors the parent passed (commands, answers)."""
    commands = Connection(int(argv[0]), writable=False)
    answers = Connection(int(argv[1]), readable=False)
    _die_with_parent()
    # Ctrl-C in a terminal reaches the whole process group; the worker decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            command, args = commands.recv()
        except EOFError:  # the parent is gone: nobody will read our answers
            handlers[SHUTDOWN]()
            return
        try:
            answer = ("ok", handlers[command](*args))
        except RequestFailed as exc:
            answer = ("failed", exc.code.value, exc.message)
        except Exception as exc:  # reported to the parent, which decides what to do
            answer = ("error", type(exc).__name__, str(exc), traceback.format_exc())
        answers.send(answer)
        if command == SHUTDOWN:
            return


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the worker dies, so a worker killed without
    its process group does not leave an engine holding the device (Linux prctl)."""
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        log.warning("cannot tie this engine process to its worker's life (no prctl)")
    if os.getppid() != parent:  # the worker died before the request above took effect
        os._exit(1)
