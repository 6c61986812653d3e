"""Write the running-sums task as chat rows: a start (10..59) and 1 to 3 two-digit addends (10..49)
drawn by a seeded generator, one user turn each, with the gold `answer` (the final total) and the
fields the reward function trainer_svc.tasks.running_sums:steps_right reads. The rows
`configs/smollm2-gpu-long.toml` trains on; deterministic (the same rows for the same seed).

    python scripts/running_sums.py configs/data/running_sums.jsonl [--rows 6000] [--seed 0]
"""

from __future__ import annotations

import random

from rows_cli import write_rows_main

QUESTION = (
    "Start at {start}. Add {addends}. Work it out one step per line: the first line is "
    "{start} + {first} = {total}. End with the total."
)


def rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        start = rng.randint(10, 59)
        addends = [rng.randint(10, 49) for _ in range(rng.randint(1, 3))]
        said = ", then ".join(str(a) for a in addends)
        content = QUESTION.format(start=start, addends=said, first=addends[0], total=start + addends[0])
        out.append(
            {
                "messages": [{"role": "user", "content": content}],
                "answer": str(start + sum(addends)),
                "start": start,
                "addends": addends,
            }
        )
    return out


def main() -> None:
    write_rows_main(rows, __doc__.splitlines()[0], default_rows=6000)


if __name__ == "__main__":
    main()
