"""The echo engine: no model, each completion is its prompt's text.

An operator's smoke test of a deployment (spool permissions, systemd units, producers) without
a GPU or weights. Tokens are Unicode code points: a completion is the first `max_tokens`
characters of its prompt, finishing with "length" when that cut it short and "stop" otherwise.
Each token's logprob is 0.0 (the echo is certain). Prompts given as token ids are echoed as
those ids, their text being the code points they name (an id past U+10FFFF is U+FFFD; one naming
a surrogate, which no text can hold, refuses its request with `invalid_request`); a conversation
(`messages`) is echoed as its last turn's text. It draws nothing at random, so its completions
depend on no seed (`seed`, `prompt_seeds`) and on no batch: each is its prompt's. It loads
nothing, so it never reports a state to its listener and every completion has a reload of 0
seconds and 0 bytes. It sleeps when asked (there is nothing to free) and is awake again at its
next call, so the worker's sleep settings can be tried without a GPU.
"""

from __future__ import annotations

from protocol.messages import ErrorCode, Request

from .. import __version__
from ..errors import RequestFailed
from .base import Completion, StateListener, ignore_state


class EchoEngine:
    name = f"echo {__version__}"
    device = "cpu"
    weights_dir = None
    weights_content_id = None
    build_s = 0.0
    asleep = False
    last_wake_s = 0.0
    state_listener = staticmethod(ignore_state)

    def set_state_listener(self, listener: StateListener) -> None:
        self.state_listener = listener  # kept for subclasses: the echo itself has no state to report

    def ensure_weights(self, weights_dir: str, expected_content_id: str | None = None) -> float:
        self.asleep = False
        return 0.0  # no weights: any weights_dir is served by echoing

    def generate(self, requests: list[Request]) -> list[Completion]:
        self.asleep = False
        return [self._echo(request) for request in requests]

    def sleep(self) -> float:
        self.asleep = True
        return 0.0

    @staticmethod
    def _echo(request: Request) -> Completion:
        n = request.n_samples_per_prompt
        # A conversation is echoed as its last turn's text.
        sources = request.prompts or [conversation[-1].content for conversation in request.messages or ()]
        prompt_ids = request.prompt_token_ids or [[ord(c) for c in p] for p in sources]
        _refuse_surrogates(prompt_ids)
        texts, token_ids, logprobs, finish = [], [], [], []
        for ids in prompt_ids:
            kept = ids[: request.max_tokens]
            texts.append(["".join(_char(i) for i in kept)] * n)
            token_ids.append([kept] * n)
            logprobs.append([[0.0] * len(kept)] * n)
            finish.append(["length" if len(ids) > request.max_tokens else "stop"] * n)
        return Completion(texts, token_ids, logprobs, finish, prompt_ids)

    def close(self) -> None:
        pass


def _refuse_surrogates(prompt_ids: list[list[int]]) -> None:
    for i, ids in enumerate(prompt_ids):
        bad = [t for t in ids if 0xD800 <= t <= 0xDFFF]
        if bad:
            raise RequestFailed(
                ErrorCode.INVALID_REQUEST,
                f"prompt_token_ids[{i}] holds {bad[:5]}: surrogate code points (U+D800..U+DFFF), which no text "
                "can hold; the echo's token ids are Unicode code points: send those of characters",
            )


def _char(code_point: int) -> str:
    return chr(code_point) if code_point <= 0x10FFFF else "\ufffd"
