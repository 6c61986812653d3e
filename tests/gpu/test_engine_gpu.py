"""VllmEngine on one GPU, driven directly: no eager mode by default, float32 logprobs equal to
transformers', an in-place reload checked tensor by tensor, and rebuilds (another architecture,
another tokenizer) that give the old engine's device memory back before the new one starts.

One engine (float32, so that the logprobs can be compared exactly) is shared by the module.
"""

from __future__ import annotations

import math
import time

import pytest
from gpu_support import GIB, GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, check_bf16_logprobs, free_bytes, gib

from protocol.messages import Request
from rollout_svc.engines.host import descendants, wait_gone
from rollout_svc.engines.vllm import VllmEngine
from rollout_svc.weights import WeightsPolicy

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

# What a closed engine may leave behind in the readings: nothing of its own (its processes are
# gone), but the reading moves by the allocator and driver noise of other processes.
READING_NOISE = 1 * GIB


def engine_processes(engine: VllmEngine) -> set[int]:
    """The engine's process and every process it started (empty without an engine)."""
    return {engine.host.pid, *descendants(engine.host.pid)} if engine.host is not None else set()


def gpu_engine(models, **settings) -> VllmEngine:
    """An engine on the GPU serving the tier's models, with `settings` over the module's defaults."""
    return VllmEngine(
        policy=WeightsPolicy([str(models["root"])]),
        device="cuda:0",
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        **settings,
    )


@pytest.fixture(scope="module")
def engine_and_baseline(models):
    """A float32 engine with default settings otherwise, and the free memory before it existed."""
    baseline = free_bytes()
    engine = gpu_engine(models, dtype="float32")
    try:
        yield engine, baseline
    finally:
        engine.close()


@pytest.fixture
def engine(engine_and_baseline, models):
    """The module's engine holding model a."""
    engine, _ = engine_and_baseline
    engine.ensure_weights(str(models["a"]))
    return engine


_ids = iter(range(10**6))


def request(weights_dir, prompts, **fields) -> Request:
    fields = dict(n_samples_per_prompt=1, max_tokens=12, temperature=0.0) | fields
    return Request(request_id=f"e{next(_ids)}", weights_dir=str(weights_dir), prompts=list(prompts), **fields)


def test_cuda_graphs_are_the_default_on_gpu(engine):
    """The default reaches vLLM. (That graphs are captured is checked on the bf16 worker of
    test_worker_gpu: the serving setting; float32 may run on attention kernels without them.)"""
    facts = engine.facts
    print(f"\nengine facts: {facts}")
    assert engine.spec.enforce_eager is False and facts["enforce_eager"] is False
    assert not facts["cudagraph_mode"].endswith("NONE")


def test_float32_sampling_logprobs_equal_transformers(engine, models, reference):
    temperature = 0.8
    [completion] = engine.generate(
        [request(models["a"], ["12+7=", "Hello", "abc"], n_samples_per_prompt=4, max_tokens=16,
                 temperature=temperature, seed=3)]
    )  # fmt: skip
    diffs = []
    for prompt_ids, samples, logprobs in zip(
        completion.prompt_token_ids, completion.token_ids, completion.logprobs, strict=True
    ):
        for sample_ids, sample_logprobs in zip(samples, logprobs, strict=True):
            expected = reference.token_logprobs(models["a"], prompt_ids, sample_ids, temperature)
            diffs += [abs(a - b) for a, b in zip(sample_logprobs, expected, strict=True)]
    mean = sum(diffs) / len(diffs)
    print(f"\nfloat32 logprob |vLLM GPU - transformers CPU| over {len(diffs)} tokens: max {max(diffs):.2e}, "
          f"mean {mean:.2e}")  # fmt: skip
    # float32 keeps 24 bits: logits of this model (|z| < 100) are exact to about 1e-5; 1e-3 leaves
    # room for the GPU's other summation order, and is far below any real disagreement.
    assert max(diffs) < 1e-3


def file_sums(model_dir, names: set[str], dtype) -> dict[str, float]:
    from safetensors import safe_open

    sums = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                if name in names:
                    sums[name] = float(f.get_tensor(name).to(dtype).double().sum())
    return sums


def test_in_place_reload_serves_the_new_tensors_in_the_same_process(engine, models, reference):
    import torch

    prompt = ["12+7="]
    before_pids = engine_processes(engine)
    before = engine.generate([request(models["a"], prompt)])[0]
    started = time.monotonic()
    load = engine.load(str(models["b"]))
    print(f"\nin-place reload {load.seconds:.3f} s ({load.bytes} bytes; {time.monotonic() - started:.3f} s seen here); "
          f"engine build {engine.build_s:.1f} s")  # fmt: skip
    assert engine_processes(engine) == before_pids, "a reload in place must not start another engine"
    # Every tensor the engine holds under a checkpoint name (fused ones have other names) equals the file's.
    shapes = engine.probe("parameter_sizes")
    expected = file_sums(models["b"], set(shapes), torch.float32)
    actual = engine.probe("parameter_sums", {name: [(0, shapes[name][0])] for name in expected})
    assert len(expected) >= 4 and set(actual) == set(expected)
    for name, want in expected.items():
        assert math.isclose(actual[name], want, rel_tol=1e-5, abs_tol=1e-5), (name, actual[name], want)
    after = engine.generate([request(models["b"], prompt)])[0]
    assert after.token_ids[0][0] == reference.greedy(models["b"], after.prompt_token_ids[0], 12)
    assert after.token_ids != before.token_ids and after.reload_s == 0.0  # already live


def test_rebuilds_give_the_old_engines_memory_back_first(engine_and_baseline, engine, models, reference):
    _, baseline = engine_and_baseline
    one_engine = baseline - free_bytes()
    print(f"\none engine holds {gib(one_engine)} (baseline free {gib(baseline)})")
    assert one_engine > 2 * READING_NOISE, "the engine's memory does not show in the readings"
    for name in ("wide", "retok"):  # another architecture; the same one with another tokenizer file
        old = engine_processes(engine)
        load = engine.load(str(models[name]))
        assert wait_gone(old, 0) == set(), f"{name}: processes {old} of the old engine still run"
        assert engine_processes(engine).isdisjoint(old)
        held = baseline - free_bytes()
        print(f"{name}: rebuilt in {load.seconds:.1f} s; engines now hold {gib(held)}")
        # One engine's worth, not two: the first was gone before the second took its memory.
        assert held < one_engine * 1.25 + READING_NOISE, f"{name}: {gib(held)} held after the rebuild"
        [completion] = engine.generate([request(models[name], ["12+7="], max_tokens=10)])
        assert completion.token_ids[0][0] == reference.greedy(models[name], completion.prompt_token_ids[0], 10)
    last = engine_processes(engine)
    engine.close()
    assert wait_gone(last, 0) == set()
    left = baseline - free_bytes()
    print(f"after close: {gib(left)} below the baseline")
    assert left < READING_NOISE


def test_without_torch_compile_decode_still_runs_as_cuda_graphs(engine_and_baseline, models, reference):
    """`--no-compile`: vLLM builds no torch.compile graph, captures whole-step CUDA graphs for the
    decode steps, and samples what the model computes (bf16 logprobs within the rounding bound of
    transformers' float32 ones)."""
    first, _ = engine_and_baseline
    first.close()  # the module's engine gives the GPU back; its fixture closes it again, harmlessly
    plain = gpu_engine(models, dtype="bfloat16", compile=False)
    try:
        plain.ensure_weights(str(models["a"]))
        facts = plain.facts
        print(f"\nengine facts without compile: {facts}")
        assert facts["compilation_mode"].rpartition(".")[2] in ("NONE", "0")
        assert facts["cudagraph_mode"].endswith("FULL_DECODE_ONLY") and facts["cuda_graphs"] > 0
        [completion] = plain.generate(
            [request(models["a"], ["12+7=", "Hello", "abc"], n_samples_per_prompt=4, max_tokens=16,
                     temperature=0.8, seed=3)]
        )  # fmt: skip
        check_bf16_logprobs(reference, models["a"], completion, 0.8)
    finally:
        plain.close()
