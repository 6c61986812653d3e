"""`trainer-svc train --smoke` never touches another run's files, from the user's side: a run
trains with an explicit `publish.dir` through a shared spool (`rollout.spawn = false`: the
workers serving it; here spool_server.SpoolServer, the deterministic test sampler), then a smoke
run of the same config. The run's published weights and every file of its run directory
(checkpoints, metrics.jsonl, stage_result.json, the banner and plot) are byte for byte what they
were; the smoke run wrote into directories of its own, which it printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_config
from spool_server import SpoolServer

from protocol import exit_codes
from trainer_svc.config import dump

TRAINER = str(Path(sys.executable).parent / "trainer-svc")


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.timeout(400)
def test_a_smoke_run_leaves_the_runs_published_weights_and_checkpoints_as_they_were(warm_model, tmp_path):
    publish_dir, spool_dir = tmp_path / "published", tmp_path / "spool"
    cfg = make_config(
        tmp_path / "run",
        warm_model,
        train={"steps": 4},
        rollout={"spawn": False, "spool": str(spool_dir)},
        publish={"dir": str(publish_dir), "keep_last": 3},
    )
    config_file = tmp_path / "run.toml"
    config_file.write_bytes(dump(cfg))
    server = SpoolServer(spool_dir, cfg)
    server.start()
    try:
        trained = subprocess.run([TRAINER, "train", str(config_file)], capture_output=True, text=True, timeout=300)
        assert trained.returncode == exit_codes.OK, trained.stderr[-3000:]
        published, run_files = snapshot(publish_dir), snapshot(tmp_path / "run")
        assert {p.split("/")[0] for p in published} == {f"step_{s:08d}" for s in (2, 3, 4)}
        checkpoints = {p.split("/")[1] for p in run_files if p.startswith("checkpoints/")}
        assert checkpoints == {"step_00000003", "step_00000004"}
        assert {"metrics.jsonl", "stage_result.json"} <= set(run_files)

        smoke = subprocess.run(
            [TRAINER, "train", str(config_file), "--smoke"], capture_output=True, text=True, timeout=300
        )
    finally:
        server.stop()
    assert smoke.returncode == exit_codes.OK, smoke.stderr[-3000:]
    assert snapshot(publish_dir) == published
    # Every file of the run as it was: checkpoints, metrics.jsonl, stage_result.json, the banner...
    after = snapshot(tmp_path / "run")
    assert sorted(after) == sorted(run_files)
    assert [name for name in run_files if after[name] != run_files[name]] == []
    # Its own directories, printed: the run's name with -smoke; the spool is the workers'.
    own_run, own_published = tmp_path / "run-smoke", tmp_path / "published-smoke"
    assert f"run directory {own_run}, published weights {own_published}, spool {spool_dir}" in smoke.stdout
    assert (own_published / "step_00000003").is_dir() and (own_run / "checkpoints" / "step_00000003").is_dir()
