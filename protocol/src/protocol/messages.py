"""Wire messages of the spool: what producers, workers and operators read and write.

Every file in `requests/`, `results/` and `workers/` is one of these structs encoded as JSON.
Decoding validates types and bounds; a field name that is not in the struct is refused, so a
typo such as `temprature` fails loudly instead of being ignored.

`SCHEMA_VERSION` is bumped only for changes an old reader cannot handle. A request with a
version this code does not know gets the `unsupported_schema` error, not a guess.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Literal

import msgspec

SCHEMA_VERSION = 1

# Ids name files, so they are restricted to a portable file-name alphabet. '@' is reserved: the
# spool uses it to join a request id and a worker id in `claimed/`, and the two lengths keep
# that name under the usual 255-byte limit. A worker id may not end in ".json": `x` claimed by
# worker `y.json` would be named as `x.json` claimed by `y`. `\Z`, not `$`: `$` also matches
# before a final newline.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z"
WORKER_ID_PATTERN = r"^(?!.*\.json\Z)[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z"
_ID_RE = re.compile(ID_PATTERN)
_WORKER_ID_RE = re.compile(WORKER_ID_PATTERN)

Id = Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]
WorkerId = Annotated[str, msgspec.Meta(pattern=WORKER_ID_PATTERN)]
Prompt = Annotated[str, msgspec.Meta(max_length=1_000_000)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]
UnitInterval = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # a 64-bit signed integer


def is_valid_id(text: str) -> bool:
    """True when `text` may be used as a request id (and so as a file name)."""
    return _ID_RE.match(text) is not None


def is_valid_worker_id(text: str) -> bool:
    return _WORKER_ID_RE.match(text) is not None


class ErrorCode(str, enum.Enum):
    """Stable error codes of a failed result. Scripts may branch on them; never renumber."""

    BAD_JSON = "bad_json"  # not JSON, or truncated
    INVALID_REQUEST = "invalid_request"  # JSON, but a field is missing, unknown, mistyped or out of range
    UNSUPPORTED_SCHEMA = "unsupported_schema"  # `schema` names a version this worker cannot read
    ID_MISMATCH = "id_mismatch"  # `request_id` differs from the file name
    TOO_LARGE = "too_large"  # file bigger than the worker accepts
    NOT_A_FILE = "not_a_file"  # a symlink, directory or other non-regular entry in requests/
    UNREADABLE = "unreadable"  # the worker may not read the file (permissions)
    BAD_RESULT = "bad_result"  # (a producer's reading) the result file is a FIFO, a link, too large or no result
    DEADLINE_EXPIRED = "deadline_expired"  # `deadline` passed before the work started
    WEIGHTS_NOT_FOUND = "weights_not_found"  # weights_dir missing or not a directory
    WEIGHTS_INVALID = "weights_invalid"  # weights_dir lacks config or safetensors, or is corrupt
    WEIGHTS_NOT_ALLOWED = "weights_not_allowed"  # weights_dir outside the worker's allowed roots
    PROMPT_TOO_LONG = "prompt_too_long"  # a prompt exceeds what the engine accepts
    ENGINE_ERROR = "engine_error"  # the engine raised serving a valid request (crashed, out of memory, process gone)
    NO_CHAT_TEMPLATE = "no_chat_template"  # `messages` given, but the loaded model's tokenizer has no chat template
    # weights_dir is a LoRA adapter this worker cannot serve: its base is not the model loaded (by
    # content id), its rank exceeds --max-lora-rank, or the worker was started without LoRA
    ADAPTER_REFUSED = "adapter_refused"
    REQUEST_TOO_LARGE = "request_too_large"  # asks more than the worker's limits (samples, prompts, tokens, bytes)

    @property
    def rejects_input(self) -> bool:
        """The request itself is at fault (unreadable, invalid, bad weights, prompt too long):
        its file is kept in bad/. A valid request that failed (deadline_expired, engine_error)
        is archived in done/ like a served one."""
        return self not in (ErrorCode.DEADLINE_EXPIRED, ErrorCode.ENGINE_ERROR)

    @property
    def transient(self) -> bool:
        """A valid request that failed for a reason of the moment (the engine crashed, ran out of
        memory or lost its process; the deadline passed): the same request sent again may
        succeed. Every other code is permanent: sent again unchanged, it fails again, until the
        request, its weights or the worker's options change."""
        return self in (ErrorCode.DEADLINE_EXPIRED, ErrorCode.ENGINE_ERROR)


class ChatTurn(msgspec.Struct, forbid_unknown_fields=True):
    """One turn of a conversation, as HF chat templates and OpenAI-style datasets write it."""

    role: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]  # "system", "user", "assistant"...
    content: Prompt


class Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A generation request: `requests/<request_id>.json`, written by a producer."""

    request_id: Id  # equals the file name without `.json`; unique per spool
    weights_dir: Annotated[str, msgspec.Meta(max_length=4096)]  # absolute path of an HF-format model directory
    prompts: list[Prompt] = []  # plain-text prompts; or give prompt_token_ids instead
    n_samples_per_prompt: PositiveInt  # G: completions sampled for each prompt
    max_tokens: PositiveInt  # cap on generated tokens per completion
    temperature: NonNegativeFloat  # 0 means greedy
    seed: int | None = None  # sampling seed; None lets the engine choose
    top_p: UnitInterval = 1.0  # nucleus sampling mass
    stop: list[str] = []  # generation stops after any of these strings
    logprobs: bool = True  # return the sampling logprob of each generated token
    deadline: float | None = None  # unix time; after it the request gets `deadline_expired`
    tag: str = ""  # free label for operators: train, eval, canary...
    prompt_token_ids: list[list[int]] | None = None  # prompts already tokenized, instead of `prompts`
    # Conversations, instead of `prompts`: the worker renders each with the chat template of the
    # model it serves (the generation prompt added) and returns the ids it rendered, so a producer
    # needs no tokenizer.
    messages: list[list[ChatTurn]] | None = None
    weights_content_id: str | None = None  # if set, weights with another content id are refused
    # The call this request is a part of: requests sent together with the same call_id go to
    # different idle workers (a worker takes only its share while others are idle). None: a call
    # of its own, batched with any request for the same weights.
    call_id: Id | None = None
    # The worker that should serve this request while it lives (it holds the episode's earlier
    # turns in its prefix cache): other workers leave it to that one for up to their
    # `--sticky-wait-s` after its arrival while that worker's heartbeat is fresh, and take it at
    # once when the worker is dead or has no status file. None: any worker.
    prefer_worker: WorkerId | None = None
    # One sampling seed per prompt, in prompt order: a prompt's samples then depend on its own
    # seed, not on which request or batch position it travelled in. Overrides `seed`'s per-prompt
    # derivation; the length must equal the number of prompts.
    prompt_seeds: list[Seed] | None = None
    schema: int = SCHEMA_VERSION  # message version, see SCHEMA_VERSION

    def __post_init__(self) -> None:
        # A relative path would resolve against each worker's own working directory.
        if not self.weights_dir.startswith("/"):
            raise ValueError(f"weights_dir must be an absolute path, got {self.weights_dir!r}")
        if sum(map(bool, (self.prompts, self.prompt_token_ids, self.messages))) != 1:
            raise ValueError(
                "give exactly one of `prompts` (texts), `prompt_token_ids` (token id lists) and `messages` "
                "(conversations), non-empty"
            )
        if self.messages and not all(self.messages):
            raise ValueError("each conversation of `messages` must hold at least one turn")
        if self.prompt_token_ids and any(not ids or min(ids) < 0 for ids in self.prompt_token_ids):
            raise ValueError("each list of `prompt_token_ids` must be non-empty and hold ids >= 0")
        if self.prompt_seeds is not None and len(self.prompt_seeds) != self.num_prompts:
            raise ValueError(
                f"`prompt_seeds` holds {len(self.prompt_seeds)} seeds for {self.num_prompts} prompts; "
                "give one per prompt"
            )

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) or len(self.prompt_token_ids or ()) or len(self.messages or ())

    @property
    def num_sequences(self) -> int:
        """Completions this request asks for."""
        return self.num_prompts * self.n_samples_per_prompt


class Error(msgspec.Struct, forbid_unknown_fields=True):
    """Why a request failed."""

    code: ErrorCode  # stable, for scripts
    message: str  # for people: names the problem and, where it can, what to do


class Timings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Seconds spent on a request by the worker that published its result."""

    queued_s: float = 0.0  # from the request file's arrival in requests/ to its claim
    reload_s: float = 0.0  # weight reload done for this request (0 when already loaded)
    # Bytes of the weight files that reload loaded (the safetensors shards' total size; 0 when
    # already loaded). Optional with a default, so results written before it existed still decode.
    reload_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    generate_s: float = 0.0  # engine time of the call that served this request


class Result(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The outcome of one request: `results/<request_id>.json`, written once by a worker.

    Per-sample fields are nested as [prompt][sample][token]. On failure `ok` is false, `error`
    says why and the per-sample lists are empty.
    """

    request_id: Id
    ok: bool
    error: Error | None = None
    texts: list[list[str]] = []  # [prompt][sample] generated text (prompt not included)
    token_ids: list[list[list[int]]] = []  # [prompt][sample][token] generated token ids
    logprobs: list[list[list[float]]] = []  # [prompt][sample][token] sampling logprob, <= 0
    finish_reasons: list[list[str]] = []  # [prompt][sample] "stop" or "length"
    prompt_token_ids: list[list[int]] = []  # [prompt][token] the prompt as the engine saw it
    # [prompt] how many of the prompt's tokens the engine's prefix cache served (an episode's
    # earlier turns, on the worker that served them); empty where the engine does not say.
    prompt_cached_tokens: list[Annotated[int, msgspec.Meta(ge=0)]] = []
    weights_dir: str = ""  # the weights actually used
    weights_content_id: str = ""  # content id of those weights (empty for engines without weights)
    worker_id: str = ""  # who produced this result
    engine: str = ""  # engine name and version
    timings: Timings = msgspec.field(default_factory=Timings)
    finished_at: float = 0.0  # unix time the result was written
    schema: int = SCHEMA_VERSION

    @classmethod
    def failure(cls, request_id: str, code: ErrorCode, message: str, **fields) -> Result:
        return cls(request_id=request_id, ok=False, error=Error(code, message), **fields)


# sleeping: the engine's weights and KV cache are freed (a GPU shared with a trainer); the next
# request wakes it and reloads weights first.
WorkerState = Literal["starting", "loading", "idle", "sleeping", "generating", "reloading", "stopping"]


class WorkerCounters(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    requests_ok: int = 0  # results published with ok=true
    requests_failed: int = 0  # error results published
    requests_abandoned: int = 0  # claims given back or dropped without a result
    samples: int = 0  # completions generated
    engine_calls: int = 0  # calls into the engine: the requests batched into one call count once
    tokens: int = 0  # generated tokens


class WorkerStatus(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`workers/<worker_id>.json`, rewritten by the worker at every heartbeat.

    The file is the heartbeat. A worker whose file has not changed for its `lease_s`, as another
    process watched it (protocol/leases.py: no clocks of two hosts compared), is dead:
    its claims are put back in `requests/`.
    """

    worker_id: WorkerId
    pid: int
    host: str
    device: str  # "cpu", "cuda:0"...
    engine: str  # engine name and version
    state: WorkerState
    lease_s: float  # heartbeat age after which this worker counts as dead
    started_at: float  # unix time
    heartbeat_at: float  # unix time of this write (the mtime says the same)
    current_request: str | None = None  # id being served, if any
    weights_dir: str | None = None  # weights loaded in the engine
    weights_content_id: str | None = None
    engine_build_s: float | None = None  # seconds the last engine build took (a reload avoids it)
    counters: WorkerCounters = msgspec.field(default_factory=WorkerCounters)
    last_error: str | None = None  # the newest error message, for operators
    schema: int = SCHEMA_VERSION


class _Envelope(msgspec.Struct):
    """The part of any message read before the rest: its schema version. Unknown fields pass."""

    schema: int = SCHEMA_VERSION


_encoder = msgspec.json.Encoder()
_envelope_decoder = msgspec.json.Decoder(_Envelope)
_request_decoder = msgspec.json.Decoder(Request)
_result_decoder = msgspec.json.Decoder(Result)
_status_decoder = msgspec.json.Decoder(WorkerStatus)


class MessageError(ValueError):
    """A message file that cannot be accepted; `code` says which way it is wrong."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def encode_pretty(message: msgspec.Struct) -> bytes:
    """Indented JSON for files people read (`cat` in an operator's terminal)."""
    return msgspec.json.format(_encoder.encode(message), indent=2) + b"\n"


def _decode(data: bytes, decoder: msgspec.json.Decoder, what: str):
    try:
        version = _envelope_decoder.decode(data).schema
    except msgspec.ValidationError as exc:
        raise MessageError(ErrorCode.INVALID_REQUEST, f"{what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise MessageError(
            ErrorCode.BAD_JSON, f"{what} is not a complete JSON object ({exc}); rewrite the whole file"
        ) from None
    except RecursionError:
        raise MessageError(ErrorCode.BAD_JSON, f"{what} is nested too deeply to be a request") from None
    if version != SCHEMA_VERSION:
        raise MessageError(
            ErrorCode.UNSUPPORTED_SCHEMA,
            f"{what} has schema {version}, this reader understands only schema {SCHEMA_VERSION}; "
            "upgrade the reader or write the message in its schema",
        )
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise MessageError(ErrorCode.INVALID_REQUEST, f"{what}: {exc}") from None
    except msgspec.DecodeError as exc:  # valid envelope but broken further on
        raise MessageError(ErrorCode.BAD_JSON, f"{what} is not valid JSON ({exc})") from None
    except RecursionError:
        raise MessageError(ErrorCode.BAD_JSON, f"{what} is nested too deeply to be a request") from None


def validate(message: msgspec.Struct) -> None:
    """Check a message built in Python as a reader will: msgspec checks constraints on decode
    only, so a Request(max_tokens=0) built in code is caught here, before it is published."""
    data = _encoder.encode(message)
    decoder = {Request: _request_decoder, Result: _result_decoder, WorkerStatus: _status_decoder}[type(message)]
    _decode(data, decoder, type(message).__name__.lower())


def decode_request(data: bytes) -> Request:
    """Decode and validate a request; raises MessageError with the right code."""
    return _decode(data, _request_decoder, "request")


def decode_result(data: bytes) -> Result:
    return _decode(data, _result_decoder, "result")


def decode_status(data: bytes) -> WorkerStatus:
    return _decode(data, _status_decoder, "worker status")
