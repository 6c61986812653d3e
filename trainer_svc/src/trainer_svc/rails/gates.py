"""Launch gates: checks that refuse a run that cannot succeed, cheapest first, before the
expensive work. Each refusal raises GateRefused (exit code 3) with what to change.

    config      denominator arithmetic, sync cadence, gradient clipping, canary armed, an
                episode longer than the spawned worker's --max-model-len
    ceiling     the reward scores a perfect policy ~100% and a wrong one ~0% (receipt saved);
                skipped, and the receipt says why, where no `correct` or no gold judges it
    band        the band file was made from this model (its manifest says so)
    topology    the rollout worker's device is visible and is not a training rank's
    horizon     the schedule's horizon is the configured number of steps, also after a resume
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from protocol import answers, exit_codes
from protocol.weights_dir import weights_content_id

from ..config import BUILTIN_REWARDS, Config, RewardConfig
from ..data import Problem
from ..learning.reward_functions import Rewards
from ..learning.rewards import Verifier
from ..records import write_json_atomic
from ..rollout.placement import physical_gpu, requested_rollout_gpu
from ..rollout_types import Group, Sample

CEILING_PERFECT_MIN = 0.99
CEILING_WRONG_MAX = 0.01
RECEIPT = "ceiling_receipt.json"

log = logging.getLogger(__name__)


class GateRefused(RuntimeError):
    exit_code = exit_codes.GATE_REFUSED

    def __init__(self, gate: str, message: str):
        super().__init__(f"launch gate '{gate}' refused the run: {message}")
        self.gate = gate


def run_all(
    cfg: Config, world_size: int, is_main: bool, tokenizer, problems: list[Problem], verifier: Verifier
) -> dict:
    """The gates in order, cheapest first; each refuses with GateRefused. Returns their figures for
    the banner. The horizon gate runs later, once the schedule exists (check_horizon)."""
    check_config(cfg, world_size)
    receipt = ceiling_receipt(cfg, problems, tokenizer, verifier)
    if is_main:  # rank 0 keeps the receipt
        check_ceiling(receipt, cfg.run_dir)
    elif ceiling_refuses(receipt):
        raise GateRefused("ceiling", "see rank 0")
    band = check_band(cfg)
    live = None
    if not cfg.rollout.spawn:
        from protocol.spool import Spool

        live = Spool(cfg.spool_dir, create=True).live_workers()
    import torch

    topology = check_topology(cfg, world_size, torch.cuda.device_count(), live)
    keys = ("skipped",) if "skipped" in receipt else ("perfect_rate", "wrong_rate", "n")
    ceiling = {k: receipt[k] for k in keys}
    return {"ceiling": ceiling, "band": band, "topology": topology}


def check_config(cfg: Config, world_size: int) -> None:
    r, t = cfg.rollout, cfg.train
    sequences = r.prompts_per_step * r.samples_per_prompt
    parts = world_size * t.grad_accum * t.updates_per_batch
    if sequences % parts:
        raise GateRefused(
            "config",
            f"rollout.prompts_per_step x rollout.samples_per_prompt = {sequences} sequences do not split evenly "
            f"into train.updates_per_batch = {t.updates_per_batch} updates x {world_size} ranks (torchrun "
            f"--nproc_per_node) x train.grad_accum = {t.grad_accum}; change one of them so that {parts} divides "
            f"{sequences}",
        )
    lag = r.ahead + cfg.publish.every - 1
    if lag > r.max_policy_lag:
        raise GateRefused(
            "config",
            f"rollout.ahead = {r.ahead} and publish.every = {cfg.publish.every}: requests sent {r.ahead} steps "
            f"ahead name weights published every {cfg.publish.every} steps (the weight sync), so rollouts would "
            f"come from weights up to {lag} steps old, more than rollout.max_policy_lag = {r.max_policy_lag}; "
            "lower rollout.ahead or publish.every, or raise rollout.max_policy_lag to allow the lag explicitly",
        )
    if not t.max_grad_norm > 0:
        raise GateRefused(
            "config", "train.max_grad_norm must be set: unclipped GRPO updates blow up on outlier batches"
        )
    limit = worker_max_model_len(r.worker_args) if r.spawn else None
    if cfg.env is not None and limit is not None and cfg.env.max_episode_tokens > limit:
        raise GateRefused(
            "config",
            f"env.max_episode_tokens = {cfg.env.max_episode_tokens} is more than the spawned worker's "
            f"--max-model-len {limit} (rollout.worker_args): an episode's later turns would be refused in the "
            "middle of the run (prompt_too_long); raise --max-model-len to at least env.max_episode_tokens, or "
            "lower env.max_episode_tokens",
        )
    if cfg.canary.every:
        if cfg.canary.problems < 1 or cfg.canary.problems > cfg.data.held_out:
            raise GateRefused(
                "config",
                f"the canary is armed (canary.every = {cfg.canary.every}) "
                f"with canary.problems = {cfg.canary.problems}, "
                f"but data.held_out = {cfg.data.held_out} problems are kept out of training; "
                "raise data.held_out to at least canary.problems, or lower canary.problems",
            )


def worker_max_model_len(worker_args: list[str]) -> int | None:
    """The --max-model-len that `rollout-svc serve` options give (the last one, as its parser
    takes it); None where they give none or a value that is no integer (the worker refuses that)."""
    found = None
    for i, arg in enumerate(worker_args):
        if arg == "--max-model-len" and i + 1 < len(worker_args):
            found = worker_args[i + 1]
        elif arg.startswith("--max-model-len="):
            found = arg.partition("=")[2]
    try:
        return int(found) if found is not None else None
    except ValueError:
        return None


def ceiling_receipt(cfg: Config, problems: list[Problem], tokenizer, verifier: Verifier) -> dict:
    """Score each problem's gold written as a perfect policy writes it, and a wrong answer, through
    the built-in reward functions configured (correct, format, overlong, at their weights).

    A perfect completion is the gold text, ended by the model itself; the built-ins must give it
    their maximum, the weight of `correct` (format and overlong only subtract). A wrong one
    (gold + 1) must not count as correct. A reward that cannot tell them apart trains nothing (the
    0/100 trap). This is well defined only through `correct` and a gold: without `correct` in
    reward.functions, or without a problem that has a gold, the gate is skipped and the receipt
    says why. A user's functions are not judged (their maximum is not known)."""
    builtins = [
        (name, w) for name, w in zip(cfg.reward.functions, cfg.reward.weights, strict=True) if name in BUILTIN_REWARDS
    ]
    users = [name for name in cfg.reward.functions if name not in BUILTIN_REWARDS]
    golden = [p for p in problems if p.gold is not None]
    skipped = None
    if "correct" not in cfg.reward.functions:
        skipped = 'reward.functions has no "correct": the gate judges perfect and wrong answers through it'
    elif not golden:
        skipped = "no problem has a gold answer to write a perfect and a wrong completion from"
    if skipped is not None:
        return {"skipped": skipped, "n": 0, "not_judged": users, "created_at": time.time()}
    judged = RewardConfig(
        functions=[name for name, _ in builtins],
        weights=[w for _, w in builtins],
        overlong_buffer=cfg.reward.overlong_buffer,
    )
    rewards = Rewards(judged, verifier, cfg.rollout.max_tokens)
    best_total = dict(builtins)["correct"]
    eos = [tokenizer.eos_token_id]
    perfect, wrong, failures = 0, 0, []
    for p in golden:
        ids = tokenizer(p.gold, add_special_tokens=False)["input_ids"] + eos  # ended by itself
        group = Group([], [Sample(ids, [], p.gold, "stop"), Sample(ids, [], _wrong(p.gold), "stop")])
        (scored,) = rewards.score([p], [group], "ceiling gate")
        if scored.totals[0] >= best_total - 1e-9:
            perfect += 1
        elif len(failures) < 5:
            values = {name: v[0] for name, v in scored.values.items()}
            failures.append({"prompt": p.prompt, "gold": p.gold, "reward": scored.totals[0], "values": values})
        wrong += scored.correct[1]
    n = len(golden)
    return {
        "n": n,
        "without_gold": len(problems) - n,
        "perfect_rate": perfect / n,
        "wrong_rate": wrong / n,
        "failures": failures,
        "judged_by": [name for name, _ in builtins],
        "not_judged": users,
        "created_at": time.time(),
    }


def _wrong(gold: str) -> str:
    """An answer that must not count as `gold`: gold + 1, exactly, for numbers; else `gold+1`."""
    canonical = answers.normalise_answer(gold)
    number = answers.as_number(canonical) if canonical is not None else None
    return str(number + 1) if number is not None else f"{gold}+1"


def ceiling_refuses(receipt: dict) -> bool:
    return "skipped" not in receipt and (
        receipt["perfect_rate"] < CEILING_PERFECT_MIN or receipt["wrong_rate"] > CEILING_WRONG_MAX
    )


def check_ceiling(receipt: dict, run_dir: Path) -> None:
    write_json_atomic(run_dir / RECEIPT, receipt)  # a relaunch on a full disk keeps the last one whole
    if "skipped" in receipt:
        log.warning("launch gate 'ceiling' skipped: %s (receipt: %s)", receipt["skipped"], run_dir / RECEIPT)
    if ceiling_refuses(receipt):
        raise GateRefused(
            "ceiling",
            f"a perfect policy would score {receipt['perfect_rate']:.0%} and a wrong one {receipt['wrong_rate']:.0%} "
            f"(need >= {CEILING_PERFECT_MIN:.0%} and <= {CEILING_WRONG_MAX:.0%}); the verifier or the format reward "
            "cannot read the gold answers as written. Examples: "
            f"{receipt['failures'][:3]}. Receipt: {run_dir / RECEIPT}",
        )


def check_band(cfg: Config) -> dict | None:
    """The band file's manifest must name the model this run starts from (path and content)."""
    if not cfg.data.band_file:
        return None
    manifest_path = Path(cfg.data.band_file + ".manifest.json")
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise GateRefused("band", f"{manifest_path} is missing; make the band file with `trainer-svc band`") from None
    except (OSError, ValueError, RecursionError) as exc:
        why = type(exc).__name__ if isinstance(exc, RecursionError) else exc
        raise GateRefused(
            "band", f"{manifest_path} cannot be read ({why}); make it again with `trainer-svc band`"
        ) from None
    if not isinstance(manifest, dict):
        raise GateRefused("band", f"{manifest_path} is not a band manifest; make it again with `trainer-svc band`")
    model = os.path.realpath(cfg.model.path)
    content = weights_content_id(model)
    if manifest.get("model") != model or manifest.get("content_id") != content:
        raise GateRefused(
            "band",
            f"{cfg.data.band_file} was banded on {manifest.get('model')} (content {manifest.get('content_id')}), "
            f"this run starts from {model} (content {content}); band again with `trainer-svc band`",
        )
    split = {k: manifest.get("settings", {}).get(k) for k in ("seed", "held_out")}
    if split != {"seed": cfg.run.seed, "held_out": cfg.data.held_out}:
        raise GateRefused(
            "band",
            f"{cfg.data.band_file} was banded with run.seed {split['seed']} "
            f"and data.held_out {split['held_out']}, this run "
            f"uses {cfg.run.seed} and {cfg.data.held_out}: its prompts may include the canary's held-out problems; "
            "band again",
        )
    return manifest


def check_topology(cfg: Config, world_size: int, cuda_devices: int, live_workers: list | None = None) -> dict:
    """Where the rollout worker runs must not be where a training rank runs."""
    if cfg.rollout.spawn:
        if cuda_devices == 0:
            return {"train_ranks": world_size, "rollout_device": "cpu"}
        if cfg.rollout.colocate:
            if world_size > 1:
                raise GateRefused(
                    "topology",
                    f"rollout.colocate shares one GPU between one training process and its worker; this run has "
                    f"{world_size} ranks: give the worker a GPU of its own (rollout.colocate = false)",
                )
            return {"train_ranks": 1, "rollout_device": "cuda:0 (shared with rank 0: rollout.colocate)"}
        gpu = requested_rollout_gpu(world_size)
        if not gpu.isdigit() or not world_size <= int(gpu) < cuda_devices:
            raise GateRefused(
                "topology",
                f"ROLLOUT_GPU={gpu}: training ranks use cuda:0..{world_size - 1} and {cuda_devices} GPUs are visible; "
                f"the rollout worker needs its own visible GPU (set ROLLOUT_GPU to one of "
                f"{list(range(world_size, cuda_devices)) or 'none: free a GPU'}), or shares rank 0's with "
                "rollout.colocate = true (one rank only)",
            )
        return {"train_ranks": world_size, "rollout_device": f"cuda:{gpu}"}
    host = socket.gethostname()
    # Workers report the physical GPU; training ranks use positions among the visible ones.
    training = {f"cuda:{physical_gpu(i)}" for i in range(world_size)} if cuda_devices else set()
    clashes = [w.worker_id for w in live_workers or [] if w.host == host and w.device in training]
    if clashes:
        raise GateRefused(
            "topology", f"workers {clashes} on this host use a training rank's GPU; stop them or train on other GPUs"
        )
    return {"train_ranks": world_size, "rollout_device": "workers on the spool"}


def check_horizon(scheduler_horizon: int, cfg: Config, resumed_horizon: int | None) -> None:
    # A changed train.steps on resume first: it also explains a restored schedule's other span.
    if resumed_horizon is not None and resumed_horizon != cfg.train.steps:
        raise GateRefused(
            "horizon",
            f"this run was started with train.steps = {resumed_horizon}; resuming with {cfg.train.steps} would "
            "bend its learning-rate schedule mid-run. Resume with the original value, or start a new run.dir",
        )
    if scheduler_horizon != cfg.train.steps:
        raise GateRefused(
            "horizon",
            f"the learning-rate schedule spans {scheduler_horizon} steps, the run train.steps = {cfg.train.steps}; "
            "the schedule must end where the run does (train.steps, train.warmup_steps, train.schedule)",
        )
