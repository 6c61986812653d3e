"""The safety rails of a GRPO run, in-process with a deterministic sampler: the collapse
tripwire stops the run (exit 4) and pins the checkpoint of the firing step, also across a
resume; the canary answers held-out problems greedily every `canary.every` steps; the banner
records what the run starts from; a band file is made from the starting model and refused for
another one."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import make_config
from local_sampler import TorchSampler

from protocol import exit_codes
from protocol.weights_dir import weights_content_id
from trainer_svc.data import load_problems
from trainer_svc.learning.rewards import Verifier, format_ok
from trainer_svc.rails.band import run_band
from trainer_svc.rails.gates import GateRefused
from trainer_svc.rollout_types import Sample
from trainer_svc.run.loop import train
from trainer_svc.weights import checkpoint as ckpt

TIMING_KEYS = {"rollout_s", "generate_s", "score_s", "train_s", "publish_s", "save_s", "step_s"}


class Recording(TorchSampler):
    """TorchSampler that also keeps every call's arguments, prompts and groups."""

    def __init__(self, cfg, launch_id: str = "test"):
        super().__init__(cfg, launch_id)
        self.calls: list[dict] = []

    def sample(self, prompts, **kwargs):
        groups = super().sample(prompts, **kwargs)
        weights = {"weights_dir": kwargs["weights"].dir, "content_id": kwargs["weights"].content_id}
        self.calls.append(
            {
                "tag": "train",
                "n": None,
                "temperature": None,
                **kwargs,
                **weights,
                "prompts": list(prompts),
                "groups": groups,
            }
        )
        return groups


class Collapsing(Recording):
    """From training step COLLAPSE_FROM (0-based, as requested) on, every completion is the
    end-of-sequence token alone: a policy that stopped answering."""

    COLLAPSE_FROM = 2

    def sample(self, prompts, **kwargs):
        groups = super().sample(prompts, **kwargs)
        if kwargs.get("tag", "train") == "train" and kwargs["step"] >= self.COLLAPSE_FROM:
            eos = self._load(kwargs["weights"].dir, kwargs["weights"].content_id)[1].eos_token_id
            for group in groups:
                group.samples = [Sample([eos], [-0.25], "", "stop") for _ in group.samples]
        return groups


class Emptied(Recording):
    """From training step 1 on, every completion is empty (no token at all)."""

    def sample(self, prompts, **kwargs):
        groups = super().sample(prompts, **kwargs)
        if kwargs.get("tag", "train") == "train" and kwargs["step"] >= 1:
            for group in groups:
                group.samples = [Sample([], [], "", "stop") for _ in group.samples]
        return groups


class Launcher:
    """make_sampler for loop.train that keeps the samplers it made."""

    def __init__(self, kind=Recording):
        self.kind = kind
        self.samplers: list[Recording] = []

    def __call__(self, cfg, launch_id):
        self.samplers.append(self.kind(cfg, launch_id))
        return self.samplers[-1]

    def calls(self, tag: str) -> list[dict]:
        return [c for s in self.samplers for c in s.calls if c["tag"] == tag]


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def stage_result(run_dir) -> dict:
    return json.loads((run_dir / "stage_result.json").read_text())


def checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def step_dir(run_dir, step: int):
    return run_dir / "checkpoints" / f"step_{step:08d}"


def first_short_window(rows: list[dict], window: int, below: float) -> int | None:
    """The step at which the mean response length of the last `window` steps first drops below `below`."""
    lengths = [r["response_length"] for r in rows]
    for end in range(window, len(lengths) + 1):
        if sum(lengths[end - window : end]) / window < below:
            return rows[end - 1]["step"]
    return None


# Stopped answering: answers are empty (only the end of sequence) from step 3 on; the tripwire
# judges 2-step windows against 1.5 tokens. The reward-drop signal is set out of reach so that
# the length signal is the one that fires.
COLLAPSE_TRIPWIRE = {"window": 2, "min_response_length": 1.5, "max_reward_drop": 10.0}


# -- the collapse tripwire -----------------------------------------------------------------------


def test_a_collapse_fires_the_tripwire_pins_its_checkpoint_and_stops_the_run(warm_model, tmp_path):
    cfg = make_config(
        tmp_path / "run",
        warm_model,
        train={"steps": 8},
        checkpoint={"every": 1, "keep_last": 1},
        tripwire=COLLAPSE_TRIPWIRE,
    )
    launcher = Launcher(Collapsing)
    assert train(cfg, make_sampler=launcher) == exit_codes.TRIPWIRE == 4

    rows = metrics(cfg.run_dir)
    # the end-of-sequence token closing an answer is not counted: an empty answer measures 0
    assert [r["response_length"] for r in rows if r["step"] > Collapsing.COLLAPSE_FROM] == [0.0] * (
        len(rows) - Collapsing.COLLAPSE_FROM
    )
    assert all(r["response_length"] > 0.0 for r in rows[: Collapsing.COLLAPSE_FROM])
    fired = first_short_window(rows, 2, 1.5)
    assert fired in (Collapsing.COLLAPSE_FROM + 1, Collapsing.COLLAPSE_FROM + 2)
    # metrics end at the firing step; nothing was sampled after it
    assert [r["step"] for r in rows] == list(range(1, fired + 1))
    assert max(c["step"] for c in launcher.calls("train")) == fired - 1

    # the firing step's checkpoint is the one left (keep_last 1), pinned with the reason
    assert checkpoints(cfg.run_dir) == [f"step_{fired:08d}"]
    pinned = step_dir(cfg.run_dir, fired)
    reason = (pinned / ckpt.PINNED_FILE).read_text().strip()
    assert (
        reason.startswith("response length collapsed")
        and f"at step {fired}," in reason
        and "min_response_length = 1.5" in reason
    )

    result = stage_result(cfg.run_dir)
    assert result["exit_code"] == exit_codes.TRIPWIRE and result["finished"] is False
    assert result["checkpoint"] == str(pinned)
    tripwire = result["collapse_tripwire"]
    assert tripwire["fired"] is True and tripwire["armed"] is True
    assert tripwire["reason"] == reason and tripwire["fired_at_step"] == fired
    assert result["summary"]["steps"] == fired

    # prune never removes a pinned checkpoint, even when newer ones crowd it out
    for later in (fired + 1, fired + 2):
        shutil.copytree(pinned, step_dir(cfg.run_dir, later))
        (step_dir(cfg.run_dir, later) / ckpt.PINNED_FILE).unlink()
    assert ckpt.prune(cfg.run_dir, keep_last=1) == [step_dir(cfg.run_dir, fired + 1)]
    assert checkpoints(cfg.run_dir) == [f"step_{fired:08d}", f"step_{fired + 2:08d}"]


def test_the_tripwire_state_survives_a_resume(warm_model, tmp_path):
    sections = {
        "train": {"steps": 8},
        "checkpoint": {"every": 1, "keep_last": 2},
        "tripwire": {**COLLAPSE_TRIPWIRE, "window": 3},
    }
    straight = make_config(tmp_path / "straight", warm_model, **sections)
    assert train(straight, make_sampler=Launcher(Collapsing)) == exit_codes.TRIPWIRE
    expected = stage_result(straight.run_dir)["collapse_tripwire"]
    fired = expected["fired_at_step"]
    assert fired == first_short_window(metrics(straight.run_dir), 3, 1.5) and fired >= 3

    # A wall-clock limit below one step: every launch does one step, saves and stops (75), so
    # the tripwire's window is only ever full with the observations of earlier launches.
    interrupted = make_config(tmp_path / "interrupted", warm_model, run={"max_wall_seconds": 1e-6}, **sections)
    launcher = Launcher(Collapsing)
    codes = []
    while not codes or codes[-1] == exit_codes.RESUMABLE_STOP:
        codes.append(train(interrupted, make_sampler=launcher))
        assert len(codes) <= 8
    assert codes == [exit_codes.RESUMABLE_STOP] * (fired - 1) + [exit_codes.TRIPWIRE]
    got = stage_result(interrupted.run_dir)["collapse_tripwire"]
    assert (got["fired_at_step"], got["reason"], got["best_window_reward"]) == (
        fired,
        expected["reason"],
        expected["best_window_reward"],
    )
    assert without_timings(metrics(interrupted.run_dir)) == without_timings(metrics(straight.run_dir))
    assert (step_dir(interrupted.run_dir, fired) / ckpt.PINNED_FILE).read_text().strip() == expected["reason"]

    # Relaunching a fired run exits 4 at once: nothing sampled, trained, saved or logged. (Its
    # sampler is made before the checkpoint is read, as a spawned worker starts early, and unused.)
    before = (
        (interrupted.run_dir / "metrics.jsonl").read_bytes(),
        checkpoints(interrupted.run_dir),
        len(launcher.calls("train")),
    )
    assert train(interrupted, make_sampler=launcher) == exit_codes.TRIPWIRE
    assert (
        (interrupted.run_dir / "metrics.jsonl").read_bytes(),
        checkpoints(interrupted.run_dir),
        len(launcher.calls("train")),
    ) == before
    assert not launcher.samplers[-1].calls and not launcher.samplers[-1].submitted
    again = stage_result(interrupted.run_dir)
    assert again["exit_code"] == exit_codes.TRIPWIRE and again["collapse_tripwire"]["reason"] == expected["reason"]
    assert again["banner"]["resumed_from"] == str(step_dir(interrupted.run_dir, fired))


def test_a_policy_that_only_ends_its_answers_fires_the_default_tripwire(warm_model, tmp_path):
    cfg = make_config(tmp_path / "run", warm_model, train={"steps": 6}, tripwire={"window": 2, "max_reward_drop": 10.0})
    assert train(cfg, make_sampler=Launcher(Collapsing)) == exit_codes.TRIPWIRE
    # No token at all: no length and no entropy left to measure; either signal may name it.
    assert stage_result(cfg.run_dir)["collapse_tripwire"]["reason"].startswith(
        ("response length collapsed", "entropy collapsed")
    )


def test_a_policy_that_stops_answering_altogether_fires_the_tripwire(warm_model, tmp_path):
    cfg = make_config(tmp_path / "run", warm_model, train={"steps": 6}, tripwire={"window": 2})
    assert train(cfg, make_sampler=Launcher(Emptied)) == exit_codes.TRIPWIRE
    # No token at all: no length and no entropy left to measure; either signal may name it.
    assert stage_result(cfg.run_dir)["collapse_tripwire"]["reason"].startswith(
        ("response length collapsed", "entropy collapsed")
    )


# -- the canary ----------------------------------------------------------------------------------


CANARY = {
    "train": {"steps": 6},
    "canary": {"every": 2, "problems": 5},
    "data": {"held_out": 8},
    # a reward that is not the accuracy: the canary's reward must be the configured one
    "reward": {"functions": ["correct", "format"], "weights": [1.0, 0.5]},
}


def canary_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "canary.jsonl").read_text().splitlines()]


def test_the_canary_answers_held_out_problems_greedily(warm_model, tmp_path):
    cfg = make_config(tmp_path / "run", warm_model, **CANARY)
    launcher = Launcher()
    assert train(cfg, make_sampler=launcher) == exit_codes.OK

    # a row for the starting model (step 0), then one every 2 steps, from that step's published weights
    rows = canary_rows(cfg.run_dir)
    assert [r["step"] for r in rows] == [0, 2, 4, 6]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["n"] == 5 for r in rows)
    weights = [str(warm_model)] + [str(cfg.run_dir / "weights" / f"step_{s:08d}") for s in (2, 4, 6)]
    assert [r["weights_dir"] for r in rows] == weights

    train_problems, held_out = load_problems(cfg.data, cfg.run.seed)
    canary_prompts = [p.prompt for p in held_out[:5]]
    assert not set(canary_prompts) & {p.prompt for p in train_problems}
    calls = launcher.calls("canary")
    assert [(c["step"], c["n"], c["temperature"], c["prompts"], c["weights_dir"]) for c in calls] == [
        (s, 1, 0.0, canary_prompts, w) for s, w in zip((0, 2, 4, 6), weights, strict=False)
    ]
    assert calls[0]["content_id"] is None
    # the content id the published weights had when the next step sampled from them
    content = {c["step"]: c["content_id"] for c in launcher.calls("train") if c["attempt"] == 0}
    content[6] = json.loads((cfg.run_dir / "weights" / "step_00000006" / "manifest.json").read_text())["content_id"]
    assert [c["content_id"] for c in calls[1:]] == [content[s] for s in (2, 4, 6)] and None not in {
        content[s] for s in (2, 4, 6)
    }
    assert all(len(g.samples) == 1 for c in calls for g in c["groups"])
    # the recorded accuracy is the greedy answers' accuracy
    with Verifier() as verifier:
        for row, call in zip(rows, calls, strict=False):
            answers = zip(call["groups"], held_out[:5], strict=True)
            right = [verifier.is_correct(g.samples[0].text, p.gold) for g, p in answers]
            assert row["accuracy"] == sum(right) / 5
            # and the held-out reward is the configured functions' total: 1 * correct + 0.5 * (0 or -1)
            formed = [format_ok(g.samples[0].text, g.samples[0].finish_reason) for g in call["groups"]]
            totals = [float(r) + 0.5 * (0.0 if f else -1.0) for r, f in zip(right, formed, strict=True)]
            assert row["reward"] == pytest.approx(sum(totals) / 5)
    # training never sampled a held-out problem
    assert not {p for c in launcher.calls("train") for p in c["prompts"]} & set(p.prompt for p in held_out)

    by_step = {r["step"]: r for r in metrics(cfg.run_dir)}
    assert [s for s, r in by_step.items() if "canary_accuracy" in r] == [2, 4, 6]
    assert [by_step[s]["canary_accuracy"] for s in (2, 4, 6)] == [r["accuracy"] for r in rows[1:]]
    assert [by_step[s]["canary_reward"] for s in (2, 4, 6)] == [r["reward"] for r in rows[1:]]
    assert stage_result(cfg.run_dir)["canary_history"] == rows


def test_the_canary_history_survives_resumes(warm_model, tmp_path):
    straight = make_config(tmp_path / "straight", warm_model, **CANARY)
    assert train(straight, make_sampler=Launcher()) == exit_codes.OK
    interrupted = make_config(tmp_path / "interrupted", warm_model, run={"max_wall_seconds": 1e-6}, **CANARY)
    launcher = Launcher()
    codes = []
    while not codes or codes[-1] == exit_codes.RESUMABLE_STOP:
        codes.append(train(interrupted, make_sampler=launcher))
        assert len(codes) <= 6
    assert codes == [exit_codes.RESUMABLE_STOP] * 5 + [exit_codes.OK]

    def essence(rows):
        return [(r["step"], r["accuracy"], r["n"]) for r in rows]

    assert essence(canary_rows(interrupted.run_dir)) == essence(canary_rows(straight.run_dir))
    assert [c["step"] for c in launcher.calls("canary")] == [0, 2, 4, 6]  # each exactly once
    assert essence(stage_result(interrupted.run_dir)["canary_history"]) == essence(canary_rows(straight.run_dir))


# -- the banner ----------------------------------------------------------------------------------


def test_the_banner_records_what_the_run_starts_from(warm_model, tmp_path):
    cfg = make_config(tmp_path / "run", warm_model, run={"max_wall_seconds": 1e-6}, train={"steps": 2})
    assert train(cfg, make_sampler=Launcher()) == exit_codes.RESUMABLE_STOP
    first = stage_result(cfg.run_dir)
    assert first["exit_code"] == exit_codes.RESUMABLE_STOP and first["finished"] is False
    assert train(cfg, make_sampler=Launcher()) == exit_codes.OK
    banner = stage_result(cfg.run_dir)["banner"]

    assert first["banner"]["resumed_from"] is None
    assert banner["resumed_from"] == str(step_dir(cfg.run_dir, 1))
    assert banner["stage"] == "grpo" and banner["substrate"] == str(warm_model)
    assert banner["shape"] == {
        "prompts_per_step": 4,
        "G": 4,
        "max_response_len": 4,
        "loss_denominator": "token",
        "policy_loss": "clip (clip 0.2, 0.28)",
        "optimizer_steps": 2,
        "grad_accum": 2,
        "ahead": 0,
        "fan_out": "one request per live worker",
    }
    assert banner["task"] == {"kind": "arithmetic", "train_problems": 90, "held_out": 10}
    assert banner["ceiling"] == {"perfect_rate": 1.0, "wrong_rate": 0.0, "n": 100}
    assert banner["topology"] == {
        "train_ranks": 1,
        "rollout_device": "workers on the spool",
        "rollout": f"workers on {cfg.spool_dir}",
    }
    assert banner["band_file"] is None and banner["band_prompts"] is None
    assert "grad clip 1.0" in banner["safety"] and "canary every off" in banner["safety"]
    assert "tripwire armed (window 20)" in banner["safety"] and "policy lag <= 0" in banner["safety"]
    receipt = json.loads((cfg.run_dir / "ceiling_receipt.json").read_text())
    assert (receipt["perfect_rate"], receipt["wrong_rate"], receipt["n"]) == (1.0, 0.0, 100)


# -- band ----------------------------------------------------------------------------------------


def test_band_file_is_made_from_the_starting_model_and_refused_for_another(warm_model, tiny_model, tmp_path):
    band_cfg = make_config(
        tmp_path / "band-run", warm_model, band={"samples": 4, "candidates": 20, "out": str(tmp_path / "band.jsonl")}
    )
    sampler = Recording(band_cfg)
    report = run_band(band_cfg, sampler=sampler)

    path = tmp_path / "band.jsonl"
    assert report["path"] == str(path)
    manifest = json.loads((tmp_path / "band.jsonl.manifest.json").read_text())
    model = os.path.realpath(warm_model)
    assert manifest["model"] == model and manifest["content_id"] == weights_content_id(model)
    assert (
        sum(manifest["counts"].values()) == 20
        and manifest["settings"]["samples"] == 4
        and manifest["settings"]["candidates"] == 20
    )
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert manifest["rows"] == len(rows) == manifest["counts"]["band"]
    assert all(band_cfg.band.low <= r["pass_rate"] <= band_cfg.band.high for r in rows)
    assert all(r["gold"] == str(sum(map(int, r["prompt"].rstrip("=").split("+")))) for r in rows)

    # the counts are what the samples say: pass rate of 4 samples per candidate, in [low, high] or not
    assert all(c["tag"] == "band" and c["n"] == 4 and c["weights_dir"] == model for c in sampler.calls)
    candidates = load_problems(band_cfg.data, band_cfg.run.seed)[0][:20]
    assert [p for c in sampler.calls for p in c["prompts"]] == [p.prompt for p in candidates]
    with Verifier() as verifier:
        rates = [
            sum(verifier.is_correct(s.text, p.gold) for s in g.samples) / 4
            for p, g in zip(candidates, [g for c in sampler.calls for g in c["groups"]], strict=False)
        ]
    assert [(p.prompt, r) for p, r in zip(candidates, rates, strict=False) if 0.1 <= r <= 0.9] == [
        (r["prompt"], r["pass_rate"]) for r in rows
    ]
    assert manifest["counts"] == {
        "never": sum(r < 0.1 for r in rates),
        "band": len(rows),
        "always": sum(r > 0.9 for r in rates),
    }
    assert rows, "the warm model should solve some candidates sometimes"

    # training on the band file passes the band gate, and trains on band prompts only
    cfg = make_config(tmp_path / "run", warm_model, train={"steps": 2}, data={"band_file": str(path)})
    launcher = Launcher()
    assert train(cfg, make_sampler=launcher) == exit_codes.OK
    banner = stage_result(cfg.run_dir)["banner"]
    assert banner["band_file"] == str(path) and banner["band_prompts"] == len(rows)
    assert banner["task"]["train_problems"] == len(rows)
    assert {p for c in launcher.calls("train") for p in c["prompts"]} <= {r["prompt"] for r in rows}

    # the same band file for a run that starts from another model is refused before training
    other = make_config(tmp_path / "other", tiny_model, train={"steps": 2}, data={"band_file": str(path)})
    launcher = Launcher()
    with pytest.raises(GateRefused) as info:
        train(other, make_sampler=launcher)
    assert info.value.gate == "band" and info.value.exit_code == exit_codes.GATE_REFUSED
    assert f"banded on {model}" in str(info.value) and f"starts from {os.path.realpath(tiny_model)}" in str(info.value)
    # its sampler (started before the gates, as a spawned worker is) was closed unused
    assert [(s.closed, s.calls, s.submitted) for s in launcher.samplers] == [(True, [], [])]
    assert not (other.run_dir / "checkpoints").exists()
