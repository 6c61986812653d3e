"""weights_writer: HF-layout safetensors written by us, byte for byte what save_pretrained writes,
atomic under SIGKILL, refusing bad input with the previous directory intact, and the FSDP2 path
on two gloo ranks. The pinned-buffer path of CUDA tensors is the GPU tier's
(tests/gpu/test_weights_writer_gpu.py).

Run as a script, this file is also the child process of the kill, file-size and FSDP tests."""

from __future__ import annotations

import filecmp
import json
import os
import random
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import crc32c
import pytest
import torch

HERE = Path(__file__).parent
TESTS = HERE.parent
sys.path.insert(0, str(HERE))
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))  # helpers shared with the GPU tier (hf_weights)
torch.set_num_threads(1)

from hf_weights import assert_bit_equal, build_llama, load_model, read_all  # noqa: E402
from manifest_check import WeightsCorrupt, verify  # noqa: E402

from protocol.weights_dir import MANIFEST, FileEntry  # noqa: E402
from trainer_svc.distributed import Distributed  # noqa: E402
from trainer_svc.weights.writer import (  # noqa: E402
    TensorSpec,
    TensorStream,
    iter_full_tensors,
    omitted_names,
    write_weights_dir,
)

CPU = Distributed(0, 1, torch.device("cpu"))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    return build_llama(tmp_path_factory.mktemp("tied") / "model")


def test_single_file_is_save_pretrained_byte_for_byte(tiny_model, tmp_path):
    model = load_model(tiny_model)
    model.save_pretrained(tmp_path / "hf")
    out = tmp_path / "out"
    written = write_weights_dir(out, model.state_dict(), base_model=tiny_model, step=7, content_id="run-step_7-ab")

    assert filecmp.cmp(out / "model.safetensors", tmp_path / "hf" / "model.safetensors", shallow=False)
    assert_bit_equal(read_all(out), model.state_dict())
    assert_bit_equal(load_model(out).state_dict(), model.state_dict())
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_model / name).read_bytes(), name
    manifest = verify(out, checksums=True)
    assert (manifest.step, manifest.content_id, manifest.dtype) == (7, "run-step_7-ab", "float32")
    assert set(manifest.files) == {p.name for p in out.iterdir()} - {MANIFEST}
    for name, entry in manifest.files.items():
        data = (out / name).read_bytes()
        assert entry == FileEntry(size=len(data), crc32c=f"{crc32c.crc32c(data):08x}")
    assert written.bytes == sum(entry.size for entry in manifest.files.values())
    assert sorted(os.listdir(tmp_path)) == ["hf", "out"]  # no staging left behind


def test_shards_and_index_are_save_pretrained_byte_for_byte(tiny_model, tmp_path):
    model = load_model(tiny_model)
    model.save_pretrained(tmp_path / "hf", max_shard_size=400_000)
    out = tmp_path / "out"
    write_weights_dir(out, model.state_dict(), base_model=tiny_model, step=1, content_id="c", max_shard_bytes=400_000)

    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    for name in [*shards, "model.safetensors.index.json"]:
        assert filecmp.cmp(out / name, tmp_path / "hf" / name, shallow=False), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert_bit_equal(load_model(out).state_dict(), model.state_dict())
    verify(out, checksums=True)


@pytest.mark.parametrize("chunk_bytes", [4096, 65536])
def test_chunks_and_cast_give_the_same_bytes(tiny_model, tmp_path, chunk_bytes):
    """Small chunks split tensors across chunks and pack several tensors into one; the output
    must not depend on it. Casting chunk by chunk equals casting each whole tensor."""
    state = load_model(tiny_model).state_dict()
    for dtype in (torch.float32, torch.bfloat16):
        big = tmp_path / f"big-{dtype}"
        small = tmp_path / f"small-{dtype}"
        write_weights_dir(big, state, base_model=tiny_model, step=1, content_id="a", dtype=dtype)
        write_weights_dir(
            small,
            state,
            base_model=tiny_model,
            step=1,
            content_id="b",
            dtype=dtype,
            chunk_bytes=chunk_bytes,
            max_shard_bytes=300_000,
        )
        assert_bit_equal(read_all(small), {k: v.to(dtype) for k, v in state.items()})
        assert_bit_equal(read_all(big), read_all(small))
        verify(small, checksums=True)


def test_several_writer_threads_give_the_same_bytes(tiny_model, tmp_path, monkeypatch):
    """Four threads writing 4 KiB chunks at their offsets, out of order, write the same file
    and the same checksum as one thread."""
    import trainer_svc.weights.streaming as stream

    state = load_model(tiny_model).state_dict()
    one = tmp_path / "one"
    write_weights_dir(one, state, base_model=tiny_model, step=1, content_id="a", dtype=torch.bfloat16)
    monkeypatch.setattr(stream, "writer_threads", lambda: 4)
    monkeypatch.setattr(stream, "_pools", {})
    monkeypatch.setattr(stream.Buffers, "_cache", {})
    many = tmp_path / "many"
    write_weights_dir(
        many, state, base_model=tiny_model, step=1, content_id="a", dtype=torch.bfloat16, chunk_bytes=4096
    )
    # One file being filled plus one buffer per writer thread, kept for the next write.
    assert stream._writers()._max_workers == 4 and len(stream.Buffers._cache[(4096, False)]) == 5
    assert (many / "model.safetensors").read_bytes() == (one / "model.safetensors").read_bytes()
    assert verify(many, checksums=True).files["model.safetensors"] == verify(one).files["model.safetensors"]


def test_spread_shards_one_per_writer_thread_written_side_by_side(tiny_model, tmp_path, monkeypatch):
    """max_shard_bytes=None: one shard per writer thread, filled side by side, each file the
    bytes save_pretrained writes for that split."""
    import trainer_svc.weights.writer as writer

    model = load_model(tiny_model)
    total = sum(v.numel() * v.element_size() for k, v in model.state_dict().items() if k not in omitted_names(model))
    monkeypatch.setattr(writer, "writer_threads", lambda: 3)
    monkeypatch.setattr(writer, "MIN_SPREAD_SHARD_BYTES", 1)
    out = tmp_path / "spread"
    write_weights_dir(
        out, model.state_dict(), base_model=tiny_model, step=1, content_id="c", max_shard_bytes=None,
        omit=omitted_names(model), chunk_bytes=4096,
    )  # fmt: skip
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3
    reference = tmp_path / "reference"
    model.save_pretrained(reference, max_shard_size=-(-total // 3))
    for name in shards + ["model.safetensors.index.json"]:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    verify(out, checksums=True)


def test_a_manifest_with_zlib_crc32_is_still_verified(tiny_model, tmp_path):
    """Directories written before crc32c carry zlib's crc32: verify checks them with it."""
    out = tmp_path / "out"
    write_weights_dir(out, load_model(tiny_model).state_dict(), base_model=tiny_model, step=1, content_id="c")
    manifest = json.loads((out / MANIFEST).read_bytes())
    manifest["checksum"] = "crc32"
    manifest["files"] = {
        name: {"size": e["size"], "crc32": f"{zlib.crc32((out / name).read_bytes()):08x}"}
        for name, e in manifest["files"].items()
    }
    (out / MANIFEST).write_text(json.dumps(manifest))
    verify(out, checksums=True)
    shard = out / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightsCorrupt, match="does not match its crc32 "):
        verify(out, checksums=True)


def test_tied_weights_are_left_out_as_save_pretrained_does(tied_model, tmp_path):
    model = load_model(tied_model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert omitted_names(model) == {"lm_head.weight"}
    model.save_pretrained(tmp_path / "hf")
    from_dict = tmp_path / "dict"
    from_stream = tmp_path / "stream"
    write_weights_dir(from_dict, model.state_dict(), base_model=tied_model, step=1, content_id="a")
    write_weights_dir(from_stream, iter_full_tensors(model, CPU), base_model=tied_model, step=1, content_id="b")
    for out in (from_dict, from_stream):
        assert filecmp.cmp(out / "model.safetensors", tmp_path / "hf" / "model.safetensors", shallow=False)
        assert "lm_head.weight" not in read_all(out)
        reloaded = load_model(out)
        assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
        assert_bit_equal(reloaded.state_dict(), model.state_dict())


def test_stream_of_a_single_process_model(tiny_model, tmp_path):
    model = load_model(tiny_model)
    stream = iter_full_tensors(model, CPU)
    assert not stream.collective
    assert [spec.name for spec in stream.specs] == list(model.state_dict())
    out = tmp_path / "out"
    write_weights_dir(out, stream, base_model=tiny_model, step=3, content_id="c", chunk_bytes=8192)
    assert_bit_equal(read_all(out), model.state_dict())
    pairs = tmp_path / "pairs"  # a plain iterator of (name, tensor) is taken too
    write_weights_dir(pairs, iter(model.state_dict().items()), base_model=tiny_model, step=3, content_id="p")
    assert filecmp.cmp(out / "model.safetensors", pairs / "model.safetensors", shallow=False)
    with pytest.raises(TypeError, match="pairs or a TensorStream"):
        write_weights_dir(tmp_path / "bad", [torch.ones(2)], base_model=tiny_model, step=3, content_id="b")


def test_rewrite_replaces_the_directory_in_place(tiny_model, tmp_path):
    state = load_model(tiny_model).state_dict()
    out = tmp_path / "out"
    write_weights_dir(out, state, base_model=tiny_model, step=1, content_id="first")
    doubled = {k: v * 2 for k, v in state.items()}
    write_weights_dir(out, doubled, base_model=tiny_model, step=2, content_id="second")
    assert verify(out, checksums=True).content_id == "second"
    assert_bit_equal(read_all(out), doubled)
    assert os.listdir(tmp_path) == ["out"]


def test_verify_finds_truncation_corruption_and_strays(tiny_model, tmp_path):
    out = tmp_path / "out"
    write_weights_dir(out, load_model(tiny_model).state_dict(), base_model=tiny_model, step=1, content_id="c")
    shard = out / "model.safetensors"
    data = bytearray(shard.read_bytes())

    data[len(data) // 2] ^= 0x01  # same size, one bit off
    shard.write_bytes(bytes(data))
    verify(out)  # sizes only: cheap, and blind to this
    with pytest.raises(WeightsCorrupt, match="crc32"):
        verify(out, checksums=True)

    shard.write_bytes(bytes(data[:-1]))
    with pytest.raises(WeightsCorrupt, match="model.safetensors has .* bytes"):
        verify(out)

    shard.write_bytes(bytes(data))
    (out / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(WeightsCorrupt, match="extra.safetensors not in"):
        verify(out)

    (out / MANIFEST).unlink()
    with pytest.raises(WeightsCorrupt, match="no readable manifest"):
        verify(out)


def previous(tiny_model: Path, out: Path) -> dict:
    write_weights_dir(out, load_model(tiny_model).state_dict(), base_model=tiny_model, step=1, content_id="old")
    return {p.name: p.read_bytes() for p in out.iterdir()}


def assert_untouched(out: Path, before: dict) -> None:
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert os.listdir(out.parent) == [out.name]  # the staging directory is gone


@pytest.mark.parametrize("case", ["non_contiguous", "integer", "meta"])
def test_bad_tensor_is_refused_with_its_name_before_writing(tiny_model, tmp_path, case):
    out = tmp_path / "out"
    before = previous(tiny_model, out)
    state = dict(load_model(tiny_model).state_dict())
    bad = state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.1.mlp.up_proj.weight"] = {
        "non_contiguous": bad.t(),
        "integer": bad.to(torch.int32),
        "meta": bad.to("meta"),
    }[case]
    expected = {
        "non_contiguous": r"not contiguous.*tensor.contiguous\(\)",
        "integer": "floating-point",
        "meta": "meta device",
    }[case]
    with pytest.raises(ValueError, match=f"'model.layers.1.mlp.up_proj.weight'.*{expected}"):
        write_weights_dir(out, state, base_model=tiny_model, step=2, content_id="new")
    assert_untouched(out, before)


def test_bad_tensor_in_a_stream_stops_the_write_mid_way(tiny_model, tmp_path):
    """A stream's tensors are only seen as they arrive: the write stops there, nothing is published."""
    out = tmp_path / "out"
    before = previous(tiny_model, out)
    state = load_model(tiny_model).state_dict()
    specs = [TensorSpec(k, tuple(v.shape), v.dtype, v.device) for k, v in state.items()]
    bad = "model.layers.1.mlp.up_proj.weight"  # half-way through the file
    arrived = []

    def fetch(names):
        for name in names:
            arrived.append(name)
            # same shape and values, column-major: not contiguous
            yield name, (state[name].t().contiguous().t() if name == bad else state[name])

    with pytest.raises(ValueError, match=f"'{bad}' is not contiguous"):
        write_weights_dir(out, TensorStream(specs, fetch), base_model=tiny_model, step=2, content_id="new")
    assert 1 < len(arrived) < len(state)
    assert_untouched(out, before)


def test_base_model_without_config_is_refused(tiny_model, tmp_path):
    out = tmp_path / "out"
    before = previous(tiny_model, out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        write_weights_dir(out, {"w": torch.ones(2)}, base_model=tmp_path / "empty", step=2, content_id="new")
    (tmp_path / "empty").rmdir()
    assert_untouched(out, before)


def test_full_disk_names_the_tensor_and_keeps_the_previous_directory(tiny_model, tmp_path, monkeypatch):
    """ENOSPC part-way through a shard (os.pwrite fails once 600 kB are out)."""
    import errno

    out = tmp_path / "out"
    before = previous(tiny_model, out)
    real_pwrite = os.pwrite
    budget = {"left": 600_000}

    def pwrite(fd, data, offset):
        if budget["left"] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_pwrite(fd, data[: budget["left"]], offset)
        budget["left"] -= n
        return n

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError, match=r"model.safetensors failed: No space left on device\. .*free space") as info:
        write_weights_dir(
            out, load_model(tiny_model).state_dict(), base_model=tiny_model, step=2, content_id="n", chunk_bytes=65536
        )
    assert info.value.errno == errno.ENOSPC
    assert "tensor 'model." in str(info.value)
    monkeypatch.undo()
    assert_untouched(out, before)


def test_file_size_limit_in_a_child_process(tiny_model, tmp_path):
    """A real EFBIG: RLIMIT_FSIZE below the shard's size, SIGXFSZ ignored, in a child process."""
    out = tmp_path / "out"
    before = previous(tiny_model, out)
    child = subprocess.run(
        [sys.executable, __file__, "fsize", str(out), str(tiny_model), "700000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 3, child.stdout + child.stderr
    assert "File too large" in child.stdout and "tensor 'model." in child.stdout, child.stdout
    assert_untouched(out, before)


def expected_state(step: int) -> dict[str, torch.Tensor]:
    """What the kill test's child writes at `step`: different values every step, two shards."""
    g = torch.Generator().manual_seed(step)
    return {f"layer.{i}.weight": torch.randn(256, 1024, generator=g) for i in range(4)}


@pytest.mark.timeout(500)
def test_sigkill_at_random_points_leaves_old_or_new_directory(tiny_model, tmp_path):
    """A child rewrites one directory again and again (each write replaces the last); it is
    SIGKILLed at random delays. After every kill the directory is complete and verifies, and is
    the last write the child reported or the one after; anything else is a hidden .partial sibling."""
    out = tmp_path / "weights" / "current"
    rng = random.Random(1234)
    leftovers_seen = 0
    for kill in range(12):
        start = verify(out).step if out.exists() else 0
        child = subprocess.Popen(
            [sys.executable, __file__, "rewrite", str(out), str(tiny_model)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout.readline().strip() == "ready"
        try:
            child.wait(timeout=rng.uniform(0.0, 0.6))
        except subprocess.TimeoutExpired:
            pass
        child.send_signal(signal.SIGKILL)
        reported = [int(line) for line in child.stdout.read().split()]
        child.wait()
        last = reported[-1] if reported else start
        manifest = verify(out, checksums=True)
        assert manifest.step in (last, last + 1), (kill, manifest.step, last)
        assert_bit_equal(read_all(out), expected_state(manifest.step))
        siblings = set(os.listdir(out.parent)) - {out.name}
        assert all(name.startswith(f".{out.name}.") and name.endswith(".partial") for name in siblings), siblings
        leftovers_seen += len(siblings)
    # the next write clears what dead writers left
    write_weights_dir(out, expected_state(0), base_model=tiny_model, step=0, content_id="final")
    assert os.listdir(out.parent) == [out.name]
    print(f"{leftovers_seen} leftovers seen after 12 kills")


@pytest.mark.timeout(400)
def test_fsdp_two_ranks_write_what_one_process_writes(tied_model, tmp_path):
    """Each parameter gathered with full_tensor() and written by rank 0; tied weights too. A failure
    on rank 0 (a base model without config.json) is raised on both ranks, and they stay in step.
    Two CPU ranks over gloo; two GPUs over NCCL where the machine has them."""
    untied = build_llama(tmp_path / "untied-base", tied=False)
    env = dict(os.environ)
    if torch.cuda.device_count() < 2:
        env["CUDA_VISIBLE_DEVICES"] = ""  # one GPU cannot hold two ranks: both on the CPU
    run = subprocess.run(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc_per_node=2",
            __file__,
            "fsdp",
            str(tmp_path),
            str(tied_model),
            str(untied),
        ],
        capture_output=True,
        text=True,
        timeout=360,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    outcome = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(o["rank"] for o in outcome) == [0, 1]
    for o in outcome:
        assert "no config.json" in o["error"], o
    for name, base in (("tied", tied_model), ("untied", untied)):
        model = load_model(base)
        model.save_pretrained(tmp_path / f"hf-{name}")
        out = tmp_path / name
        verify(out, checksums=True)
        assert filecmp.cmp(out / "model.safetensors", tmp_path / f"hf-{name}" / "model.safetensors", shallow=False)
        assert_bit_equal(load_model(out).state_dict(), model.state_dict())


# --- child processes ---------------------------------------------------------------------------


def _child_fsize(out: str, base: str, limit: str) -> int:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write() instead of death by signal
    state = load_model(Path(base)).state_dict()
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    try:
        write_weights_dir(Path(out), state, base_model=Path(base), step=2, content_id="new")
    except OSError as exc:
        print(exc)
        return 3
    return 0


def _child_rewrite(out: str, base: str) -> int:
    dest = Path(out)
    step = verify(dest).step if dest.exists() else 0
    print("ready", flush=True)
    while True:
        step += 1
        # small chunks and two shards: many write calls, so kills land everywhere
        write_weights_dir(
            dest,
            expected_state(step),
            base_model=Path(base),
            step=step,
            content_id=f"s{step}",
            chunk_bytes=256 * 1024,
            max_shard_bytes=2 * 2**20,
        )
        print(step, flush=True)


def _child_fsdp(root: str, tied: str, untied: str) -> int:
    import torch.distributed as dist

    from trainer_svc.distributed import init_distributed
    from trainer_svc.learning.model import shard

    dist_info = init_distributed()
    for name, base in (("tied", tied), ("untied", untied)):
        model = load_model(Path(base)).to(dist_info.device)
        shard(model)
        stream = iter_full_tensors(model, dist_info)
        assert stream.collective
        if name == "tied":
            try:
                write_weights_dir(
                    Path(root) / "never",
                    stream,
                    base_model=Path(root) / "nowhere",
                    step=1,
                    content_id="x",
                    dist_info=dist_info,
                )
            except (FileNotFoundError, RuntimeError) as exc:
                # a file per rank: two ranks printing at once can share one line of the common stdout
                said = {"rank": dist_info.rank, "error": str(exc)}
                (Path(root) / f"rank{dist_info.rank}.json").write_text(json.dumps(said))
            stream = iter_full_tensors(model, dist_info)
        # float32 on GPUs too, so the files equal the float32 save_pretrained's
        written = write_weights_dir(
            Path(root) / name,
            stream,
            base_model=Path(base),
            step=1,
            content_id=name,
            dist_info=dist_info,
            chunk_bytes=16384,
            dtype=torch.float32,
        )
        assert (written is not None) == dist_info.is_main
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter finalization: on a loaded machine torch's gloo threads sometimes
    # abort the process there (SIGABRT, "terminate called without an active exception") after
    # DTensor gathers, with or without the writer; the work above is complete and flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    children = {"fsize": _child_fsize, "rewrite": _child_rewrite, "fsdp": _child_fsdp}
    sys.exit(children[sys.argv[1]](*sys.argv[2:]))
