"""Property tests of the wire messages: round trips, and refusal of every invalid field."""

from __future__ import annotations

import json
import string

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from protocol.messages import (
    SCHEMA_VERSION,
    ChatTurn,
    Error,
    ErrorCode,
    MessageError,
    Request,
    Result,
    Timings,
    WorkerCounters,
    WorkerStatus,
    decode_request,
    decode_result,
    decode_status,
    encode,
    encode_pretty,
    is_valid_id,
    is_valid_worker_id,
)

# -- strategies built from the field constraints ---------------------------------------------------

ID_FIRST = string.ascii_letters + string.digits
ID_REST = ID_FIRST + "._-"

ids = st.builds(lambda a, b: a + b, st.sampled_from(ID_FIRST), st.text(ID_REST, max_size=127))
abs_paths = st.builds(lambda rest: "/" + rest, st.text(max_size=60))
finite = dict(allow_nan=False, allow_infinity=False)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
positive = st.integers(min_value=1, max_value=2**63 - 1)

text_prompts = st.fixed_dictionaries({"prompts": st.lists(st.text(max_size=40), min_size=1, max_size=4)})
token_prompts = st.fixed_dictionaries(
    {
        "prompt_token_ids": st.lists(
            st.lists(st.integers(min_value=0, max_value=2**40), min_size=1, max_size=8), min_size=1, max_size=4
        )
    }
)
turns = st.builds(ChatTurn, st.sampled_from(["system", "user", "assistant"]), st.text(max_size=40))
chat_prompts = st.fixed_dictionaries(
    {"messages": st.lists(st.lists(turns, min_size=1, max_size=3), min_size=1, max_size=3)}
)
requests = st.builds(
    lambda prompts, **fields: Request(**prompts, **fields),
    text_prompts | token_prompts | chat_prompts,
    request_id=ids,
    weights_dir=abs_paths,
    weights_content_id=st.none() | st.text(max_size=20),
    n_samples_per_prompt=positive,
    max_tokens=positive,
    temperature=st.floats(min_value=0.0, **finite),
    seed=st.none() | int64,
    top_p=st.floats(min_value=0.0, max_value=1.0, exclude_min=True),
    stop=st.lists(st.text(max_size=10), max_size=3),
    logprobs=st.booleans(),
    deadline=st.none() | st.floats(**finite),
    tag=st.text(max_size=20),
)

errors = st.builds(Error, st.sampled_from(list(ErrorCode)), st.text(max_size=80))
small_floats = st.floats(width=32, **finite)


def nested(leaf, depth):
    strategy = leaf
    for _ in range(depth):
        strategy = st.lists(strategy, max_size=3)
    return strategy


results = st.builds(
    Result,
    request_id=ids,
    ok=st.booleans(),
    error=st.none() | errors,
    texts=nested(st.text(max_size=10), 2),
    token_ids=nested(st.integers(min_value=0, max_value=2**31), 3),
    logprobs=nested(st.floats(max_value=0.0, **finite), 3),
    finish_reasons=nested(st.sampled_from(["stop", "length"]), 2),
    prompt_token_ids=nested(st.integers(min_value=0, max_value=2**31), 2),
    weights_dir=st.text(max_size=30),
    weights_content_id=st.text(max_size=30),
    worker_id=st.text(max_size=30),
    engine=st.text(max_size=30),
    timings=st.builds(Timings, queued_s=small_floats, reload_s=small_floats, generate_s=small_floats),
    finished_at=st.floats(**finite),
)

statuses = st.builds(
    WorkerStatus,
    worker_id=ids.filter(is_valid_worker_id),
    pid=st.integers(min_value=1, max_value=2**31),
    host=st.text(max_size=30),
    device=st.sampled_from(["cpu", "cuda:0", "cuda:7"]),
    engine=st.text(max_size=30),
    state=st.sampled_from(["starting", "loading", "idle", "sleeping", "generating", "reloading", "stopping"]),
    lease_s=st.floats(min_value=0.0, **finite),
    started_at=st.floats(**finite),
    heartbeat_at=st.floats(**finite),
    current_request=st.none() | ids,
    weights_dir=st.none() | abs_paths,
    weights_content_id=st.none() | st.text(max_size=20),
    counters=st.builds(
        WorkerCounters,
        requests_ok=st.integers(min_value=0, max_value=2**40),
        requests_failed=st.integers(min_value=0, max_value=2**40),
        requests_abandoned=st.integers(min_value=0, max_value=2**40),
        samples=st.integers(min_value=0, max_value=2**40),
        tokens=st.integers(min_value=0, max_value=2**40),
    ),
    last_error=st.none() | st.text(max_size=40),
)

VALID = {
    "request_id": "r1",
    "weights_dir": "/models/m",
    "prompts": ["a"],
    "n_samples_per_prompt": 1,
    "max_tokens": 4,
    "temperature": 0.5,
}


def as_json(**changes) -> bytes:
    """A request as JSON, with fields replaced (or removed, when the value is `...`)."""
    fields = {**VALID, **changes}
    return json.dumps({k: v for k, v in fields.items() if v is not ...}).encode()


def refused(data: bytes, decoder=decode_request) -> MessageError:
    with pytest.raises(MessageError) as info:
        decoder(data)
    return info.value


# -- round trips -----------------------------------------------------------------------------------


@given(requests)
def test_request_round_trip(request):
    assert decode_request(encode(request)) == request
    assert decode_request(encode_pretty(request)) == request


@given(results)
def test_result_round_trip(result):
    assert decode_result(encode(result)) == result


@given(statuses)
def test_status_round_trip(status):
    assert decode_status(encode_pretty(status)) == status


@given(errors)
def test_error_round_trip(error):
    decoded = msgspec.json.decode(encode(error), type=Error)
    assert decoded == error
    assert isinstance(decoded.code, ErrorCode)


@given(ids)
def test_generated_ids_are_valid(text):
    assert is_valid_id(text)


@pytest.mark.parametrize("text", ["", "-a", ".a", "_a", "a b", "a/b", "a@b", "é", "a" * 129, "a\n", "a\x00"])
def test_invalid_ids(text):
    assert not is_valid_id(text)


def test_defaults_of_optional_request_fields():
    request = decode_request(as_json())
    assert (request.seed, request.top_p, request.stop, request.logprobs) == (None, 1.0, [], True)
    assert (request.deadline, request.tag, request.schema) == (None, "", SCHEMA_VERSION)
    assert (request.prompt_token_ids, request.weights_content_id) == (None, None)
    assert (request.prefer_worker, request.prompt_seeds) == (None, None)


def test_failure_result_carries_code_and_message():
    result = decode_result(encode(Result.failure("r1", ErrorCode.ENGINE_ERROR, "boom")))
    assert result.ok is False
    assert result.error == Error(ErrorCode.ENGINE_ERROR, "boom")
    assert result.texts == [] and result.token_ids == []


def test_error_codes_are_stable():
    """Scripts branch on these strings; renaming one breaks them."""
    assert {c.value for c in ErrorCode} == {
        "bad_result",  # a producer's own: a result file it cannot use
        "bad_json", "invalid_request", "unsupported_schema", "id_mismatch", "too_large", "not_a_file",
        "unreadable", "deadline_expired", "weights_not_found", "weights_invalid", "weights_not_allowed",
        "prompt_too_long", "engine_error", "no_chat_template", "adapter_refused", "request_too_large",
    }  # fmt: skip


# -- refusal of invalid fields ---------------------------------------------------------------------

INVALID_FIELDS = [
    ("request_id", ""),
    ("request_id", "-leading-dash"),
    ("request_id", "has space"),
    ("request_id", "a/b"),
    ("request_id", "a@b"),
    ("request_id", "x" * 129),
    ("request_id", 7),
    ("weights_dir", "models/relative"),
    ("weights_dir", ""),
    ("weights_dir", "/" + "a" * 4096),
    ("weights_dir", None),
    ("prompts", "a string"),
    ("prompts", [1]),
    ("prompts", ["x" * 1_000_001]),
    ("n_samples_per_prompt", 0),
    ("n_samples_per_prompt", -3),
    ("n_samples_per_prompt", "2"),
    ("n_samples_per_prompt", 1.5),
    ("n_samples_per_prompt", True),
    ("max_tokens", 0),
    ("max_tokens", "16"),
    ("max_tokens", 16.0),
    ("max_tokens", None),
    ("temperature", -0.1),
    ("temperature", "0.5"),
    ("temperature", None),
    ("temperature", True),
    ("seed", "7"),
    ("seed", 1.5),
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -1),
    ("top_p", "1"),
    ("stop", "###"),
    ("stop", [1]),
    ("logprobs", "yes"),
    ("logprobs", 1),
    ("deadline", "tomorrow"),
    ("tag", 3),
    ("schema", "1"),
    ("schema", 1.0),
    ("schema", None),
]


@pytest.mark.parametrize(("field", "value"), INVALID_FIELDS, ids=[f"{f}={v!r:.20}" for f, v in INVALID_FIELDS])
def test_invalid_field_refused_with_its_path(field, value):
    error = refused(as_json(**{field: value}))
    assert error.code is ErrorCode.INVALID_REQUEST
    assert names_field(error.message, field)


def names_field(message: str, field: str) -> bool:
    """msgspec names the path (`$.max_tokens`); checks done in __post_init__ name the field."""
    return f"`$.{field}" in message or message.startswith(f"request: {field} ") or f"`{field}`" in message


@given(st.sampled_from(["n_samples_per_prompt", "max_tokens"]), st.integers(max_value=0))
def test_non_positive_counts_refused(field, value):
    error = refused(as_json(**{field: value}))
    assert error.code is ErrorCode.INVALID_REQUEST
    assert f"`$.{field}`" in error.message


@given(st.floats(max_value=0.0, exclude_max=True, **finite))
def test_negative_temperature_refused(value):
    error = refused(as_json(temperature=value))
    assert error.code is ErrorCode.INVALID_REQUEST and "`$.temperature`" in error.message


@given(st.floats(max_value=0.0, **finite) | st.floats(min_value=1.0, exclude_min=True, **finite))
def test_top_p_outside_unit_interval_refused(value):
    error = refused(as_json(top_p=value))
    assert error.code is ErrorCode.INVALID_REQUEST and "`$.top_p`" in error.message


@given(st.text(max_size=20).filter(lambda s: not s.startswith("/")))
def test_relative_weights_dir_refused(value):
    error = refused(as_json(weights_dir=value))
    assert error.code is ErrorCode.INVALID_REQUEST and names_field(error.message, "weights_dir")


@given(st.text(max_size=140).filter(lambda s: not is_valid_id(s) and not is_valid_id(s.removesuffix("\n"))))
def test_invalid_request_id_refused(value):
    error = refused(as_json(request_id=value))
    assert error.code is ErrorCode.INVALID_REQUEST and "`$.request_id`" in error.message


@pytest.mark.parametrize("field", ["request_id", "worker_id"])
def test_id_with_trailing_newline_refused(field):
    if field == "request_id":
        error = refused(as_json(request_id="abc\n"))
    else:
        status = WorkerStatus(
            worker_id="w1", pid=1, host="h", device="cpu", engine="echo", state="idle", lease_s=30.0,
            started_at=0.0, heartbeat_at=0.0,
        )  # fmt: skip
        data = msgspec.json.encode({**msgspec.to_builtins(status), "worker_id": "w1\n"})
        error = refused(data, decode_status)
    assert error.code is ErrorCode.INVALID_REQUEST


REQUIRED = sorted(f.name for f in msgspec.structs.fields(Request) if f.required)


def test_required_fields_are_those_of_the_contract():
    assert REQUIRED == ["max_tokens", "n_samples_per_prompt", "request_id", "temperature", "weights_dir"]


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field_refused(field):
    error = refused(as_json(**{field: ...}))
    assert error.code is ErrorCode.INVALID_REQUEST
    assert "missing required field" in error.message and f"`{field}`" in error.message


@pytest.mark.parametrize(
    "prompts",
    [
        {"prompts": ...},
        {"prompts": []},
        {"prompts": [], "prompt_token_ids": []},
        {"prompts": ..., "prompt_token_ids": None},
        {"prompt_token_ids": [[1, 2]]},  # and `prompts` too: exactly one is allowed
        {"messages": [[{"role": "user", "content": "hi"}]]},
        {"prompts": ..., "messages": []},
        {"prompts": ..., "messages": [[{"role": "user", "content": "hi"}]], "prompt_token_ids": [[1]]},
    ],
)
def test_exactly_one_kind_of_prompt(prompts):
    error = refused(as_json(**prompts))
    assert error.code is ErrorCode.INVALID_REQUEST
    assert all(f"`{kind}`" in error.message for kind in ("prompts", "prompt_token_ids", "messages"))


@pytest.mark.parametrize(
    "messages",
    [
        [[]],  # a conversation without turns
        [[{"role": "user"}]],
        [[{"role": "", "content": "hi"}]],
        [[{"role": "user", "content": "hi", "name": "x"}]],  # an unknown key, refused as everywhere
        [[{"role": "user", "content": 3}]],
        [{"role": "user", "content": "hi"}],  # one conversation, not a list of them
    ],
)
def test_invalid_messages_refused(messages):
    error = refused(as_json(prompts=..., messages=messages))
    assert error.code is ErrorCode.INVALID_REQUEST
    assert "messages" in error.message or "turn" in error.message, error.message


def test_a_chat_request_counts_its_conversations():
    chat = [[ChatTurn("system", "be brief"), ChatTurn("user", "2+2?")], [ChatTurn("user", "3+3?")]]
    request = Request(
        request_id="c", weights_dir="/w", messages=chat, n_samples_per_prompt=4, max_tokens=8, temperature=1.0
    )
    assert (request.num_prompts, request.num_sequences) == (2, 8)


@pytest.mark.parametrize("token_ids", [[[]], [[1], []], [[-1]], [[3, -2]], [["a"]], [1, 2], "1 2"])
def test_invalid_prompt_token_ids_refused(token_ids):
    error = refused(as_json(prompts=..., prompt_token_ids=token_ids))
    assert error.code is ErrorCode.INVALID_REQUEST
    assert "prompt_token_ids" in error.message


def test_prompt_token_ids_accepted_instead_of_prompts():
    request = decode_request(as_json(prompts=..., prompt_token_ids=[[1, 2], [3]]))
    assert request.prompts == [] and request.prompt_token_ids == [[1, 2], [3]]
    assert request.num_prompts == 2 and request.num_sequences == 2 * VALID["n_samples_per_prompt"]


@given(
    st.lists(int64, min_size=1, max_size=6).flatmap(
        lambda seeds: st.tuples(st.just(seeds), text_prompts | token_prompts | chat_prompts)
    ),
    st.sampled_from([None, "worker-0", "gpu3.host-b"]),
)
def test_prompt_seeds_and_prefer_worker_round_trip(seeds_and_prompts, worker):
    seeds, prompts = seeds_and_prompts
    count = len(next(iter(prompts.values())))
    seeds = (seeds * count)[:count]  # one per prompt
    request = Request(
        request_id="r", weights_dir="/w", n_samples_per_prompt=1, max_tokens=1, temperature=1.0,
        prompt_seeds=seeds, prefer_worker=worker, **prompts,
    )  # fmt: skip
    assert decode_request(encode(request)) == request


@pytest.mark.parametrize("seeds", [[], [1], [1, 2, 3]])
def test_prompt_seeds_of_another_length_than_the_prompts_refused(seeds):
    error = refused(as_json(prompts=["a", "b"], prompt_seeds=seeds))
    assert error.code is ErrorCode.INVALID_REQUEST
    assert f"holds {len(seeds)} seeds for 2 prompts" in error.message and "one per prompt" in error.message


@pytest.mark.parametrize("seeds", [[2**63], [-(2**63) - 1], [1.5], ["7"], 7])
def test_prompt_seeds_outside_64_bits_or_not_integers_refused(seeds):
    error = refused(as_json(prompt_seeds=seeds))
    assert error.code is ErrorCode.INVALID_REQUEST and "prompt_seeds" in error.message


@pytest.mark.parametrize("worker", ["", "a b", "w.json", "-w", "w@x", 3])
def test_prefer_worker_that_is_no_worker_id_refused(worker):
    error = refused(as_json(prefer_worker=worker))
    assert error.code is ErrorCode.INVALID_REQUEST and "prefer_worker" in error.message


@given(st.text(min_size=1, max_size=20).filter(lambda name: name not in Request.__struct_fields__))
def test_unknown_request_field_refused(name):
    error = refused(as_json(**{name: 1}))
    assert error.code is ErrorCode.INVALID_REQUEST
    assert "unknown field" in error.message


def test_typo_named_in_refusal():
    error = refused(as_json(temprature=0.5))
    assert error.code is ErrorCode.INVALID_REQUEST and "`temprature`" in error.message


def test_unknown_result_and_status_fields_refused():
    result = msgspec.to_builtins(Result.failure("r1", ErrorCode.ENGINE_ERROR, "x"))
    error = refused(json.dumps({**result, "extra": 1}).encode(), decode_result)
    assert error.code is ErrorCode.INVALID_REQUEST and "`extra`" in error.message
    result["error"]["code"] = "no_such_code"
    error = refused(json.dumps(result).encode(), decode_result)
    assert error.code is ErrorCode.INVALID_REQUEST and "`$.error.code`" in error.message


def test_status_refuses_unknown_state():
    status = WorkerStatus(
        worker_id="w1", pid=1, host="h", device="cpu", engine="echo", state="idle", lease_s=30.0,
        started_at=0.0, heartbeat_at=0.0,
    )  # fmt: skip
    data = msgspec.to_builtins(status)
    data["state"] = "dreaming"
    error = refused(json.dumps(data).encode(), decode_status)
    assert error.code is ErrorCode.INVALID_REQUEST and "`$.state`" in error.message


# -- schema versions -------------------------------------------------------------------------------


@given(st.integers().filter(lambda v: v != SCHEMA_VERSION))
def test_unknown_schema_version_refused(version):
    error = refused(as_json(schema=version))
    assert error.code is ErrorCode.UNSUPPORTED_SCHEMA
    assert f"schema {version}" in error.message and f"schema {SCHEMA_VERSION}" in error.message


def test_future_schema_with_new_fields_is_unsupported_not_invalid():
    """A newer writer adds fields: the reader must say 'unsupported schema', not 'unknown field'."""
    error = refused(as_json(schema=SCHEMA_VERSION + 1, new_field=[1, 2]))
    assert error.code is ErrorCode.UNSUPPORTED_SCHEMA


@pytest.mark.parametrize("decoder", [decode_result, decode_status])
def test_unknown_schema_refused_for_every_message(decoder):
    error = refused(json.dumps({"schema": SCHEMA_VERSION + 1}).encode(), decoder)
    assert error.code is ErrorCode.UNSUPPORTED_SCHEMA


# -- broken JSON -----------------------------------------------------------------------------------


@given(requests)
def test_every_truncation_refused_cleanly(request):
    for data in (encode(request), encode_pretty(request).rstrip()):
        for end in range(len(data)):
            try:
                decode_request(data[:end])
            except MessageError as exc:
                assert exc.code in (ErrorCode.BAD_JSON, ErrorCode.INVALID_REQUEST), (end, exc.code)
                assert exc.message
            else:
                pytest.fail(f"prefix of {end} bytes decoded: {data[:end]!r}")


@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_message_error(data):
    try:
        decode_request(data)
    except MessageError as exc:
        assert exc.code in (ErrorCode.BAD_JSON, ErrorCode.INVALID_REQUEST, ErrorCode.UNSUPPORTED_SCHEMA)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=10))  # fmt: skip
def test_json_that_is_not_a_request_refused(value):
    assume(not isinstance(value, dict) or "schema" not in value)
    error = refused(json.dumps(value).encode())
    assert error.code is ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", ErrorCode.BAD_JSON),
        (b"   \n", ErrorCode.BAD_JSON),
        (b"not json", ErrorCode.BAD_JSON),
        (b"\xff\xfe{}", ErrorCode.BAD_JSON),
        (b"[]", ErrorCode.INVALID_REQUEST),
        (b"null", ErrorCode.INVALID_REQUEST),
        (b'"r1"', ErrorCode.INVALID_REQUEST),
        (as_json() + b"garbage", ErrorCode.BAD_JSON),
    ],
)
def test_non_object_json_refused(data, code):
    assert refused(data).code is code


@pytest.mark.parametrize("where", ["unknown_field", "known_field", "value"])
def test_deeply_nested_json_refused(where):
    depth = 100_000
    if where == "unknown_field":
        data = b'{"x":' + b"[" * depth
    elif where == "known_field":
        data = b'{"schema":1,"stop":' + b"[" * depth
    else:
        data = b'{"tag":' + b'{"a":' * depth
    error = refused(data)
    assert error.code in (ErrorCode.BAD_JSON, ErrorCode.INVALID_REQUEST)
