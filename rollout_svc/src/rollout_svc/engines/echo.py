"""The echo engine: no model, each completion is its prompt's text.

An operator's smoke test of a deployment (spool permissions, systemd units, producers) without
a GPU or weights. Tokens are Unicode code points: a completion is the first `max_tokens`
characters of its prompt, finishing with "length" when that cut it short and "stop" otherwise.
Each token's logprob is 0.0 (the echo is certain).
"""

from __future__ import annotations

from protocol.messages import Request

from .. import __version__
from .base import Completion


class EchoEngine:
    name = f"echo {__version__}"
    device = "cpu"
    weights_dir = None
    weights_content_id = None

    def generate(self, requests: list[Request]) -> list[Completion]:
        return [self._echo(request) for request in requests]

    @staticmethod
    def _echo(request: Request) -> Completion:
        n = request.n_samples_per_prompt
        texts, token_ids, logprobs, finish = [], [], [], []
        for prompt in request.prompts:
            text = prompt[: request.max_tokens]
            ids = [ord(c) for c in text]
            texts.append([text] * n)
            token_ids.append([ids] * n)
            logprobs.append([[0.0] * len(ids)] * n)
            finish.append(["length" if len(prompt) > request.max_tokens else "stop"] * n)
        prompt_ids = [[ord(c) for c in prompt] for prompt in request.prompts]
        return Completion(texts, token_ids, logprobs, finish, prompt_ids)

    def close(self) -> None:
        pass
