"""What a run leaves behind: metrics.jsonl (cut back to the resumed step on reopen, atomically;
a damaged line never stops a relaunch and is never lost), the summary of its reward curve, and
JSON files replaced atomically."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_svc.records import write_json_atomic
from trainer_svc.run.outputs import METRICS, MetricsLog, read_metrics, summary

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))  # the small tmpfs shared with the other tiers
from small_fs import small_tmpfs  # noqa: E402


def log_steps(run_dir: Path, resumed_step: int, steps, **extra) -> None:
    log = MetricsLog(run_dir, resumed_step)
    for step in steps:
        log.write({"step": step, **extra})
    log.close()


def steps_of(run_dir: Path) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir)]


def test_metrics_log_appends_one_line_per_step(tmp_path):
    log = MetricsLog(tmp_path, 0)
    log.write({"step": 1, "loss": 0.5})
    # line-buffered: a step's row is on disk before the next step starts (a crash keeps it)
    assert (tmp_path / METRICS).read_text() == '{"step": 1, "loss": 0.5}\n'
    log.write({"step": 2, "loss": 0.25})
    log.close()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]


def test_reopen_drops_the_steps_after_the_resumed_one(tmp_path):
    log_steps(tmp_path, 0, range(1, 6), run="first")
    # the run resumes from the checkpoint of step 3: steps 4 and 5 will be run again
    log_steps(tmp_path, 3, range(4, 7), run="second")
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["run"] for r in rows] == ["first"] * 3 + ["second"] * 3


def test_reopen_at_step_zero_starts_over(tmp_path):
    log_steps(tmp_path, 0, range(1, 4))
    log_steps(tmp_path, 0, [1])
    assert steps_of(tmp_path) == [1]


def test_reopen_at_the_last_step_keeps_everything(tmp_path):
    log_steps(tmp_path, 0, range(1, 4))
    MetricsLog(tmp_path, 3).close()
    assert steps_of(tmp_path) == [1, 2, 3]


def test_reopen_skips_blank_lines(tmp_path):
    (tmp_path / METRICS).write_text('{"step": 1}\n\n{"step": 2}\n')
    log_steps(tmp_path, 1, [2])
    assert (tmp_path / METRICS).read_text() == '{"step": 1}\n{"step": 2}\n'


def test_reopen_after_a_torn_last_line(tmp_path):
    (tmp_path / METRICS).write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    log_steps(tmp_path, 2, [3])
    assert steps_of(tmp_path) == [1, 2, 3]


def test_reopen_after_a_torn_line_in_the_middle_keeps_the_readable_rows_and_the_original(tmp_path, caplog):
    damaged = '{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n{"step": 4}\n'
    (tmp_path / METRICS).write_text(damaged)
    log_steps(tmp_path, 3, [4])  # the relaunch goes on: the checkpoint, not the log, says where the run stands
    assert steps_of(tmp_path) == [1, 3, 4]
    assert (tmp_path / f"{METRICS}.damaged-1").read_text() == damaged  # nothing lost
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert f"{tmp_path / METRICS} line 2" in warning and f"{METRICS}.damaged-1" in warning
    # a second damaged file is set aside beside the first, never over it
    (tmp_path / METRICS).write_text('["not a row"]\n{"step": 1}\n')
    log_steps(tmp_path, 1, [2])
    assert steps_of(tmp_path) == [1, 2]
    assert (tmp_path / f"{METRICS}.damaged-1").read_text() == damaged
    assert (tmp_path / f"{METRICS}.damaged-2").read_text() == '["not a row"]\n{"step": 1}\n'


def test_reopen_appends_the_checkpoints_row_when_the_log_lost_it(tmp_path):
    # The checkpoint of step 3 was saved, then the disk filled before its row reached the log.
    log_steps(tmp_path, 0, [1, 2])
    log = MetricsLog(tmp_path, 3, checkpoint_row={"step": 3, "from": "checkpoint"})
    log.write({"step": 4})
    log.close()
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}, {"step": 3, "from": "checkpoint"}, {"step": 4}]
    MetricsLog(tmp_path, 3, checkpoint_row={"step": 3, "from": "checkpoint"}).close()  # the log has it: kept
    assert steps_of(tmp_path) == [1, 2, 3]


REWRITE_UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
from pathlib import Path
from trainer_svc.run.outputs import MetricsLog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
try:
    MetricsLog(Path(sys.argv[1]), 3)
except OSError as exc:
    print(exc.errno, exc.filename)
    sys.exit(74)
"""


def test_a_write_failing_during_the_rewrite_keeps_the_history(tmp_path):
    rows = [{"step": step, "loss": 0.123456789 * step} for step in range(1, 9)]
    history = "".join(json.dumps(row) + "\n" for row in rows)
    (tmp_path / METRICS).write_text(history)
    # Resuming at step 3 rewrites the file with rows 1..3; every write past 40 bytes fails (EFBIG).
    done = subprocess.run(
        [sys.executable, "-c", REWRITE_UNDER_A_FILE_SIZE_LIMIT, str(tmp_path), "40"], capture_output=True, text=True
    )
    assert done.returncode == 74, done.stderr
    assert (tmp_path / METRICS).read_text() == history
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS]
    assert done.stdout.split() == [str(errno.EFBIG), str(tmp_path / METRICS)]


def test_a_full_disk_during_the_rewrite_and_the_append_keeps_the_history(tmp_path):
    with small_tmpfs(tmp_path / "disk", 1 * 2**20) as disk:
        run_dir = disk.path / "run"
        run_dir.mkdir()
        log_steps(run_dir, 0, range(1, 6))
        before = (run_dir / METRICS).read_text()
        filler = disk.fill()
        with pytest.raises(OSError) as raised:
            MetricsLog(run_dir, 3)
        assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(run_dir / METRICS)
        assert (run_dir / METRICS).read_text() == before
        assert sorted(p.name for p in run_dir.iterdir()) == [METRICS]

        log = MetricsLog(run_dir, 5)  # nothing to cut: opened without a rewrite
        with pytest.raises(OSError) as raised:
            log.write({"step": 6, "text": "x" * 10000})
        log.close()
        assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(run_dir / METRICS)
        assert (run_dir / METRICS).read_text() == before  # no torn row left behind

        filler.unlink()
        log_steps(run_dir, 3, [4])
        assert steps_of(run_dir) == [1, 2, 3, 4]


def test_read_metrics_without_a_file(tmp_path):
    assert read_metrics(tmp_path / "never-ran") == []


def rows(rewards: list[float]) -> list[dict]:
    return [
        {
            "step": i + 1,
            "reward_mean": r,
            "accuracy": r / 2,
            "mismatch_mean": 0.01 * (i + 1),
            "mismatch_max": 0.1 * (i + 1),
            "dead_groups": i % 3,
            "dead_groups_after_retry": 1 if i == 4 else 0,
            "step_s": 2.0,
        }
        for i, r in enumerate(rewards)
    ]


def test_summary_first_and_last_windows():
    s = summary(rows([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]), window=3)
    assert s["steps"] == 10
    assert s["reward_first"] == pytest.approx((0.0 + 0.1 + 0.2) / 3)
    assert s["reward_last"] == pytest.approx((0.7 + 0.8 + 0.9) / 3)
    assert s["reward_gain"] == pytest.approx(0.7)
    assert s["accuracy_last"] == pytest.approx(0.4)
    assert s["mismatch_mean"] == pytest.approx(0.055)
    assert s["mismatch_max"] == pytest.approx(1.0)
    assert s["dead_groups"] == 0 + 1 + 2 + 0 + 1 + 2 + 0 + 1 + 2 + 0
    assert s["dead_groups_after_retry"] == 1
    assert s["wall_s"] == pytest.approx(20.0)


def test_summary_with_fewer_rows_than_the_window():
    s = summary(rows([0.2, 0.6]), window=10)
    assert s["reward_first"] == s["reward_last"] == pytest.approx(0.4)
    assert s["reward_gain"] == pytest.approx(0.0)
    assert s["steps"] == 2


def test_summary_of_a_falling_reward_is_a_negative_gain():
    assert summary(rows([1.0] * 5 + [0.0] * 5), window=5)["reward_gain"] == pytest.approx(-1.0)


def test_summary_of_rows_without_a_gold_has_no_accuracy():
    # Rows with no gold answer log no accuracy: the summary says so, and counts only steps that did.
    unmeasured = [{k: v for k, v in row.items() if k != "accuracy"} for row in rows([0.0, 0.5, 1.0])]
    assert summary(unmeasured)["accuracy_last"] is None and summary(unmeasured)["reward_last"] == pytest.approx(0.5)
    assert summary(unmeasured[:2] + rows([1.0]))["accuracy_last"] == pytest.approx(0.5)  # the one step that did


def test_summary_of_nothing():
    assert summary([]) == {"steps": 0}


def test_write_json_atomic_replaces_and_leaves_no_partial(tmp_path):
    path = tmp_path / "stage_result.json"
    write_json_atomic(path, {"step": 1})
    write_json_atomic(path, {"step": 2, "run_dir": tmp_path})  # paths are written as strings
    assert json.loads(path.read_text()) == {"step": 2, "run_dir": str(tmp_path)}
    assert [p.name for p in tmp_path.iterdir()] == ["stage_result.json"]


def test_write_json_atomic_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "stage_result.json"
    write_json_atomic(path, {"step": 1})
    circular: dict = {"step": 2}
    circular["self"] = circular
    with pytest.raises(ValueError):
        write_json_atomic(path, circular)
    assert json.loads(path.read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["stage_result.json"]


def test_write_json_atomic_on_a_full_disk_names_the_file_and_keeps_the_old(tmp_path):
    with small_tmpfs(tmp_path / "disk", 1 * 2**20) as disk:
        path = disk.path / "stage_result.json"
        write_json_atomic(path, {"step": 1})
        disk.fill()
        with pytest.raises(OSError) as raised:
            write_json_atomic(path, {"step": 2, "text": "x" * 10000})
        assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
        assert json.loads(path.read_text()) == {"step": 1}
        assert sorted(p.name for p in disk.path.iterdir()) == [".filler", "stage_result.json"]


def test_the_canary_history_is_kept_like_the_metrics_a_damaged_line_never_stops_a_relaunch(tmp_path):
    """canary.jsonl is a step log too: on resume it is cut back atomically, and a line damaged in
    its middle neither stops the relaunch nor loses the readable rows."""
    from conftest import make_config

    from trainer_svc.rails.canary import CANARY_FILE, Canary

    cfg = make_config(tmp_path, tmp_path, canary={"every": 10})
    rows = [{"step": s, "accuracy": s / 10, "n": 4, "weights_dir": "w", "time": 0.0} for s in (10, 20, 30)]
    lines = [json.dumps(r) for r in rows]
    (tmp_path / CANARY_FILE).write_text(lines[0] + "\n" + '{"step": 15, "accura\n' + lines[1] + "\n" + lines[2] + "\n")
    canary = Canary(cfg, held_out=[], rewards=None, sampler=object(), resumed_step=20)
    assert canary.history == rows[:2]
    assert (tmp_path / CANARY_FILE).read_text() == lines[0] + "\n" + lines[1] + "\n"
    assert (tmp_path / f"{CANARY_FILE}.damaged-1").read_text().count("\n") == 4  # the original, whole
    assert not canary.due(20) and canary.due(30)
