"""The episode runner: each episode's turns, between its environment (in the pool) and the
engine (through the turns of a TurnBatcher), as one sequence of exact token ids.

An episode goes: create (its environment instance is made from the row and gives the first
messages) -> engine turn (a Turn carrying the exact prompt ids, its seed, and the worker that
served the episode's previous turn as `prefer_worker`) -> environment step (the assistant's text
in, the next messages, a reward and done out) -> engine turn ... until it ends:
- "done": the environment said so;
- "max_turns": `env.max_turns` assistant turns were taken;
- "length": the assistant's turn was cut at rollout.max_tokens and the chat template has no way
  to continue after it (no end-of-turn token; the environment still got the text, for its
  reward). Without a chat template the environment's text is appended after the cut turn;
- "tokens": the next environment turn plus a full assistant turn would pass
  `env.max_episode_tokens`;
- "drift": the chat template renders the conversation so far otherwise than the ids held
  (trainer_svc.envs.render; with env.drift = "refuse" this is an EnvError instead).

The sequence a sample trains on is the first prompt's ids, then each assistant turn's engine ids
(loss mask 1, the engine's logprobs) and each environment turn's suffix ids (loss mask 0): the
ids the next turn's request carried, so the trained ids are the ids the engine saw, turn by turn.
Its reward is the sum of the environment's step rewards.

Replay (a resume): an episode given recorded assistant turns takes them in place of engine
calls, in order, and checks that the environment answers each with the environment ids recorded
(EnvError otherwise: the environment is not a deterministic function of its row, seed and the
assistant texts). Turns after the recorded ones go to the engine as usual.

Not thread-safe: one thread drives a runner (trainer_svc.envs.sampler's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import Config
from ..rollout.turn_batcher import Turn
from ..rollout_types import WeightsRef
from .errors import EnvError
from .pool import EnvCall, EnvPool
from .render import Renderer


@dataclass
class Recorded:
    """One answered assistant turn, as the journal keeps it."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    worker_id: str = ""
    env_ids: list[int] | None = None  # the environment turn's ids appended after it; None: not known


@dataclass
class Episode:
    id: str  # unique among the runner's episodes; its turns' keys are "<id>.t<turn>"
    row: dict
    seed: int
    weights: WeightsRef
    replay: list[Recorded] = field(default_factory=list)  # recorded turns to take before asking the engine
    temperature: float | None = None  # its turns' sampling temperature; None: the run's
    prompt_ids: list[int] = field(default_factory=list)  # the first prompt
    ids: list[int] = field(default_factory=list)  # every id after the first prompt
    mask: list[int] = field(default_factory=list)  # 1: the engine's id, 0: the environment's
    logprobs: list[float] = field(default_factory=list)  # the engine's per id, 0.0 on the environment's
    messages: list[dict] = field(default_factory=list)  # the conversation so far
    tools: list[dict] = field(default_factory=list)  # the tools' schemas
    texts: list[str] = field(default_factory=list)  # the assistant's text per turn
    reward: float = 0.0
    finish_reason: str = ""  # the last assistant turn's
    worker: str | None = None  # the worker that served the last turn
    ended: str = ""  # why it ended ("" while it runs)
    # Later turns (not the first) answered by the engine: their prompt tokens, and those the
    # worker's prefix cache served (None once a worker did not say).
    later_prompt_tokens: int = 0
    cached_tokens: int | None = 0

    @property
    def turns(self) -> int:
        return len(self.texts)

    def turn_seed(self) -> int:
        return (self.seed * 1_000_003 + self.turns) % 2**31


class EpisodeRunner:
    def __init__(
        self,
        cfg: Config,
        pool: EnvPool,
        turns,  # TurnBatcher's interface: put, poll, set_weights
        renderer: Renderer,
        on_turn: Callable[[Episode, Recorded], None] = lambda episode, turn: None,
        on_env: Callable[[Episode, int, list[int]], None] = lambda episode, turn, ids: None,
    ):
        self.cfg, self.env = cfg, cfg.env
        self.pool, self.turns, self.renderer = pool, turns, renderer
        self.on_turn, self.on_env = on_turn, on_env  # the journal's hooks: an answered turn, its environment ids
        self.episodes: dict[str, Episode] = {}
        self.drift_ends = 0
        self._weights: WeightsRef | None = None

    def start(self, episode: Episode) -> None:
        self.episodes[episode.id] = episode
        self.pool.submit(EnvCall(episode.id, 0, "create", (episode.row, episode.seed)))

    def running(self) -> int:
        return sum(not e.ended for e in self.episodes.values())

    def advance(self, timeout_s: float) -> None:
        """Take what the environments and the engine have answered (waiting up to `timeout_s`
        for the engine when no environment call is under way)."""
        for call, value in self.pool.poll():
            episode = self.episodes[call.episode]
            if call.kind == "create":
                self._created(episode, value)
            else:
                self._stepped(episode, value)
        wait = 0.005 if self.pool.busy() else timeout_s
        for outcome in self.turns.poll(wait):
            episode = self.episodes[outcome.key.rpartition(".t")[0]]
            recorded = Recorded(
                outcome.token_ids, outcome.logprobs, outcome.text, outcome.finish_reason, outcome.worker_id
            )
            if episode.turns > 0:  # a later turn: its prompt holds the episode's earlier turns
                episode.later_prompt_tokens += len(episode.prompt_ids) + len(episode.ids)
                known = episode.cached_tokens is not None and outcome.cached_tokens is not None
                episode.cached_tokens = episode.cached_tokens + outcome.cached_tokens if known else None
            self.on_turn(episode, recorded)
            self._answered(episode, recorded)

    def pop(self, episode_id: str) -> Episode:
        return self.episodes.pop(episode_id)

    # -- the steps of an episode -------------------------------------------------------------------

    def _created(self, episode: Episode, value: dict) -> None:
        episode.messages, episode.tools = list(value["messages"]), list(value["tools"])
        episode.prompt_ids = self.renderer.first_ids(episode.messages, episode.tools)
        if not episode.prompt_ids:
            raise EnvError(
                f"environment {self.env.class_} (episode {episode.id}, turn 0): its first messages render to no tokens"
            )
        self._ask(episode)

    def _ask(self, episode: Episode) -> None:
        """The next assistant turn: a recorded one where the replay has it, else the engine's."""
        if len(episode.replay) > episode.turns:
            self._answered(episode, episode.replay[episode.turns])
            return
        if self._weights != episode.weights:
            self.turns.set_weights(episode.weights.dir, episode.weights.content_id)
            self._weights = episode.weights
        prompt = episode.prompt_ids + episode.ids
        key = f"{episode.id}.t{episode.turns}"
        self.turns.put(Turn(key, prompt, episode.turn_seed(), episode.worker, episode.temperature))

    def _answered(self, episode: Episode, turn: Recorded) -> None:
        episode.ids += turn.token_ids
        episode.mask += [1] * len(turn.token_ids)
        episode.logprobs += turn.logprobs
        episode.texts.append(turn.text)
        episode.messages.append({"role": "assistant", "content": turn.text})
        episode.finish_reason, episode.worker = turn.finish_reason, turn.worker_id or episode.worker
        self.pool.submit(EnvCall(episode.id, episode.turns, "step", (turn.text,)))

    def _stepped(self, episode: Episode, value: dict) -> None:
        episode.reward += value["reward"]
        if value["done"]:
            return self._end(episode, "done")
        if episode.turns >= self.env.max_turns:
            return self._end(episode, "max_turns")
        suffix = self.renderer.suffix_ids(value["messages"], episode.tools, episode.ids[-1]) if episode.ids else None
        if suffix is None and episode.finish_reason == "length":  # cut short: no end-of-turn to continue after
            return self._end(episode, "length")
        conversation = episode.messages + value["messages"]
        if suffix is None or not self.renderer.agrees(
            conversation, episode.tools, episode.prompt_ids + episode.ids + suffix
        ):
            return self._drift(episode)
        self._check_replay(episode, suffix)
        self.on_env(episode, episode.turns - 1, suffix)
        if (
            len(episode.prompt_ids) + len(episode.ids) + len(suffix) + self.cfg.rollout.max_tokens
            > self.env.max_episode_tokens
        ):
            return self._end(episode, "tokens")
        episode.ids += suffix
        episode.mask += [0] * len(suffix)
        episode.logprobs += [0.0] * len(suffix)
        episode.messages = conversation
        self._ask(episode)

    def _check_replay(self, episode: Episode, suffix: list[int]) -> None:
        turn = episode.turns - 1
        if turn < len(episode.replay) and episode.replay[turn].env_ids not in (None, suffix):
            raise EnvError(
                f"environment {self.env.class_} (episode {episode.id}, turn {episode.turns}) answered the replayed "
                "assistant turns of a resume otherwise than it did before the stop: an environment must be a "
                "deterministic function of its row, its seed and the assistant texts it is given (no clock, no "
                "unseeded randomness, no outside state). Make it so, then relaunch"
            )

    def _drift(self, episode: Episode) -> None:
        if self.env.drift == "refuse":
            raise EnvError(
                f"environment {self.env.class_} (episode {episode.id}, turn {episode.turns}): the chat template of "
                f"{self.cfg.model.path} renders the conversation so far otherwise than the token ids the engine saw "
                "(a template that rewrites earlier turns, such as one dropping earlier reasoning, or an assistant "
                'turn that did not end with the template\'s end-of-turn token). Set env.drift = "end" to end such '
                "episodes there (the sample keeps the ids the engine saw), or use a template that keeps history as "
                "written"
            )
        self.drift_ends += 1
        self._end(episode, "drift")

    def _end(self, episode: Episode, why: str) -> None:
        episode.ended = why
        self.pool.end(episode.id)
