"""A deterministic stand-in for the TurnBatcher, for episode tests that need exact repeatability
(resume, learning): answers each turn with transformers from the weights it was put with, seeded
by the turn's seed, reporting the sampling logprobs as the engine would. Every key it was asked
is kept (`asked`), over all the batchers a service made."""

from __future__ import annotations

import threading

import torch
from local_sampler import TorchSampler

from trainer_svc.rollout.turn_batcher import TurnOutcome


class TorchTurns:
    def __init__(self, cfg, weights, asked: list[str], sampler: TorchSampler, hold=lambda key: False):
        self.cfg, self.asked, self.sampler, self.hold = cfg, asked, sampler, hold
        self.weights = (weights.dir, weights.content_id)
        self.queue: list = []
        self.lock = threading.Lock()

    def set_weights(self, weights_dir: str, content_id: str | None) -> None:
        self.weights = (weights_dir, content_id)

    def put(self, turn) -> None:
        with self.lock:
            self.queue.append((turn, self.weights))

    def pending(self) -> int:
        return len(self.queue)

    @torch.no_grad()
    def poll(self, timeout_s: float) -> list[TurnOutcome]:
        with self.lock:
            queued = [q for q in self.queue if not self.hold(q[0].key)]
            self.queue = [q for q in self.queue if self.hold(q[0].key)]
        outcomes = []
        r = self.cfg.rollout
        for turn, (weights_dir, content_id) in queued:
            self.asked.append(turn.key)
            model, tokenizer = self.sampler._load(weights_dir, content_id)
            generator = torch.Generator().manual_seed(turn.seed)
            ids, tokens, logprobs, reason = list(turn.prompt_token_ids), [], [], "length"
            for _ in range(r.max_tokens):
                probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double() / r.temperature, -1)
                token = int(torch.multinomial(probs, 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(torch.log(probs[token])))
                ids.append(token)
                if token == tokenizer.eos_token_id:
                    reason = "stop"
                    break
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            outcomes.append(TurnOutcome(turn.key, tokens, logprobs, reason, text, "torch", content_id or ""))
        return outcomes

    def close(self) -> None:
        pass


class TorchTurnService:
    """make_sampler for loop.train with an [env]: the service the episode sampler asks for a
    TurnBatcher. `asked` keeps every turn key any of its batchers answered; turns whose key
    `hold` is true are never answered (the engine is slow on them)."""

    def __init__(self, asked: list[str] | None = None, hold=lambda key: False):
        self.asked = [] if asked is None else asked
        self.hold = hold
        self.closed = False

    def __call__(self, cfg, launch_id):
        self.cfg, self.sampler = cfg, TorchSampler(cfg)
        return self

    def turn_batcher(self, weights, temperature=None):
        return TorchTurns(self.cfg, weights, self.asked, self.sampler, self.hold)

    def close(self) -> None:
        self.closed = True


class ScriptedTurns:
    """A stand-in engine for episode tests of rendering and faults: turn t of every episode is
    answered with `answers[t]` tokenized, then the end-of-sequence id ("stop"). Every Turn put is
    kept (`turns`), with the outcome given (`outcomes`)."""

    def __init__(self, tokenizer, answers: list[str], hold=lambda key: False):
        self.tokenizer, self.answers, self.hold = tokenizer, answers, hold
        self.queue: list = []
        self.turns: dict[str, object] = {}
        self.outcomes: dict[str, TurnOutcome] = {}
        self.lock = threading.Lock()

    def set_weights(self, weights_dir: str, content_id: str | None) -> None:
        pass

    def put(self, turn) -> None:
        with self.lock:
            self.queue.append(turn)
            self.turns[turn.key] = turn

    def pending(self) -> int:
        return len(self.queue)

    def poll(self, timeout_s: float) -> list[TurnOutcome]:
        with self.lock:
            queued = [turn for turn in self.queue if not self.hold(turn.key)]
            self.queue = [turn for turn in self.queue if self.hold(turn.key)]
        outcomes = []
        for turn in queued:
            text = self.answers[int(turn.key.rpartition(".t")[2])]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            worker = f"w{len(self.outcomes) % 2}"
            outcome = TurnOutcome(turn.key, ids, [-0.5] * len(ids), "stop", text, worker, "")
            self.outcomes[turn.key] = outcome
            outcomes.append(outcome)
        return outcomes

    def close(self) -> None:
        pass


class Service:
    """What the episode sampler asks for its batcher: one made beforehand."""

    def __init__(self, turns):
        self.turns = turns
        self.closed = False

    def turn_batcher(self, weights, temperature=None):
        return self.turns

    def close(self) -> None:
        self.closed = True
