"""Write the times-tables task as chat rows: the multiplication table of `base` (3..19) from
base x start (start 1..20) for `count` lines (12..30), one user turn each, with the fields the
reward function trainer_svc.tasks.times_tables:lines_right reads. The rows
`configs/smollm2-gpu-long.toml` trains on; deterministic (every combination, in order).

    python scripts/times_tables.py configs/data/times_tables.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

QUESTION = (
    "Write the multiplication table of {base} from {base} x {start} to {base} x {stop}, one line each, "
    "written like {base} x {start} = {first}."
)


def rows() -> list[dict]:
    return [
        {
            "messages": [
                {
                    "role": "user",
                    "content": QUESTION.format(base=base, start=start, stop=start + count - 1, first=base * start),
                }
            ],
            "base": base,
            "start": start,
            "count": count,
        }
        for base in range(3, 20)
        for start in range(1, 21)
        for count in range(12, 31)
    ]


def main() -> None:
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows()))
    print(f"{len(rows())} rows in {out}")


if __name__ == "__main__":
    main()
