"""The command line the seeded row generators share: `SCRIPT OUT [--rows N] [--seed S]` writes
`rows(N, S)` to OUT as JSON lines (compact, so the same rows give the same bytes)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path


def write_rows_main(rows: Callable[[int, int], list[dict]], description: str, default_rows: int) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=default_rows)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = rows(args.rows, args.seed)
    args.out.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in written))
    print(f"{len(written)} rows in {args.out}")
