"""The README's hand-submission recipe, run as written (spool path aside) against a real
`rollout-svc serve --engine echo`: a person with `cat` and `mv` gets a result."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def recipe() -> str:
    """The indented shell block of docs/operations.md's "Submitting by hand" section."""
    section = (ROOT / "docs" / "operations.md").read_text().split("## Submitting by hand", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"\n((?:    .*\n)+)", section).group(1)
    return "\n".join(line[4:] for line in block.splitlines())


def test_the_readme_recipe_gets_a_result_from_an_echo_worker(tmp_path):
    spool = tmp_path / "spool"
    worker = subprocess.Popen(
        [
            str(BIN / "rollout-svc"),
            "serve",
            "--spool",
            str(spool),
            "--engine",
            "echo",
            "--worker-id",
            "readme",
            "--idle-exit",
            "60",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (spool / "workers" / "readme.json").exists():  # the worker made the layout and is up
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.1)
        lines = recipe().replace("/srv/spool", str(spool)).splitlines()
        submit, read = "\n".join(lines[:-1]), lines[-1]
        assert read.startswith("cat ") and "mv " in submit
        subprocess.run(["bash", "-euc", submit], check=True)
        result_file = spool / "results" / "hello-1.json"
        while not result_file.exists():
            assert time.monotonic() < deadline + 30
            time.sleep(0.05)
        result = json.loads(subprocess.run(["bash", "-euc", read], check=True, capture_output=True, text=True).stdout)
        assert result["ok"] and result["texts"] == [["2+2=", "2+2="]] and result["worker_id"] == "readme"
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
