"""Users' reward functions run in a worker process of their own, so that each call has a real
timeout: a call that overruns `reward.timeout_s` has its process killed, whatever it is stuck in
(C code that holds the interpreter lock, such as a pathological regular expression, included).

The process's main thread runs the functions, so libraries that time themselves with signals
(math-verify's parse and verify, as TRL's and veRL's math rewards call them) work as they do in a
script. It is started once (`start`, or the first call) by forkserver (as the Verifier's is; a
script must keep its top-level code under `if __name__ == "__main__":`), with this process's
sys.path. It alone imports the user's modules (a judge model loaded at import time is loaded
there only, not in the trainer), and their module-level state lives there across calls. It
ignores SIGINT and SIGTERM: the trainer decides when to stop and stops it.

Guarantees: `call` returns what the function returned, as plain data (a list of its values, each
a bool, int or float, or a NotAValue describing what it was; or a NotAList), or raises Raised (the
function's exception, described in the worker, where its traceback is; or its process died) or
Overran (past the timeout; the process is killed, the next call starts a fresh one).
"""

from __future__ import annotations

import importlib
import importlib.util
import numbers
import signal
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context

STARTUP_TIMEOUT_S = 300.0  # the worker's start and the user's imports, apart from any call's timeout


class LoadError(Exception):
    """A function cannot be imported: the message names it and says why."""


class Raised(Exception):
    """The function raised; the message is `Type: message (file:line)`."""


class Overran(Exception):
    """The call did not return within its timeout (or the worker did not start in time)."""


@dataclass(frozen=True)
class NotAValue:
    """A returned element that is not a number, described (its value cannot always cross)."""

    type_name: str
    shown: str


@dataclass(frozen=True)
class NotAList:
    """A returned object that is not a list or tuple."""

    type_name: str


def find_module(name: str) -> None:
    """LoadError unless the module of "package.module:function" is found, without running it (its
    parent packages are imported): the trainer's launch check, which leaves importing to the worker."""
    module_name = name.partition(":")[0]
    try:
        found = importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    except Exception as exc:
        raise LoadError(f"reward function {name!r}: finding module {module_name!r} failed: {describe(exc)}") from None
    if not found:
        raise LoadError(
            f"reward function {name!r}: module {module_name!r} cannot be found; is its directory on PYTHONPATH?"
        )


def import_function(name: str) -> Callable:
    """The callable "package.module:function" names (the part after ":" may be dotted: a class's
    static method). LoadError when the module cannot be imported, lacks the name, or the name is
    not callable."""
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        hint = "; is its directory on PYTHONPATH?" if exc.name == module_name.split(".")[0] else ""
        raise LoadError(f"reward function {name!r}: module {module_name!r} cannot be imported ({exc}){hint}") from None
    except Exception as exc:
        raise LoadError(f"reward function {name!r}: importing module {module_name!r} failed: {describe(exc)}") from None
    found = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise LoadError(
                f"reward function {name!r}: module {module_name!r} ({getattr(module, '__file__', None)}) has no "
                f"{attribute!r}"
            )
        found = getattr(found, part)
    if not callable(found):
        raise LoadError(
            f"reward function {name!r} is a {type(found).__name__}, not a function: name a function that takes "
            "(completions, prompts, **kwargs) and returns a list of floats"
        )
    return found


def describe(exc: BaseException) -> str:
    """`Type: message (file:line)`, the line being the innermost frame the exception passed."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


class UserFunctions:
    """The worker process that runs the named user functions; one call at a time."""

    def __init__(self, names: list[str]):
        self.names = names
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the worker and import the functions there (nothing to do without functions, or
        when started): LoadError when one cannot be imported, Overran past STARTUP_TIMEOUT_S."""
        if self._pool is None and self.names:
            self._pool = self._start()

    def call(self, name: str, kwargs: dict, timeout_s: float) -> list | NotAList:
        self.start()
        future = self._pool.submit(_call, name, kwargs)
        try:
            outcome, value = future.result(timeout=timeout_s)
        except FutureTimeout:
            self._kill()
            raise Overran from None
        except BrokenProcessPool:  # the function ended its process (os._exit, a crash in C code)
            self._kill()
            raise Raised("its process died during the call (os._exit, a signal, or a crash in C code)") from None
        if outcome == "raised":
            raise Raised(value)
        return value

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _start(self) -> ProcessPoolExecutor:
        # forkserver, not fork: the trainer has threads (torch, the spool client), and a child
        # forked from a threaded process can inherit locks that no thread will ever release.
        pool = ProcessPoolExecutor(
            max_workers=1, mp_context=get_context("forkserver"), initializer=_prepare, initargs=(list(sys.path),)
        )
        try:
            pool.submit(_load, self.names).result(timeout=STARTUP_TIMEOUT_S)
        except FutureTimeout:
            self._pool = pool
            self._kill()
            raise Overran(f"the reward worker did not import {self.names} within {STARTUP_TIMEOUT_S:g} s") from None
        except BaseException:
            pool.shutdown(wait=True)
            raise
        return pool

    def _kill(self) -> None:
        """Kill the worker, stuck as it is; the next call starts a fresh one."""
        pool, self._pool = self._pool, None
        kill_pool(pool)


def kill_pool(pool: ProcessPoolExecutor) -> None:
    """Kill a pool's processes, whatever they are stuck in, and shut it down."""
    # ProcessPoolExecutor has no public way to stop a running task before Python 3.14.
    processes = list(pool._processes.values())
    for process in processes:
        process.kill()
    for process in processes:
        process.join()
    pool.shutdown(wait=False, cancel_futures=True)


# -- in the worker -------------------------------------------------------------------------------

_FUNCTIONS: dict[str, Callable] = {}


def ignore_stop_signals() -> None:
    """In a worker process: Ctrl-C and SIGTERM reach the trainer's whole process group, and the
    trainer stops at a step boundary, which may still need this worker; the trainer stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _prepare(sys_path: list[str]) -> None:
    # The forkserver kept the sys.path it started with; the functions are found on the trainer's.
    sys.path[:] = sys_path
    ignore_stop_signals()


def _load(names: list[str]) -> None:
    for name in names:
        _FUNCTIONS[name] = import_function(name)  # checked at launch: a LoadError here is news


def _call(name: str, kwargs: dict) -> tuple[str, object]:
    """("returned", values as plain data) or ("raised", its description): nothing the function
    does or returns can fail the pickling back."""
    try:
        returned = _FUNCTIONS[name](**kwargs)
    except BaseException as exc:  # SystemExit too: the function's failure, never the worker's exit
        return "raised", describe(exc)
    if not isinstance(returned, (list, tuple)):
        return "returned", NotAList(type(returned).__name__)
    return "returned", [_plain(value) for value in returned]


def _plain(value: object) -> object:
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, numbers.Real):  # numpy's numeric scalars, Fraction
        return float(value)
    numpy = sys.modules.get("numpy")  # loaded by the function, if it returns numpy's bools
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    shown = repr(value)
    return NotAValue(type(value).__name__, shown if len(shown) <= 80 else shown[:80] + "...")
