"""bench.trainer_memory runs on a CPU in its tiny mode: the trainer's step with the old math
(the whole logits) and the new (chunks), side by side, for each length asked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_tiny_mode_runs_both_maths_at_each_length(tmp_path):
    out = tmp_path / "memory.json"
    args = ["--shape", "tiny", "--lengths", "4,8", "--sequences", "4", "--micro-batches", "2", "--prompt-tokens", "6"]
    run = subprocess.run(
        [sys.executable, "-m", "bench.trainer_memory", *args, "--steps", "1", "--compile", "off",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["length"], r["math"]) for r in rows] == [(4, "whole"), (4, "chunked"), (8, "whole"), (8, "chunked")]
    assert all(r["step_s"] > 0 and "error" not in r for r in rows)
    assert "| completion tokens |" in run.stdout
