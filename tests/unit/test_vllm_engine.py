"""VllmEngine's decisions, with its engine process replaced by a recording double: what a weight
change costs (nothing, a reload in place, a wake, a rebuild in a new process), what reaches the
engine process, and the defaults and refusals of its settings. No vLLM runs here; the real
engine process is tested in tests/e2e (CPU) and tests/gpu."""

from __future__ import annotations

import json
import os

import pytest

import rollout_svc.engines.vllm as vllm_module
from protocol.messages import ErrorCode
from rollout_svc.engines.base import Completion
from rollout_svc.engines.host import HostDied, HostError
from rollout_svc.engines.vllm import VllmEngine
from rollout_svc.engines.vllm_host import configure_environment
from rollout_svc.errors import RequestFailed
from rollout_svc.tiny_model import build
from rollout_svc.weights import WeightsPolicy

pytestmark = pytest.mark.timeout(120)


class FakeHost:
    """An engine process that records the commands it gets; `fail` maps a command to the error
    it raises next time."""

    started: list[FakeHost] = []

    def __init__(self, module, *, env=None, **_):
        self.module, self.env = module, env
        self.calls: list[tuple] = []
        self.fail: dict[str, Exception] = {}
        self.closed = False
        self.dead = False
        self.pid = 1000 + len(FakeHost.started)
        FakeHost.started.append(self)

    def alive(self) -> bool:
        return not (self.closed or self.dead)

    def call(self, command, *args):
        self.calls.append((command, *args))
        if command in self.fail:
            raise self.fail.pop(command)
        if command == "build":
            return {"enforce_eager": args[0].enforce_eager, "cuda_graphs": 0, "pid": self.pid}
        if command == "generate":
            return [Completion([["x"]], [[[1]]], [[[-0.5]]], [["length"]], [[2]]) for _ in args[0]]
        return None

    def close(self) -> None:
        self.closed = True

    @property
    def commands(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("models")
    models = {"root": root, "a": build(root / "a", seed=0), "b": build(root / "b", seed=1)}
    models["wide"] = build(root / "wide", seed=2, hidden=192)
    models["retok"] = build(root / "retok", seed=0)
    config = json.loads((models["retok"] / "tokenizer_config.json").read_text())
    config["model_max_length"] += 1  # the same tokens, another tokenizer file
    (models["retok"] / "tokenizer_config.json").write_text(json.dumps(config))
    return models


@pytest.fixture
def engine(models, monkeypatch):
    FakeHost.started = []
    monkeypatch.setattr(vllm_module, "EngineHost", FakeHost)
    return lambda **options: VllmEngine(policy=WeightsPolicy([str(models["root"])]), **options)


def test_settings_follow_the_device():
    cpu = VllmEngine(policy=WeightsPolicy())
    gpu = VllmEngine(policy=WeightsPolicy(), device="cuda:0")
    assert (cpu.spec.dtype, cpu.spec.enforce_eager, cpu.spec.sleep_mode) == ("float32", True, False)
    assert (gpu.spec.dtype, gpu.spec.enforce_eager) == ("bfloat16", False)  # CUDA graphs on GPU
    assert VllmEngine(policy=WeightsPolicy(), device="cuda:0", enforce_eager=True).spec.enforce_eager is True
    assert VllmEngine(policy=WeightsPolicy(), device="cuda:0", sleep_level=1).spec.sleep_mode is True
    assert cpu.name.startswith("vllm ")


@pytest.mark.parametrize(
    ("device", "dtype", "expected"),
    [("cuda:0", "float32", "ieee"), ("cuda:0", "bfloat16", None), ("cpu", "float32", None)],
)
def test_a_float32_gpu_engine_asks_triton_for_ieee_float32_dots(monkeypatch, device, dtype, expected):
    """Triton's default float32 dot is TF32, which moved GPU logprobs by 1e-2 from the trainer's."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "unset")  # records the variable's state, restored afterwards
    monkeypatch.delenv("TRITON_F32_DEFAULT")
    configure_environment(device, dtype, kv_cache_gib=1.0)
    assert os.environ.get("TRITON_F32_DEFAULT") == expected


def test_sleep_is_refused_on_cpu_and_levels_other_than_1_and_2_everywhere():
    with pytest.raises(ValueError, match="--sleep-when-idle.*CPU build"):
        VllmEngine(policy=WeightsPolicy(), sleep_level=2)
    with pytest.raises(ValueError, match="--sleep-level"):
        VllmEngine(policy=WeightsPolicy(), device="cuda:0", sleep_level=3)


def test_first_load_builds_then_the_same_weights_cost_nothing(engine, models):
    e = engine()
    first = e.load(str(models["a"]))
    assert first.bytes > 0 and len(FakeHost.started) == 1
    assert FakeHost.started[0].commands == ["build"] and FakeHost.started[0].module == vllm_module.HOST_MODULE
    assert e.load(str(models["a"])) == vllm_module.ALREADY_LIVE
    assert FakeHost.started[0].commands == ["build"] and e.weights_dir == str(models["a"])


def test_same_architecture_and_tokenizer_reload_in_place(engine, models):
    e = engine()
    states = []
    e.set_state_listener(states.append)
    e.load(str(models["a"]))
    load = e.load(str(models["b"]))
    host = FakeHost.started[0]
    assert len(FakeHost.started) == 1 and host.commands == ["build", "reload"]
    assert host.calls[1][1].path == str(models["b"]) and load.bytes > 0
    assert states == ["loading", "reloading"] and e.weights_dir == str(models["b"])


@pytest.mark.parametrize("other", ["wide", "retok"])
def test_another_architecture_or_tokenizer_closes_the_engine_process_and_builds_anew(engine, models, other):
    e = engine()
    e.load(str(models["a"]))
    e.load(str(models[other]))
    old, new = FakeHost.started
    assert old.closed and old.commands == ["build"] and new.commands == ["build"]
    assert e.host is new and e.weights_dir == str(models[other])


def test_a_failed_reload_rebuilds(engine, models):
    e = engine()
    e.load(str(models["a"]))
    FakeHost.started[0].fail["reload"] = HostError("StaleWeights: model.norm.weight")
    e.load(str(models["b"]))
    assert FakeHost.started[0].closed and len(FakeHost.started) == 2 and e.weights_dir == str(models["b"])


def test_a_directory_replaced_while_it_loads_is_loaded_again_and_named_by_its_new_content(engine, models, tmp_path):
    """A trainer republishing a step swaps the directory while the engine reads it: the engine may
    hold the new files under the content id it read first. It reads the id again after the load;
    a change means loading again, so the id it reports is the one its weights came from."""
    import shutil

    from protocol.weights_dir import weights_content_id

    served = models["root"] / "served"
    shutil.copytree(models["b"], served)
    e = engine()
    e.load(str(models["a"]))
    host = FakeHost.started[0]
    replaced = []
    real_call = host.call

    def republish_during_the_first_reload(command, *args):
        if command == "reload" and not replaced:  # the writer swaps in a new version mid-read
            replaced.append(weights_content_id(str(served)))
            fresh = tmp_path / "fresh"
            shutil.copytree(models["b"], fresh)
            os.rename(fresh, served.with_name("served.new"))
            shutil.rmtree(served)
            os.rename(served.with_name("served.new"), served)
        return real_call(command, *args)

    host.call = republish_during_the_first_reload
    load = e.load(str(served))
    assert host.commands == ["build", "reload", "reload"]
    assert e.weights_content_id == weights_content_id(str(served)) != replaced[0]
    assert load.bytes == 2 * e.weights.size_bytes


def test_a_reload_check_failed_by_a_directory_replaced_under_it_reloads_in_place_not_rebuilds(engine, models):
    """The engine process compares its tensors with the files after a reload; files swapped under
    it fail that check. The engine is sound (the files moved, not the engine): load again in
    place, never pay for a new engine."""
    import shutil

    served = models["root"] / "swapped"
    shutil.copytree(models["b"], served)
    e = engine()
    e.load(str(models["a"]))
    host = FakeHost.started[0]
    real_call = host.call

    def swap_and_fail_the_first_check(command, *args):
        if command == "reload" and host.commands.count("reload") == 0:
            config = served / "config.json"
            config.write_text(config.read_text() + " ")  # a new version of the directory
            host.calls.append((command, *args))
            raise HostError("StaleWeights: model.norm.weight: engine sum 1.0, file sum 2.0")
        return real_call(command, *args)

    host.call = swap_and_fail_the_first_check
    e.load(str(served))
    assert host.commands == ["build", "reload", "reload"] and len(FakeHost.started) == 1 and not host.closed


def test_what_a_failed_reload_left_is_never_taken_for_the_weights_it_had(engine, models):
    """The directory is removed while the engine reloads from it: the request fails cleanly, and
    the engine, holding neither the old weights nor the new, reloads for the next request even if
    it names the weights it had before."""
    import shutil

    from rollout_svc.errors import RequestFailed

    served = models["root"] / "vanishing"
    shutil.copytree(models["b"], served)
    e = engine()
    e.load(str(models["a"]))
    host = FakeHost.started[0]
    real_call = host.call

    def remove_and_fail(command, *args):
        if command == "reload":
            shutil.rmtree(served, ignore_errors=True)
            host.calls.append((command, *args))
            raise HostError("FileNotFoundError: model.safetensors")
        return real_call(command, *args)

    host.call = remove_and_fail
    with pytest.raises(RequestFailed) as failure:
        e.load(str(served))
    assert failure.value.code.value == "weights_not_found"
    host.call = real_call
    e.load(str(models["a"]))
    assert host.commands == ["build", "reload", "reload"] and e.weights_dir == str(models["a"])


def test_a_directory_replaced_at_every_load_fails_its_request_and_the_engine_serves_on(engine, models):
    from rollout_svc.errors import RequestFailed

    served = models["root"] / "churning"
    import shutil

    shutil.copytree(models["b"], served)
    e = engine()
    e.load(str(models["a"]))
    host = FakeHost.started[0]
    real_call = host.call

    def republish_every_time(command, *args):
        if command == "reload":
            config = served / "config.json"
            config.write_text(config.read_text() + " ")  # a new version: its content id changes
        return real_call(command, *args)

    host.call = republish_every_time
    with pytest.raises(RequestFailed, match="replaced each of the 3 times") as failure:
        e.load(str(served))
    assert failure.value.code.value == "weights_invalid" and host.commands == ["build"] + ["reload"] * 3
    host.call = real_call
    e.load(str(models["a"]))  # the engine still serves: back to weights that stand still
    assert host.commands[-1] == "reload" and e.weights_dir == str(models["a"])


def test_a_failed_build_leaves_no_process_and_no_weights(engine, models):
    e = engine()
    e.load(str(models["a"]))
    original = FakeHost.__init__

    def failing(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.fail["build"] = HostError("ValueError: no room on the device")

    FakeHost.__init__ = failing
    try:
        with pytest.raises(HostError, match="no room"):
            e.load(str(models["wide"]))
    finally:
        FakeHost.__init__ = original
    assert all(h.closed for h in FakeHost.started) and e.host is None and e.weights_dir is None


def test_an_engine_process_that_died_in_generate_is_closed_and_rebuilt_next_time(engine, models, make_request):
    e = engine()
    e.load(str(models["a"]))
    host = FakeHost.started[0]
    host.fail["generate"] = HostDied("engine process 1000 exited with -9")
    request = make_request(weights_dir=str(models["a"]))
    with pytest.raises(HostDied):
        e.generate([request])
    assert host.closed and e.weights_dir is None
    [completion] = e.generate([request])
    assert len(FakeHost.started) == 2 and completion.reload_bytes > 0


@pytest.mark.parametrize(
    "level, weights, wake_reloads, bytes_read",
    [(2, "a", True, True), (1, "a", False, False), (1, "b", True, True), (2, "b", True, True)],
)
def test_a_request_wakes_the_engine_reloading_only_what_the_sleep_discarded(
    engine, models, make_request, level, weights, wake_reloads, bytes_read
):
    e = engine(device="cuda:0", sleep_level=level)
    e.load(str(models["a"]))
    host = FakeHost.started[0]
    assert e.sleep() >= 0 and e.asleep and host.calls[-1] == ("sleep", level)
    assert e.sleep() == 0.0 and host.commands.count("sleep") == 1  # asleep already
    [completion] = e.generate([make_request(weights_dir=str(models[weights]))])
    command, woken, reload = host.calls[-2]
    assert (command, woken.path, reload) == ("wake", str(models[weights]), wake_reloads)
    assert host.calls[-1][0] == "generate" and not e.asleep and len(FakeHost.started) == 1
    assert (completion.reload_bytes > 0) == bytes_read and completion.reload_s > 0 and e.last_wake_s > 0


def test_an_asleep_engine_asked_for_another_architecture_is_rebuilt(engine, models):
    e = engine(device="cuda:0", sleep_level=2)
    e.load(str(models["a"]))
    e.sleep()
    e.load(str(models["wide"]))
    old, new = FakeHost.started
    assert old.closed and "wake" not in old.commands and new.commands == ["build"] and not e.asleep


def test_an_engine_without_sleep_mode_refuses_to_sleep(engine, models):
    e = engine()
    e.load(str(models["a"]))
    with pytest.raises(RuntimeError, match="--sleep-when-idle"):
        e.sleep()


def test_the_engine_process_logs_at_the_worker_level(engine, models):
    import logging

    logging.getLogger("rollout_svc").setLevel(logging.WARNING)
    try:
        engine().load(str(models["a"]))
    finally:
        logging.getLogger("rollout_svc").setLevel(logging.NOTSET)
    assert FakeHost.started[0].env["ROLLOUT_LOG_LEVEL"] == "WARNING"


@pytest.mark.parametrize("shape", [[151936, 1536], [8960, 1536], [1536], [64, 128], [3], [1 << 20]])
def test_the_reload_check_sums_row_blocks_spread_over_each_tensor(shape):
    """From the first rows to the last, never past the tensor, a bounded count of values; small
    tensors are summed whole."""
    from rollout_svc.engines.weight_check import PROBE_BLOCK_ELEMENTS, PROBE_BLOCKS, probe_blocks

    rows, per_row = shape[0], (shape[1] if len(shape) > 1 else 1)
    blocks = probe_blocks(shape)
    assert blocks[0][0] == 0 and blocks[-1][1] == rows
    assert all(0 <= a < b <= rows for a, b in blocks) and blocks == sorted(blocks)
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(blocks, blocks[1:], strict=False))  # no row summed twice
    if rows * per_row <= PROBE_BLOCKS * PROBE_BLOCK_ELEMENTS:
        assert blocks == [(0, rows)]
    else:
        assert len(blocks) == PROBE_BLOCKS
        assert all((b - a) * per_row <= PROBE_BLOCK_ELEMENTS for a, b in blocks)


def test_a_tokenizer_identical_to_the_live_one_is_not_loaded_again(engine, models, monkeypatch, tmp_path):
    """Each publish carries the same tokenizer files: checked once, when the engine took them.
    Other files are loaded and checked; a config whose vocabulary is smaller than the known
    tokenizer is still refused."""
    from rollout_svc.engines import tokenizer_check

    loads = []
    real = tokenizer_check.tokenizer_size
    monkeypatch.setattr(tokenizer_check, "tokenizer_size", lambda path: loads.append(path) or real(path))
    e = engine()
    e.load(str(models["a"]))
    e.load(str(models["b"]))
    assert loads == [os.path.realpath(models["a"])]
    e.load(str(models["retok"]))
    assert loads[-1] == os.path.realpath(models["retok"])
    small = models["root"] / "small-vocab"
    small.mkdir()
    for f in models["retok"].iterdir():
        (small / f.name).write_bytes(f.read_bytes())
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = e.tokenizer_size - 1
    (small / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="the tokenizer has .* tokens but the model's vocab_size"):
        e.load(str(small))
    assert len(loads) == 2


def test_each_prompt_of_a_seeded_request_has_a_seed_of_its_own():
    from rollout_svc.engines.vllm_requests import prompt_seed

    seeds = [prompt_seed(base, i) for base in (0, 1, 2, 7) for i in range(16)]
    assert seeds == [prompt_seed(base, i) for base in (0, 1, 2, 7) for i in range(16)]  # reproducible
    ordered = sorted(seeds)
    # vLLM seeds a prompt's n samples seed, seed + 1, ...: no two prompts' ranges may meet
    assert min(b - a for a, b in zip(ordered, ordered[1:], strict=False)) > 10**6
    assert all(0 <= s < 2**62 for s in seeds) and prompt_seed(None, 3) is None


def test_a_prompt_given_its_own_seed_samples_by_it_whatever_its_position(make_request):
    from rollout_svc.engines.vllm_requests import own_prompt_seed, prompt_seed, sampling_params

    alone = make_request(prompts=["x"], prompt_seeds=[41], seed=3)
    third = make_request(prompts=["a", "b", "x"], prompt_seeds=[7, 40, 41], seed=9)
    assert sampling_params(third, 2).seed == sampling_params(alone, 0).seed == own_prompt_seed(41)
    assert sampling_params(make_request(prompts=["a", "b"], seed=3), 1).seed == prompt_seed(3, 1)  # without them
    seeds = sorted(own_prompt_seed(s) for s in range(-8, 64))
    # adjacent own seeds are far apart too: vLLM seeds a prompt's samples seed, seed + 1, ...
    assert min(b - a for a, b in zip(seeds, seeds[1:], strict=False)) > 10**6
    assert all(0 <= s < 2**62 for s in seeds) and own_prompt_seed(2**63 - 1) < 2**62


class RecordingLLM:
    """The engine process's `LLM`, recording what a weight change asks of it; a load answers with
    the block sums `sums` gives (None: the sums of nothing)."""

    def __init__(self, sums=None):
        from types import SimpleNamespace

        self.calls: list[tuple] = []
        self.sums = sums
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype="float32"))

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append((method, *args))
        if method == "parameter_sizes":
            return [{}]  # nothing comparable, so the check has nothing to read
        return [self.sums(args[-1]) if self.sums else {}]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


@pytest.mark.parametrize("post_process", [True, False])
def test_a_reload_reads_the_weight_files_onto_the_device_itself(models, post_process):
    """Not vLLM's reload_weights from the directory (tensor by tensor through host memory: 0.21 s
    for 270 MB on an H200, against 0.08 s read straight onto the GPU); vLLM's post-load processing
    only where the engine needs it, and always after a wake (a deep sleep discarded buffers)."""
    from rollout_svc.engines.vllm_host import LiveEngine

    weights = WeightsPolicy([str(models["root"])]).inspect(str(models["b"]))
    files = [os.path.join(weights.real_path, shard) for shard in weights.shards]
    engine = LiveEngine()
    engine.llm, engine.post_process = RecordingLLM(), post_process
    engine.reload(weights)
    assert engine.llm.calls[1] == ("load_files", files, post_process, {}) and engine.weights is weights
    assert ("reset_prefix_cache",) in engine.llm.calls
    engine.llm = RecordingLLM()
    engine.wake(weights, reload=True)
    assert engine.llm.calls[:3] == [
        ("wake_up", ["weights"]),
        ("load_files", files, True, {}),
        ("wake_up", ["kv_cache"]),
    ]


def test_a_reload_and_its_check_are_one_call_into_the_engine_and_stale_sums_are_refused(models):
    """The engine sums its tensors' blocks in the load's own call (no call of its own for the check,
    which would wait behind a colocated trainer's kernels once more); sums that differ from the
    files' leave the engine holding no verified weights."""
    from safetensors import safe_open

    from rollout_svc.engines.vllm_host import LiveEngine
    from rollout_svc.engines.weight_check import StaleWeights

    weights = WeightsPolicy([str(models["root"])]).inspect(str(models["b"]))
    shapes = {}
    for shard in weights.shards:
        with safe_open(os.path.join(weights.real_path, shard), framework="pt") as f:
            shapes |= {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    engine = LiveEngine()
    engine.engine_shapes = shapes  # as asked at the engine's build
    engine.llm = RecordingLLM()
    source, blocks = engine._probe_plan(weights)
    right = engine._file_sums(source, blocks)
    assert blocks and right
    engine.llm = RecordingLLM(sums=lambda asked: {name: right[name] for name in asked})
    engine.reload(weights)
    assert engine.weights is weights
    assert [call[0] for call in engine.llm.calls] == ["load_files", "reset_prefix_cache"]
    assert engine.llm.calls[0][-1] == blocks
    stale = {name: value + 1.0 for name, value in right.items()}
    engine.llm = RecordingLLM(sums=lambda asked: {name: stale[name] for name in asked})
    with pytest.raises(StaleWeights):
        engine.reload(weights)
    assert engine.weights is None


@pytest.mark.parametrize(
    ("device", "quantization", "expected"),
    [("cpu", None, True), ("cuda:0", None, False), ("cuda:0", "fp8", True), ("cpu", "fp8", True)],
)
def test_only_cpu_or_quantized_weights_need_vllms_post_load_processing(device, quantization, expected):
    from rollout_svc.engines.vllm_host import needs_post_processing

    assert needs_post_processing(device, quantization) is expected


def test_vllm_detokenizes_per_token_only_for_stop_strings(make_request):
    """Texts are decoded once per sample at the end; with vLLM's per-token detokenizing (of the
    text and of each logprob's token) and a dict per position the engine call took 1.05 s on an
    H200 instead of 0.73-0.81 s. Stop strings are matched on text, so a request with them keeps it."""
    from rollout_svc.engines.vllm_requests import sampling_params

    plain = sampling_params(make_request(seed=5), 1)
    stopping = sampling_params(make_request(stop=["\n"]), 0)
    assert (plain.detokenize, plain.flat_logprobs, plain.logprobs) == (False, True, 0)
    assert stopping.detokenize is True and stopping.stop == ["\n"]
    assert sampling_params(make_request(logprobs=False), 0).logprobs is None


@pytest.mark.parametrize(
    ("device", "compile_", "eager", "expected"),
    [
        ("cuda:0", True, False, {}),
        ("cuda:0", False, False, {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}),
        ("cuda:0", False, True, {}),  # eager: no graphs to keep
        ("cpu", False, True, {}),
    ],
)
def test_compile_off_keeps_whole_step_cuda_graphs_for_decoding(device, compile_, eager, expected):
    from rollout_svc.engines.vllm import VllmEngine
    from rollout_svc.engines.vllm_host import compile_options
    from rollout_svc.weights import WeightsPolicy

    engine = VllmEngine(policy=WeightsPolicy([]), device=device, enforce_eager=eager, compile=compile_)
    assert compile_options(engine.spec) == expected


def test_the_worker_takes_no_compile_from_its_command_line(tmp_path, monkeypatch):
    """`rollout-svc serve --no-compile` reaches the vLLM engine's settings; without it, compile."""
    from typer.testing import CliRunner

    from rollout_svc import cli, engines

    seen = []

    def record(name, **options):
        seen.append(options)
        raise ValueError("recorded")  # the command stops here, as for settings an engine refuses

    monkeypatch.setattr(engines, "make_engine", record)
    for flags in (["--no-compile"], []):
        CliRunner().invoke(
            cli.app, ["serve", "--spool", str(tmp_path / "spool"), "--allowed-root", str(tmp_path), *flags]
        )
    assert [options["compile"] for options in seen] == [False, True]


def test_the_tokenizers_size_is_transformers_count_without_importing_transformers(models, tmp_path):
    """A fast tokenizer is counted by the `tokenizers` library, as transformers counts it (added
    tokens of tokenizer_config.json included); one that does not parse is a weights_invalid."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from rollout_svc.engines.tokenizer_check import tokenizer_size

    for name in ("a", "retok"):
        assert tokenizer_size(str(models[name])) == len(AutoTokenizer.from_pretrained(models[name])), name
    extra = tmp_path / "extra"
    extra.mkdir()
    for f in models["a"].iterdir():
        (extra / f.name).write_bytes(f.read_bytes())
    config = json.loads((extra / "tokenizer_config.json").read_text())
    config.setdefault("added_tokens_decoder", {})["150"] = {"content": "<extra>", "special": True}
    (extra / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_size(str(extra)) == len(AutoTokenizer.from_pretrained(extra)) == 101
    code = (
        "import sys; from rollout_svc.engines.tokenizer_check import tokenizer_size; "
        f"tokenizer_size({str(models['a'])!r}); print('transformers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_the_engines_description_says_when_it_runs_without_torch_compile():
    from rollout_svc.engines.vllm_host import describe

    graphs = {"enforce_eager": False, "cudagraph_mode": "CUDAGraphMode.FULL_DECODE_ONLY", "cuda_graphs": 51}
    assert describe(graphs | {"compilation_mode": "0"}) == "CUDA graphs FULL_DECODE_ONLY, 51 captured, no torch.compile"
    assert describe(graphs | {"compilation_mode": "3"}) == "CUDA graphs FULL_DECODE_ONLY, 51 captured"
    assert describe({"enforce_eager": True, "compilation_mode": "0"}) == "eager"


# -- each form resolved once per call -------------------------------------------------------------


@pytest.fixture
def manifest_reads(monkeypatch) -> list[str]:
    """The manifest.json files read (protocol.fsio's bounded reads), by resolved path."""
    import protocol.fsio

    seen: list[str] = []
    real = protocol.fsio._open_regular

    def recording(path):
        if os.path.basename(path) == "manifest.json":
            seen.append(os.path.realpath(path))
        return real(path)

    monkeypatch.setattr(protocol.fsio, "_open_regular", recording)
    return seen


def publish_adapter(path, base_content_id: str, content_id: str, base_model: str | None = None):
    """A LoRA adapter directory as the trainer publishes it (PEFT's two files, the manifest last)."""
    import torch
    from safetensors.torch import save_file

    from protocol.weights_dir import MANIFEST, Adapter, Manifest, encode_manifest

    path.mkdir()
    save_file({"lora_A.weight": torch.ones(4, 8)}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    adapter = Adapter(base_content_id=base_content_id, rank=4, alpha=8.0, target_modules=["q_proj"])
    manifest = Manifest(step=1, content_id=content_id, base_model=base_model, adapter=adapter)
    (path / MANIFEST).write_bytes(encode_manifest(manifest))
    return path


def test_an_engine_call_resolves_its_weights_once_and_reads_their_manifest_once_more_after_a_load(
    engine, models, make_request, manifest_reads, monkeypatch
):
    """Resolved once per call; the manifest read again only after a load, to see that the
    directory was not replaced meanwhile."""
    from rollout_svc import weight_forms

    resolved = []
    real = weight_forms.resolve
    monkeypatch.setattr(vllm_module, "resolve", lambda policy, path: resolved.append(path) or real(policy, path))
    e = engine()
    own = os.path.realpath(models["a"] / "manifest.json")
    e.generate([make_request(weights_dir=str(models["a"]))])
    assert resolved == [str(models["a"])] and manifest_reads == [own, own]
    resolved.clear(), manifest_reads.clear()
    [completion] = e.generate([make_request(weights_dir=str(models["a"]))])
    assert resolved == [str(models["a"])] and manifest_reads == [own] and completion.reload_bytes == 0


def test_an_adapter_is_served_on_the_live_base_from_one_read_of_its_manifest(
    engine, models, make_request, manifest_reads, tmp_path
):
    e = engine(max_lora_rank=8)
    e.load(str(models["a"]))
    base_id = e.weights.content_id
    path = publish_adapter(models["root"] / "adapter-1", base_id, "adapter-1")
    own = os.path.realpath(path / "manifest.json")
    manifest_reads.clear()
    e.generate([make_request(weights_dir=str(path))])
    # Resolved, then read again after the copy (the copy is of the version checked); the base is live.
    assert manifest_reads == [own, own]
    host = FakeHost.started[0]
    assert host.commands == ["build", "add_adapter", "generate"] and host.calls[-1][2].content_id == "adapter-1"
    assert (e.weights_dir, e.weights_content_id) == (str(path), "adapter-1")
    manifest_reads.clear()
    e.generate([make_request(weights_dir=str(path))])
    assert manifest_reads == [own]  # its copy held: nothing read again
    other = publish_adapter(models["root"] / "adapter-b", "another-base", "adapter-b", base_model=str(models["b"]))
    with pytest.raises(RequestFailed) as refused:
        e.generate([make_request(weights_dir=str(other))])
    assert refused.value.code == ErrorCode.ADAPTER_REFUSED and f"serves {models['a']}" in refused.value.message


def test_a_fresh_engine_loads_the_base_an_adapter_names_and_a_held_copy_never_skips_the_roots(
    engine, models, make_request, tmp_path
):
    from rollout_svc.weight_forms import resolve

    base_id = resolve(WeightsPolicy(), str(models["a"])).content_id
    path = publish_adapter(models["root"] / "adapter-2", base_id, "adapter-2", base_model=str(models["a"]))
    e = engine(max_lora_rank=8)
    [completion] = e.generate([make_request(weights_dir=str(path))])
    assert e.weights.path == str(models["a"]) and completion.reload_bytes > 0
    # The adapter's weights replaced by a link out of the roots: refused, its copy held or not.
    outside = tmp_path / "elsewhere.safetensors"
    os.rename(path / "adapter_model.safetensors", outside)
    os.symlink(outside, path / "adapter_model.safetensors")
    with pytest.raises(RequestFailed) as refused:
        e.generate([make_request(weights_dir=str(path))])
    assert refused.value.code == ErrorCode.WEIGHTS_NOT_ALLOWED


def test_an_adapter_is_not_weights_to_load_alone(engine, models):
    path = publish_adapter(models["root"] / "adapter-3", "base", "adapter-3", base_model="/models/base")
    with pytest.raises(RequestFailed) as refused:
        engine().load(str(path))
    assert refused.value.code == ErrorCode.WEIGHTS_INVALID and "is a LoRA adapter" in refused.value.message
