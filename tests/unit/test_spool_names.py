"""protocol.spool_names: which weights the waiting and claimed requests name, the one answer that
pruning, the slot choice and delta anchors ask. Hostile request files (FIFOs, symlinks, a huge
file, bad JSON) neither block nor raise; claimed requests are read under their claim names; a
named delta keeps its chain back to the anchor."""

from __future__ import annotations

import os
import threading

import pytest

from protocol import weights_chain
from protocol.spool import claimed_name
from protocol.spool_names import NamedWeights, weights_named
from protocol.spool_worker import MAX_REQUEST_BYTES
from protocol.weights_dir import MANIFEST, Manifest, encode_manifest, step_dir_name

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 30.0


def finishes(call):
    """call()'s value; a test failure if it is still running after DEADLINE_S (a blocked open)."""
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(call()), daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        pytest.fail(f"blocked for {DEADLINE_S} s on a hostile request file")
    assert outcome, "it raised (see the thread's traceback above)"
    return outcome[0]


def step(publish_dir, n: int, content_id: str, delta_base: str | None = None):
    path = publish_dir / step_dir_name(n)
    path.mkdir(parents=True)
    (path / MANIFEST).write_bytes(encode_manifest(Manifest(step=n, content_id=content_id, delta_base=delta_base)))
    return path


def test_queued_and_claimed_requests_name_their_weights(spool, make_request, tmp_path):
    a, b, c = (tmp_path / "w" / name for name in ("step_1", "step_2", "step_3"))
    for path in (a, b, c):
        path.mkdir(parents=True)
    spool.submit(make_request("queued", weights_dir=str(a)))
    spool.submit(make_request("taken", weights_dir=str(b)))
    os.rename(spool.requests / "taken.json", spool.claimed / claimed_name("taken.json", "gpu0"))
    os.symlink(c, tmp_path / "link-to-3")
    spool.submit(make_request("through-a-link", weights_dir=str(tmp_path / "link-to-3")))
    found = finishes(lambda: weights_named(spool.root))
    assert found == NamedWeights(frozenset({os.path.realpath(p) for p in (a, b, c)}), ())
    assert found.names(a) and found.names(b) and found.names(tmp_path / "link-to-3")
    assert not found.names(tmp_path / "w" / "step_4")


@pytest.mark.parametrize("state", ["requests", "claimed"])
def test_hostile_request_files_name_nothing_and_never_block(spool, make_request, tmp_path, state):
    named = tmp_path / "w" / "step_00000001"
    named.mkdir(parents=True)
    spool.submit(make_request("ok", weights_dir=str(named)))
    directory = spool.root / state

    def name(stem: str) -> str:
        return claimed_name(f"{stem}.json", "gpu0") if state == "claimed" else f"{stem}.json"

    os.mkfifo(directory / name("fifo"))  # a plain open() would wait for a writer forever
    os.symlink("/dev/zero", directory / name("zero"))  # endless bytes behind a link
    os.symlink(named / "absent.json", directory / name("dangling"))
    with open(directory / name("huge"), "wb") as f:  # sparse: larger than a worker reads
        f.truncate(MAX_REQUEST_BYTES + 1)
    (directory / name("dir")).mkdir()
    (directory / name("empty")).write_bytes(b"")
    (directory / name("relative")).write_bytes(b'{"weights_dir": "step_00000007"}')
    (directory / name("number")).write_bytes(b'{"weights_dir": 7}')
    (directory / name("list")).write_bytes(b'["weights_dir", "/x/step_00000008"]')
    (directory / name("torn")).write_bytes(b'{"weights_dir": "/x/step_0000')
    (directory / name("@@")).write_bytes(b'{"weights_dir": "/x/step_00000009"}')  # odd claim names
    (directory / "notes.txt").write_bytes(b'{"weights_dir": "/x/step_00000010"}')  # not a request's name
    found = finishes(lambda: weights_named(spool.root))
    assert found.paths == {os.path.realpath(named), os.path.realpath("/x/step_00000009")}
    # the files that do not parse are kept as bytes: their names are searched, never trusted
    assert sorted(found.unparsed) == sorted(
        [
            b"",
            b'{"weights_dir": "step_00000007"}',
            b'{"weights_dir": 7}',
            b'["weights_dir", "/x/step_00000008"]',
            b'{"weights_dir": "/x/step_0000',
        ]
    )
    assert found.names(tmp_path / "elsewhere" / "step_00000007")  # a relative name: might be it
    assert found.names("/y/step_00000008")
    assert not found.names("/x/step_00000010")  # notes.txt is no request
    assert not found.names("/x/step_00000011")


def test_a_named_delta_keeps_its_links_back_to_the_anchor(tmp_path, spool, make_request):
    publish_dir = tmp_path / "pub"
    paths = {
        1: step(publish_dir, 1, "v1"),
        2: step(publish_dir, 2, "v2", "v1"),
        3: step(publish_dir, 3, "v3", "v2"),
        4: step(publish_dir, 4, "v4"),
        5: step(publish_dir, 5, "v5", "v4"),
    }
    chains = weights_chain.versions(publish_dir)
    candidates = [paths[1], paths[2], paths[3], paths[4]]
    spool.submit(make_request("r3", weights_dir=str(paths[3])))
    found = weights_named(spool.root)
    assert found.protected(candidates, chains) == {os.path.realpath(paths[n]) for n in (1, 2, 3)}

    (spool.requests / "torn.json").write_bytes(b"{... step_00000005")  # does not parse, mentions step 5
    found = weights_named(spool.root)
    assert found.protected([*candidates, paths[5]], chains) == {os.path.realpath(paths[n]) for n in (1, 2, 3, 4, 5)}
    assert NamedWeights(frozenset(), ()).protected(candidates, chains) == set()


def test_a_directory_that_is_not_a_spool_is_refused_by_name(tmp_path):
    (tmp_path / "requests").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no claimed/"):
        weights_named(tmp_path)
