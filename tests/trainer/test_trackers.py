"""Experiment tracking with real files: a training run's TensorBoard event files, W&B offline run
and MLflow file store, read back with each tool's own reader (the W&B file through its shipped
protobuf schema), hold metrics.jsonl's values; a resumed run sends no step twice; a backend
that is missing, unreachable, raising or blocked warns once and the run is the same."""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import threading
from pathlib import Path

import pytest
from conftest import make_config
from local_sampler import TorchSampler

from protocol import exit_codes
from trainer_svc.run.loop import train
from trainer_svc.run.outputs import Outputs
from trainer_svc.run.trackers import Backend, Tracking

TIMING_KEYS = {"rollout_s", "generate_s", "score_s", "train_s", "publish_s", "save_s", "step_s"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """W&B offline whatever this machine's login; MLflow's file store allowed as the trainer does."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def run(cfg) -> int:
    return train(cfg, make_sampler=lambda cfg, launch_id: TorchSampler(cfg))


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def numeric(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, int | float)}


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_texts(run_dir) -> dict[str, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    return {
        tag.removesuffix("/text_summary"): events.Tensors(tag)[-1].tensor_proto.string_val[0].decode()
        for tag in events.Tags()["tensors"]
    }


def wandb_records(run_dir) -> list:
    """The records of every offline run file under run_dir/wandb, oldest first: the file is
    LevelDB's log format (32 KiB blocks of records with a 7-byte header, long ones in pieces)
    after a 7-byte W&B header; each record is a wandb_internal Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    records = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, block = path.read_bytes(), 32768
        assert data[:4] == b":W&B", path
        pos, pieces = 7, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind == 0:
                break
            pieces = chunk if kind in (1, 2) else pieces + chunk
            if kind in (1, 4):  # a whole record, or its last piece
                record = Record()
                record.ParseFromString(pieces)
                records.append(record)
    return records


def wandb_history(run_dir) -> list[dict]:
    rows = []
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            rows.append({k: v for k, v in items.items() if not k.startswith("_")} | {"step": items["_step"]})
    return rows


def mlflow_run(run_dir):
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "tracking" / "mlflow.json").read_text())
    assert state["tracking_uri"] == (run_dir / "mlruns").as_uri()
    client = MlflowClient(state["tracking_uri"])
    return client, client.get_run(state["run_id"])


@pytest.mark.timeout(300)
def test_each_backend_holds_the_steps_of_metrics_jsonl(tiny_model, tmp_path):
    cfg = make_config(tmp_path / "run", tiny_model, train={"steps": 3}, log={"wandb": True, "mlflow": True})
    assert run(cfg) == exit_codes.OK
    rows = metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    keys = set(numeric(rows[0]))
    assert {"loss", "reward_mean", "reward/correct", "step_s"} <= keys

    scalars = tensorboard_scalars(cfg.run_dir)
    assert set(scalars) == keys
    for key in keys:  # TensorBoard keeps float32
        assert scalars[key] == [(r["step"], pytest.approx(r[key], rel=1e-6, abs=1e-30)) for r in rows], key
    texts = tensorboard_texts(cfg.run_dir)
    assert json.loads(texts["banner"].strip("`\njson"))["stage"] == "grpo"
    assert texts["config"].strip("`\ntoml") == (cfg.run_dir / "config.resolved.toml").read_text().strip()

    history = wandb_history(cfg.run_dir)
    assert history == [{"step": r["step"], **numeric(r)} for r in rows]
    configs = [r.config for r in wandb_records(cfg.run_dir) if r.WhichOneof("record_type") == "config"]
    sent = {item.key: json.loads(item.value_json) for c in configs for item in c.update}
    assert sent["train"]["steps"] == 3 and sent["banner"]["stage"] == "grpo"

    client, mlflow = mlflow_run(cfg.run_dir)
    assert mlflow.info.status == "FINISHED" and mlflow.info.run_name == "run"
    assert mlflow.data.params["train.steps"] == "3"
    for key in keys:
        history = sorted((m.step, m.value) for m in client.get_metric_history(mlflow.info.run_id, key))
        assert history == [(r["step"], r[key]) for r in rows], key
    artifacts = {a.path for a in client.list_artifacts(mlflow.info.run_id)}
    assert {"banner.json", "config.resolved.toml", "stage_result.json"} <= artifacts


@pytest.mark.timeout(300)
def test_a_resumed_run_goes_on_in_the_same_runs_and_sends_no_step_twice(tiny_model, tmp_path):
    cfg = make_config(
        tmp_path / "run",
        tiny_model,
        train={"steps": 4},
        checkpoint={"every": 2, "keep_last": 3},
        log={"wandb": True, "mlflow": True},
    )
    assert run(cfg) == exit_codes.OK
    first = metrics(cfg.run_dir)
    ids = {name: json.loads((cfg.run_dir / "tracking" / f"{name}.json").read_text()) for name in ("wandb", "mlflow")}
    assert ids["wandb"]["last_step"] == ids["mlflow"]["last_step"] == 4
    # The run lost its last checkpoint (a crash before it was saved): the relaunch resumes from
    # step 2 and runs steps 3 and 4 again.
    shutil.rmtree(cfg.run_dir / "checkpoints" / "step_00000004")
    assert run(cfg) == exit_codes.OK
    rows = metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[:2] == first[:2] and rows[2:] != first[2:]

    # TensorBoard: each step once, the redone steps with their new values (the old ones purged)
    scalars = tensorboard_scalars(cfg.run_dir)
    assert scalars["step_s"] == [(r["step"], pytest.approx(r["step_s"], rel=1e-6)) for r in rows]
    # W&B: one run id across both launches, each step once (as first sent)
    history = wandb_history(cfg.run_dir)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert [h["step_s"] for h in history] == [r["step_s"] for r in first]
    runs = {r.run.run_id for r in wandb_records(cfg.run_dir) if r.WhichOneof("record_type") == "run"}
    assert runs == {ids["wandb"]["id"]}
    assert len(list((cfg.run_dir / "wandb").glob("offline-run-*"))) == 2  # `wandb sync` joins them
    # MLflow: the same run, each step once
    client, mlflow = mlflow_run(cfg.run_dir)
    assert mlflow.info.run_id == ids["mlflow"]["run_id"] and mlflow.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(mlflow.info.run_id, "step_s"))
    assert steps == [1, 2, 3, 4]


@pytest.mark.timeout(300)
def test_missing_and_unreachable_backends_warn_once_and_the_run_is_the_same(tiny_model, tmp_path, monkeypatch, caplog):
    plain = make_config(tmp_path / "plain", tiny_model, train={"steps": 3}, log={"tensorboard": False})
    assert run(plain) == exit_codes.OK
    assert not (plain.run_dir / "tensorboard").exists()

    monkeypatch.setitem(sys.modules, "wandb", None)  # as where the wandb extra is not installed
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    # nothing listens on port 9 (discard) here: the server is down
    tracked = make_config(
        tmp_path / "tracked",
        tiny_model,
        train={"steps": 3},
        log={"wandb": True, "mlflow": True, "mlflow_tracking_uri": "http://127.0.0.1:9"},
    )
    with caplog.at_level(logging.WARNING, logger="trainer_svc.run.trackers"):
        assert run(tracked) == exit_codes.OK
    warnings = [r.getMessage() for r in caplog.records if r.name == "trainer_svc.run.trackers"]
    assert len(warnings) == 2, warnings
    assert any("trainer_svc[wandb]" in w and "log.wandb = false" in w for w in warnings)
    assert any("MLflow failed" in w and "log.mlflow = false" in w for w in warnings)

    def without_timings(run_dir):
        return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in metrics(run_dir)]

    assert without_timings(tracked.run_dir) == without_timings(plain.run_dir)
    assert [step for step, _ in tensorboard_scalars(tracked.run_dir)["loss"]] == [1, 2, 3]  # the others went on


class SilentServer:
    """An HTTP port that accepts connections and never answers: a tracking server that hangs."""

    def __init__(self):
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)  # held open, never read, never answered

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.mark.timeout(300)
def test_a_real_backend_whose_server_hangs_never_holds_the_loop_and_the_end_waits_close_timeout_s(
    tiny_model, tmp_path, caplog
):
    """MLflow's own client against a server that accepts and never answers: its calls block (for
    minutes, with its retries). The run takes its steps as without it, and its end waits for the
    backend no longer than log.close_timeout_s, then says what it left unsent."""
    plain = make_config(tmp_path / "plain", tiny_model, train={"steps": 3}, log={"tensorboard": False})
    assert run(plain) == exit_codes.OK
    server = SilentServer()
    try:
        hung = make_config(
            tmp_path / "hung",
            tiny_model,
            train={"steps": 3},
            log={
                "tensorboard": False,
                "mlflow": True,
                "mlflow_tracking_uri": f"http://127.0.0.1:{server.port}",
                "close_timeout_s": 2,
            },
        )
        with caplog.at_level(logging.WARNING, logger="trainer_svc.run.trackers"):
            assert run(hung) == exit_codes.OK
        assert server.accepted, "MLflow never called the server: nothing was blocked"
    finally:
        server.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "trainer_svc.run.trackers"]
    assert any("MLflow did not finish sending within log.close_timeout_s" in w for w in warnings), warnings

    def without_timings(run_dir):
        return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in metrics(run_dir)]

    assert without_timings(hung.run_dir) == without_timings(plain.run_dir)


class Raising(Backend):
    name, extra, key = "Raising", "raising", "log.raising"

    def __init__(self):
        self.rows: list[int] = []
        self.closed = False

    def row(self, row: dict) -> None:
        if row["step"] == 2:
            raise ConnectionError("the server went away")
        self.rows.append(row["step"])

    def close(self) -> None:
        self.closed = True


def test_a_backend_that_raises_mid_run_warns_once_is_off_and_metrics_jsonl_has_every_row(tmp_path, caplog):
    backend = Raising()
    out = Outputs.open(tmp_path, 5, 0, tracking=Tracking([backend]))
    with caplog.at_level(logging.WARNING, logger="trainer_svc.run.trackers"):
        for step in range(1, 6):
            out.step({"step": step, "loss": 0.5})
        out.close()
    assert backend.rows == [1] and not backend.closed
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
    ]
    warnings = [r.getMessage() for r in caplog.records if r.name == "trainer_svc.run.trackers"]
    assert len(warnings) == 1 and "Raising failed (ConnectionError: the server went away)" in warnings[0]


class Blocked(Backend):
    """A backend whose every call waits (a server that does not answer) until released."""

    name = "Blocked"

    def __init__(self):
        self.release = threading.Event()
        self.rows: list[int] = []

    def row(self, row: dict) -> None:
        self.release.wait()
        self.rows.append(row["step"])


def test_a_backend_that_blocks_never_holds_the_loop_and_its_dropped_rows_are_counted(tmp_path, caplog):
    backend = Blocked()
    out = Outputs.open(tmp_path, 100, 0, tracking=Tracking([backend], queue_size=5, close_timeout_s=0))
    with caplog.at_level(logging.WARNING, logger="trainer_svc.run.trackers"):
        for step in range(1, 101):  # would never return, were a row to wait for the backend
            out.step({"step": step, "loss": 0.5})
        out.close()  # gives up at once (close_timeout_s = 0)
    assert len(metrics(tmp_path)) == 100
    warnings = [r.getMessage() for r in caplog.records if r.name == "trainer_svc.run.trackers"]
    assert len(warnings) == 3, warnings  # falling behind, the end it did not reach, the count
    assert "Blocked is 5 rows behind" in warnings[0] and "did not finish" in warnings[1]
    dropped = int(warnings[2].split()[1])
    assert 100 - 6 <= dropped <= 100 - 5  # 5 queued, and 1 in hand unless not yet taken
    backend.release.set()
    out.tracking.channels[0].thread.join()
    # The first five were queued before anything was dropped; the one more it got is the next row
    # the queue had room for once the sender took its first: row 6 then, or a later one when the
    # sender took it only after the queue had filled.
    assert backend.rows[:5] == [1, 2, 3, 4, 5] and len(backend.rows) == 100 - dropped
    assert backend.rows == sorted(set(backend.rows))


def test_the_readmes_tracking_example_loads(tmp_path):
    from trainer_svc.config import load

    section = (Path(__file__).resolve().parents[2] / "docs" / "tracking.md").read_text()
    (example,) = re.findall(r"```toml\n(.*?)```", section, flags=re.S)
    path = tmp_path / "run.toml"
    path.write_text(f'[run]\ndir = "{tmp_path}/run"\n[model]\npath = "m"\n{example}')
    log = load(path).log
    assert log.tensorboard and log.wandb and log.mlflow and log.wandb_project == "grpo"


def test_wandb_mode_auto_is_offline_without_a_key_or_a_server_and_respects_wandb_mode(monkeypatch, tmp_path):
    import socket

    from trainer_svc.run.trackers import wandb_mode

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto", "http://127.0.0.1:9")[0] == "disabled"
    assert wandb_mode("online", "http://127.0.0.1:9") == ("online", "log.wandb_mode = 'online'")
    monkeypatch.delenv("WANDB_MODE")
    mode, why = wandb_mode("auto", "http://127.0.0.1:9")
    assert mode == "offline" and "WANDB_API_KEY" in why and "wandb login" in why
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    mode, why = wandb_mode("auto", "http://127.0.0.1:9")  # nothing listens on port 9 (discard)
    assert mode == "offline" and "127.0.0.1 does not answer" in why
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert wandb_mode("auto", f"http://127.0.0.1:{server.getsockname()[1]}")[0] == "online"
