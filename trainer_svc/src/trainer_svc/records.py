"""The run's files that are replaced whole (stage_result.json, the launch receipt, the trackers'
ids) or appended a row at a time (metrics.jsonl, canary.jsonl): readers never see part of one,
and a write that fails (a full disk) names the file it stopped."""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

from protocol.fsio import replace_atomic

log = logging.getLogger(__name__)


def write_json_atomic(path: Path, data: dict) -> None:
    """Readers see the old file or the new one, never a part (and it survives a power cut)."""
    write_bytes_atomic(path, (json.dumps(data, indent=1, default=str) + "\n").encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically (protocol.fsio.replace_atomic); a failure names it."""
    with naming(path):
        replace_atomic(path, data)


@contextmanager
def naming(path: Path):
    """An OSError raised inside names `path` first (a failed write() names no file on its own, and
    an atomic replace names its scratch file, kept second), so a full disk's message says which
    output it stopped."""
    try:
        yield
    except OSError as exc:
        if exc.filename == str(path):
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path), None, exc.filename) from exc


class StepLog:
    """A JSONL file of rows keyed by "step" (metrics.jsonl, canary.jsonl), appended whole or not at
    all: a write that fails (a full disk) cuts the file back to its last complete row, and a row
    is on disk before the next step.

    On resume the rows of steps after the checkpoint are dropped (those steps run again), and
    the checkpoint's own row is appended if the log lost it (the disk filled between the save and
    the row). That rewrite goes to a new file renamed over the old (protocol.fsio.replace_atomic):
    a crash or a full disk during it leaves the old history whole. `rows` holds what was kept.

    A line that does not read as a row: the last one was torn by a crash mid-append and is
    dropped (its step is run again, or its row comes back from the checkpoint). One elsewhere
    was damaged otherwise (an editor, the disk): the readable rows are kept, the original file is
    kept whole beside it as `<name>.damaged-N`, and a warning names the line. A damaged log never
    stops a relaunch: the checkpoint, not the log, says where the run stands, and refusing would
    leave a run idle for a record that is kept anyway."""

    def __init__(self, path: Path, resumed_step: int, checkpoint_row: dict | None = None):
        self.path = Path(path)
        self.rows: list[dict] = []
        if self.path.exists():
            self._cut_back(resumed_step, checkpoint_row)
        with naming(self.path):
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o664)
        self._size = os.fstat(self._fd).st_size

    def _cut_back(self, resumed_step: int, checkpoint_row: dict | None) -> None:
        original = self.path.read_text()
        lines = original.splitlines()
        while lines and not lines[-1].strip():
            lines.pop()
        rows = [_row(line) for line in lines]
        if rows and rows[-1] is None:  # torn by a crash mid-append: its step is redone
            rows.pop()
            lines.pop()
        damaged = [n for n, (line, row) in enumerate(zip(lines, rows, strict=True), 1) if row is None and line.strip()]
        kept = [row for row in rows if row is not None and row["step"] <= resumed_step]
        if checkpoint_row is not None and not any(row["step"] == resumed_step for row in kept):
            kept.append(checkpoint_row)
        self.rows = kept
        text = "".join(json.dumps(row) + "\n" for row in kept)
        if text == original:
            return  # nothing to cut: no write, which a full disk might refuse
        if damaged:
            aside = self._set_aside()
            log.warning(
                "%s line %s does not read as a metrics row (damaged?); kept its readable rows up to step %d, "
                "and the original whole as %s",
                self.path,
                ", ".join(map(str, damaged)),
                resumed_step,
                aside,
            )
        with naming(self.path):
            replace_atomic(self.path, text.encode())

    def _set_aside(self) -> Path:
        """Keep the file as it is under the first free `<name>.damaged-N` (a hard link: no copy, so
        it works on a full disk too)."""
        number = 1
        while True:
            aside = self.path.with_name(f"{self.path.name}.damaged-{number}")
            try:
                os.link(self.path, aside)
                return aside
            except FileExistsError:
                number += 1

    def write(self, row: dict) -> None:
        data = (json.dumps(row) + "\n").encode()
        left = memoryview(data)
        try:
            with naming(self.path):
                while left:
                    left = left[os.write(self._fd, left) :]
        except OSError:
            os.ftruncate(self._fd, self._size)  # no torn row: shrinking a file needs no space
            raise
        self._size += len(data)
        self.rows.append(row)

    def close(self) -> None:
        os.close(self._fd)


def _row(line: str) -> dict | None:
    """A metrics row, or None for a line that is not one."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None
