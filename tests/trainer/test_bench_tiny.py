"""The tiny modes of the benchmarks that run in the trainer venv run (bench/README.md's index; the
rollout venv's run in tests/unit/test_bench_tiny.py), and what some of them measure holds even
tiny; the made-up runs the tiny modes summarise carry every key of the trainer's own step lines."""

from __future__ import annotations

import pytest
from conftest import make_config
from local_sampler import TorchSampler

from bench import synthetic
from bench.common import read_jsonl
from tests.bench_tiny import run_tiny, scripts_for


def episodes_batch_turns(report: dict, stdout: str) -> None:
    """Against real echo workers every episode ends, and batching sends far fewer request files
    per turn than one request per turn, measured side by side."""
    on, off = report["rows"]
    assert (on["batching"], off["batching"]) == ("on", "off")
    assert on["turns"] == off["turns"] == report["episodes"] * report["turns"]
    assert off["requests"] == off["turns"] + off["resent"]  # one request per turn
    assert on["requests"] * 4 <= on["turns"]  # at most a request per 4 turns: 40 episodes on 2 workers
    # Live workers all along: later turns go to their episode's worker (another takes one only
    # after its 2 s sticky wait, which a worker slowed by a loaded machine might exceed).
    assert on["sticky"] >= 0.9 and off["sticky"] >= 0.9
    assert "| files_per_turn |" in stdout


def episodes_sticky_and_not(report: dict, stdout: str) -> None:
    """Both runs take every turn; with the sticky rule later turns stay on their episode's worker,
    without it they are spread by load; echo workers report no prefix cache, and it says so."""
    sticky, spread = report["rows"]
    assert (sticky["sticky"], spread["sticky"]) == (True, False)
    assert sticky["turns"] == spread["turns"] == report["episodes"] * report["turns"]
    assert sticky["later_turns_on_previous_worker"] >= 0.9
    assert spread["later_turns_on_previous_worker"] < sticky["later_turns_on_previous_worker"]
    assert sticky["prefix_cache_hit_rate"] is None and report["engine"] == "echo"
    assert "| prefix_cache_hit_rate |" in stdout


def memory_both_maths_at_each_length(report: dict, stdout: str) -> None:
    """The trainer's step with the old math (the whole logits) and the new (chunks), side by
    side, for each length asked."""
    rows = report["rows"]
    assert [(r["length"], r["math"]) for r in rows] == [(4, "whole"), (4, "chunked"), (8, "whole"), (8, "chunked")]
    assert all(r["step_s"] > 0 and "error" not in r for r in rows)
    assert "| completion tokens |" in stdout


CHECKS = {
    "episodes_echo.py": episodes_batch_turns,
    "episodes_prefix_cache.py": episodes_sticky_and_not,
    "trainer_memory.py": memory_both_maths_at_each_length,
}


@pytest.mark.parametrize("script", scripts_for("trainer"), ids=lambda s: s.file)
def test_the_tiny_mode_runs(script, tmp_path):
    report, stdout = run_tiny(script, tmp_path)
    if script.file in CHECKS:
        CHECKS[script.file](report, stdout)


def test_the_mfu_bench_steps_with_the_log_prob_chunk_it_is_given(tmp_path):
    """--chunk-mib reaches the trainer's log-prob math: the step runs, and its chunks hold fewer
    positions than at the trainer's default size."""
    (script,) = [s for s in scripts_for("trainer") if s.file == "trainer_mfu.py"]
    default, _ = run_tiny(script, tmp_path / "default")
    small, _ = run_tiny(script, tmp_path / "small", "--chunk-mib", "1")
    (default_row,), (small_row,) = default["rows"], small["rows"]
    assert "error" not in small_row and small_row["step_s"] > 0
    assert small_row["logprob_chunk_rows"] < default_row["logprob_chunk_rows"]


def test_the_made_up_runs_carry_every_key_of_the_trainers_step_lines(tiny_model, tmp_path):
    from trainer_svc.run.loop import train

    cfg = make_config(tmp_path / "run", tiny_model, train={"steps": 1})
    assert train(cfg, make_sampler=lambda cfg, launch_id: TorchSampler(cfg)) == 0
    real = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert set(synthetic.metrics_rows(1)[0]) == set(real)
