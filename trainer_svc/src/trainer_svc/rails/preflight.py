"""Checks that run before anything expensive: a bad model directory, an unwritable run
directory or an unusable spool fails in milliseconds with its exit code, not after a model load."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from protocol import exit_codes

from ..config import Config


class PreflightError(RuntimeError):
    """A launch that would fail later; exit 2, or the code a check gives (69: no worker can serve the spool)."""

    exit_code = exit_codes.USAGE

    def __init__(self, message: str, exit_code: int = exit_codes.USAGE):
        super().__init__(message)
        self.exit_code = exit_code


def check_model_dir(path: Path) -> None:
    if not path.is_dir():
        raise PreflightError(
            f"model directory {path} does not exist (model.path); "
            "build one with `make tiny-model` or point at an HF model"
        )
    try:
        json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise PreflightError(f"{path} has no config.json: not an HF model directory (model.path)") from None
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise PreflightError(f"{path}/config.json is not valid JSON ({why}); fix it or change model.path") from None
    if not any(path.glob("*.safetensors")):
        raise PreflightError(
            f"{path} (model.path) has no .safetensors weights (pickle checkpoints are not loaded); "
            "save it with safe_serialization=True"
        )


def check_run_dir(run_dir: Path) -> None:
    _check_writable(run_dir, "run directory", "run.dir")


def check_publish_dir(publish_dir: Path) -> None:
    _check_writable(publish_dir, "publish directory", "publish.dir")


def _check_writable(path: Path, what: str, key: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise PreflightError(f"{what} {path} cannot be written ({exc.strerror}); choose another {key}") from None


def check_spool(cfg: Config) -> None:
    spool = cfg.spool_dir
    try:
        spool.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=spool, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise PreflightError(
            f"spool {spool} is unusable ({exc.strerror}); check rollout.spool and its permissions",
            exit_codes.ROLLOUT_UNAVAILABLE,
        ) from None
    if cfg.rollout.spawn:
        executable = Path(cfg.rollout.rollout_venv) / "bin" / "rollout-svc"
        if not os.access(executable, os.X_OK):
            raise PreflightError(
                f"{executable} is missing: create the rollout venv with `make venvs`, or set rollout.rollout_venv",
                exit_codes.ROLLOUT_UNAVAILABLE,
            )
    else:
        from protocol.spool import Spool, SpoolError

        try:
            live = Spool(spool).live_workers()
        except SpoolError as exc:
            raise PreflightError(str(exc), exit_codes.ROLLOUT_UNAVAILABLE) from None
        if not live:
            raise PreflightError(
                f"rollout.spawn is false but no live worker serves {spool}; start one (`systemctl start rollout-svc@0` "
                f"or `rollout-svc serve --spool {spool}`), or set rollout.spawn = true",
                exit_codes.ROLLOUT_UNAVAILABLE,
            )
