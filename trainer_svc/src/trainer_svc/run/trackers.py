"""Experiment tracking: each step's metrics row, the banner and the resolved config sent to
TensorBoard, Weights & Biases and MLflow, as `[log]` asks (config.LogConfig).

Guarantees:
- metrics.jsonl stays the record of truth: a row reaches a backend only after it is on disk
  there (outputs.Outputs.step writes it first).
- The training loop never waits on a backend. Each backend has a thread of its own and a
  bounded queue (`log.queue` rows); a row that finds the queue full is dropped for that backend,
  counted, and warned of once (and the count again at the end). A backend is opened in its
  thread too, so a server that does not answer delays nothing.
- A backend that fails (not installed, server down, raises mid-run) logs ONE warning naming it
  and what to do, and is off for the rest of the run; the run goes on with the others.
- Only rank 0 tracks (ranks other than 0 get outputs.Outputs.silent()).
- A resumed run goes on in the same places: TensorBoard's directory (the steps after the resumed
  checkpoint, which run again, replace the earlier ones: purge_step), the same W&B run id and
  MLflow run (their ids kept in <run.dir>/tracking/<backend>.json). W&B and MLflow are sent no
  step twice: the last step each received is kept beside its id, and a redone step it already
  holds is not sent again (W&B steps only go forward). They keep the first values of such
  steps; metrics.jsonl and TensorBoard have the redone ones.

TensorBoard is written with torch.utils.tensorboard and the `tensorboard` package (extra
trainer_svc[tensorboard], installed by `make venvs`): the writer ships with torch, and the
package is the viewer a user runs anyway (`tensorboard --logdir RUN_DIR/tensorboard`) and the
reader the tests check the event files with. A lighter writer (tensorboardX, ~1 MB) would save
the ~50 MB of the viewer and its gRPC (~7% of the trainer venv's torch) but then a second
writer sits beside the reader that is needed anyway.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgspec

from ..config import Config, dump
from ..records import write_json_atomic

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
STATE_DIR = "tracking"  # <run.dir>/tracking/<backend>.json: the run id and the last step sent
_STOP = object()


def numbers(row: dict) -> dict[str, float]:
    """The row's numeric values but its step, as floats (the backends plot numbers only)."""
    return {
        key: float(value)
        for key, value in row.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }


class Backend:
    """One tracking backend. `open` may block (a network call): it runs in the backend's thread,
    like every other method. Any exception turns the backend off (Channel)."""

    name = ""
    extra = ""  # the trainer_svc extra that installs it
    key = ""  # the [log] key that turns it off

    def open(self) -> None: ...

    def config(self, config: dict, toml: str) -> None: ...

    def banner(self, banner: dict) -> None: ...

    def row(self, row: dict) -> None: ...

    def end(self, result: dict) -> None: ...

    def close(self) -> None: ...

    def advice(self, exc: BaseException) -> str:
        if isinstance(exc, ImportError):
            return f"install it (pip install 'trainer_svc[{self.extra}]') or set {self.key} = false"
        return f"fix the cause, or set {self.key} = false; metrics.jsonl has every row"


class StepRecord:
    """<run.dir>/tracking/<backend>.json: the backend's run id and the last step it received, so
    that a resumed run goes on in the same run and sends no step twice."""

    def __init__(self, run_dir: Path, backend: str):
        self.path = Path(run_dir) / STATE_DIR / f"{backend}.json"
        self.data: dict = json.loads(self.path.read_text()) if self.path.exists() else {}

    @property
    def last_step(self) -> int:
        return int(self.data.get("last_step", 0))

    def save(self, **values: Any) -> None:
        self.data.update(values)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.data)


class TensorBoard(Backend):
    name, extra, key = "TensorBoard", "tensorboard", "log.tensorboard"

    def __init__(self, run_dir: Path, resumed_step: int):
        self.directory = Path(run_dir) / TENSORBOARD_DIR
        self.resumed_step = resumed_step
        self.writer = None

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard discards the events of steps >= it written before, the steps
        # after the resumed checkpoint that this launch runs again (all of them where a launch
        # died before its first checkpoint).
        self.writer = SummaryWriter(str(self.directory), purge_step=self.resumed_step + 1)

    def config(self, config: dict, toml: str) -> None:
        self.writer.add_text("config", _fenced(toml, "toml"), global_step=self.resumed_step)

    def banner(self, banner: dict) -> None:
        self.writer.add_text("banner", _fenced(json.dumps(banner, indent=1), "json"), global_step=self.resumed_step)

    def row(self, row: dict) -> None:
        for key, value in numbers(row).items():
            self.writer.add_scalar(key, value, global_step=row["step"])
        self.writer.flush()  # a person watching sees each step as it lands

    def end(self, result: dict) -> None:
        step = result.get("summary", {}).get("steps") or self.resumed_step
        self.writer.add_text("stage_result", _fenced(json.dumps(result, indent=1, default=str), "json"), step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB(Backend):
    name, extra, key = "Weights & Biases", "wandb", "log.wandb"

    def __init__(self, cfg: Config, run_name: str):
        self.cfg, self.run_name = cfg, run_name
        self.record = StepRecord(cfg.run_dir, "wandb")
        self.run = None

    def open(self) -> None:
        import wandb

        mode, why = wandb_mode(self.cfg.log.wandb_mode, wandb.Settings().base_url)
        run_id = self.record.data.get("id") or secrets.token_hex(6)
        self.run = wandb.init(
            project=self.cfg.log.wandb_project,
            entity=self.cfg.log.wandb_entity or None,
            name=self.run_name,
            id=run_id,
            resume="allow",
            dir=str(self.cfg.run_dir),
            mode=mode,
            # no console capture (the run's logs stay the run's), no system-metrics sampler
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.record.save(id=run_id, mode=mode)
        if mode == "offline":
            where = Path(self.run.dir).parent  # the offline run's directory (files/ is run.dir)
            log.info("W&B: offline (%s); the run is kept in %s; upload it with `wandb sync %s`", why, where, where)
        else:
            log.info("W&B: %s (%s)", mode, why)

    def config(self, config: dict, toml: str) -> None:
        self.run.config.update(config, allow_val_change=True)

    def banner(self, banner: dict) -> None:
        self.run.config.update({"banner": banner}, allow_val_change=True)

    def row(self, row: dict) -> None:
        if row["step"] <= self.record.last_step:
            return  # sent before the resume; W&B steps only go forward
        self.run.log(numbers(row), step=row["step"])
        self.record.save(last_step=row["step"])

    def end(self, result: dict) -> None:
        self.run.summary.update({"exit_code": result["exit_code"], "finished": result["finished"]})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def wandb_mode(configured: str, base_url: str) -> tuple[str, str]:
    """(mode, why): `log.wandb_mode` unless "auto"; then WANDB_MODE where set, else online where
    an API key is known for the server and it answers, else offline."""
    if configured != "auto":
        return configured, f"log.wandb_mode = {configured!r}"
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], "WANDB_MODE"
    host = urlparse(base_url).hostname or base_url
    if not (os.environ.get("WANDB_API_KEY") or _netrc_has(host)):
        return "offline", f"no API key for {host}: WANDB_API_KEY unset and none in ~/.netrc (`wandb login`)"
    try:
        with socket.create_connection((host, urlparse(base_url).port or 443), timeout=5):
            pass
    except OSError as exc:
        return "offline", f"{host} does not answer: {exc}"
    return "online", f"logged in and {host} answers"


def _netrc_has(host: str) -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class MLflow(Backend):
    name, extra, key = "MLflow", "mlflow", "log.mlflow"

    def __init__(self, cfg: Config, run_name: str):
        self.cfg, self.run_name = cfg, run_name
        self.record = StepRecord(cfg.run_dir, "mlflow")
        self.uri = cfg.log.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or mlflow_file_store(cfg)
        self.client = self.run_id = None
        self.ended = False

    def open(self) -> None:
        if self.uri.startswith("file:"):
            # MLflow keeps its file store, the one that needs no server nor database, in
            # maintenance mode and refuses it unless told; a server or a sqlite:/// URI in
            # log.mlflow_tracking_uri gets MLflow's newest features.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if self.record.data.get("run_id") and self.record.data.get("tracking_uri") == self.uri:
            self.run_id = self.record.data["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(self.cfg.log.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(self.cfg.log.mlflow_experiment)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
        # a new run at another server starts its step count afresh
        self.record.save(run_id=self.run_id, tracking_uri=self.uri, last_step=0)
        log.info("MLflow: run %s at %s", self.run_id, self.uri)

    def config(self, config: dict, toml: str) -> None:
        from mlflow.entities import Param

        # Params are set once per run: a resume with another config has it in the artifact.
        if not self.record.data.get("params_logged"):
            params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
            for start in range(0, len(params), 100):  # the most one batch may hold
                self.client.log_batch(self.run_id, params=params[start : start + 100])
            self.record.save(params_logged=True)
        self.client.log_text(self.run_id, toml, "config.resolved.toml")

    def banner(self, banner: dict) -> None:
        self.client.log_dict(self.run_id, banner, "banner.json")

    def row(self, row: dict) -> None:
        from mlflow.entities import Metric

        if row["step"] <= self.record.last_step:
            return  # sent before the resume
        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), v, now, row["step"]) for k, v in numbers(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)
        self.record.save(last_step=row["step"])

    def end(self, result: dict) -> None:
        self.client.log_dict(self.run_id, result, "stage_result.json")
        self.client.set_terminated(self.run_id, status="FINISHED" if result["finished"] else "KILLED")
        self.ended = True

    def close(self) -> None:
        if self.client is not None and not self.ended:  # a run that stopped before its end
            self.client.set_terminated(self.run_id, status="KILLED")


def mlflow_file_store(cfg: Config) -> str:
    return (cfg.run_dir / "mlruns").as_uri()


def _mlflow_key(key: str) -> str:
    """MLflow metric names allow letters, digits and _-./ and spaces; others become _."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _fenced(text: str, language: str) -> str:
    """TensorBoard renders text as Markdown: a fenced block keeps it as written."""
    return f"```{language}\n{text}\n```"


class Channel:
    """A backend behind a bounded queue and a thread of its own: `send` never blocks."""

    def __init__(self, backend: Backend, size: int):
        self.backend = backend
        self.queue: queue.Queue = queue.Queue(maxsize=size)
        self.failed = False
        self.dropped = 0
        self.closing = False
        self.thread = threading.Thread(target=self._serve, name=f"tracker {backend.name}", daemon=True)
        self.thread.start()

    def send(self, method: str, *args) -> None:
        if self.failed:
            return
        try:
            self.queue.put_nowait((method, args))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "tracking: %s is %d rows behind; rows for it are dropped (and counted) so that the run never "
                    "waits on it; metrics.jsonl has every row",
                    self.backend.name,
                    self.queue.maxsize,
                )

    def _serve(self) -> None:
        try:
            self.backend.open()
        except BaseException as exc:  # noqa: BLE001 - whatever a backend raises, the run goes on
            self._fail(exc)
        while True:
            item = self.queue.get()
            if item is _STOP:
                break
            if not self.failed:  # else drained, never sent
                method, args = item
                try:
                    getattr(self.backend, method)(*args)
                except BaseException as exc:  # noqa: BLE001
                    self._fail(exc)
            if self.closing and self.queue.empty():  # close found the queue full: no _STOP to come
                break
        if not self.failed:
            try:
                self.backend.close()
            except BaseException as exc:  # noqa: BLE001
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.failed = True
        log.warning(
            "tracking: %s failed (%s: %s) and is off for the rest of this run, which goes on: %s",
            self.backend.name,
            type(exc).__name__,
            exc,
            self.backend.advice(exc),
        )

    def close(self, deadline: float) -> None:
        """Let the backend send what it holds and close, until `deadline` (time.monotonic())."""
        try:
            self.queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            self.closing = True
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            log.warning(
                "tracking: %s did not finish sending within log.close_timeout_s; %d items unsent (metrics.jsonl has "
                "every row)",
                self.backend.name,
                self.queue.qsize(),
            )
        if self.dropped:
            log.warning("tracking: %d rows were dropped for %s while it lagged behind", self.dropped, self.backend.name)


class Tracking:
    """The enabled backends, each behind its Channel. Methods return at once."""

    def __init__(self, backends: list[Backend], queue_size: int = 1000, close_timeout_s: float = 60.0):
        self.channels = [Channel(b, queue_size) for b in backends]
        self.close_timeout_s = close_timeout_s

    @classmethod
    def open(cls, cfg: Config, resumed_step: int, banner: dict) -> Tracking:
        name = cfg.log.run_name or cfg.run_dir.name
        backends: list[Backend] = []
        if cfg.log.tensorboard:
            backends.append(TensorBoard(cfg.run_dir, resumed_step))
        if cfg.log.wandb:
            backends.append(WandB(cfg, name))
        if cfg.log.mlflow:
            backends.append(MLflow(cfg, name))
        tracking = cls(backends, cfg.log.queue, cfg.log.close_timeout_s)
        tracking.send("config", msgspec.to_builtins(cfg), dump(cfg).decode())
        tracking.send("banner", banner)
        return tracking

    def send(self, method: str, *args) -> None:
        for channel in self.channels:
            channel.send(method, *args)

    def row(self, row: dict) -> None:
        self.send("row", row)

    def end(self, result: dict) -> None:
        self.send("end", result)

    def close(self) -> None:
        deadline = time.monotonic() + self.close_timeout_s
        for channel in self.channels:
            channel.close(deadline)
