"""protocol.weights_chain: step directories read as versions by content id, and the links a rebuild
of each needs (what pruning keeps)."""

from __future__ import annotations

from pathlib import Path

from protocol import weight_delta, weights_chain
from protocol.weights_dir import MANIFEST, Manifest, encode_manifest, step_dir_name


def write(publish_dir: Path, step: int, content_id: str, delta_base: str | None = None) -> Path:
    path = publish_dir / step_dir_name(step)
    path.mkdir(parents=True)
    (path / MANIFEST).write_bytes(encode_manifest(Manifest(step=step, content_id=content_id, delta_base=delta_base)))
    return path


def test_versions_are_found_by_content_id_and_a_directory_without_a_manifest_is_none(tmp_path):
    a = write(tmp_path, 1, "a")
    b = write(tmp_path, 2, "b", delta_base="a")
    (tmp_path / step_dir_name(3)).mkdir()  # a publish in progress elsewhere, or not a publish
    (tmp_path / ".step_00000004.9.partial").mkdir()
    found = weights_chain.versions(tmp_path)
    assert sorted(found) == ["a", "b"]
    assert found["b"].path == b and found["b"].step == 2 and found["b"].delta_base == "a"
    assert weights_chain.links(found) == {
        "a": weight_delta.Link("a", full=True, base_id=None),
        "b": weight_delta.Link("b", full=False, base_id="a"),
    }
    assert weights_chain.is_delta_dir(b) and not weights_chain.is_delta_dir(a)
    assert not weights_chain.is_delta_dir(tmp_path / step_dir_name(3))
    assert weights_chain.versions(tmp_path / "absent") == {}


def test_needed_is_the_chain_back_to_the_newest_anchor(tmp_path):
    paths = {
        1: write(tmp_path, 1, "v1"),
        2: write(tmp_path, 2, "v2", "v1"),
        3: write(tmp_path, 3, "v3", "v2"),
        4: write(tmp_path, 4, "v4"),
        5: write(tmp_path, 5, "v5", "v4"),
        7: write(tmp_path, 7, "v7", "v6"),  # its link v6 was never written
    }
    found = weights_chain.versions(tmp_path)
    assert weights_chain.needed([paths[3]], found) == {paths[1], paths[2], paths[3]}
    assert weights_chain.needed([paths[5]], found) == {paths[4], paths[5]}
    assert weights_chain.needed([paths[4]], found) == {paths[4]}
    assert weights_chain.needed([paths[7]], found) == {paths[7]}  # broken: what is there
    elsewhere = tmp_path / "elsewhere"
    assert weights_chain.needed([str(elsewhere)], found) == {elsewhere}
