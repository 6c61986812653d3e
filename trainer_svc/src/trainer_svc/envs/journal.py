"""The episodes' journal: every answered assistant turn of a sampling call not yet trained on,
so that a resume replays it instead of asking the engine again.

One JSON-lines file per sampling call, `<run.dir>/episodes/<call name>.jsonl`, its name made
from what the call asks (tag, step, attempt, and a digest of weights, seed, rows and samples):
the same call made by a relaunch finds it. A line is an answered turn of one episode
({"ep", "t", "turn": {...}}) or the environment ids appended after it ({"ep", "t", "env_ids"}).
Lines are flushed as they are written, so a stop, a crash or a kill of the trainer keeps all but
perhaps a torn last line, which a reader drops (a machine's crash may lose the page cache's
lines: those turns are asked again, with their seeds). The file is removed once its call is
collected.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import IO

from protocol.fsio import read_regular_file

from ..rollout_types import Ticket
from .episodes import Recorded

MAX_JOURNAL_BYTES = 1 << 32


def call_name(ticket: Ticket, n: int) -> str:
    asked = [ticket.weights.dir, ticket.weights.content_id, ticket.seed, list(ticket.problem_ids), n]
    digest = hashlib.sha256(json.dumps(asked).encode()).hexdigest()[:12]
    return f"{ticket.tag}-s{ticket.step:08d}-a{ticket.attempt}-{digest}"


class Journal:
    def __init__(self, root: Path):
        self.root = root
        self._open: dict[str, IO[str]] = {}

    def read(self, name: str) -> dict[str, list[Recorded]]:
        """The recorded turns of each episode of call `name` (by its key), in order."""
        path = self.root / f"{name}.jsonl"
        if not path.exists():
            return {}
        turns: dict[str, dict[int, Recorded]] = {}
        env: dict[tuple[str, int], list[int]] = {}
        for line in read_regular_file(path, MAX_JOURNAL_BYTES).decode().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:  # a torn last line
                continue
            if "turn" in entry:
                turns.setdefault(entry["ep"], {})[entry["t"]] = Recorded(**entry["turn"])
            else:
                env[(entry["ep"], entry["t"])] = entry["env_ids"]
        replay = {}
        for key, by_turn in turns.items():
            replay[key] = []
            while len(replay[key]) in by_turn:  # contiguous from turn 0
                t = len(replay[key])
                by_turn[t].env_ids = env.get((key, t))
                replay[key].append(by_turn[t])
        return replay

    def turn(self, name: str, key: str, t: int, recorded: Recorded) -> None:
        fields = {k: v for k, v in asdict(recorded).items() if k != "env_ids"}
        self._write(name, {"ep": key, "t": t, "turn": fields})

    def env(self, name: str, key: str, t: int, ids: list[int]) -> None:
        self._write(name, {"ep": key, "t": t, "env_ids": ids})

    def drop(self, name: str) -> None:
        handle = self._open.pop(name, None)
        if handle is not None:
            handle.close()
        (self.root / f"{name}.jsonl").unlink(missing_ok=True)

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()

    def _write(self, name: str, entry: dict) -> None:
        handle = self._open.get(name)
        if handle is None:
            self.root.mkdir(parents=True, exist_ok=True)
            path = self.root / f"{name}.jsonl"
            torn = path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
            handle = self._open[name] = open(path, "a", encoding="utf-8")
            if torn:  # end a torn last line, or the next entry would join it
                handle.write("\n")
        handle.write(json.dumps(entry) + "\n")
        handle.flush()
