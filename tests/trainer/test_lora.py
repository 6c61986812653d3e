"""LoRA ([lora] rank > 0): a PEFT adapter trains on the frozen base; each publish and checkpoint
holds the adapter alone in PEFT's layout, described by its manifest (the base's content id, the
rank); a stopped run resumes exactly; under FSDP2 two ranks train as one process; the adapter
merges into a full model that computes what the adapter does; and a [lora] the rollout engine
could not serve is refused at load. Sampled by the deterministic test sampler, which serves an
adapter as a worker does: PEFT's loader on the base the manifest names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import make_config
from local_sampler import TorchSampler
from safetensors.torch import load_file
from test_resume import run, step_rows

from protocol import exit_codes
from protocol.weights_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, read_manifest, weights_content_id
from trainer_svc.config import ConfigError, load
from trainer_svc.run.loop import train

HERE = Path(__file__).parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
TRAINER = Path(sys.executable).parent / "trainer-svc"
LORA = {"rank": 4, "alpha": 8.0}


def lora_config(run_dir: Path, model: Path, **sections):
    sections.setdefault("lora", LORA)
    sections.setdefault("loss", {"kl_coef": 0.05})  # the reference is the base with the adapter off
    return make_config(run_dir, model, **sections)


@pytest.mark.timeout(300)
def test_lora_trains_the_adapter_alone_and_publishes_it_in_peft_layout(warm_model, tmp_path):
    cfg = lora_config(tmp_path / "lora", warm_model, train={"steps": 3}, checkpoint={"every": 50})
    samplers: list = []
    assert run(cfg, samplers) == exit_codes.OK
    rows = step_rows(cfg.run_dir)
    assert len(rows) == 3 and any(row["grad_norm"] > 0 for row in rows) and any(row["kl"] != 0 for row in rows)

    published = [cfg.run_dir / "weights" / f"step_{s:08d}" for s in (1, 2, 3)]
    named = [r["weights_dir"] for r in samplers[0].requests if r["attempt"] == 0]
    assert named == [str(warm_model), str(published[0]), str(published[1])]
    for path in published:
        assert sorted(p.name for p in path.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST]
        manifest = read_manifest(path)
        assert manifest.adapter.base_content_id == weights_content_id(str(warm_model))
        assert (manifest.adapter.rank, manifest.adapter.alpha) == (4, 8.0)
        assert manifest.bytes == sum(entry.size for entry in manifest.files.values())
        assert json.loads((path / ADAPTER_CONFIG).read_text())["r"] == 4
    tensors = load_file(published[-1] / ADAPTER_WEIGHTS)
    assert tensors and all(".lora_A.weight" in name or ".lora_B.weight" in name for name in tensors)
    assert any(float(t.abs().max()) > 0 for name, t in tensors.items() if "lora_B" in name)  # it learned

    # The checkpoint: the adapter and its optimizer, no copy of the base.
    checkpoint = cfg.run_dir / "checkpoints" / "step_00000003"
    assert (checkpoint / ADAPTER_WEIGHTS).is_file() and not (checkpoint / "model.safetensors").exists()
    optimizer = torch.load(checkpoint / "trainer_state" / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(tensors)
    assert read_manifest(checkpoint).adapter.base_content_id == weights_content_id(str(warm_model))
    banner = json.loads((cfg.run_dir / "stage_result.json").read_text())["banner"]
    assert "LoRA adapter directories" in banner["weight_sync"] and "slots and deltas" in banner["weight_sync"]


@pytest.mark.timeout(300)
def test_a_stopped_lora_run_resumes_exactly(warm_model, tmp_path):
    straight = lora_config(tmp_path / "straight", warm_model, train={"steps": 4})
    assert run(straight, []) == exit_codes.OK
    expected = step_rows(straight.run_dir)
    assert any(row["grad_norm"] > 0 for row in expected)

    # Every launch does one step, saves and stops (75): each resumes from a checkpoint's adapter.
    interrupted = lora_config(tmp_path / "interrupted", warm_model, train={"steps": 4}, run={"max_wall_seconds": 1e-6})
    codes = []
    while not codes or codes[-1] == exit_codes.RESUMABLE_STOP:
        codes.append(run(interrupted, []))
        assert len(codes) <= 5
    assert codes == [exit_codes.RESUMABLE_STOP] * 3 + [exit_codes.OK]
    assert step_rows(interrupted.run_dir) == expected
    final = "checkpoints/step_00000004/" + ADAPTER_WEIGHTS
    assert load_file(interrupted.run_dir / final).keys() == load_file(straight.run_dir / final).keys()
    for name, tensor in load_file(straight.run_dir / final).items():
        assert torch.equal(load_file(interrupted.run_dir / final)[name], tensor), name


def test_resuming_a_lora_checkpoint_with_another_rank_is_refused(warm_model, tmp_path):
    first = lora_config(tmp_path / "run", warm_model, train={"steps": 1})
    assert run(first, []) == exit_codes.OK
    other = lora_config(tmp_path / "run", warm_model, train={"steps": 2}, lora={"rank": 8})
    shapes = r"does not hold this model.s adapter.*down_proj.lora_A.weight \[4, 384\] \(the model.s: \[8, 384\]\)"
    with pytest.raises(RuntimeError, match=shapes):
        run(other, [])


@pytest.mark.timeout(400)
def test_two_fsdp_ranks_train_a_lora_adapter_as_one_process(warm_model, tmp_path):
    shape = dict(train={"steps": 3, "grad_accum": 2})
    single = lora_config(tmp_path / "single", warm_model, **shape)
    assert train(single, make_sampler=lambda cfg, launch_id: TorchSampler(cfg)) == exit_codes.OK

    sharded = lora_config(tmp_path / "sharded", warm_model, **shape)
    config_file = tmp_path / "sharded.json"
    config_file.write_bytes(msgspec.json.encode(sharded))
    done = subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(HERE / "fsdp_run.py"), str(config_file)],
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    one, two = step_rows(single.run_dir), step_rows(sharded.run_dir)
    assert [r["reward_mean"] for r in one] == [r["reward_mean"] for r in two]
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in two]), torch.tensor([r["grad_norm"] for r in one]), rtol=1e-4, atol=1e-6
    )
    for where in ("checkpoints/step_00000003", "weights/step_00000003"):
        final_one = load_file(single.run_dir / where / ADAPTER_WEIGHTS)
        final_two = load_file(sharded.run_dir / where / ADAPTER_WEIGHTS)
        assert final_one.keys() == final_two.keys()
        for name in final_one:
            torch.testing.assert_close(final_two[name], final_one[name], rtol=1e-4, atol=1e-6)


def test_the_merged_export_computes_what_the_adapter_does(warm_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = lora_config(tmp_path / "run", warm_model, train={"steps": 2, "lr": 1e-2})
    assert run(cfg, []) == exit_codes.OK
    adapter = cfg.run_dir / "weights" / "step_00000002"
    out = tmp_path / "merged"
    done = subprocess.run([str(TRAINER), "merge-adapter", str(adapter), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert read_manifest(out).content_id == f"merged-{read_manifest(adapter).content_id}"
    assert read_manifest(out).adapter is None

    ids = torch.tensor([[1, 20, 21, 22, 23, 24, 25]])
    base = AutoModelForCausalLM.from_pretrained(warm_model, dtype=torch.float32)
    with torch.no_grad():
        plain = base(ids).logits
        with_adapter = PeftModel.from_pretrained(base, adapter)(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    assert not torch.allclose(with_adapter, plain, atol=1e-4)  # the adapter changes the model
    torch.testing.assert_close(merged, with_adapter, rtol=1e-5, atol=1e-5)

    # Another base than the adapter's is refused, naming both content ids; nothing is written.
    other = tmp_path / "not-merged"
    done = subprocess.run(
        [str(TRAINER), "merge-adapter", str(adapter), str(other), "--base", str(out)], capture_output=True, text=True
    )
    assert done.returncode == exit_codes.USAGE and "give --base the directory it was trained on" in done.stderr
    assert not other.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('[lora]\nrank = 8\n[publish]\nslots = "on"', 'publish.slots = "on" with lora.rank = 8'),
        ('[lora]\nrank = 8\n[publish]\ndelta = "on"', 'publish.delta = "on" with lora.rank = 8'),
        ('[lora]\nrank = 8\ntarget_modules = ["q_proj", "lm_head"]', "serves adapters of the decoder's linear"),
        ("[lora]\nrank = 8\ntarget_modules = []", "lora.target_modules is empty"),
        ("[lora]\nrank = -1", "lora.rank"),
        ("[lora]\nrank = 8\ndropout = 1.0", "lora.dropout"),
    ],
)
def test_a_lora_config_the_engine_cannot_serve_is_refused_at_load(tmp_path, extra, message):
    path = tmp_path / "run.toml"
    path.write_text(f'[run]\ndir = "{tmp_path / "run"}"\n[model]\npath = "{tmp_path}"\n{extra}\n')
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load(path)


def test_a_target_module_the_model_lacks_is_named_with_the_models_own(warm_model):
    from transformers import AutoModelForCausalLM

    from trainer_svc.config import LoraConfig
    from trainer_svc.learning.lora import with_adapter

    model = AutoModelForCausalLM.from_pretrained(warm_model, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"cannot be applied to LlamaForCausalLM.*'q_proj'"):
        with_adapter(model, LoraConfig(rank=4, target_modules=["qkv_proj"]))
