"""`trainer-svc plot --follow`, as a process on a run directory whose metrics.jsonl grows: the PNG
is redrawn for each new step, a resumable stop is followed through, and the command ends when
stage_result.json says the run finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from protocol import exit_codes

TRAINER = str(Path(sys.executable).parent / "trainer-svc")


def append_rows(run_dir: Path, steps) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step in steps:
            f.write(
                json.dumps({"step": step, "reward_first": step / 10, "loss": 1 / step, "mismatch_mean": 0.0}) + "\n"
            )


def stage_result(run_dir: Path, exit_code: int) -> None:
    result = {"exit_code": exit_code, "finished": exit_code == exit_codes.OK}
    tmp = run_dir / "stage_result.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, run_dir / "stage_result.json")  # as the trainer writes it: whole


@pytest.mark.timeout(120)
def test_follow_redraws_as_the_run_grows_and_ends_with_it(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    png = run_dir / "training.png"
    follower = subprocess.Popen(
        [TRAINER, "plot", str(run_dir), "--follow", "--every", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert follower.stdout.readline().startswith(f"following {run_dir}")
        append_rows(run_dir, [1, 2])
        assert follower.stdout.readline() == f"plot written to {png} (2 steps)\n"
        first = png.read_bytes()
        # a resumable stop (exit 75): the relaunch goes on, and so does the plot
        stage_result(run_dir, exit_codes.RESUMABLE_STOP)
        append_rows(run_dir, [3])
        assert follower.stdout.readline() == f"plot written to {png} (3 steps)\n"
        assert png.read_bytes() != first
        assert matplotlib.image.imread(png).shape[:2] == (700, 1400)  # a whole PNG, 14 x 7 in at 100 dpi
        append_rows(run_dir, [4])
        stage_result(run_dir, exit_codes.OK)
        rest = follower.stdout.read()
        assert follower.wait() == 0
    finally:
        follower.kill()
        follower.wait()
    assert rest.splitlines()[-1] == "the run finished"
    assert f"plot written to {png} (4 steps)" in rest  # the last step is drawn before it ends


@pytest.mark.timeout(60)
def test_follow_ends_on_a_run_that_stopped_for_good(tmp_path):
    append_rows(tmp_path, [1])
    stage_result(tmp_path, exit_codes.TRIPWIRE)
    done = subprocess.run([TRAINER, "plot", str(tmp_path), "--follow"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [
        f"plot written to {tmp_path / 'training.png'} (1 step)",
        f"the run stopped with exit code {exit_codes.TRIPWIRE}",
    ]
