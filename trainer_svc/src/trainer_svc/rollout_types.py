"""What a sampling call asks and what comes back: plain data shared by the rollout client, the
samplers, the batch builder and the gates, with no process or spool machinery attached; and the
two ways a call fails. `Ticket` is what a checkpoint keeps of a call in flight."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from protocol import exit_codes


@dataclass(frozen=True)
class WeightsRef:
    """The weights a request names: a directory, its content id, and the step that wrote them
    (None for the starting model)."""

    dir: str
    content_id: str | None = None
    step: int | None = None


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # sampling logprob of each token, as the engine drew it (0.0 where not drawn)
    text: str
    finish_reason: str
    # A multi-turn episode (trainer_svc.envs): token_ids are every turn after the first prompt, in
    # order; loss_mask holds 1 on the ids the engine generated, 0 on the environment's (weighed 0
    # in the loss). None: one turn, every id generated.
    loss_mask: list[int] | None = None
    reward: float | None = None  # an episode's reward, as its environment gave it; None: scored by [reward]
    turns: int = 1  # assistant turns
    ended: str = ""  # why an episode ended (trainer_svc.envs.episodes); "": one turn
    # An episode's later turns: their prompt tokens, and those the engine's prefix cache served
    # (None: a worker did not say)
    later_prompt_tokens: int = 0
    cached_tokens: int | None = None
    last_text: str = ""  # an episode's last assistant turn, as the engine detokenized it; "": one turn


@dataclass
class Group:
    """G samples of one prompt."""

    prompt_ids: list[int]
    samples: list[Sample]
    weights_step: int = 0  # the published weights step the samples came from (0: the starting model)


@dataclass(frozen=True)
class Ticket:
    """One sampling call: what it asks, of which weights, and, once a sampler has sent it, the
    spool requests that carry it (empty for samplers that do not use the spool). Plain data, so
    a checkpoint can keep the calls in flight (`state_dict`, `from_state`)."""

    prompts: tuple[str | list[dict], ...]  # texts, or conversations ({role, content} turns)
    weights: WeightsRef
    step: int  # the optimizer step whose batch it samples
    attempt: int  # 0: the step's first sampling; k: its k-th dead-group retry
    seed: int
    n: int | None = None  # samples per prompt; None: rollout.samples_per_prompt
    temperature: float | None = None  # None: rollout.temperature
    tag: str = "train"
    parts: tuple[int, ...] = ()  # prompts per request, in order
    problem_ids: tuple[str, ...] = ()  # the rows the prompts are of, in order (episodes are made from the row)
    request_ids: tuple[str, ...] = ()

    @property
    def weights_step(self) -> int:
        return self.weights.step or 0

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> Ticket:
        fields = {**state, "weights": WeightsRef(**state["weights"])}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def split_sizes(total: int, parts: int) -> tuple[int, ...]:
    """`total` items in `parts` contiguous parts whose sizes differ by at most one (no empty part):
    a call's prompts over its requests (Ticket.parts), a send's turns over a worker's requests."""
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    return tuple(base + (i < extra) for i in range(parts))


class RolloutUnavailable(RuntimeError):
    """No worker can serve the trainer's requests; the message says why and what to do."""

    exit_code = exit_codes.ROLLOUT_UNAVAILABLE


class RolloutFailed(RuntimeError):
    """A worker refused a request for good (a permanent error): it fails again, sent again
    unchanged, until what the message names changes."""

    exit_code = exit_codes.USAGE  # relaunching alone cannot help
