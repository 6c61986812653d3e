"""Weights directories: allowed roots, validation with a stable code and a message per defect
that names weights_dir, content ids, the bytes a load reads, the tokenizer-size check, and an
import graph without cycles."""

from __future__ import annotations

import ast
import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import rollout_svc
from protocol.messages import ErrorCode
from protocol.weights_dir import weights_content_id as content_id
from rollout_svc.errors import RequestFailed
from rollout_svc.weights import WeightsPolicy, check_tokenizer_fits

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 8}


def make_weights(directory, *, shards=("model.safetensors",), config=CONFIG, index=False):
    """A small valid weights directory: config.json and one tensor per shard."""
    directory.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"layer{i}.weight"
        save_file({name: np.arange(16, dtype=np.float32).reshape(4, 4) + i}, str(directory / shard))
        weight_map[name] = shard
    if index:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def failure(weights_dir, policy=None) -> RequestFailed:
    with pytest.raises(RequestFailed) as info:
        (policy or WeightsPolicy()).inspect(str(weights_dir))
    return info.value


@pytest.fixture
def model(tmp_path):
    return make_weights(tmp_path / "model")


# -- allowed roots -------------------------------------------------------------------------------


def test_without_roots_any_directory_is_allowed(model):
    assert WeightsPolicy().allowed_roots == []
    assert WeightsPolicy().check_allowed(str(model)) == os.path.realpath(model)
    assert WeightsPolicy(None).inspect(str(model)).real_path == os.path.realpath(model)


def test_a_directory_under_an_allowed_root_is_allowed(tmp_path):
    root = tmp_path / "root"
    weights = make_weights(root / "team" / "ckpt")
    policy = WeightsPolicy([str(root)])
    assert policy.check_allowed(str(weights)) == str(weights)
    assert policy.check_allowed(str(root)) == str(root)  # the root itself
    assert WeightsPolicy([str(root) + "/"]).check_allowed(str(weights)) == str(weights)
    assert policy.inspect(str(weights)).path == str(weights)


def test_a_directory_outside_the_roots_is_refused_with_the_fix(tmp_path):
    root, other = tmp_path / "root", make_weights(tmp_path / "other")
    root.mkdir()
    exc = failure(other, WeightsPolicy([str(root)]))
    assert exc.code == ErrorCode.WEIGHTS_NOT_ALLOWED
    assert str(other) in exc.message and str(root) in exc.message and "--allowed-root" in exc.message


def test_a_name_sharing_the_roots_prefix_is_refused(tmp_path):
    root = tmp_path / "allowed-root"
    root.mkdir()
    evil = make_weights(tmp_path / "allowed-root-evil")
    for policy in (WeightsPolicy([str(root)]), WeightsPolicy([str(root) + "/"])):
        assert failure(evil, policy).code == ErrorCode.WEIGHTS_NOT_ALLOWED
    assert failure(f"{root}/../allowed-root-evil", WeightsPolicy([str(root)])).code == ErrorCode.WEIGHTS_NOT_ALLOWED


def test_a_symlink_inside_a_root_pointing_outside_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = make_weights(tmp_path / "outside")
    os.symlink(outside, root / "link")
    exc = failure(root / "link", WeightsPolicy([str(root)]))
    assert exc.code == ErrorCode.WEIGHTS_NOT_ALLOWED
    assert f"resolved: {outside}" in exc.message


@pytest.mark.parametrize("linked", ["model.safetensors", "config.json", "tokenizer.json", "sub/extra.json", "sub"])
def test_a_file_inside_the_weights_linked_outside_the_roots_is_refused(tmp_path, linked):
    root, outside = tmp_path / "root", tmp_path / "outside"
    weights = make_weights(root / "ckpt")
    (weights / "tokenizer.json").write_text("{}")
    (weights / "sub").mkdir()
    (weights / "sub" / "extra.json").write_text("{}")
    outside.mkdir()
    target = outside / linked.replace("/", "-")
    os.rename(weights / linked, target)  # the file (or directory) now lives outside, linked from inside
    os.symlink(target, weights / linked)
    exc = failure(weights, WeightsPolicy([str(root)]))
    assert exc.code == ErrorCode.WEIGHTS_NOT_ALLOWED
    assert str(weights) in exc.message and f"{linked} resolves to {target}" in exc.message
    assert "--allowed-root" in exc.message and "copy the file" in exc.message
    assert WeightsPolicy().inspect(str(weights)).real_path == str(weights)  # no roots: any file may be read


def test_files_linked_within_the_roots_are_allowed(tmp_path):
    root = tmp_path / "root"
    weights = make_weights(root / "ckpt")
    shared = root / "shared"
    shared.mkdir()
    (shared / "tokenizer.json").write_text("{}")
    os.symlink(shared / "tokenizer.json", weights / "tokenizer.json")
    os.rename(weights / "model.safetensors", shared / "model.safetensors")
    os.symlink("../shared/model.safetensors", weights / "model.safetensors")  # relative, as hardlink farms do
    assert WeightsPolicy([str(root)]).inspect(str(weights)).shards == ("model.safetensors",)


def test_roots_are_compared_after_resolving_their_own_symlinks(tmp_path):
    real_root = tmp_path / "real-root"
    weights = make_weights(real_root / "ckpt")
    os.symlink(real_root, tmp_path / "root-link")
    policy = WeightsPolicy([str(tmp_path / "root-link")])
    assert policy.allowed_roots == [str(real_root)]
    assert policy.check_allowed(str(tmp_path / "root-link" / "ckpt")) == str(weights)
    assert policy.inspect(str(weights)).real_path == str(weights)


def test_a_missing_directory_under_a_root_is_not_found_not_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    assert failure(root / "missing", WeightsPolicy([str(root)])).code == ErrorCode.WEIGHTS_NOT_FOUND
    assert failure(tmp_path / "missing", WeightsPolicy([str(root)])).code == ErrorCode.WEIGHTS_NOT_ALLOWED


# -- validation ----------------------------------------------------------------------------------


def test_a_valid_directory_passes(model):
    weights = WeightsPolicy().inspect(str(model))
    assert (weights.path, weights.real_path) == (str(model), str(model))
    assert weights.config == CONFIG
    assert weights.shards == ("model.safetensors",)
    assert re.fullmatch(r"stat-[0-9a-f]{16}", weights.content_id)
    assert weights.architecture["vocab_size"] == 128 and weights.architecture["model_type"] == "llama"
    assert weights.architecture["num_hidden_layers"] is None


def test_a_symlinked_directory_keeps_the_requested_path(model, tmp_path):
    os.symlink(model, tmp_path / "alias")
    weights = WeightsPolicy().inspect(str(tmp_path / "alias"))
    assert (weights.path, weights.real_path) == (str(tmp_path / "alias"), str(model))


def test_a_missing_directory(tmp_path):
    exc = failure(tmp_path / "nope")
    assert exc.code == ErrorCode.WEIGHTS_NOT_FOUND
    assert exc.message == (
        f"weights_dir {tmp_path / 'nope'} does not exist or is not a directory; name a saved model directory"
    )


def test_a_file_instead_of_a_directory(tmp_path):
    (tmp_path / "file").write_text("{}")
    exc = failure(tmp_path / "file")
    assert exc.code == ErrorCode.WEIGHTS_NOT_FOUND
    assert "is not a directory" in exc.message


def test_no_config_json(tmp_path):
    weights = make_weights(tmp_path / "m", config=None)
    exc = failure(weights)
    assert exc.code == ErrorCode.WEIGHTS_INVALID
    assert exc.message == f"weights_dir {weights} has no config.json; save the model with save_pretrained"


@pytest.mark.parametrize("content", [b"{not json", b"", b'{"a": 1', b"\xff\xfe"])
def test_config_that_is_not_json(model, content):
    (model / "config.json").write_bytes(content)
    exc = failure(model)
    assert exc.code == ErrorCode.WEIGHTS_INVALID
    assert exc.message.startswith(f"weights_dir {model}: config.json is unreadable (")
    assert exc.message.endswith("); save the model again")


def test_config_that_is_a_directory(model):
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    exc = failure(model)
    assert exc.code == ErrorCode.WEIGHTS_INVALID and "config.json is unreadable" in exc.message


@pytest.mark.parametrize("content", ["[1, 2]", '"text"', "3", "null"])
def test_config_that_is_not_an_object(model, content):
    (model / "config.json").write_text(content)
    exc = failure(model)
    assert exc.code == ErrorCode.WEIGHTS_INVALID
    assert exc.message == f"weights_dir {model}: config.json is not a JSON object; save the model again"


def test_no_safetensors(tmp_path):
    weights = make_weights(tmp_path / "m", shards=())
    (weights / "tokenizer.json").write_text("{}")
    exc = failure(weights)
    assert exc.code == ErrorCode.WEIGHTS_INVALID
    assert exc.message == (
        f"weights_dir {weights} has no .safetensors weights. Save the model with save_pretrained(..., "
        "safe_serialization=True)."
    )


def test_only_pickle_files_get_the_conversion_hint(tmp_path):
    weights = make_weights(tmp_path / "m", shards=())
    (weights / "pytorch_model.bin").write_bytes(b"\x80\x04not a real pickle")
    (weights / "extra.pt").write_bytes(b"\x80\x04")
    exc = failure(weights)
    assert exc.code == ErrorCode.WEIGHTS_INVALID
    assert exc.message.startswith(f"weights_dir {weights} has no .safetensors weights. It holds ")
    assert "extra.pt" in exc.message and "pytorch_model.bin" in exc.message
    assert "pickle formats are never loaded" in exc.message
    assert "save_pretrained(..., safe_serialization=True)" in exc.message


def test_pickle_files_next_to_safetensors_are_ignored(model):
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04")
    assert WeightsPolicy().inspect(str(model)).shards == ("model.safetensors",)


def test_a_sharded_directory_uses_its_index(tmp_path):
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weights = make_weights(tmp_path / "m", shards=shards, index=True)
    save_file({"x": np.zeros(1, dtype=np.float32)}, str(weights / "stray.safetensors"))
    assert WeightsPolicy().inspect(str(weights)).shards == shards


def test_an_index_naming_a_missing_shard(tmp_path):
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weights = make_weights(tmp_path / "m", shards=shards, index=True)
    os.unlink(weights / shards[1])
    exc = failure(weights)
    assert exc.code == ErrorCode.WEIGHTS_INVALID
    assert exc.message == f"weights_dir {weights} lacks shards named in its index: {shards[1]}; copy them too"


@pytest.mark.parametrize("content", ["{not json", "[]", '{"metadata": {}}', '{"weight_map": []}'])
def test_an_unreadable_index(model, content):
    (model / "model.safetensors.index.json").write_text(content)
    exc = failure(model)
    assert exc.code == ErrorCode.WEIGHTS_INVALID
    assert exc.message.startswith(f"weights_dir {model}: model.safetensors.index.json is unreadable (")


@pytest.mark.parametrize("value", [None, 3])
def test_an_index_with_a_non_string_shard_name(model, value):
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": value}}))
    assert failure(model).code == ErrorCode.WEIGHTS_INVALID


def shard_bytes(model) -> bytes:
    return (model / "model.safetensors").read_bytes()


def write_shard(model, data: bytes) -> None:
    (model / "model.safetensors").write_bytes(data)


def assert_corrupt(model, detail: str | None = None) -> None:
    exc = failure(model)
    assert exc.code == ErrorCode.WEIGHTS_INVALID
    assert exc.message.startswith(f"weights_dir {model}: model.safetensors is not a valid safetensors file (")
    assert exc.message.endswith("); copy it again")
    if detail:
        assert detail in exc.message


def test_a_truncated_shard(model):
    data = shard_bytes(model)
    write_shard(model, data[:-4])
    assert_corrupt(model, f"tensors need {len(data)} bytes, the file has {len(data) - 4}")


def test_a_shard_with_a_garbage_header(model):
    write_shard(model, struct.pack("<Q", 16) + b"\x00garbage-header!" + b"\x00" * 64)
    assert_corrupt(model)


def test_a_shard_whose_header_length_exceeds_the_file(model):
    data = shard_bytes(model)
    write_shard(model, struct.pack("<Q", len(data)) + data[8:])
    assert_corrupt(model, "header length out of range")


@pytest.mark.parametrize(
    "data",
    [
        b"",  # empty
        b"\x05\x00",  # shorter than the length field
        struct.pack("<Q", 0),  # zero header length
        struct.pack("<Q", 2**62) + b"{}",  # absurd header length
        struct.pack("<Q", 2) + b"[]",  # header not an object
        struct.pack("<Q", 2) + b"\xff\xff",  # header not UTF-8
        struct.pack("<Q", 17) + b'{"w": {"a": 1}}  ',  # tensor without data_offsets
        struct.pack("<Q", 28) + b'{"w": {"data_offsets": "x"}}',  # offsets of the wrong type
        struct.pack("<Q", 10) + b'{"w": "x"}',  # tensor entry not an object
    ],
)
def test_other_corrupt_shards(model, data):
    write_shard(model, data)
    assert_corrupt(model)


def test_a_shard_that_is_a_directory(model):
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").mkdir()
    assert_corrupt(model)


def test_the_corrupt_shard_of_several_is_named(tmp_path):
    shards = ("a.safetensors", "b.safetensors")
    weights = make_weights(tmp_path / "m", shards=shards)
    data = (weights / "b.safetensors").read_bytes()
    (weights / "b.safetensors").write_bytes(data[: len(data) // 2])
    exc = failure(weights)
    assert exc.code == ErrorCode.WEIGHTS_INVALID and f"{weights}: b.safetensors is not a valid" in exc.message


def test_metadata_in_the_header_is_not_a_tensor(model):
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    write_shard(model, struct.pack("<Q", len(header)) + header)
    assert WeightsPolicy().inspect(str(model)).shards == ("model.safetensors",)


# -- content ids ---------------------------------------------------------------------------------


def inspect_id(model) -> str:
    return WeightsPolicy().inspect(str(model)).content_id


def test_the_content_id_is_stable_while_nothing_changes(model):
    first = inspect_id(model)
    assert inspect_id(model) == first
    assert content_id(str(model), ["model.safetensors"]) == first
    os.utime(model / "config.json")  # touching config.json changes nothing: its bytes count
    (model / "tokenizer.json").write_text("{}")  # nor do files that are not weights
    assert inspect_id(model) == first


def test_the_content_id_changes_when_a_shard_is_replaced_by_an_identical_copy(model):
    before = inspect_id(model)
    data = shard_bytes(model)
    (model / "new.tmp").write_bytes(data)
    os.replace(model / "new.tmp", model / "model.safetensors")  # same size and bytes, new inode
    assert inspect_id(model) != before


def test_the_content_id_changes_when_a_shard_is_rewritten_in_place(model):
    path = model / "model.safetensors"
    st = path.stat()
    before = inspect_id(model)
    path.write_bytes(shard_bytes(model))  # same inode, same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert path.stat().st_ino == st.st_ino and path.stat().st_size == st.st_size
    assert inspect_id(model) != before


def test_the_content_id_changes_with_the_config(model):
    before = inspect_id(model)
    (model / "config.json").write_text(json.dumps(dict(CONFIG, hidden_size=16)))
    assert inspect_id(model) != before


def test_the_manifest_content_id_wins(model):
    stat_id = inspect_id(model)
    (model / "manifest.json").write_text(json.dumps({"content_id": "step-00000100-abc", "step": 100}))
    assert inspect_id(model) == "step-00000100-abc"
    (model / "new.tmp").write_bytes(shard_bytes(model))
    os.replace(model / "new.tmp", model / "model.safetensors")
    assert inspect_id(model) == "step-00000100-abc"  # the trainer's word, not the files' stats
    assert stat_id.startswith("stat-")


@pytest.mark.parametrize("manifest", ['{"content_id": ""}', '{"content_id": 7}', "{}", "[]", "{broken", '"x"'])
def test_a_manifest_without_a_usable_content_id_falls_back_to_stats(model, manifest):
    stat_id = inspect_id(model)
    (model / "manifest.json").write_text(manifest)
    assert inspect_id(model) == stat_id


# -- tokenizer size ------------------------------------------------------------------------------


def test_a_tokenizer_that_fits_the_embedding_table(model):
    weights = WeightsPolicy().inspect(str(model))
    assert check_tokenizer_fits(weights, 100) is None
    assert check_tokenizer_fits(weights, 128) is None  # exactly the vocab: ids 0..127


def test_a_tokenizer_larger_than_the_vocab_is_refused(model):
    weights = WeightsPolicy().inspect(str(model))
    with pytest.raises(RequestFailed) as info:
        check_tokenizer_fits(weights, 129)
    assert info.value.code == ErrorCode.WEIGHTS_INVALID
    assert f"weights_dir {model}: the tokenizer has 129 tokens but the model's vocab_size is 128" in info.value.message
    assert "ids past 127 cannot be served" in info.value.message


@pytest.mark.parametrize("config", [{"model_type": "llama"}, {"vocab_size": "128"}, {"vocab_size": None}])
def test_without_an_integer_vocab_size_nothing_is_checked(tmp_path, config):
    weights = WeightsPolicy().inspect(str(make_weights(tmp_path / "m", config=config)))
    assert weights.config == config
    assert check_tokenizer_fits(weights, 10**6) is None


# -- bytes a load reads --------------------------------------------------------------------------


def test_size_bytes_is_the_total_size_of_the_shards_only(tmp_path):
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weights = make_weights(tmp_path / "m", shards=shards, index=True)
    (weights / "tokenizer.json").write_text("{}" * 100)  # not weights: not counted
    save_file({"x": np.zeros(64, dtype=np.float32)}, str(weights / "stray.safetensors"))  # not in the index
    expected = sum((weights / shard).stat().st_size for shard in shards)
    assert WeightsPolicy().inspect(str(weights)).size_bytes == expected
    single = WeightsPolicy().inspect(str(make_weights(tmp_path / "single")))
    assert single.size_bytes == (tmp_path / "single" / "model.safetensors").stat().st_size


# -- every refusal names the request key to change ------------------------------------------------


def test_every_weights_refusal_names_weights_dir(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    broken_index = make_weights(tmp_path / "index", index=True)
    (broken_index / "model.safetensors.index.json").write_text("[]")
    truncated = make_weights(tmp_path / "truncated")
    write_shard(truncated, shard_bytes(truncated)[:-4])
    not_object = make_weights(tmp_path / "not-object")
    (not_object / "config.json").write_text("[]")
    cases = [
        (make_weights(tmp_path / "outside"), WeightsPolicy([str(root)])),
        (tmp_path / "missing", None),
        (make_weights(tmp_path / "no-config", config=None), None),
        (not_object, None),
        (make_weights(tmp_path / "no-shards", shards=()), None),
        (broken_index, None),
        (truncated, None),
    ]
    for weights_dir, policy in cases:
        assert failure(weights_dir, policy).message.startswith(f"weights_dir {weights_dir}"), weights_dir


# -- imports -------------------------------------------------------------------------------------


def _package_imports() -> dict[str, set[str]]:
    """Module of rollout_svc -> the modules of rollout_svc it imports, from the source. A
    subpackage (engines) is one node: importing any of its modules runs its __init__ too."""
    root = Path(rollout_svc.__file__).parent

    def node(name: str) -> str:
        return ".".join(name.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = parts[:-1] if is_package else parts
        package = module if is_package else module[:-1]
        found = graph.setdefault(node(".".join(module)), set())
        for statement in ast.walk(ast.parse(path.read_text())):
            if isinstance(statement, ast.Import):
                names = [alias.name for alias in statement.names]
            elif isinstance(statement, ast.ImportFrom):
                base = package[: len(package) - statement.level + 1] if statement.level else []
                stem = ".".join(base + ([statement.module] if statement.module else []))
                names = [stem] + [f"{stem}.{alias.name}" for alias in statement.names]
            else:
                continue
            found.update(node(name) for name in names if name.split(".")[0] == "rollout_svc")
    return {module: {name for name in names if name in graph and name != module} for module, names in graph.items()}


def test_no_module_imports_one_that_imports_it():
    graph = _package_imports()
    assert graph["rollout_svc.weights"] == {"rollout_svc.errors"}
    assert graph["rollout_svc.errors"] == set()
    assert {"rollout_svc.weights", "rollout_svc.errors"} <= graph["rollout_svc.engines"]

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for name in graph[todo.pop()] - seen:
                seen.add(name)
                todo.append(name)
        return seen

    cycles = sorted(module for module in graph if module in reachable(module))
    assert cycles == [], f"modules that import themselves through others: {cycles}"
