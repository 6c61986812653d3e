"""What one request may ask of a worker, and what one result may weigh.

A request is small on disk and can ask for a lot: 141 bytes asking `n_samples_per_prompt:
1000000` made a 112 MB result. The limits bound what a request makes the worker hold and write;
the defaults fit a worker's memory (about 4 M generated tokens, a result of at most 256 MiB) and
leave the trainer's own requests far inside them (configs/*.toml ask at most 64 prompts x 8
samples x 16 tokens per request; an eval request 64 prompts).

Guarantees:
- A request asking more samples per prompt, more prompts, or more generated tokens (prompts x
  samples x max_tokens) than the limits is answered `request_too_large` before the engine sees
  it, the message naming the limit, the request's value and the `rollout-svc serve` option that
  raises it. It is permanent (sent again unchanged it fails again) and the file is kept in bad/.
- A result whose encoding is larger than `max_result_bytes` is replaced by the same error
  (naming --max-result-bytes); a result that cannot be encoded at all (text that is no valid
  Unicode) becomes that request's `engine_error`. Either way only that request is affected: the
  results of its batch are checked one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import ErrorCode, Request, Result, encode


@dataclass(frozen=True)
class RequestLimits:
    max_samples: int = 1024  # n_samples_per_prompt of one request
    max_prompts: int = 4096  # prompts (texts, token id lists or conversations) of one request
    max_request_tokens: int = 4 * 2**20  # prompts x samples x max_tokens: tokens one request may ask for
    max_result_bytes: int = 256 * 2**20  # one result's file

    def refusal(self, request: Request) -> str | None:
        """Why `request` asks too much of this worker (a message for its error result), or None."""
        asked = request.num_sequences * request.max_tokens
        for value, limit, what, option in (
            (request.n_samples_per_prompt, self.max_samples, "n_samples_per_prompt", "--max-samples"),
            (request.num_prompts, self.max_prompts, "prompts", "--max-prompts"),
            (asked, self.max_request_tokens, "prompts x n_samples_per_prompt x max_tokens", "--max-request-tokens"),
        ):
            if value > limit:
                return (
                    f"the request asks for {what} = {value}, above this worker's limit of {limit}; "
                    f"split it into smaller requests, or start the worker with a larger {option} "
                    "if its memory and disk can hold the result"
                )
        return None

    def unpublishable(self, result: Result) -> tuple[ErrorCode, str] | None:
        """Why `result` cannot be published as it is (an error code and message), or None."""
        try:
            size = len(encode(result))
        except Exception as exc:  # any failure here is this result's, not the batch's
            message = f"{type(exc).__name__}: {exc}".encode("utf-8", "backslashreplace").decode()
            return ErrorCode.ENGINE_ERROR, f"the result cannot be encoded as JSON ({message})"
        if size > self.max_result_bytes:
            return (
                ErrorCode.REQUEST_TOO_LARGE,
                f"the result is {size} bytes, above this worker's limit of {self.max_result_bytes} "
                "(--max-result-bytes); ask for fewer prompts, samples or tokens per request, or start the "
                "worker with a larger --max-result-bytes",
            )
        return None
