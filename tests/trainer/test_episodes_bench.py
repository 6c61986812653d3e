"""bench.episodes_echo runs in its tiny mode against real echo workers: every episode ends, and
batching sends far fewer request files per turn than one request per turn, measured side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_tiny_mode_runs_batching_on_and_off_side_by_side(tmp_path):
    out = tmp_path / "episodes.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.episodes_echo", "--tiny", "--spool-dir", str(tmp_path),
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    on, off = report["rows"]
    assert (on["batching"], off["batching"]) == ("on", "off")
    assert on["turns"] == off["turns"] == report["episodes"] * report["turns"]
    assert off["requests"] == off["turns"] + off["resent"]  # one request per turn
    assert on["requests"] * 4 <= on["turns"]  # at most a request per 4 turns: 40 episodes on 2 workers
    # Live workers all along: later turns go to their episode's worker (another takes one only
    # after its 2 s sticky wait, which a worker slowed by a loaded machine might exceed).
    assert on["sticky"] >= 0.9 and off["sticky"] >= 0.9
    assert "| files_per_turn |" in run.stdout
