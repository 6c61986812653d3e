"""Weight slots on a GPU: the writer's mapping pinned with cudaHostRegister and filled by
device-to-host copies, the reader's pinned too, its one host-to-device copy checked on the device,
and a vLLM engine on the GPU loading a slot into the same weights as the directory publish's. The
CPU paths are tests/trainer/test_slot_publish.py and tests/e2e/test_vllm_worker.py.

Runs in the rollout venv (`make test-gpu`); trainer_svc is imported from its source tree.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent.parent
for path in (TESTS, TESTS.parent / "trainer_svc" / "src"):
    if str(path) not in sys.path:
        sys.path.append(str(path))

from protocol.weight_slots import SLOT_DATA, combine_sums, read_slot_manifest, word_sum  # noqa: E402
from rollout_svc import slot_load  # noqa: E402
from trainer_svc.weights.slots import SlotRing  # noqa: E402
from trainer_svc.weights.writer import as_stream  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def shm_path():
    """A directory on /dev/shm, the slots' default home (publish.slots_dir): many kernels refuse to
    pin a writable file mapping on a disk filesystem, where pytest's tmp_path may be."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="slots-gpu-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(4099, 64, device="cuda", generator=g),
        "model.norm.weight": torch.randn(65, device="cuda", generator=g),  # 130 bf16 bytes: a partial word
    }


def base(tmp_path: Path) -> Path:
    path = tmp_path / "base"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}\n')
    return path


def test_the_writer_pins_its_slot_and_fills_it_from_the_device(shm_path):
    tmp_path = shm_path
    ring = SlotRing(tmp_path / "ring", 2, spool_dir=None, wait_s=0)
    source = tensors()
    slot = ring.write(ring.choose(), 1, "c1", as_stream(source), torch.bfloat16, base(tmp_path)).path
    assert ring._maps[slot].pinned, "cudaHostRegister failed: see the warning logged"
    torch.zeros(1, device="cuda")  # no error of the registration is left for a later launch to report
    manifest = read_slot_manifest(slot)
    data = (slot / SLOT_DATA).read_bytes()[: manifest.bytes]
    assert combine_sums([word_sum(data)]) == manifest.checksum  # the device's sums are the bytes'
    for name, entry in manifest.tensors.items():
        got = torch.frombuffer(bytearray(data[entry.offset : entry.offset + entry.nbytes]), dtype=torch.bfloat16)
        assert torch.equal(got.view(entry.shape), source[name].to(torch.bfloat16).cpu()), name


def test_the_reader_pins_copies_once_and_checks_on_the_device(shm_path):
    tmp_path = shm_path
    ring = SlotRing(tmp_path / "ring", 2, spool_dir=None, wait_s=0)
    source = tensors()
    slot = ring.write(ring.choose(), 1, "c1", as_stream(source), torch.bfloat16, base(tmp_path)).path
    manifest = read_slot_manifest(slot)
    mapped = slot_load.MappedSlot(str(slot), pin=True)
    assert mapped.pinned
    data = slot_load.copy_to_device(mapped, manifest, torch.device("cuda", 0))
    slot_load.check(data, manifest, str(slot))
    for name, tensor in slot_load.tensors(data, manifest):
        assert tensor.is_cuda and torch.equal(tensor, source[name].to(torch.bfloat16)), name
    # A changed byte is caught by the device's sum, before anything is loaded.
    with open(slot / SLOT_DATA, "r+b") as f:
        f.seek(manifest.tensors["model.norm.weight"].offset)
        f.write(b"\x7f")
    with pytest.raises(slot_load.SlotChecksumMismatch):
        slot_load.check(slot_load.copy_to_device(mapped, manifest, torch.device("cuda", 0)), manifest, str(slot))
    mapped.close()


def test_an_engine_on_the_gpu_loads_a_slot_as_it_loads_the_directory(models, tmp_path):
    from safetensors.torch import load_file

    from rollout_svc.engines.vllm import VllmEngine
    from rollout_svc.engines.weight_check import probe_blocks
    from rollout_svc.weights import WeightsPolicy

    weights = {k: v.cuda() for k, v in load_file(models["b"] / "model.safetensors").items()}
    ring = SlotRing(tmp_path / "ring", 2, spool_dir=None, wait_s=0)
    slot = ring.write(ring.choose(), 1, "slot-b", as_stream(weights), torch.bfloat16, models["b"]).path
    engine = VllmEngine(policy=WeightsPolicy([str(models["root"]), str(tmp_path)]), device="cuda:0",
                        gpu_memory_utilization=0.3)  # fmt: skip
    try:
        engine.ensure_weights(str(models["b"]))
        shapes = engine.probe("parameter_sizes")
        blocks = {name: probe_blocks(shape) for name, shape in shapes.items()}
        from_directory = engine.probe("parameter_sums", blocks)
        engine.ensure_weights(str(models["a"]))  # other weights in between
        assert engine.ensure_weights(str(slot), "slot-b") > 0
        assert engine.probe("parameter_sums", blocks) == from_directory
    finally:
        engine.close()
