"""The every-N-steps cadence the publish, the checkpoint and the portable directory share."""

from __future__ import annotations

import pytest

from trainer_svc.cadence import on_cadence


@pytest.mark.parametrize(
    ("every", "last", "due"),
    [
        (1, 5, [1, 2, 3, 4, 5]),
        (2, 5, [2, 4, 5]),  # the last step too, though not a multiple
        (3, 6, [3, 6]),
        (50, 5, [5]),  # a cadence longer than the run: the last step only
        (0, 5, [5]),  # 0: off, but for the last step
    ],
)
def test_multiples_of_every_and_the_last_step(every, last, due):
    assert [step for step in range(1, last + 1) if on_cadence(step, every, last)] == due
