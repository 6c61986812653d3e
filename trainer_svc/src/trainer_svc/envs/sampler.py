"""Episodes as the step sampler's samples: a Sampler (rollout.sampling) whose calls run the G
episodes of each row, driven by a thread of their own so that they overlap training.

Decisions, and what they guarantee:
- The trainer side drives the episodes; every turn is a request through the spool carrying
  exact `prompt_token_ids` (trainer_svc.envs.render), sent by a TurnBatcher with the turns of
  every other episode ready at the time (one request per target worker), preferring the worker
  that served the episode's previous turn. The worker stays a generic engine.
- `submit` starts a call's episodes and returns at once; the driver thread takes them turn by
  turn while the trainer trains (`rollout.ahead` calls in flight, as single-turn requests are);
  `collect` waits for them and returns one Group per row: the first prompt's ids, and per
  episode a Sample of every later id, its loss mask (0 on environment ids), the engine's
  logprobs (0.0 on environment ids) and the environment's reward. The GRPO group is the G
  episodes of one row. All turns of an episode are sampled from the weights its call names.
- A call's `temperature` (None: the run's) samples every turn of its episodes: the canary's
  greedy episodes run beside the training ones.
- Seeds: episode g of prompt p of a call gets seed f(call seed, p, g), passed to its
  environment; its turn t is sampled with seed f(episode seed, t). They do not depend on the
  batch a turn travelled in, nor on timing.
- Resume: every answered turn is journaled (trainer_svc.envs.journal) until its call is
  collected. A relaunch taking over a call in flight (or making a call again) re-creates its
  episodes in fresh environment instances and replays their journaled assistant turns in place
  of engine calls (checking the environment answers as before); only the turns never answered
  go to the engine. So a stop in the middle of episodes, then a relaunch, trains on exactly the
  samples the run never stopped would have.
- A call made again for the same step and attempt (its first was sampled from weights staler
  than rollout.max_policy_lag) replaces the first: the first's episodes are dropped, with their
  journal, once they end.
- Faults: an environment's fault stops the run (EnvError, exit 2: trainer_svc.envs.pool); the
  engine's as the TurnBatcher says (a dead worker's turns are sent again to another, under fresh
  ids). No progress at all (no turn answered, no environment call returned) for
  `rollout.timeout_s` raises RolloutUnavailable naming what waits: never a hang.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from ..config import Config
from ..learning.reward_functions import GroupScores
from ..rollout_types import Group, RolloutUnavailable, Sample, Ticket
from .episodes import Episode, EpisodeRunner, Recorded
from .errors import EnvError
from .journal import Journal, call_name
from .pool import EnvPool
from .render import renderer_for

POLL_S = 0.05  # the longest the driver waits for the engine before looking at the environments again


class EpisodeSampler:
    def __init__(self, cfg: Config, service, problems, tokenizer):
        """`service`: what makes the TurnBatcher (`turn_batcher(weights, temperature)`: the spool's rollout
        service, or a test's stand-in), closed with this sampler. `problems`: every row a call
        may name, by id."""
        self.cfg, self.service, self.tokenizer = cfg, service, tokenizer
        self.rows = {p.id: p for p in problems}
        self.pool = EnvPool(cfg.env)
        self.journal = Journal(cfg.run_dir / "episodes")
        self.turns = None
        self.runner: EpisodeRunner | None = None
        self._calls: dict[str, list[list[str]]] = {}  # call name -> episode ids per prompt
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closing = False
        self._progress_at = time.monotonic()
        self._thread: threading.Thread | None = None
        self._discarded: set[str] = set()  # calls replaced before they were collected
        self.pool.start()  # the class is imported at launch: a missing module stops it before any step

    # -- the Sampler interface -----------------------------------------------------------------

    def submit(self, call: Ticket) -> Ticket:
        ticket = replace(call, parts=(len(call.prompts),))
        self._start(ticket)
        return ticket

    def restore(self, ticket: Ticket) -> None:
        self._start(ticket)  # the journal holds what the previous launch's episodes were answered

    def collect(self, ticket: Ticket) -> list[Group]:
        name = call_name(ticket, self._n(ticket))
        with self._cond:
            while True:
                self._raise_error()
                ended = all(self.runner.episodes[e].ended for ids in self._calls[name] for e in ids)
                if ended:
                    break
                if time.monotonic() - self._progress_at > self.cfg.rollout.timeout_s:
                    raise RolloutUnavailable(
                        f"step {ticket.step + 1}'s episodes ({ticket.tag}) made no progress for rollout.timeout_s = "
                        f"{self.cfg.rollout.timeout_s:g} s: {self.turns.pending()} turns wait for the engine. "
                        f"`spoolctl stats -s {self.cfg.spool_dir}` shows what the workers do"
                    )
                self._cond.wait(POLL_S)
            episodes = [[self.runner.pop(e) for e in ids] for ids in self._calls.pop(name)]
            self.journal.drop(name)
        return [self._group(ticket, row) for row in episodes]

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.pool.close()
        self.journal.close()
        if self.turns is not None:
            self.turns.close()
        self.service.close()

    # -- episodes ------------------------------------------------------------------------------

    def _n(self, ticket: Ticket) -> int:
        return ticket.n or self.cfg.rollout.samples_per_prompt

    def _start(self, ticket: Ticket) -> None:
        if len(ticket.problem_ids) != len(ticket.prompts):
            raise ValueError(f"a call of episodes names the row of each prompt (problem_ids); {ticket} does not")
        name, n = call_name(ticket, self._n(ticket)), self._n(ticket)
        replay = self.journal.read(name)
        with self._cond:
            self._raise_error()
            # A call made again for the same step and attempt (its first was sampled from weights too
            # old to train on) replaces it: the old one's episodes are dropped once they end.
            again = f"{ticket.tag}-s{ticket.step:08d}-a{ticket.attempt}-"
            self._discarded.update(old for old in self._calls if old.startswith(again) and old != name)
            if self.runner is None:
                self.turns = self.service.turn_batcher(ticket.weights)  # a call's own temperature rides on its turns
                self.runner = EpisodeRunner(
                    self.cfg, self.pool, self.turns, renderer_for(self.tokenizer), self._journal_turn, self._journal_env
                )
                self._thread = threading.Thread(target=self._drive, name="episodes", daemon=True)
                self._thread.start()
            ids = []
            for p, problem_id in enumerate(ticket.problem_ids):
                problem = self.rows[problem_id]
                row = {**problem.fields, "id": problem.id, "prompt": problem.prompt, "gold": problem.gold}
                ids.append([])
                for g in range(n):
                    key = f"p{p}g{g}"
                    seed = (ticket.seed * 1_000_003 + p * 1009 + g) % 2**31
                    episode = Episode(
                        f"{name}.{key}", row, seed, ticket.weights, replay.get(key, []), ticket.temperature
                    )
                    self.runner.start(episode)
                    ids[-1].append(episode.id)
            self._calls[name] = ids
            self._progress_at = time.monotonic()
            self._cond.notify_all()

    def _journal_turn(self, episode: Episode, turn: Recorded) -> None:
        name, _, key = episode.id.rpartition(".")
        self.journal.turn(name, key, episode.turns, turn)

    def _journal_env(self, episode: Episode, t: int, ids: list[int]) -> None:
        name, _, key = episode.id.rpartition(".")
        self.journal.env(name, key, t, ids)

    def _drive(self) -> None:
        """The driver thread: environments' answers and engine turns, until close."""
        try:
            while True:
                with self._cond:
                    if self._closing:
                        return
                    self._drop_discarded()
                    if not self.runner.running():
                        self._cond.wait(POLL_S)
                        continue
                    before = self._moves()
                    self.runner.advance(POLL_S)
                    if self._moves() != before:
                        self._progress_at = time.monotonic()
                    self._cond.notify_all()
                time.sleep(0)  # let a waiting submit or collect take the lock
        except BaseException as exc:
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _drop_discarded(self) -> None:
        for name in [
            n for n in self._discarded if all(self.runner.episodes[e].ended for ids in self._calls[n] for e in ids)
        ]:
            for ids in self._calls.pop(name):
                for episode in ids:
                    self.runner.pop(episode)
            self.journal.drop(name)
            self._discarded.discard(name)

    def _moves(self) -> tuple[int, int]:
        return (
            sum(len(e.prompt_ids) + len(e.ids) + e.turns for e in self.runner.episodes.values()),
            self.runner.running(),
        )

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _group(self, ticket: Ticket, episodes: list[Episode]) -> Group:
        prompts = {tuple(e.prompt_ids) for e in episodes}
        if len(prompts) != 1:
            raise EnvError(
                f"environment {self.cfg.env.class_}: the {len(episodes)} episodes of row {episodes[0].row['id']} "
                "start with different first messages; the episodes of a row are one GRPO group, compared on one "
                "prompt, so reset() must depend on the row alone (not on the seed)"
            )
        samples = [
            Sample(
                e.ids,
                e.logprobs,
                self.tokenizer.decode(e.ids, skip_special_tokens=True),
                e.finish_reason,
                loss_mask=e.mask,
                reward=e.reward,
                turns=e.turns,
                ended=e.ended,
                later_prompt_tokens=e.later_prompt_tokens,
                cached_tokens=e.cached_tokens,
                last_text=e.texts[-1] if e.texts else "",
            )
            for e in episodes
        ]
        return Group(list(episodes[0].prompt_ids), samples, ticket.weights_step)


class EpisodeRewards:
    """The step sampler's scorer for episodes: a sample's reward is its environment's."""

    names = ["env"]

    def score(self, problems, groups, where: str = "") -> list[GroupScores]:
        scores = []
        for group in groups:
            totals = [s.reward for s in group.samples]
            scores.append(GroupScores(totals=totals, values={"env": list(totals)}, correct=None, format_ok=None))
        return scores
