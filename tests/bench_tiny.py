"""The benchmarks' tiny modes as the two test tiers run them: each row of bench/README.md's index
whose tiny mode runs in the tier's venv, as `python -m bench.NAME --tiny --json OUT` from the
checkout, its temporary files in the test's own directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import index
from bench.common import sources_first

ROOT = Path(__file__).resolve().parents[1]


def scripts_for(venv: str) -> list[index.Script]:
    return [script for script in index.scripts() if script.tiny == venv]


def run_tiny(script: index.Script, tmp_path: Path, *extra: str) -> tuple[dict, str]:
    """Run the script's tiny mode (with `extra` arguments); its JSON report and its output. Each
    venv holds its own service only: the three packages' sources go on the path, as the index's
    commands put them."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "figures.json"
    env = sources_first(os.environ, "protocol", "rollout_svc", "trainer_svc") | {"TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", script.module, "--tiny", "--json", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"{script.module} --tiny exited {done.returncode}:\n{done.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert isinstance(report, dict) and report, f"{script.module} --tiny wrote no figures"
    return report, done.stdout
