"""A file moved out of a watched directory must not delay the wake-up for the next arrival.

inotify reports a rename out of the directory as an unpaired IN_MOVED_FROM; an event grouper
that holds such events back to pair them would hold every later event too, and each claim
moves a request out of requests/. Compared as a ratio measured side by side, not a time."""

from __future__ import annotations

import os
import statistics
import time

from protocol.watch import Waker


def wake_latency(waker: Waker, directory, name: str, *, move_out_first: bool, elsewhere) -> float:
    if move_out_first:
        (directory / f"{name}.old").write_text("x")
        waker.wait(5)  # consume the hint of that creation
        os.rename(directory / f"{name}.old", elsewhere / f"{name}.old")
    waker.wait(0)  # start from a cleared hint
    started = time.perf_counter()
    (directory / name).write_text("x")
    assert waker.wait(5), "no wake-up at all"
    return time.perf_counter() - started


def test_a_move_out_does_not_hold_back_the_next_wake_up(tmp_path):
    watched, elsewhere = tmp_path / "requests", tmp_path / "claimed"
    watched.mkdir()
    elsewhere.mkdir()
    with Waker([watched], poll=False) as waker:
        plain = [wake_latency(waker, watched, f"p{i}", move_out_first=False, elsewhere=elsewhere) for i in range(5)]
        after_move = [wake_latency(waker, watched, f"m{i}", move_out_first=True, elsewhere=elsewhere) for i in range(5)]
    # Held-back events cost ~0.5 s against well under a millisecond: a ratio in the hundreds.
    assert statistics.median(after_move) < 20 * statistics.median(plain) + 0.05
