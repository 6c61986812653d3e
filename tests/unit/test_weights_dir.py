"""protocol.weights_dir: the weights-directory contract. Manifests round-trip and read as the
trainer's writers have always written them; a bad manifest is refused naming the file and the
field; step names parse both ways; content ids follow their rule."""

from __future__ import annotations

import json
import re

import pytest

from protocol.weights_dir import (
    MANIFEST,
    FileEntry,
    Manifest,
    ManifestError,
    Source,
    decode_manifest,
    encode_manifest,
    files_content_id,
    read_manifest,
    step_content_id,
    step_dir_name,
    step_of,
    weights_content_id,
)

SHA = "ab" * 32

# What the writers wrote before the contract had a type, field for field and in their order:
# weights_writer (a publish), checkpoint.save, gguf_import (canonical JSON).
PUBLISHED = {
    "step": 12,
    "content_id": "run-step_00000012-0a1b2c3d",
    "base_model": "/models/tiny",
    "dtype": "bfloat16",
    "bytes": 1030,
    "checksum": "crc32c",
    "files": {
        "model.safetensors": {"size": 1000, "crc32c": "0badf00d"},
        "config.json": {"size": 30, "crc32c": "00c0ffee"},
    },
    "write_seconds": 0.012345,
    "created_at": 1764619776.123456,
}
CHECKPOINT = {"step": 3, "content_id": "run-step_00000003-deadbeef", "base_model": "/models/tiny", "created_at": 1.5}
IMPORTED = {
    "content_id": "sha256-0123456789abcdef",
    "dtype": "bfloat16",
    "bytes": 7,
    "checksum": "crc32c",
    "files": {"model.safetensors": {"size": 7, "crc32c": "12345678", "sha256": SHA}},
    "source": {"file": "m.gguf", "sha256": SHA},
    "made_with": {"torch": "2.9.0", "gguf": "absent"},
}


def legacy_bytes(value: dict) -> bytes:
    return json.dumps(value, indent=1).encode()


def canonical_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


# -- round trip and compatibility -----------------------------------------------------------------


@pytest.mark.parametrize("written", [PUBLISHED, CHECKPOINT], ids=["published", "checkpoint"])
def test_the_trainers_manifests_read_and_write_back_byte_for_byte(written):
    data = legacy_bytes(written)
    manifest = decode_manifest(data, "w/manifest.json")
    assert manifest.content_id == written["content_id"] and manifest.step == written["step"]
    assert encode_manifest(manifest) == data


def test_an_imports_manifest_reads_and_writes_back_canonically():
    data = canonical_bytes(IMPORTED)
    manifest = decode_manifest(data, "w/manifest.json")
    assert manifest.source == Source(file="m.gguf", sha256=SHA)
    assert manifest.files["model.safetensors"].sha256 == SHA
    assert encode_manifest(manifest, canonical=True) == data


def test_a_manifest_built_in_code_round_trips():
    manifest = Manifest(
        step=5,
        content_id="x",
        base_model="/b",
        dtype="float32",
        bytes=3,
        checksum="crc32c",
        files={"a.safetensors": FileEntry(size=1, crc32c="00000001"), "b.json": FileEntry(size=2)},
        write_seconds=0.5,
        created_at=2.0,
        source=Source(file="f", sha256=SHA),
        made_with={"torch": "1"},
    )
    for canonical in (False, True):
        assert decode_manifest(encode_manifest(manifest, canonical=canonical), "m") == manifest


def test_older_manifests_still_read():
    # written with checksums=False: explicit nulls (now simply left out)
    unchecked = dict(PUBLISHED, checksum=None, files={"model.safetensors": {"size": 1030, "crc32c": None}})
    manifest = decode_manifest(legacy_bytes(unchecked), "m")
    assert manifest.checksum is None and manifest.files["model.safetensors"] == FileEntry(size=1030)
    assert b"null" not in encode_manifest(manifest)
    # before crc32c: zlib's crc32
    crc32 = dict(PUBLISHED, checksum="crc32", files={"model.safetensors": {"size": 1030, "crc32": "0000abcd"}})
    assert decode_manifest(legacy_bytes(crc32), "m").files["model.safetensors"].crc32 == "0000abcd"
    # a content id alone (what an operator or a test writes by hand)
    assert decode_manifest(b'{"content_id": "a-1"}', "m") == Manifest(content_id="a-1")


def test_fields_a_newer_writer_adds_are_ignored():
    data = legacy_bytes(dict(CHECKPOINT, shard_layout={"kind": "new"}, files_hash="x"))
    assert decode_manifest(data, "m") == decode_manifest(legacy_bytes(CHECKPOINT), "m")


def test_read_manifest_reads_the_directorys_and_says_when_there_is_none(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST).write_bytes(legacy_bytes(PUBLISHED))
    assert read_manifest(tmp_path).step == 12


# -- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"step": -1}, "$.step"),
        ({"step": "12"}, "$.step"),
        ({"content_id": ""}, "$.content_id"),
        ({"content_id": None}, "$.content_id"),
        ({"bytes": 1031}, "bytes is 1031, the files listed add up to 1030"),
        ({"files": {"../model.safetensors": {"size": 1030}}}, "'../model.safetensors'"),
        ({"files": {"sub/model.safetensors": {"size": 1030}}}, "'sub/model.safetensors'"),
        ({"files": {MANIFEST: {"size": 1030}}}, "'manifest.json'"),
        ({"files": {"model.safetensors": {"size": -1}}, "bytes": None}, "$.files[...].size"),
        ({"files": {"model.safetensors": {"crc32c": "0badf00d"}}}, "missing required field `size`"),
        ({"files": {"model.safetensors": {"size": 1030, "crc32c": "nothex!!"}}}, "$.files[...].crc32c"),
        ({"files": ["model.safetensors"]}, "$.files"),
        ({"source": {"file": "m.gguf"}}, "sha256"),
        ({"made_with": {"torch": 2}}, "$.made_with[...]"),
    ],
)
def test_a_bad_manifest_is_refused_naming_the_file_and_the_field(change, named):
    data = legacy_bytes(dict(PUBLISHED, **change))
    with pytest.raises(ManifestError, match=r"^/w/step_00000012/manifest\.json is not a weights manifest") as info:
        decode_manifest(data, "/w/step_00000012/manifest.json")
    assert named in str(info.value)
    assert str(info.value).endswith("write it again")


@pytest.mark.parametrize("data", [b"", b"{broken", b"[]", b'"x"', b"{}", b'{"step": 1}'])
def test_what_is_no_manifest_at_all_is_refused(data):
    with pytest.raises(ManifestError, match="m.json is not a weights manifest"):
        decode_manifest(data, "m.json")


def test_a_writer_cannot_build_a_manifest_it_could_not_read():
    with pytest.raises(ValueError, match="bytes is 5, the files listed add up to 1"):
        Manifest(content_id="x", bytes=5, files={"a": FileEntry(size=1)})
    with pytest.raises(ValueError, match="'a/b'"):
        Manifest(content_id="x", files={"a/b": FileEntry(size=1)})


# -- step names -----------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 1, 12, 99_999_999, 100_000_000, 123_456_789_012])
def test_a_step_name_parses_back_to_its_step(step):
    name = step_dir_name(step)
    assert name.startswith("step_") and len(name) >= len("step_00000000")
    assert step_of(name) == step


def test_step_names_are_zero_padded_to_eight_digits():
    assert step_dir_name(12) == "step_00000012"


@pytest.mark.parametrize(
    "name",
    [".step_00000012.4242.partial", "step_", "step_-1", "step_1a", "steps_00000001", "step_00000012.old", "step_١٢"],
)
def test_other_names_are_no_step(name):
    assert step_of(name) is None


def test_steps_order_by_number_past_eight_digits():
    names = [step_dir_name(s) for s in (100_000_000, 2, 99_999_999)]
    assert sorted(names, key=step_of) == ["step_00000002", "step_99999999", "step_100000000"]
    assert sorted(names) != sorted(names, key=step_of)  # the names alone would put 100000000 first


def test_a_negative_step_has_no_name():
    with pytest.raises(ValueError, match="non-negative"):
        step_dir_name(-1)


# -- content ids ----------------------------------------------------------------------------------


def test_a_writers_content_id_names_run_and_step_and_is_unique_per_write():
    ids = {step_content_id("demo", 12) for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"demo-step_00000012-[0-9a-f]{8}", i) for i in ids)


def test_an_imports_content_id_is_its_files_names_and_sha256s():
    files = {"b.json": FileEntry(size=1, sha256="1" * 64), "a.safetensors": FileEntry(size=2, sha256="2" * 64)}
    same = files_content_id(files)
    assert re.fullmatch(r"sha256-[0-9a-f]{16}", same)
    assert files_content_id(dict(reversed(files.items()))) == same  # not the listing's order
    assert files_content_id({**files, MANIFEST: FileEntry(size=9, sha256="9" * 64)}) == same
    assert files_content_id({**files, "b.json": FileEntry(size=1, sha256="3" * 64)}) != same
    assert files_content_id({"c.json": files["b.json"], "a.safetensors": files["a.safetensors"]}) != same
    with pytest.raises(ValueError, match="a.safetensors has no sha256"):
        files_content_id({"a.safetensors": FileEntry(size=2)})


def test_a_directorys_content_id_is_its_manifests_when_the_manifest_reads(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    stat_id = weights_content_id(str(tmp_path))
    assert stat_id.startswith("stat-")
    (tmp_path / MANIFEST).write_bytes(legacy_bytes(PUBLISHED))
    assert weights_content_id(str(tmp_path)) == PUBLISHED["content_id"]
    # a manifest this contract does not read is not the trainer's word: the files' stats decide
    (tmp_path / MANIFEST).write_bytes(legacy_bytes(dict(PUBLISHED, bytes=1)))
    assert weights_content_id(str(tmp_path)) == stat_id
