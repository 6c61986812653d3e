"""Models for trainer tests: the tiny model (built by the rollout venv's command, as `make
tiny-model` does) and a briefly warmed-up copy whose samples are sometimes right."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ROLLOUT_SVC = ROOT / ".venvs" / "rollout" / "bin" / "rollout-svc"

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run([str(ROLLOUT_SVC), "tiny-model", str(path)], check=True, capture_output=True)
    return path


def make_config(run_dir: Path, model: Path, **sections):
    """A small config for tests: 4 prompts x 4 samples x 4 tokens, arithmetic 0..9."""
    from trainer_svc.config import Config

    data = {
        "run": {"dir": str(run_dir), "seed": 3, "deterministic": True},
        "model": {"path": str(model)},
        "data": {"arithmetic_low": 0, "arithmetic_high": 9, "held_out": 10},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_tokens": 4, "spawn": False},
        "train": {"steps": 6, "lr": 1e-4, "grad_accum": 2},
        "checkpoint": {"every": 1, "keep_last": 2},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return msgspec.convert(data, Config)


@pytest.fixture(scope="session")
def warm_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model after a short supervised warm-up (answers 0..9 sums now and then)."""
    from trainer_svc.learning.sft import run_sft

    base = tmp_path_factory.mktemp("warm")
    out = base / "model"
    cfg = make_config(
        base / "run",
        out,
        sft={
            "base": str(tiny_model),
            "problems": 60,
            "steps": 150,
            "stop_at_accuracy": 0.15,
            "eval_every": 25,
            "eval_problems": 64,
        },
    )
    run_sft(cfg)
    return out


@pytest.fixture
def base(tmp_path) -> Path:
    """A base model directory as a publish copies it: config and tokenizer, no weights."""
    path = tmp_path / "base"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}\n')
    (path / "tokenizer.json").write_text("{}\n")
    return path
