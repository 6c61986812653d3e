"""Sleep mode on one GPU: a worker with --sleep-when-idle gives its device memory back when idle,
says so, and a request wakes it with the weights it names (level 2: reloaded from disk); an
engine at level 1 wakes with the weights it kept and answers exactly as before.
"""

from __future__ import annotations

import time

import pytest
from gpu_support import (
    GPU_MEMORY_UTILIZATION,
    MAX_MODEL_LEN,
    ServedWorker,
    check_bf16_greedy,
    free_bytes,
    gib,
    keep_running,
    metric,
    poll,
)

from protocol.messages import Request
from protocol.spool import Spool
from rollout_svc.engines.vllm import VllmEngine
from rollout_svc.weights import WeightsPolicy

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

WORKER = "gpu-sleeper"
SLEEP_WHEN_IDLE_S = 10  # long enough to read the memory of the awake engine after it is ready
# Asleep, an engine keeps its CUDA context, CUDA graph pools and allocator caches; the weights and
# the KV cache (nearly all of its budget) go. At least this share of what it held must come back.
FREED_SHARE = 0.75


@pytest.fixture(scope="module")
def sleeper(models, tmp_path_factory):
    base = tmp_path_factory.mktemp("gpu-sleeper")
    args = [
        "--engine", "vllm", "--allowed-root", str(models["root"]), "--weights", str(models["a"]),
        "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION),
        "--sleep-when-idle", str(SLEEP_WHEN_IDLE_S), "--sleep-level", "2",
        "--idle-exit", "1800", "--metrics-dir", str(base / "metrics"),
    ]  # fmt: skip
    baseline = free_bytes()
    served = ServedWorker(Spool(base / "spool", create=True), WORKER, args, log_dir=base)
    try:
        yield served, baseline
    finally:
        served.stop()


def metrics_path(served: ServedWorker):
    return served.log_dir / "metrics" / f"rollout_svc_{WORKER}.prom"


def wait_asleep(served: ServedWorker, sleeps: int) -> None:
    value = poll(lambda: metric(metrics_path(served), "rollout_sleeps_total") or 0, until=lambda n: n >= sleeps,
                 timeout_s=SLEEP_WHEN_IDLE_S + 60)  # fmt: skip
    assert value >= sleeps, f"the worker did not fall asleep ({value} sleeps); see {served.log_dir}"
    assert metric(metrics_path(served), "rollout_asleep") == 1


def test_an_idle_worker_sleeps_with_its_memory_given_back_and_a_request_wakes_it(
    sleeper, models, client_for, reference
):
    served, baseline = sleeper
    if served.running():  # a fresh life, so that the engine is awake when measured
        served.stop()
    keep_running(served)
    awake = baseline - free_bytes()
    wait_asleep(served, 1)
    asleep = baseline - free_bytes()
    print(f"\nawake the worker holds {gib(awake)}, asleep {gib(asleep)}; "
          f"fell asleep in {metric(metrics_path(served), 'rollout_sleep_seconds'):.2f} s")  # fmt: skip
    assert awake - asleep >= FREED_SHARE * awake, "sleep did not give the engine's memory back"

    client = client_for(served.spool.root)
    request = Request(request_id=f"wake-{time.time_ns()}", weights_dir=str(models["b"]), prompts=["12+7="],
                      n_samples_per_prompt=1, max_tokens=12, temperature=0.0)  # fmt: skip
    client.submit(request)
    result = client.wait([request.request_id], timeout_s=600)[request.request_id]
    assert result.ok, result.error
    # Level 2 discarded a's weights; the wake loaded b's (and verified them before generating).
    check_bf16_greedy(reference, models["b"], result.prompt_token_ids[0], result.token_ids[0][0])
    assert result.timings.reload_bytes > 0
    wakes = poll(lambda: metric(metrics_path(served), "rollout_wakes_total") or 0, until=lambda n: n >= 1)
    assert wakes == 1
    print(f"woke and reloaded in {metric(metrics_path(served), 'rollout_wake_seconds'):.2f} s "
          f"(result reload_s {result.timings.reload_s:.2f} s)")  # fmt: skip

    # Idle again, it sleeps again, and gives the memory back again (nothing leaks per cycle).
    wait_asleep(served, 2)
    again = baseline - free_bytes()
    print(f"asleep the second time: {gib(again)}")
    assert again <= asleep + 2**30
    status = next(s for _, s in served.spool.statuses() if s is not None and s.worker_id == WORKER)
    assert status.state == "sleeping" and status.weights_dir == str(models["b"])


def test_level_1_keeps_the_weights_and_answers_as_before(models):
    engine = VllmEngine(
        policy=WeightsPolicy([str(models["root"])]),
        device="cuda:0",
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        sleep_level=1,
    )
    try:
        request = Request(request_id="l1", weights_dir=str(models["a"]), prompts=["12+7=", "Hello"],
                          n_samples_per_prompt=1, max_tokens=12, temperature=0.0)  # fmt: skip
        before = engine.generate([request])[0]
        awake = free_bytes()
        slept_s = engine.sleep()
        freed = free_bytes() - awake
        print(f"\nlevel 1: asleep in {slept_s:.2f} s, {gib(freed)} freed")
        assert engine.asleep and freed > 2**30
        after = engine.generate([request])[0]
        print(f"woke in {engine.last_wake_s:.2f} s; the result's reload {after.reload_s:.2f} s, "
              f"{after.reload_bytes} bytes")  # fmt: skip
        assert not engine.asleep and after.reload_bytes == 0  # no file read: the weights came back from host memory
        assert after.token_ids == before.token_ids
    finally:
        engine.close()
