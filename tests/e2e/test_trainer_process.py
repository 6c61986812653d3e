"""`trainer-svc train` as a process, the way a user stops it: SIGTERM (systemd, a scheduler) or
Ctrl-C (SIGINT to its whole process group) mid-run stops it at a step boundary with a
checkpoint and exit 75; the relaunch resumes and finishes, and its per-step metrics equal an
uninterrupted run's, also with the demo's settings (generating ahead, spare prompts, the tis
correction, a spawned vLLM worker) and with a stop between two publishes (publish.every = 2).
A run whose worker's engine is killed in the middle of a call trains as one with no fault.
A disk that fills while it publishes weights, saves a checkpoint or appends a metrics row stops
it with exit 74 and a message naming the file, leaving nothing half written (a file-size limit,
and a really full tmpfs mounted by the test); once there is room the relaunch resumes from the
newest checkpoint and takes every step exactly once.

Determinism: vLLM's CPU build samples reproducibly for a seeded request. The same request
(seed, prompts, weights) gives the same token ids and bitwise-equal logprobs from one engine
and from an engine restarted in a new process (measured with vLLM 0.32.0: 3 prompts x 8
samples, temperature 1, every token and logprob equal). The trainer seeds each request from
run.seed and the step and trains deterministically on the CPU (run.deterministic), so the runs
here compare exactly. They share the session's worker (rollout.spawn = false): no engine start of
their own.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
from conftest import engine_process, hanging_call, keep_running, poll
from run_config import ROLLOUT_VENV, SMALL_STEPS, merge, write_run_config
from small_fs import small_tmpfs

from protocol import exit_codes

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / ".venvs" / "trainer" / "bin" / "trainer-svc"
STEPS = 10  # the interrupt tests signal after a step or two: the rest is their margin
TIMING_KEYS = {"rollout_s", "generate_s", "score_s", "train_s", "publish_s", "save_s", "step_s"}


def write_config(path: Path, run_dir: Path, model: Path, spool: Path, **sections: dict) -> Path:
    """SMALL_STEPS, seeded and deterministic, on the shared worker's spool; `sections` add to it."""
    ours = {
        "run": {"dir": run_dir, "seed": 3, "deterministic": True},
        "model": {"path": model},
        "rollout": {"spawn": False, "spool": spool},
        "train": {"steps": STEPS, "lr": 1e-4, "grad_accum": 2},
        "checkpoint": {"keep_last": 2},
    }
    return write_run_config(path, SMALL_STEPS, ours, sections)


@pytest.fixture(scope="module")
def setting(trainer_fleet):
    """The session's warmed-up tiny model and shared vLLM worker (conftest's trainer_fleet), this
    module's folder under its allowed root, and the uninterrupted run's per-step metrics."""
    base = trainer_fleet.room("process")
    keep_running(trainer_fleet.worker)
    straight = base / "straight"
    finished = launch(write_config(base / "straight.toml", straight, trainer_fleet.model, trainer_fleet.spool.root))
    assert finished.wait(timeout=600) == exit_codes.OK, log_tail(finished)
    expected = step_rows(straight)
    assert len(expected) == STEPS and any(row["grad_norm"] > 0 for row in expected)
    return {
        "base": base,
        "model": trainer_fleet.model,
        "spool": trainer_fleet.spool,
        "worker": trainer_fleet.worker,
        "worker_log": trainer_fleet.worker_log,
        "expected": expected,
    }


def launch(config: Path, file_size_limit: int | None = None) -> subprocess.Popen:
    """`trainer-svc train CONFIG` in its own process group, output in CONFIG's .log (or a pipe
    under a file-size limit, which would cut the log too). A worker it spawns gets the KV cache
    the shared worker has (the machine's memory is shared)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    out = subprocess.PIPE if file_size_limit else open(config.with_suffix(".log"), "ab")
    return subprocess.Popen(
        [str(TRAINER), "train", str(config)], stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        start_new_session=True, preexec_fn=limit if file_size_limit else None,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),
    )  # fmt: skip


def log_tail(proc: subprocess.Popen) -> str:
    config = Path(proc.args[-1])
    return config.with_suffix(".log").read_text()[-3000:] if config.with_suffix(".log").exists() else ""


def step_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def newest_checkpoint(run_dir: Path) -> str | None:
    names = (
        sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else []
    )
    return names[-1] if names else None


def no_partials(run_dir: Path) -> None:
    """Nothing half written is left: no hidden staging directory, every step directory complete."""
    for parent in (run_dir / "checkpoints", run_dir / "weights"):
        if parent.exists():
            assert [p.name for p in parent.iterdir() if p.name.startswith(".")] == []
            assert all((p / "manifest.json").exists() for p in parent.iterdir())


def interrupt_after(config: Path, run_dir: Path, rows: int, send) -> None:
    """Launch, wait for `rows` metrics rows, `send(proc)` a signal; it must stop at a step boundary
    with a checkpoint of that step and exit 75."""
    proc = launch(config)
    try:
        # Polled often: a step takes a tenth of a second here, and a signal sent after the last
        # step would find the run finished.
        seen = poll(
            lambda: len(step_rows(run_dir)),
            lambda n: n >= rows or proc.poll() is not None,
            timeout_s=600,
            interval_s=0.005,
        )
        assert proc.poll() is None and seen >= rows, log_tail(proc)
        send(proc)
        assert proc.wait(timeout=600) == exit_codes.RESUMABLE_STOP, log_tail(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped_at = len(step_rows(run_dir))
    assert stopped_at < STEPS and newest_checkpoint(run_dir) == f"step_{stopped_at:08d}"
    assert "relaunch to resume" in log_tail(proc)


def test_sigterm_and_ctrl_c_stop_at_a_step_boundary_and_the_relaunch_repeats_the_run(setting):
    base = setting["base"]
    run_dir = base / "interrupted"
    config = write_config(base / "interrupted.toml", run_dir, setting["model"], setting["spool"].root)
    interrupt_after(config, run_dir, 1, lambda proc: proc.send_signal(signal.SIGTERM))
    first_stop = len(step_rows(run_dir))
    # Ctrl-C at a terminal: SIGINT to the whole process group (the verifier's process included).
    interrupt_after(config, run_dir, first_stop + 1, lambda proc: os.killpg(proc.pid, signal.SIGINT))
    finished = launch(config)
    assert finished.wait(timeout=600) == exit_codes.OK, log_tail(finished)
    assert step_rows(run_dir) == setting["expected"]
    assert json.loads((run_dir / "stage_result.json").read_text())["finished"]


def test_an_engine_killed_mid_call_is_sent_again_and_the_run_trains_as_without_it(setting):
    """The shared vLLM worker's engine process is frozen, then killed, in the middle of a call of
    the run: the worker answers engine_error and builds a new engine, the trainer sends the
    request again under a fresh id, and every step's metrics equal those of the same run with no
    fault. One publish, at the end: the call that hangs is a generation, not a weight change (a
    reload that fails builds a new engine for the same call, with no error to resend)."""
    base, spool = setting["base"], setting["spool"]
    keep_running(setting["worker"])
    one_publish = {"publish": {"every": STEPS}, "rollout": {"max_policy_lag": STEPS}}
    expected = straight_rows(setting, "no-fault-straight", **one_publish)
    run_dir = base / "engine-killed"
    config = write_config(base / "engine-killed.toml", run_dir, setting["model"], spool.root, **one_publish)
    proc = launch(config)
    try:
        seen = poll(lambda: len(step_rows(run_dir)), lambda n: n >= 1 or proc.poll() is not None, 600, 0.005)
        assert proc.poll() is None and seen >= 1, log_tail(proc)
        engine = engine_process(setting["worker"].proc.pid)
        os.kill(engine, signal.SIGSTOP)  # the worker's next engine call hangs in it...
        hanging_call(spool, time.monotonic())
        os.kill(engine, signal.SIGKILL)  # ...and the engine dies under it
        assert proc.wait(timeout=700) == exit_codes.OK, log_tail(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ours = {p.name: msgspec.json.decode(p.read_bytes()) for p in spool.done.glob("engine-killed-*.result.json")}
    failed = [r for r in ours.values() if not r["ok"]]
    assert [r["error"]["code"] for r in failed] == ["engine_error"], failed
    assert ours[f"{failed[0]['request_id']}-r1.result.json"]["ok"]
    assert step_rows(run_dir) == expected


def test_a_full_disk_while_publishing_weights_exits_74_and_keeps_nothing_half_written(setting):
    base = setting["base"]
    run_dir = base / "full-publish"
    config = write_config(base / "full-publish.toml", run_dir, setting["model"], setting["spool"].root)
    weights_bytes = (setting["model"] / "model.safetensors").stat().st_size
    proc = launch(config, file_size_limit=weights_bytes // 2)  # small files fit, the weights do not
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == exit_codes.CANNOT_WRITE, output[-3000:]
    assert "File too large" in output and "Free space, then relaunch" in output and "from the start" in output
    assert "Traceback" not in output
    assert not (run_dir / "weights").exists() or list((run_dir / "weights").iterdir()) == []
    no_partials(run_dir)


def test_a_full_disk_while_saving_a_checkpoint_exits_74_and_the_relaunch_repeats_the_run(setting):
    base = setting["base"]
    run_dir = base / "full-checkpoint"
    config = write_config(
        base / "full-checkpoint.toml", run_dir, setting["model"], setting["spool"].root, checkpoint={"every": 2}
    )
    weights_bytes = (setting["model"] / "model.safetensors").stat().st_size
    # Published weights fit; a checkpoint's optimizer state (two tensors per parameter) does not.
    proc = launch(config, file_size_limit=weights_bytes + weights_bytes // 2)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == exit_codes.CANNOT_WRITE, output[-3000:]
    assert "writing checkpoint" in output and "step_00000002" in output and "from the start" in output
    assert "Traceback" not in output
    assert newest_checkpoint(run_dir) is None
    no_partials(run_dir)

    finished = launch(config)
    assert finished.wait(timeout=600) == exit_codes.OK, log_tail(finished)
    assert step_rows(run_dir) == setting["expected"]


def demo_settings() -> dict[str, dict]:
    """configs/demo.toml's settings of how a step samples and learns (generating ahead, the
    policy lag, spare prompts, the tis correction, the loss, the optimizer, the tripwire), on
    SMALL_STEPS' shape."""
    demo = msgspec.toml.decode((ROOT / "configs" / "demo.toml").read_bytes())
    rollout = {k: demo["rollout"][k] for k in ("ahead", "max_policy_lag", "spare_prompts", "temperature")}
    train = {k: demo["train"][k] for k in ("lr", "betas", "max_grad_norm", "grad_accum")}
    return {"rollout": rollout, "train": train, "loss": demo["loss"], "tripwire": demo["tripwire"]}


SPAWNED = {"spawn": True, "rollout_venv": ROLLOUT_VENV, "worker_args": ["--max-model-len", "64"]}


def straight_rows(setting, name: str, **sections: dict) -> list[dict]:
    """An uninterrupted run of `sections` on the shared worker: the rows a resumed run must equal."""
    base = setting["base"]
    config = write_config(base / f"{name}.toml", base / name, setting["model"], setting["spool"].root, **sections)
    finished = launch(config)
    assert finished.wait(timeout=600) == exit_codes.OK, log_tail(finished)
    rows = step_rows(base / name)
    assert len(rows) == STEPS
    return rows


def test_the_demos_settings_with_a_spawned_worker_resume_exactly(setting):
    demo = demo_settings()
    assert demo["rollout"]["ahead"] >= 1 and demo["rollout"]["spare_prompts"] > 0 and demo["loss"]["correction"]
    expected = straight_rows(setting, "demo-straight", **demo)
    base = setting["base"]
    run_dir = base / "demo-interrupted"
    # Its own worker, spawned by each launch on the run's own spool: a new engine after the stop.
    # Beside it the weights go through slots (the default), in a ring of the test's own.
    (base / "demo-shm").mkdir()
    spawned = merge(
        demo, {"rollout": {**SPAWNED, "spool": base / "demo-spool"}, "publish": {"slots_dir": base / "demo-shm"}}
    )
    config = write_config(base / "demo-interrupted.toml", run_dir, setting["model"], setting["spool"].root, **spawned)
    interrupt_after(config, run_dir, 1, lambda proc: proc.send_signal(signal.SIGTERM))
    finished = launch(config)
    assert finished.wait(timeout=600) == exit_codes.OK, log_tail(finished)
    assert step_rows(run_dir) == expected


def test_a_stop_between_two_publishes_resumes_exactly(setting):
    """With publish.every = 2 the checkpoint of an odd step holds newer weights than the requests
    name; the relaunch must sample from the published ones, as the uninterrupted run does."""
    every_2 = {"publish": {"every": 2}, "rollout": {"max_policy_lag": 1}}
    expected = straight_rows(setting, "every-2-straight", **every_2)
    base = setting["base"]
    run_dir = base / "every-2-interrupted"
    config = write_config(
        base / "every-2-interrupted.toml", run_dir, setting["model"], setting["spool"].root, **every_2
    )
    stops = [0]
    while not any(stop % 2 for stop in stops):  # until one stop falls between two publishes
        # A signal sent once row n is written mostly lands in step n + 1: n even, after the last stop.
        interrupt_after(config, run_dir, stops[-1] + 2, lambda proc: proc.send_signal(signal.SIGTERM))
        stops.append(len(step_rows(run_dir)))
        assert len(stops) <= 4, stops
    finished = launch(config)
    assert finished.wait(timeout=600) == exit_codes.OK, log_tail(finished)
    assert step_rows(run_dir) == expected


def test_a_run_publishing_sparse_deltas_samples_exactly_as_one_publishing_full_weights(setting):
    """publish.delta = on, bfloat16 publishes, a learning rate at which few elements change per
    step: the shared worker rebuilds each delta from its chain (its log says so), and every
    step's metrics equal those of the same run publishing full bfloat16 directories: the worker
    served the same weights, bit for bit."""
    bf16 = {"publish": {"dtype": "bfloat16", "keep_last": 2}, "train": {"lr": 1e-6}}
    expected = straight_rows(setting, "full-bf16", **merge(bf16, {"publish": {"delta": "off"}}))
    rows = straight_rows(setting, "deltas-bf16", **merge(bf16, {"publish": {"delta": "on", "delta_anchor_every": 4}}))
    trainer_log = (setting["base"] / "deltas-bf16.log").read_text()
    assert "sparse deltas, a full anchor every 4 publishes (publish.delta = on)" in trainer_log  # the banner
    published = [line for line in trainer_log.splitlines() if "weights.deltas: published step" in line]
    assert sum(" delta (against " in line for line in published) >= STEPS // 2, published
    worker_log = setting["worker_log"].read_text()
    prefix = f"delta_load: rebuilt {setting['base'] / 'deltas-bf16' / 'weights'}/step_"
    assert sum(prefix in line for line in worker_log.splitlines()) >= STEPS // 2
    assert rows == expected


def nothing_torn(run_dir: Path) -> None:
    """No half directory, no scratch file, and metrics.jsonl whole: rows of steps 1, 2, 3... each
    a complete line."""
    no_partials(run_dir)
    assert [p.name for p in run_dir.rglob("*.tmp")] == []
    text = (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
    assert text == "" or text.endswith("\n")
    assert [json.loads(line)["step"] for line in text.splitlines()] == list(range(1, len(text.splitlines()) + 1))


def test_a_really_full_disk_stops_the_run_with_74_and_the_relaunch_takes_every_step_once(setting):
    """run_dir (weights, checkpoints, metrics, the spawned worker's log) on a 5 MB tmpfs: the
    weights of two steps fit, a third or a checkpoint does not."""
    base = setting["base"]
    with small_tmpfs(base / "disk-5mb", 5 * 2**20) as disk:
        run_dir = disk.path / "run"
        # Weights directories: the disk they fill is what this test is about.
        spawned = {"rollout": {**SPAWNED, "spool": base / "full-spool"}, "publish": {"slots": "off"}}
        config = write_config(base / "full-5mb.toml", run_dir, setting["model"], setting["spool"].root, **spawned)
        proc = launch(config)
        assert proc.wait(timeout=600) == exit_codes.CANNOT_WRITE, log_tail(proc)
        [error] = [line for line in log_tail(proc).splitlines() if line.startswith("error:")]
        assert "No space left on device" in error and f"{disk.path}/run/" in error, error
        assert "Free space, then relaunch" in error and "Traceback" not in log_tail(proc)
        nothing_torn(run_dir)

        disk.grow(256 * 2**20)
        finished = launch(config)
        assert finished.wait(timeout=600) == exit_codes.OK, log_tail(finished)
        nothing_torn(run_dir)
        assert step_rows(run_dir) == setting["expected"]


def test_a_disk_that_fills_mid_run_stops_the_metrics_whole_and_nothing_is_lost(setting):
    """run_dir on a tmpfs filled after the first row (weights published elsewhere, checkpoints
    only at the stops): the next metrics row cannot be written. Then the finished run relaunched
    on a full disk: its outputs (stage result, resolved config, receipts, metrics) stay whole."""
    base = setting["base"]
    with small_tmpfs(base / "disk-fills", 16 * 2**20) as disk:
        run_dir = disk.path / "run"
        elsewhere = {"publish": {"dir": base / "fills-weights"}, "checkpoint": {"every": 1000}}
        config = write_config(base / "fills.toml", run_dir, setting["model"], setting["spool"].root, **elsewhere)
        proc = launch(config)
        try:
            seen = poll(lambda: len(step_rows(run_dir)), lambda n: n >= 1 or proc.poll() is not None, 600, 0.005)
            assert proc.poll() is None and seen >= 1, log_tail(proc)
            filler = disk.fill()
            assert proc.wait(timeout=600) == exit_codes.CANNOT_WRITE, log_tail(proc)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        output = log_tail(proc)
        assert f"({run_dir / 'metrics.jsonl'})" in output and "No space left on device" in output, output
        nothing_torn(run_dir)
        assert 1 <= len(step_rows(run_dir)) < STEPS

        filler.unlink()
        finished = launch(config)
        assert finished.wait(timeout=600) == exit_codes.OK, log_tail(finished)
        assert step_rows(run_dir) == setting["expected"]

        kept = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
        filler = disk.fill()
        again = launch(config)
        assert again.wait(timeout=600) == exit_codes.CANNOT_WRITE, log_tail(again)
        assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == kept
        nothing_torn(run_dir)
        filler.unlink()
        again = launch(config)
        assert again.wait(timeout=600) == exit_codes.OK, log_tail(again)
        assert step_rows(run_dir) == setting["expected"]
