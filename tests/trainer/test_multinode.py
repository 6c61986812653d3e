"""The trainer across nodes: `torchrun --nnodes=2` with c10d rendezvous, two node agents on this
host over loopback (one rank each), FSDP2 on gloo, rollouts through one shared spool. The two
nodes train exactly as one process does through the same spool: the same rewards, gradient norms
and final weights.

Rollouts are served by spool_server.SpoolServer (the deterministic test sampler behind the real
spool), so both runs sample the same completions; the trainer's side is the real rollout service
(`rollout.spawn = false`: it uses the workers serving the spool)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import make_config
from safetensors.torch import load_file
from spool_server import SpoolServer

from protocol import exit_codes
from trainer_svc.run.loop import train

HERE = Path(__file__).parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS = 2


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_agent(node: int, port: int, rdzv_id: str, config_file: Path, log: Path) -> subprocess.Popen:
    """One node's torchrun agent. Agent 0 hosts the c10d rendezvous store; both listen on
    loopback only, and gloo talks over it too."""
    command = [
        str(TORCHRUN), "--nnodes=2", "--nproc-per-node=1", "--max-restarts=0",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=is_host={str(node == 0).lower()}", "--local-addr=127.0.0.1",
        str(HERE / "fsdp_run.py"), str(config_file), "--through-spool",
    ]  # fmt: skip
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.mark.timeout(400)
def test_two_nodes_train_as_one_process_through_one_spool(warm_model, tmp_path):
    spool_dir = tmp_path / "spool"
    shape = dict(train={"steps": STEPS, "grad_accum": 2}, rollout={"spawn": False, "spool": str(spool_dir)})
    single = make_config(tmp_path / "single", warm_model, **shape)
    server = SpoolServer(spool_dir, single)
    server.start()
    agents: list[subprocess.Popen] = []
    try:
        assert train(single) == exit_codes.OK

        nodes = make_config(tmp_path / "nodes", warm_model, **shape)
        config_file = tmp_path / "nodes.json"
        config_file.write_bytes(msgspec.json.encode(nodes))
        port, rdzv_id = free_port(), uuid.uuid4().hex[:8]
        logs = [tmp_path / f"node{n}.log" for n in range(2)]
        agents = [node_agent(n, port, rdzv_id, config_file, logs[n]) for n in range(2)]
        deadline = time.monotonic() + 330
        for agent in agents:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [agent.returncode for agent in agents]
        assert codes == [0, 0], "\n".join(f"{log.name}:\n{log.read_text()[-3000:]}" for log in logs)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait(timeout=30)
        server.stop()

    one, two = metrics(single.run_dir), metrics(nodes.run_dir)
    assert len(one) == len(two) == STEPS
    assert [r["reward_mean"] for r in one] == [r["reward_mean"] for r in two]
    assert any(r["grad_norm"] > 0 for r in one)
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in two]), torch.tensor([r["grad_norm"] for r in one]), rtol=1e-4, atol=1e-6
    )
    # Every rollout went through the spool, each request once.
    assert len(server.served) == len(set(server.served)) >= 2 * STEPS
    assert sorted(os.listdir(server.spool.requests)) == [] and os.listdir(server.spool.claimed) == []
    final = f"step_{STEPS:08d}"
    final_one = load_file(single.run_dir / "checkpoints" / final / "model.safetensors")
    final_two = load_file(nodes.run_dir / "checkpoints" / final / "model.safetensors")
    assert final_one.keys() == final_two.keys()
    for name in final_one:
        torch.testing.assert_close(final_two[name], final_one[name], rtol=1e-4, atol=1e-6)
