"""`--allowed-root` holds for every file a worker reads, not only for the weights directory: a
real vLLM worker gets weights directories under its root whose shard, config or tokenizer file
is a symlink to a file outside. Each is refused with `weights_not_allowed` before anything reads
it, and the worker serves on (the next request, for clean weights, is served by the same
process)."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import poll, start_worker, stop_worker, wait_for_status

from protocol import exit_codes
from protocol.messages import Request
from protocol.spool import Spool

pytestmark = pytest.mark.timeout(600)

LINKED = ("model.safetensors", "config.json", "tokenizer.json")


def request(request_id: str, weights_dir) -> Request:
    return Request(
        request_id=request_id, weights_dir=str(weights_dir), prompts=["1+1="], n_samples_per_prompt=1,
        max_tokens=4, temperature=0.0,
    )  # fmt: skip


def test_a_file_linked_outside_the_roots_is_refused_and_the_worker_serves_on(tmp_path, models, client_for):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    clean_weights = shutil.copytree(models["a"], root / "clean")
    linked_dirs = {}
    for name in LINKED:
        weights = shutil.copytree(models["a"], root / f"linked-{name}")
        target = outside / f"{weights.name}-{name}"
        os.rename(weights / name, target)
        os.symlink(target, weights / name)
        linked_dirs[name] = (weights, target)
    spool = Spool(tmp_path / "spool", create=True)
    client = client_for(spool.root)
    args = ["--engine", "vllm", "--allowed-root", str(root), "--max-model-len", "64", "--idle-exit", "0"]
    worker = start_worker(spool.root, "roots", *args, log_dir=tmp_path)
    try:
        wait_for_status(spool, "roots", lambda s: s.state == "idle", 300, worker)  # up: vLLM imported
        ids = [f"linked-{i}" for i in range(len(LINKED))]
        for rid, name in zip(ids, LINKED, strict=True):
            client.submit(request(rid, linked_dirs[name][0]))
        results = client.wait(ids, timeout_s=300)
        for rid, name in zip(ids, LINKED, strict=True):
            weights, target = linked_dirs[name]
            result = results[rid]
            assert not result.ok, f"{name} linked outside the roots was served"
            assert result.error.code == "weights_not_allowed"
            assert f"{name} resolves to {target}" in result.error.message and str(weights) in result.error.message
            # The request file moves to bad/ just after its result is published.
            assert poll(spool.bad_path(f"{rid}.json").exists, until=bool), f"{rid} not kept in bad/"
        client.submit(request("clean", clean_weights))
        clean = client.wait(["clean"], timeout_s=420)["clean"]
        assert clean.ok and clean.worker_id == "roots" and clean.weights_dir == str(clean_weights)
        assert worker.poll() is None
    finally:
        assert stop_worker(worker) == exit_codes.OK
