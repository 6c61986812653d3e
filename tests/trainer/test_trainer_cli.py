"""`trainer-svc` through typer's CliRunner: bad input exits with its code and a message that
names the problem before anything expensive starts; `plot` draws a PNG; `--help` works."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from protocol import exit_codes
from protocol.private_dirs import NotPrivate
from protocol.spool import Spool
from trainer_svc.cli import app
from trainer_svc.rollout_types import RolloutFailed, RolloutUnavailable
from trainer_svc.run.plot import PANELS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def config(tmp_path: Path, model: Path, extra: str = "") -> Path:
    path = tmp_path / "run.toml"
    path.write_text(f'[run]\ndir = "{tmp_path / "run"}"\n[model]\npath = "{model}"\n{extra}')
    return path


def fake_model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_train_config_error_comes_first(tmp_path):
    # both the config and the model path are bad: the config is reported, exit 2
    path = config(tmp_path, tmp_path / "no-model", "[train]\nsteps = 0\n")
    result = invoke("train", path)
    assert result.exit_code == exit_codes.USAGE
    assert "$.train.steps" in result.output and ">= 1" in result.output and str(path) in result.output
    assert "model directory" not in result.output
    assert not (tmp_path / "run").exists()  # nothing was started


def test_train_with_an_unknown_key(tmp_path):
    result = invoke("train", config(tmp_path, tmp_path / "no-model", "[rollout]\nsampels_per_prompt = 4\n"))
    assert result.exit_code == exit_codes.USAGE
    assert "sampels_per_prompt" in result.output and "$.rollout" in result.output


def test_train_with_a_missing_config_file(tmp_path):
    result = invoke("train", tmp_path / "nowhere.toml")
    assert result.exit_code == exit_codes.USAGE
    assert "no such config file" in result.output


def test_train_with_a_missing_model_dir(tmp_path):
    result = invoke("train", config(tmp_path, tmp_path / "no-model"))
    assert result.exit_code == exit_codes.USAGE
    assert f"model directory {tmp_path / 'no-model'} does not exist" in result.output


def test_train_without_a_live_worker_exits_unavailable(tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    path = config(tmp_path, fake_model(tmp_path / "model"), f'[rollout]\nspawn = false\nspool = "{spool.root}"\n')
    result = invoke("train", path)
    assert result.exit_code == exit_codes.ROLLOUT_UNAVAILABLE
    assert f"no live worker serves {spool.root}" in result.output


def test_config_errors_and_help_import_no_torch(tmp_path):
    """`--help` and config errors are instant: neither torch nor transformers is imported."""
    bad = config(tmp_path, tmp_path / "no-model", "[train]\nlr = -1.0\n")
    script = textwrap.dedent(
        f"""
        import sys
        from typer.testing import CliRunner
        from trainer_svc.cli import app
        commands = (["--help"], ["train", "--help"], ["sft", "--help"], ["plot", "--help"], ["train", {str(bad)!r}])
        codes = [CliRunner().invoke(app, args).exit_code for args in commands]
        print(codes, sorted(m for m in ("torch", "transformers", "matplotlib") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[0, 0, 0, 0, 2] []"


def test_sft_without_an_sft_section(tmp_path):
    path = config(tmp_path, tmp_path / "model")
    result = invoke("sft", path)
    assert result.exit_code == exit_codes.USAGE
    assert f"{path} has no [sft] section" in result.output


def test_sft_with_a_missing_base_model(tmp_path):
    path = config(tmp_path, tmp_path / "model", f'[sft]\nbase = "{tmp_path / "no-base"}"\n')
    result = invoke("sft", path)
    assert result.exit_code == exit_codes.USAGE
    assert f"{tmp_path / 'no-base'} does not exist" in result.output


def test_sft_refuses_to_overwrite_model_path(tmp_path):
    base = fake_model(tmp_path / "base")
    existing = fake_model(tmp_path / "model")
    result = invoke("sft", config(tmp_path, existing, f'[sft]\nbase = "{base}"\n'))
    assert result.exit_code == exit_codes.USAGE
    assert f"{existing} exists" in result.output
    assert sorted(p.name for p in existing.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("where", ["empty", "missing"])
def test_plot_without_metrics(tmp_path, where):
    run_dir = tmp_path / "run"
    if where == "empty":
        run_dir.mkdir()
    result = invoke("plot", run_dir)
    assert result.exit_code == exit_codes.USAGE
    assert f"{run_dir} has no metrics.jsonl rows" in result.output
    assert not (run_dir / "training.png").exists()


def write_metrics(run_dir: Path, steps: int = 30) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            row = {
                "step": step,
                "reward_mean": step / steps,
                "reward_first": step / steps,
                "reward_trained": min(1.0, 1.5 * step / steps),
                "accuracy": min(1.0, 0.02 * step),
                "loss": math.sin(step) * 0.1,
                "entropy": 2.0 - step / steps,
                "response_length": 3 + step % 2,
                "mismatch_mean": 1e-3 / step,
            }
            f.write(json.dumps(row) + "\n")


def test_plot_metrics_keys_are_the_panels():
    assert {key for key, _ in PANELS} == {
        "reward_first",
        "accuracy",
        "loss",
        "entropy",
        "response_length",
        "mismatch_mean",
    }


def test_plot_writes_a_png(tmp_path):
    run_dir = tmp_path / "run"
    write_metrics(run_dir)
    result = invoke("plot", run_dir)
    assert result.exit_code == 0, result.output
    png = run_dir / "training.png"
    assert f"plot written to {png}" in result.output
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 20_000  # six panels with lines and labels, not an empty canvas


def test_plot_to_a_chosen_path(tmp_path):
    run_dir = tmp_path / "run"
    write_metrics(run_dir, steps=5)
    out = tmp_path / "figures" / "curves.png"
    out.parent.mkdir()
    result = invoke("plot", run_dir, "--out", out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert not (run_dir / "training.png").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], ["train", "sft", "plot"]),
        (["train"], ["--smoke", "Run GRPO"]),
        (["sft"], ["Supervised warm-up"]),
        (["plot"], ["--out", "metrics.jsonl"]),
    ],
    ids=["app", "train", "sft", "plot"],
)
def test_help(args, expected):
    result = invoke(*args, "--help")
    assert result.exit_code == 0, result.output
    for text in expected:
        assert text in result.output


def test_sft_help_names_the_sft_section():
    result = invoke("sft", "--help")
    assert "[sft].base" in result.output and "[sft].stop_at_accuracy" in result.output


def test_train_with_a_directory_as_config(tmp_path):
    result = invoke("train", tmp_path)
    assert result.exit_code == exit_codes.USAGE
    assert str(tmp_path) in result.output


def stopping_with(error: Exception, tmp_path, monkeypatch):
    """`train` on a run that raises `error` where training would start."""
    import trainer_svc.run.loop as loop

    def raising(cfg, stage):
        raise error

    monkeypatch.setattr(loop, "train", raising)
    path = config(tmp_path, fake_model(tmp_path / "model"), "[rollout]\nspawn = false\n")
    monkeypatch.setattr("trainer_svc.cli.check_before_work", lambda cfg, **kw: None)
    return invoke("train", path)


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (RolloutFailed("refused: fix x"), 2, "refused: fix x"),
        (RolloutUnavailable("no worker"), 69, "no worker"),
        (NotPrivate("/r", "is a link"), 2, "/r is a link: refused;"),
        (OSError(28, "No space left on device", "/run/x"), 74, "a write failed (/run/x): No space left on device"),
    ],
)
def test_train_exits_with_the_code_its_error_carries(error, code, message, tmp_path, monkeypatch):
    result = stopping_with(error, tmp_path, monkeypatch)
    assert result.exit_code == code, result.output
    assert f"error: {message}" in result.output and "[Errno" not in result.output


@pytest.mark.parametrize("error", [KeyError("bug"), PermissionError(13, "Permission denied")])
def test_train_lets_an_error_without_an_exit_code_propagate(error, tmp_path, monkeypatch):
    """A bug (or an OSError other than a full disk) is not dressed up as a trainer error: its traceback shows."""
    result = stopping_with(error, tmp_path, monkeypatch)
    assert result.exception is error
