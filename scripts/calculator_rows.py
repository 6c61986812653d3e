"""Write the calculator task's rows: the product of a three-digit (100..999) and a two-digit
(11..99) number, drawn by a seeded generator, with the gold `answer` and the fields the
environment trainer_svc.tasks.calculator:Calculator reads (`a`, `b`). The rows
`configs/smollm2-gpu-tools.toml` trains on; deterministic (the same rows for the same seed).

    python scripts/calculator_rows.py configs/data/calculator.jsonl [--rows 4000] [--seed 0]
"""

from __future__ import annotations

import random

from rows_cli import write_rows_main


def rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(100, 999), rng.randint(11, 99)
        out.append({"prompt": f"What is {a} * {b}?", "answer": str(a * b), "a": a, "b": b})
    return out


def main() -> None:
    write_rows_main(rows, __doc__.splitlines()[0], default_rows=4000)


if __name__ == "__main__":
    main()
