"""`trainer-svc band`: keep the prompts the starting model solves sometimes.

A prompt it never solves, or always solves, gives a group of equal rewards and no gradient.
Banding samples `band.samples` completions of each candidate prompt from the starting model
through the rollout service, keeps those whose pass rate lies in [band.low, band.high], and
writes them as a JSONL file of {"id", "prompt", "gold", "pass_rate"} rows with a manifest
(`<file>.manifest.json`): the model and its content id, the settings, and the count per band.
`train` with `data.band_file` refuses a band file whose manifest names another model.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from protocol.fsio import replace_atomic
from protocol.weights_dir import weights_content_id

from ..config import Config
from ..data import DataError, load_problems
from ..learning.rewards import Verifier
from ..rollout_types import Ticket, WeightsRef

BATCH = 64  # prompts per request


def band_path(cfg: Config) -> Path:
    return Path(cfg.band.out) if cfg.band.out else cfg.run_dir / "band.jsonl"


def run_band(cfg: Config, sampler=None) -> dict:
    candidates, _ = load_problems(cfg.data, cfg.run.seed)
    if cfg.band.candidates:
        candidates = candidates[: cfg.band.candidates]
    unknown = [p.id for p in candidates if p.gold is None]
    if unknown:
        raise DataError(
            f"banding grades each candidate's samples against its gold answer, and rows {', '.join(unknown[:5])}"
            f"{' ...' if len(unknown) > 5 else ''} have none: give the rows an answer field"
        )
    own_sampler = sampler is None
    if own_sampler:
        from ..rollout.client import RolloutService

        sampler = RolloutService(cfg)
    verifier = Verifier()
    rows, counts = [], {"never": 0, "band": 0, "always": 0}
    model = os.path.realpath(cfg.model.path)
    try:
        for start in range(0, len(candidates), BATCH):
            batch = candidates[start : start + BATCH]
            prompts, seed = tuple(p.prompt for p in batch), cfg.run.seed + start
            call = Ticket(prompts, WeightsRef(model), start // BATCH, 0, seed, n=cfg.band.samples, tag="band")
            groups = sampler.collect(sampler.submit(call))
            for problem, group in zip(batch, groups, strict=True):
                rate = sum(verifier.is_correct(s.text, problem.gold) for s in group.samples) / len(group.samples)
                if rate < cfg.band.low:
                    counts["never"] += 1
                elif rate > cfg.band.high:
                    counts["always"] += 1
                else:
                    counts["band"] += 1
                    # The row's own fields kept: reward functions read them when the band is trained on.
                    rows.append(
                        {
                            **problem.fields,
                            "id": problem.id,
                            "prompt": problem.prompt,
                            "gold": problem.gold,
                            "pass_rate": rate,
                        }
                    )
    finally:
        verifier.close()
        if own_sampler:
            sampler.close()
    out = band_path(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    manifest = {
        "model": model,
        "content_id": weights_content_id(model),
        "rows": len(rows),
        "counts": counts,
        "settings": {
            "samples": cfg.band.samples,
            "low": cfg.band.low,
            "high": cfg.band.high,
            "temperature": cfg.rollout.temperature,
            "max_tokens": cfg.rollout.max_tokens,
            "candidates": len(candidates),
            "task": cfg.data.task,
            # the split that kept held-out problems out of the candidates
            "seed": cfg.run.seed,
            "held_out": cfg.data.held_out,
        },
        "created_at": time.time(),
    }
    replace_atomic(out, "".join(json.dumps(r) + "\n" for r in rows).encode())
    replace_atomic(Path(str(out) + ".manifest.json"), (json.dumps(manifest, indent=1) + "\n").encode())
    return {"path": str(out), **manifest}
