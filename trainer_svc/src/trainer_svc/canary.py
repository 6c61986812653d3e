"""The canary: every `canary.every` steps, greedy answers to held-out problems through the
spool, from the newest checkpoint. Its accuracy (canary.jsonl, stage_result.json) shows
whether the policy improves on problems it never trained on, not only on its training prompts."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .config import Config
from .data import Problem
from .rewards import Verifier, extract_answer

CANARY_FILE = "canary.jsonl"


class Canary:
    def __init__(self, cfg: Config, held_out: list[Problem], verifier: Verifier, resumed_step: int = 0):
        self.every = cfg.canary.every
        self.problems = held_out[: cfg.canary.problems]
        self.verifier = verifier
        self.path = Path(cfg.run_dir) / CANARY_FILE
        kept = [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []
        self.history = [h for h in kept if h["step"] <= resumed_step]  # later ones will be redone
        if self.path.exists():
            self.path.write_text("".join(json.dumps(h) + "\n" for h in self.history))

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and not any(h["step"] == step for h in self.history)

    def run(self, sampler, *, step: int, weights_dir: str, content_id: str | None) -> dict:
        groups = sampler.sample(
            [p.prompt for p in self.problems], weights_dir=weights_dir, content_id=content_id,
            step=step, attempt=0, seed=0, n=1, temperature=0.0, tag="canary",
        )
        correct = [self.verifier.verify(extract_answer(g.samples[0].text), p.gold) for p, g in zip(self.problems, groups, strict=True)]
        record = {"step": step, "accuracy": sum(correct) / len(correct), "n": len(correct), "weights_dir": weights_dir, "time": time.time()}
        self.history.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return record
