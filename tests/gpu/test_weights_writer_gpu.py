"""weights_writer on a GPU: CUDA tensors cast to bf16 on the device and streamed through two pinned
host buffers, byte for byte what save_pretrained writes of the bf16 model, and a writer that waits
for the device's copies before writing a buffer. The CPU paths are tests/trainer/test_weights_writer.py.

This tier runs in the rollout venv (`make test-gpu`), which holds torch, transformers and
safetensors but not trainer_svc: the writer is imported from its source tree there.
"""

from __future__ import annotations

import filecmp
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent.parent
for path in (TESTS, TESTS.parent / "trainer_svc" / "src"):
    if str(path) not in sys.path:
        sys.path.append(str(path))  # hf_weights, shared with the trainer tier; trainer_svc where not installed

from hf_weights import assert_bit_equal, build_llama, load_model, read_all  # noqa: E402
from manifest_check import verify  # noqa: E402

from trainer_svc.distributed import Distributed  # noqa: E402
from trainer_svc.weights.writer import (  # noqa: E402
    TensorSpec,
    TensorStream,
    iter_full_tensors,
    write_weights_dir,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("chunk_bytes", [4096, 2**20, 64 * 2**20])
def test_cuda_tensors_stream_through_pinned_buffers(tmp_path, chunk_bytes):
    """CUDA tensors are cast to bf16 on the device and copied through two pinned buffers in turn:
    the bytes equal save_pretrained's of the bf16 model, whatever the chunk size; float32 stays exact."""
    base = build_llama(tmp_path / "base")
    model = load_model(base).to("cuda")
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.randn(64))  # not all ones: a misplaced chunk shows
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    model.to(torch.float32)
    out = tmp_path / "bf16"
    write_weights_dir(
        out,
        iter_full_tensors(model, Distributed(0, 1, torch.device("cuda", 0))),
        base_model=base,
        step=1,
        content_id="c",
        chunk_bytes=chunk_bytes,
    )
    assert verify(out, checksums=True).dtype == "bfloat16"
    assert filecmp.cmp(out / "model.safetensors", tmp_path / "hf" / "model.safetensors", shallow=False)

    big = {"a.weight": torch.randn(3_000_001, device="cuda"), "b.weight": torch.randn(17, 5, device="cuda")}
    write_weights_dir(
        tmp_path / "f32",
        big,
        base_model=base,
        step=1,
        content_id="c",
        dtype=torch.float32,
        chunk_bytes=chunk_bytes,
        max_shard_bytes=8 * 2**20,
    )
    assert_bit_equal(read_all(tmp_path / "f32"), {k: v.cpu() for k, v in big.items()})
    verify(tmp_path / "f32", checksums=True)


def test_cuda_writer_waits_for_the_device(tmp_path):
    """Each tensor is produced by kernels queued behind a ~50 ms sleep on the GPU, and the cast
    and copies queue behind them: the writer must wait for every buffer's copies before writing it."""
    base = build_llama(tmp_path / "base")
    sizes = {"a.weight": 3 * 16384 + 5, "b.weight": 7, "c.weight": 2 * 16384}  # spans 1 to 4 chunks of 64 KiB
    produced = {}

    def fetch(names):
        for name in names:
            torch.cuda._sleep(100_000_000)
            produced[name] = torch.arange(sizes[name], device="cuda", dtype=torch.float32) * 1.5 + len(name)
            yield name, produced[name]

    specs = [TensorSpec(n, (size,), torch.float32, torch.device("cuda", 0)) for n, size in sizes.items()]
    for dtype in (torch.float32, torch.bfloat16):
        out = tmp_path / str(dtype)
        write_weights_dir(
            out, TensorStream(specs, fetch), base_model=base, step=1, content_id="c", dtype=dtype, chunk_bytes=65536
        )
        assert_bit_equal(read_all(out), {k: v.to(dtype).cpu() for k, v in produced.items()})
