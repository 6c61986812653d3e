"""Write the three-number sums task as chat rows: a + b + c with a, b, c in 10..99, asked to be
worked out step by step with the answer on a last line "#### N" (the line protocol.answers reads
first). The rows `configs/smollm2-gpu-long.toml` trains on: completions of a few sentences to a
few hundred tokens, where working the sum out is what gets it right. Deterministic (a seeded draw
of ROWS distinct triples).

    python scripts/three_number_sums.py configs/data/three_number_sums.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROWS = 8000
SEED = 0
QUESTION = (
    "What is {a} + {b} + {c}? Work it out step by step, then give the final answer on its own last line "
    "as #### followed by the number."
)


def rows() -> list[dict]:
    rng = random.Random(SEED)
    triples = rng.sample([(a, b, c) for a in range(10, 100) for b in range(10, 100) for c in range(10, 100)], ROWS)
    return [
        {"messages": [{"role": "user", "content": QUESTION.format(a=a, b=b, c=c)}], "answer": a + b + c}
        for a, b, c in triples
    ]


def main() -> None:
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows()))
    print(f"{len(rows())} rows in {out}")


if __name__ == "__main__":
    main()
