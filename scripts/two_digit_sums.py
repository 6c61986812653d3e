"""Write the two-digit sums task as chat rows: every a + b with a, b in 10..99, one user turn
each, with the sum as the answer. The rows `configs/smollm2-gpu.toml` trains on; deterministic.

    python scripts/two_digit_sums.py configs/data/two_digit_sums.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

QUESTION = "What is {a} + {b}? Answer with the number only."


def rows() -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": a + b}
        for a in range(10, 100)
        for b in range(10, 100)
    ]


def main() -> None:
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows()))
    print(f"{len(rows())} rows in {out}")


if __name__ == "__main__":
    main()
