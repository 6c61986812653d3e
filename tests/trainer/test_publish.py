"""publish: step directories, their content ids, discarding after a resume, and pruning that never
removes weights a pending or claimed request names.

Run as a script, this file is also the child process of the kill test."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from protocol.weights_dir import weights_content_id  # noqa: E402
from trainer_svc.distributed import Distributed  # noqa: E402
from trainer_svc.weights.publish import (  # noqa: E402
    discard_newer_than,
    latest_published,
    list_published,
    prune_published,
    publish,
    published_dir,
)
from trainer_svc.weights.writer import iter_full_tensors  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[1]))  # manifest_check, shared with the other tiers
from manifest_check import verify  # noqa: E402


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
    }


def publish_steps(publish_dir: Path, base: Path, steps) -> dict[int, Path]:
    return {step: publish(step, weights(step), publish_dir=publish_dir, base_model=base).path for step in steps}


def visible(publish_dir: Path) -> list[str]:
    return sorted(name for name in os.listdir(publish_dir) if not name.startswith("."))


def test_publish_writes_a_step_directory_a_worker_recognises(base, tmp_path):
    publish_dir = tmp_path / "run-a" / "published"
    record = publish(12, weights(12), publish_dir=publish_dir, base_model=base)
    assert record.path == published_dir(publish_dir, 12) == publish_dir / "step_00000012"
    assert re.fullmatch(r"run-a-step_00000012-[0-9a-f]{8}", record.content_id)
    # the worker's content id is the manifest's
    assert weights_content_id(str(record.path)) == record.content_id
    manifest = verify(record.path, checksums=True)
    assert manifest.step == 12 and record.bytes == manifest.bytes > 0
    assert latest_published(publish_dir) == record.__class__(
        record.path, 12, record.content_id, record.bytes, manifest.write_seconds
    )
    from safetensors.torch import load_file

    loaded = load_file(record.path / "model.safetensors")
    for name, tensor in weights(12).items():
        assert torch.equal(loaded[name], tensor)

    again = publish(12, weights(12), publish_dir=publish_dir, base_model=base)
    assert again.content_id != record.content_id  # unique per write: the worker reloads
    assert weights_content_id(str(again.path)) == again.content_id
    assert visible(publish_dir) == ["step_00000012"] and os.listdir(publish_dir) == ["step_00000012"]


def test_publish_takes_a_model_stream(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    stream = iter_full_tensors(model, Distributed(0, 1, torch.device("cpu")))
    record = publish(
        1, stream, publish_dir=tmp_path / "pub", base_model=tiny_model, run_name="demo", dtype=torch.bfloat16
    )
    assert record.content_id.startswith("demo-step_00000001-")
    reloaded = AutoModelForCausalLM.from_pretrained(record.path, dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor.to(torch.bfloat16)), name


def test_latest_and_list_skip_what_publish_did_not_write(base, tmp_path):
    publish_dir = tmp_path / "pub"
    assert latest_published(publish_dir) is None
    publish_steps(publish_dir, base, [2, 10, 3])
    (publish_dir / "step_00000099").mkdir()  # no manifest: not ours, not complete
    (publish_dir / "notes").mkdir()
    assert [p.step for p in list_published(publish_dir)] == [2, 3, 10]
    assert latest_published(publish_dir).step == 10


def test_discard_newer_than(base, tmp_path):
    publish_dir = tmp_path / "pub"
    paths = publish_steps(publish_dir, base, range(1, 6))
    assert discard_newer_than(publish_dir, 3) == [paths[4], paths[5]]
    assert visible(publish_dir) == ["step_00000001", "step_00000002", "step_00000003"]
    assert latest_published(publish_dir).step == 3
    assert sorted(os.listdir(publish_dir)) == visible(publish_dir)  # removed, not left hidden
    assert discard_newer_than(publish_dir, 3) == []
    assert discard_newer_than(publish_dir, 0) == [paths[1], paths[2], paths[3]]
    assert latest_published(publish_dir) is None


def make_spool(root: Path) -> Path:
    for state in ("tmp", "requests", "claimed", "results", "done", "bad", "workers"):
        (root / state).mkdir(parents=True)
    return root


def request(weights_dir: str, request_id: str) -> str:
    return json.dumps(
        {
            "request_id": request_id,
            "weights_dir": weights_dir,
            "prompts": ["1+1="],
            "n_samples_per_prompt": 1,
            "max_tokens": 4,
            "temperature": 1.0,
        }
    )


def test_prune_keeps_the_newest_and_every_directory_a_request_names(base, tmp_path):
    publish_dir = tmp_path / "pub"
    paths = publish_steps(publish_dir, base, range(1, 9))
    spool = make_spool(tmp_path / "spool")
    (spool / "requests" / "r1.json").write_text(request(str(paths[1]), "r1"))
    # claimed, naming it through a symlink: the same directory by its real path
    (tmp_path / "link").symlink_to(publish_dir)
    (spool / "claimed" / "r2@gpu0.json").write_text(request(str(tmp_path / "link" / "step_00000002"), "r2"))
    # half a file: cannot be parsed, but it names step 3 in its bytes
    text = request(str(paths[3]), "r3")
    (spool / "requests" / "r3.json").write_text(text[: text.index('"prompts"')])
    assert "step_00000003" in (spool / "requests" / "r3.json").read_text()
    # served or finished requests protect nothing
    (spool / "done" / "r4.request.json").write_text(request(str(paths[4]), "r4"))
    (spool / "results" / "r5.json").write_text(request(str(paths[5]), "r5"))
    (spool / "tmp" / "r6.json").write_text("{")  # being written: not yet a request

    removed = prune_published(publish_dir, keep_last=2, spool_dir=spool)
    assert removed == [paths[4], paths[5], paths[6]]
    assert visible(publish_dir) == ["step_00000001", "step_00000002", "step_00000003", "step_00000007", "step_00000008"]
    assert sorted(os.listdir(publish_dir)) == visible(publish_dir)
    for path in list_published(publish_dir):
        verify(path.path, checksums=True)

    # once the requests are served, their weights go too; the newest keep_last stay
    for name in ("requests/r1.json", "claimed/r2@gpu0.json", "requests/r3.json"):
        (spool / name).unlink()
    assert prune_published(publish_dir, keep_last=2, spool_dir=spool) == [paths[1], paths[2], paths[3]]
    assert visible(publish_dir) == ["step_00000007", "step_00000008"]


def test_a_request_written_while_the_prune_runs_keeps_its_weights(base, tmp_path, monkeypatch):
    """A producer names an older step just after the prune's scan, and a worker claims it and
    starts loading: the prune's second scan, made before it deletes, sees the claim and puts that
    directory back; a reader finds every file it opens after the prune."""
    import trainer_svc.weights.publish as publish_module

    publish_dir = tmp_path / "pub"
    paths = publish_steps(publish_dir, base, range(1, 5))
    spool = make_spool(tmp_path / "spool")
    real_scan = publish_module.weights_named
    scans = []

    def scan_then_a_request_arrives(spool_dir):
        found = real_scan(spool_dir)
        scans.append(found)
        if len(scans) == 1:  # the race: written and claimed right after the first scan
            (spool / "claimed" / "late@gpu0.json").write_text(request(str(paths[2]), "late"))
        return found

    monkeypatch.setattr(publish_module, "weights_named", scan_then_a_request_arrives)
    removed = prune_published(publish_dir, keep_last=1, spool_dir=spool)
    assert removed == [paths[1], paths[3]]
    assert visible(publish_dir) == ["step_00000002", "step_00000004"]
    assert sorted(os.listdir(publish_dir)) == visible(publish_dir)  # nothing left aside
    verify(paths[2], checksums=True)  # whole, as the claiming worker reads it


def test_prune_removes_nothing_when_a_request_cannot_be_read(base, tmp_path, monkeypatch):
    import protocol.spool_names

    publish_dir = tmp_path / "pub"
    publish_steps(publish_dir, base, range(1, 5))
    spool = make_spool(tmp_path / "spool")
    (spool / "requests" / "odd.json").write_text("{}")
    real = protocol.spool_names.read_regular_file

    def refused(path, max_bytes):  # what a trainer outside the spool's group gets (root reads any mode)
        if Path(path).name == "odd.json":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, max_bytes)

    monkeypatch.setattr(protocol.spool_names, "read_regular_file", refused)
    assert prune_published(publish_dir, keep_last=1, spool_dir=spool) == []  # it could name anything
    assert len(visible(publish_dir)) == 4
    monkeypatch.undo()
    (spool / "requests" / "odd.json").unlink()
    (spool / "requests" / "odd.json").mkdir()  # a worker refuses a directory unread: it names nothing
    assert len(prune_published(publish_dir, keep_last=1, spool_dir=spool)) == 3


def test_prune_checks_its_arguments(base, tmp_path):
    publish_dir = tmp_path / "pub"
    publish_steps(publish_dir, base, [1, 2])
    with pytest.raises(ValueError, match="keep_last"):
        prune_published(publish_dir, keep_last=0, spool_dir=None)
    with pytest.raises(FileNotFoundError, match="not a spool"):
        prune_published(publish_dir, keep_last=1, spool_dir=tmp_path / "nowhere")
    assert len(visible(publish_dir)) == 2
    assert prune_published(publish_dir, keep_last=1, spool_dir=None) == [publish_dir / "step_00000001"]


def test_leftovers_of_dead_writers_are_cleaned_live_ones_kept(base, tmp_path):
    publish_dir = tmp_path / "pub"
    publish_steps(publish_dir, base, [1])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (publish_dir / f".step_00000002.{dead.stdout.strip()}.partial").mkdir()
        (publish_dir / f".step_00000003.{live.pid}.partial").mkdir()
        prune_published(publish_dir, keep_last=1, spool_dir=None)
        assert sorted(os.listdir(publish_dir)) == [f".step_00000003.{live.pid}.partial", "step_00000001"]
    finally:
        live.kill()
        live.wait()
    publish_steps(publish_dir, base, [2])  # a publish cleans them too, once the writer is gone
    assert sorted(os.listdir(publish_dir)) == ["step_00000001", "step_00000002"]


@pytest.mark.timeout(400)
def test_sigkill_while_publishing_and_pruning(base, tmp_path):
    """A child publishes step after step and prunes to 2; it is SIGKILLed at random delays. Every
    visible step directory is complete and right, the newest is the last reported or the next."""
    publish_dir = tmp_path / "pub"
    rng = random.Random(99)
    for _ in range(10):
        latest = latest_published(publish_dir)
        child = subprocess.Popen(
            [sys.executable, __file__, "publish", str(publish_dir), str(base)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout.readline().strip() == "ready"
        try:
            child.wait(timeout=rng.uniform(0.0, 0.4))
        except subprocess.TimeoutExpired:
            pass
        child.send_signal(signal.SIGKILL)
        reported = [int(line) for line in child.stdout.read().split()]
        child.wait()
        last = reported[-1] if reported else (latest.step if latest else 0)
        newest = latest_published(publish_dir)  # None if killed before its first publish completed
        assert (newest.step if newest else 0) in (last, last + 1)
        for record in list_published(publish_dir):
            verify(record.path, checksums=True)
            from safetensors.torch import load_file

            assert all(
                torch.equal(load_file(record.path / "model.safetensors")[k], v) for k, v in weights(record.step).items()
            )
        hidden = [name for name in os.listdir(publish_dir) if name.startswith(".")]
        assert all(name.startswith(".step_") and name.endswith(".partial") for name in hidden), hidden
        assert set(visible(publish_dir)) == {p.path.name for p in list_published(publish_dir)}
    prune_published(publish_dir, keep_last=2, spool_dir=None)
    assert not [name for name in os.listdir(publish_dir) if name.startswith(".")]


def _child_publish(publish_dir: str, base: str) -> int:
    latest = latest_published(Path(publish_dir))
    step = latest.step if latest else 0
    print("ready", flush=True)
    while True:
        step += 1
        publish(step, weights(step), publish_dir=Path(publish_dir), base_model=Path(base))
        print(step, flush=True)
        prune_published(Path(publish_dir), keep_last=2, spool_dir=None)


if __name__ == "__main__":
    sys.exit({"publish": _child_publish}[sys.argv[1]](*sys.argv[2:]))
