"""Fan-out over two real vLLM workers (the rollout venv's CPU build), one SIGKILLed while it holds
a step's request: its claim goes back after its lease, the other worker serves it, and the run
trains on every step with no request lost or answered twice. And the call id on every part of a
call, by which workers leave the other parts to their idle peers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import ROLLOUT_SVC, make_config

from protocol import exit_codes
from protocol.spool import Spool, id_from_name, split_claimed_name
from trainer_svc.rollout.client import RolloutService
from trainer_svc.rollout_types import Ticket, WeightsRef
from trainer_svc.run.loop import train

pytestmark = pytest.mark.timeout(900)

LEASE_S = 3.0
KILLED_STEP = 2  # its request names weights the workers have not loaded yet: a reload widens the window


def start_vllm_worker(spool_dir, worker_id: str, model, allowed: list, log_dir) -> subprocess.Popen:
    allowed_args = [arg for root in allowed for arg in ("--allowed-root", str(root))]
    with open(log_dir / f"{worker_id}.log", "ab") as log:
        return subprocess.Popen(
            [str(ROLLOUT_SVC), "serve", "--spool", str(spool_dir), "--worker-id", worker_id, "--engine", "vllm"]
            + ["--weights", str(model), "--max-model-len", "64", "--idle-exit", "0", *allowed_args]
            + ["--lease", str(LEASE_S), "--heartbeat", "1"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1"),
        )


class KillingService(RolloutService):
    """The real rollout service, which SIGKILLs worker B once B holds a request of KILLED_STEP.
    Worker A is frozen while that call is sent, so B claims first; it is woken after the kill.
    B is frozen too until the call is written: on a loaded machine writing it can take longer
    than B's engine call, and a part B claimed, served and archived before the first look at
    claimed/ would never be seen there."""

    def __init__(self, cfg, procs: dict[str, subprocess.Popen]):
        super().__init__(cfg)
        self.procs = procs
        self.tickets = []
        self.killed_claims: list[str] = []

    def submit(self, call):
        if call.step != KILLED_STEP or call.attempt != 0 or self.killed_claims:
            self.tickets.append(super().submit(call))
            return self.tickets[-1]
        os.killpg(self.procs["vllm-a"].pid, signal.SIGSTOP)
        os.killpg(self.procs["vllm-b"].pid, signal.SIGSTOP)
        try:
            try:
                self.tickets.append(super().submit(call))
            finally:
                os.killpg(self.procs["vllm-b"].pid, signal.SIGCONT)
            # Only this call's requests count: a claim B has already answered stays in claimed/
            # for a moment after its result is published.
            mine = set(self.tickets[-1].request_ids)
            deadline = time.monotonic() + 60  # B may first finish what it serves (slow on a loaded machine)
            while not self.killed_claims and time.monotonic() < deadline:
                claims = [split_claimed_name(name) for name in os.listdir(self.client.spool.claimed)]
                self.killed_claims = [
                    id_from_name(name) for name, worker in claims if worker == "vllm-b" and id_from_name(name) in mine
                ]
                if self.killed_claims:
                    os.killpg(self.procs["vllm-b"].pid, signal.SIGKILL)
                time.sleep(0.001)
        finally:
            os.killpg(self.procs["vllm-a"].pid, signal.SIGCONT)
        assert self.killed_claims, "worker B never held a claim of the step"
        return self.tickets[-1]


def test_a_worker_killed_mid_step_costs_a_lease_not_the_run(warm_model, tmp_path):
    spool_dir, run_dir = tmp_path / "spool", tmp_path / "run"
    spool = Spool(spool_dir, create=True)
    (run_dir / "weights").mkdir(parents=True)  # where the trainer publishes
    procs = {
        worker_id: start_vllm_worker(
            spool_dir, worker_id, warm_model, [warm_model.parent, run_dir / "weights"], tmp_path
        )
        for worker_id in ("vllm-a", "vllm-b")
    }
    try:
        deadline = time.monotonic() + 600
        while {s.worker_id for s in spool.live_workers() if s.state == "idle" and s.weights_dir} != set(procs):
            assert all(p.poll() is None for p in procs.values()), "a vLLM worker exited; see its log in tmp_path"
            assert time.monotonic() < deadline, "the vLLM workers did not start"
            time.sleep(0.5)
        cfg = make_config(
            run_dir,
            warm_model,
            rollout={
                "spool": str(spool_dir),
                "ahead": 1,
                "max_policy_lag": 1,
                "no_worker_grace_s": 30.0,
                "timeout_s": 120.0,
            },
            train={"steps": 4},
            checkpoint={"every": 50},
        )
        services = []

        def make(cfg, launch_id):
            services.append(KillingService(cfg, procs))
            return services[-1]

        assert train(cfg, make_sampler=make) == exit_codes.OK
        deadline = time.monotonic() + 30  # a worker archives its claim just after publishing its result
        while os.listdir(spool.claimed) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)

    [service] = services
    killed = [t for t in service.tickets if (t.step, t.attempt) == (KILLED_STEP, 0)]
    assert [len(t.request_ids) for t in killed] == [2]  # fanned out over the two live workers
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[KILLED_STEP]["dropped_stale"] == 0
    # What B held was served again, by A, once B's lease ran out.
    for request_id in service.killed_claims:
        assert spool.read_result(request_id).worker_id == "vllm-a"
    # Every request has exactly one result, consumed once; none is left anywhere else.
    sent = sorted(i for t in service.tickets for i in t.request_ids)
    done = os.listdir(spool.root / "done")
    assert sorted(n.removesuffix(".result.json") for n in done if n.endswith(".result.json")) == sent
    assert os.listdir(spool.requests) == os.listdir(spool.claimed) == os.listdir(spool.results) == []


def test_every_part_of_a_call_names_the_call_and_another_call_another(tmp_path):
    """What the workers' fan-out rule reads: the request files the trainer writes, as `cat` shows them."""
    spool_dir = tmp_path / "spool"
    cfg = make_config(tmp_path / "run", tmp_path / "model", rollout={"spool": str(spool_dir), "fan_out": 3})
    service = RolloutService(cfg, cuda_devices=0)
    weights = WeightsRef("/models/none", None, 3)
    prompts = [f"{i}+1=" for i in range(7)]
    try:
        first = service.submit(Ticket(tuple(prompts), weights, 7, 0, 1))
        retry = service.submit(Ticket(tuple(prompts[:3]), weights, 7, 1, 2))
        ahead = service.submit(Ticket(tuple(prompts), weights, 8, 0, 3))
    finally:
        service.close()
    files = {path.name: json.loads(path.read_bytes()) for path in (spool_dir / "requests").iterdir()}
    calls = [{files[f"{i}.json"].get("call_id") for i in t.request_ids} for t in (first, retry, ahead)]
    assert [len(t.request_ids) for t in (first, retry, ahead)] == [3, 3, 3]
    assert all(len(call) == 1 and None not in call for call in calls), calls  # one call id on every part
    assert len(set.union(*calls)) == 3  # and each call its own
    # The same call made again (a relaunch redoing the step, its requests lost) names the same call.
    for request_id in first.request_ids:
        os.unlink(spool_dir / "requests" / f"{request_id}.json")
    again = RolloutService(cfg, cuda_devices=0)
    try:
        assert again.submit(Ticket(tuple(prompts), weights, 7, 0, 1)) == first
    finally:
        again.close()
    for request_id in first.request_ids:
        assert json.loads((spool_dir / "requests" / f"{request_id}.json").read_bytes())["call_id"] in calls[0]
