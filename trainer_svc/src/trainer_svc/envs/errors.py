"""The error an environment's fault stops the run with (importable without torch, for the CLI)."""

from __future__ import annotations

from protocol import exit_codes


class EnvError(Exception):
    """An environment cannot be used, or failed in an episode: the run stops (exit 2) before
    training on anything it produced. The message names the environment, the episode and the
    turn, and what to do."""

    exit_code = exit_codes.USAGE
