"""Trainer run configs (TOML) for the tests and benches that run `trainer-svc` as a process.

A config is built from layers, each a dict of sections ({"rollout": {"max_tokens": 4}, ...});
a later layer sets keys over an earlier one, section by section. The first layer is one of the
settings below, the others say what a test changes. The file written holds flat sections of
str, path, bool, int, float and lists of them: what a run config holds.

Plain Python, no trainer_svc import: the tests that use this run in the rollout venv.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ROLLOUT_VENV = Path(__file__).resolve().parents[1] / ".venvs" / "rollout"

# The tiny model learning sums up to 20 after a supervised warm-up: 16 prompts x 8 samples a
# step, at the lr it learns at in float32. The reward rises within 150 steps (smoke test, GPU
# tier, bench/sync_mismatch.py).
LEARNING: dict[str, dict] = {
    "run": {"seed": 1},
    "sft": {"problems": 200, "stop_at_accuracy": 0.3},
    "data": {"arithmetic_high": 20, "held_out": 41},
    "rollout": {
        "prompts_per_step": 16,
        "samples_per_prompt": 8,
        "max_tokens": 4,
        "rollout_venv": ROLLOUT_VENV,
        "worker_args": ["--max-model-len", "64"],
    },
    "train": {"lr": 1e-4},
}

# Small steps (4 prompts x 4 samples, sums up to 9) for the tests of the trainer as a process
# (signals, full disks, worker faults, relaunches): what they check is not learning, so each
# step costs as little as it can.
SMALL_STEPS: dict[str, dict] = {
    "data": {"arithmetic_low": 0, "arithmetic_high": 9, "held_out": 10},
    "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_tokens": 4},
}


def write_run_config(path: Path, *layers: dict[str, dict]) -> Path:
    """Write the layers, merged, to `path` as TOML; returns `path`."""
    path.write_text(to_toml(merge(*layers)))
    return path


def merge(*layers: dict[str, dict]) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for layer in layers:
        for section, keys in layer.items():
            merged.setdefault(section, {}).update(keys)
    return merged


def to_toml(sections: dict[str, dict]) -> str:
    return "\n".join(
        f"[{section}]\n" + "".join(f"{key} = {toml_value(value)}\n" for key, value in keys.items())
        for section, keys in sections.items()
    )


def toml_value(value) -> str:
    # bool before int: True is an int too. For the paths and flags a config holds, a JSON string
    # literal is also a TOML basic string (same quotes, same escapes).
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(os.fspath(value))
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"a run config holds str, path, bool, int, float or a list of them, not {type(value).__name__}")
