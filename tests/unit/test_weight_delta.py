"""protocol.weight_delta: a chain of sparse deltas applied to an anchor is the full tensor bit for
bit; a delta applies only onto the version it was taken against; the plan rebuilds a version from
the held one or the newest full copy past a missing link; the bytes round-trip."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.weight_delta import (
    DeltaInvalid,
    Link,
    MissingLink,
    ModelDelta,
    Plan,
    apply,
    apply_model,
    decode,
    diff,
    diff_model,
    encode,
    plan,
)

SHAPES = {"embed": (64, 16), "layers.0.w": (16, 48), "norm": (16,), "scalar": ()}


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounding to nearest even as torch casts; a NaN stays a (quiet) NaN."""
    raw = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((raw + 0x7FFF + ((raw >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), (raw >> 16).astype(np.uint16) | 0x40, rounded)


def training_run(steps: int, rate: float, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """bf16 weights as a trainer publishes them: float32 masters nudged each step (a few elements
    much, most a little, so that some bf16 values change and most do not), cast every step; with a
    NaN, an infinity and signed zeros coming and going."""
    rng = np.random.default_rng(seed)
    master = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    published = []
    for step in range(steps):
        for weight in master.values():
            weight += rate * rng.standard_normal(weight.shape).astype(np.float32)
            if weight.size > 4:
                flat = weight.reshape(-1)
                flat[step % flat.size] = [np.nan, -0.0, 0.0, np.inf][step % 4]
        published.append({name: to_bf16_bits(weight) for name, weight in master.items()})
    return published


def copies(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: array.copy() for name, array in weights.items()}


def assert_bits_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert np.array_equal(got[name].view(np.uint16), want[name].view(np.uint16)), name


# -- bit-exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [1e-4, 1e-2, 1.0])
def test_a_chain_applied_to_its_anchor_is_the_full_publish_bit_for_bit(rate):
    published = training_run(8, rate)
    deltas = [
        diff_model(before, after, base_id=f"v{i}", content_id=f"v{i + 1}")
        for i, (before, after) in enumerate(zip(published[:-1], published[1:], strict=True))
    ]
    weights = copies(published[0])
    for i, delta in enumerate(deltas):
        apply_model(weights, delta, held_id=f"v{i}")
        assert_bits_equal(weights, published[i + 1])
    assert 0 < sum(d.changed for d in deltas) < sum(w.size for w in published[0].values()) * len(deltas)


def test_the_elements_that_change_are_those_whose_bits_change():
    old = np.array([0x0000, 0x8000, 0x7FC0, 0x7FC1, 0x3F80, 0x7F80], dtype=np.uint16)  # +0 -0 NaN NaN' 1 inf
    new = np.array([0x8000, 0x8000, 0x7FC1, 0x7FC1, 0x3F81, 0x7F80], dtype=np.uint16)
    delta = diff(old, new)
    assert delta.indices.tolist() == [0, 2, 4] and delta.values.tolist() == [0x8000, 0x7FC1, 0x3F81]
    assert delta.nbytes == 3 * 4 + 3 * 2
    target = old.copy()
    apply(target, delta)
    assert target.tobytes() == new.tobytes()


def test_float32_compares_bits_not_numbers():
    old = np.array([0.0, np.nan, 1.0], dtype=np.float32)
    new = np.array([-0.0, np.nan, 1.0], dtype=np.float32)  # -0.0 == 0.0 and nan != nan as numbers
    delta = diff(old, new)
    assert delta.indices.tolist() == [0]
    apply(old, delta)
    assert old.tobytes() == new.tobytes()


def test_no_change_is_an_empty_delta_that_changes_nothing():
    weights = training_run(1, 0.0)[0]
    delta = diff_model(weights, weights, base_id="a", content_id="b")
    assert delta.changed == 0 and delta.nbytes == 0
    held = copies(weights)
    apply_model(held, delta, held_id="a")
    assert_bits_equal(held, weights)


# -- refusals -------------------------------------------------------------------------------------


def test_a_delta_applies_only_onto_the_version_it_was_taken_against():
    first, second, third = training_run(3, 1e-2)
    delta = diff_model(second, third, base_id="v1", content_id="v2")
    held = copies(first)
    with pytest.raises(MissingLink, match="applies to v1, the weights held are v0"):
        apply_model(held, delta, held_id="v0")
    assert_bits_equal(held, first)  # untouched


def test_a_delta_that_does_not_fit_is_refused_before_anything_changes():
    first, second = training_run(2, 1e-2)
    delta = diff_model(first, second, base_id="v0", content_id="v1")
    held = copies(first)
    held["norm"] = np.zeros(17, dtype=np.uint16)
    reference = copies(held)
    with pytest.raises(DeltaInvalid, match=r"norm: the delta is uint16 \(16,\), the weights hold uint16 \(17,\)"):
        apply_model(held, delta, held_id="v0")
    assert_bits_equal(held, reference)
    with pytest.raises(DeltaInvalid, match="other tensors"):
        apply_model({k: v for k, v in copies(first).items() if k != "norm"}, delta, held_id="v0")


def test_apply_refuses_shapes_widths_and_indices_that_do_not_fit():
    delta = diff(np.zeros(4, np.uint16), np.array([0, 1, 0, 1], np.uint16))
    with pytest.raises(DeltaInvalid, match="cannot apply to uint16 \\(5,\\)"):
        apply(np.zeros(5, np.uint16), delta)
    with pytest.raises(DeltaInvalid, match="cannot apply to float32"):
        apply(np.zeros(4, np.float32), delta)
    with pytest.raises(DeltaInvalid, match="not C-contiguous"):
        apply(np.zeros(8, np.uint16)[::2], delta)
    broken = type(delta)(delta.shape, delta.dtype, np.array([1, 9], np.uint32), delta.values)
    with pytest.raises(DeltaInvalid, match="index 9 is past the tensor's 4 elements"):
        apply(np.zeros(4, np.uint16), broken)


def test_diff_refuses_tensors_of_another_shape_or_names():
    with pytest.raises(DeltaInvalid, match="shapes and dtypes differ"):
        diff(np.zeros(3, np.uint16), np.zeros(4, np.uint16))
    with pytest.raises(DeltaInvalid, match=r"gone: \['b'\], new: \['c'\]"):
        diff_model(
            {"a": np.zeros(1), "b": np.zeros(1)}, {"a": np.zeros(1), "c": np.zeros(1)}, base_id="x", content_id="y"
        )


# -- the plan -------------------------------------------------------------------------------------


def chain(*specs: str) -> dict[str, Link]:
    """'v3:full', 'v4<v3', 'v5<v4+full': a version, its delta's base, and whether a full copy exists."""
    links = {}
    for spec in specs:
        full = spec.endswith("full")
        spec = spec.removesuffix("+full").removesuffix(":full")
        name, _, base = spec.partition("<")
        links[name] = Link(name, full, base or None)
    return links


def test_the_plan_applies_the_deltas_from_the_version_held():
    links = chain("v0:full", "v1<v0", "v2<v1", "v3<v2")
    assert plan("v3", links, held_id="v1") == Plan(None, ("v2", "v3"))
    assert plan("v3", links, held_id="v3") == Plan(None, ())
    assert plan("v3", links, held_id=None) == Plan("v0", ("v1", "v2", "v3"))


def test_a_worker_behind_a_newer_anchor_still_takes_the_deltas_it_can():
    links = chain("v0:full", "v1<v0", "v2<v1+full", "v3<v2")
    assert plan("v3", links, held_id="v1") == Plan(None, ("v2", "v3"))  # deltas through the anchor
    assert plan("v3", links, held_id="v0") == Plan(None, ("v1", "v2", "v3"))
    assert plan("v3", links, held_id="elsewhere") == Plan("v2", ("v3",))  # the newest full copy


def test_a_missing_link_falls_back_to_the_newest_full_copy_after_it():
    links = chain("v0:full", "v2<v1", "v3<v2+full", "v4<v3", "v5<v4")  # v1 pruned
    assert plan("v5", links, held_id="v0") == Plan("v3", ("v4", "v5"))
    assert plan("v2", chain("v0:full", "v1<v0", "v2<v1+full"), held_id="v0") == Plan(None, ("v1", "v2"))


def test_a_chain_broken_before_any_full_copy_says_where():
    links = chain("v0:full", "v2<v1", "v3<v2")
    with pytest.raises(MissingLink, match="v3 cannot be rebuilt: the chain back from it breaks at v1.*v0 is"):
        plan("v3", links, held_id="v0")
    with pytest.raises(MissingLink, match="breaks at v9"):
        plan("v9", links)


def test_a_cycle_of_links_ends_the_walk():
    links = {"a": Link("a", False, "b"), "b": Link("b", False, "a")}
    with pytest.raises(MissingLink):
        plan("a", links)


def test_the_plan_rebuilds_the_target_bit_for_bit():
    published = training_run(6, 1e-2, seed=3)
    ids = [f"v{i}" for i in range(6)]
    deltas = {
        ids[i + 1]: diff_model(published[i], published[i + 1], base_id=ids[i], content_id=ids[i + 1]) for i in range(5)
    }
    fulls = {ids[0]: published[0], ids[3]: published[3]}
    links = {v: Link(v, v in fulls, deltas[v].base_id if v in deltas else None) for v in ids if v != "v2"}
    for held_id, held in ((None, None), ("v1", published[1]), ("v4", published[4])):
        steps = plan("v5", links, held_id=held_id)
        weights = copies(fulls[steps.full]) if steps.full else copies(held)
        version = steps.full or held_id
        for step in steps.deltas:
            apply_model(weights, deltas[step], held_id=version)
            version = step
        assert_bits_equal(weights, published[5])


# -- bytes ----------------------------------------------------------------------------------------


def test_encode_and_decode_round_trip_as_a_safetensors_file():
    first, second = training_run(2, 1e-2)
    delta = diff_model(first, second, base_id="run-step_00000001-aa", content_id="run-step_00000002-bb")
    data = encode(delta)
    back = decode(data)
    assert (back.base_id, back.content_id) == (delta.base_id, delta.content_id)
    assert set(back.tensors) == set(delta.tensors)
    for name, tensor_delta in delta.tensors.items():
        got = back.tensors[name]
        assert (got.shape, got.dtype) == (tensor_delta.shape, tensor_delta.dtype)
        assert np.array_equal(got.indices, tensor_delta.indices) and np.array_equal(got.values, tensor_delta.values)
    held = copies(first)
    apply_model(held, back, held_id="run-step_00000001-aa")
    assert_bits_equal(held, second)
    safetensors = pytest.importorskip("safetensors.numpy")  # the rollout venv has it: a real reader agrees
    loaded = safetensors.load(data)
    assert np.array_equal(loaded["embed:indices"], delta.tensors["embed"].indices)
    assert np.array_equal(loaded["embed:values"], delta.tensors["embed"].values)


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (b"", "the header needs"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "the header needs 16 bytes"),
        ((2).to_bytes(8, "little") + b"{}", "__metadata__"),
    ],
)
def test_bytes_that_are_no_delta_are_refused(data, named):
    with pytest.raises(DeltaInvalid, match=f"not an encoded weight delta.*{named}"):
        decode(data)


def test_a_delta_whose_data_was_cut_short_is_refused():
    first, second = training_run(2, 1.0)
    data = encode(diff_model(first, second, base_id="a", content_id="b"))
    with pytest.raises(DeltaInvalid, match="lies outside the data"):
        decode(data[:-1])
    assert isinstance(decode(data), ModelDelta)
