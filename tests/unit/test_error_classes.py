"""Which error results are worth sending again: a transient error (the engine failed on a valid
request) may pass, a permanent one (the request or its weights are at fault) fails again."""

from __future__ import annotations

from protocol.messages import ErrorCode


def test_only_failures_of_the_moment_are_transient():
    transient = {code for code in ErrorCode if code.transient}
    assert transient == {ErrorCode.ENGINE_ERROR, ErrorCode.DEADLINE_EXPIRED}
    # A permanent error is one whose request file the worker keeps in bad/: the input is at fault.
    assert all(code.rejects_input for code in ErrorCode if not code.transient)
