"""Two CPU ranks under torchrun with FSDP2 (gloo) train exactly as one process does: the same
rewards, gradient norms and final weights, because the loss denominator covers the whole step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import make_config
from local_sampler import TorchSampler
from safetensors.torch import load_file

from protocol import exit_codes
from trainer_svc.run.loop import train

HERE = Path(__file__).parent
TORCHRUN = Path(sys.executable).parent / "torchrun"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("denominator", "budget"), [("token", None), ("sequence", None), ("token", 20)])
def test_two_fsdp_ranks_match_one_process(warm_model, tmp_path, denominator, budget):
    """With a token budget each rank's share needs its own number of micro-batches: the ranks
    take the largest (an FSDP2 pass is a collective), and still train as one process."""
    train_cfg = {"steps": 3, "grad_accum": 2} | ({"max_tokens_per_micro_batch": budget} if budget else {})
    shape = dict(train=train_cfg, loss={"denominator": denominator})
    single = make_config(tmp_path / "single", warm_model, **shape)
    assert train(single, make_sampler=lambda cfg, launch_id: TorchSampler(cfg)) == exit_codes.OK

    sharded = make_config(tmp_path / "sharded", warm_model, **shape)
    config_file = tmp_path / "sharded.json"
    config_file.write_bytes(msgspec.json.encode(sharded))
    run = subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(HERE / "fsdp_run.py"), str(config_file)],
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    one, two = metrics(single.run_dir), metrics(sharded.run_dir)
    if budget:
        assert all(r["micro_batches"] > 2 for r in two), [r["micro_batches"] for r in two]
    # only rank 0 tracks: one TensorBoard event file, as one process writes
    assert len(list((sharded.run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert [r["reward_mean"] for r in one] == [r["reward_mean"] for r in two]
    assert any(r["grad_norm"] > 0 for r in one)
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in two]), torch.tensor([r["grad_norm"] for r in one]), rtol=1e-4, atol=1e-6
    )
    final_one = load_file(single.run_dir / "checkpoints" / "step_00000003" / "model.safetensors")
    final_two = load_file(sharded.run_dir / "checkpoints" / "step_00000003" / "model.safetensors")
    assert final_one.keys() == final_two.keys()
    for name in final_one:
        torch.testing.assert_close(final_two[name], final_one[name], rtol=1e-4, atol=1e-6)
