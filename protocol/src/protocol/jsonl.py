"""Reading JSONL files people write by hand: each bad line is named as `file:line`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def json_lines(path: str | Path, error: type[Exception]) -> Iterator[tuple[int, str, object]]:
    """(line number, "file:line", value) for each non-blank line; `error` for a line that is not
    UTF-8 or not JSON. Which values are acceptable is the caller's to say."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise error(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as exc:
                raise error(f"{where}: not JSON ({exc})") from None
            except RecursionError:
                raise error(f"{where}: nested too deeply to be a row") from None
            yield number, where, value
