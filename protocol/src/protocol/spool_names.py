"""Which weights the spool's waiting and claimed requests name: the one answer a publisher asks
before it prunes a weights directory, rewrites a weight slot, or lets a delta's anchor go (a
trainer must not delete or overwrite what a request is about to load).

    named = weights_named(spool_dir)     # None: cannot be known, so everything counts as named
    named.names(path)                    # does a request name `path`?
    named.protected(candidates, chains)  # real paths to keep: those named, and the chain links they need

Guarantees (tests/unit/test_hostile_spool_reads.py, tests/unit/test_spool_names.py):
- No file in requests/ or claimed/ makes this raise or block: request files are read with
  fsio.read_regular_file (a FIFO, a device, a symlink or an oversized file is refused at once),
  and every decoding failure (deep nesting's RecursionError, bytes that are not UTF-8, not JSON)
  turns the file into raw bytes for the caller to search.
- A file a worker would refuse without reading its content (not a regular file, a symlink, too
  large: `not_a_file`, `too_large`) names no weights. One that this process may not read (or a
  scan that keeps changing) makes the answer unknown (None): it might name anything.
- A request file that does not parse names every path whose name appears in its bytes (it might
  be a request a worker reads otherwise; the answer errs on the side of keeping).
- A delta publish that is named keeps every link back to its anchor (`protected`, through
  weights_chain.needed): a worker holding nothing rebuilds it from those.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from .fsio import NotRegularFile, read_regular_file
from .spool_entries import JSON_SUFFIX, split_claimed_name
from .spool_worker import MAX_REQUEST_BYTES
from .weights_chain import Version, needed

STATES = ("requests", "claimed")  # where a request is waiting or being served
_SCAN_ROUNDS = 5


class _NamesWeights(msgspec.Struct):
    """The one field read here; the rest of a request (valid or not) is the worker's to judge."""

    weights_dir: object = None


_decoder = msgspec.json.Decoder(_NamesWeights)


@dataclass(frozen=True)
class NamedWeights:
    """What the waiting and claimed requests name, as one scan of the spool saw it."""

    paths: frozenset[str]  # real paths of the weights_dir of the requests that parse
    unparsed: tuple[bytes, ...]  # the bytes of request files that do not parse

    def names(self, path: str | os.PathLike) -> bool:
        """Whether a request names `path`: its real path is a request's weights_dir, or its name
        appears in the bytes of a request file that does not parse."""
        needle = os.fsencode(Path(path).name)
        return os.path.realpath(path) in self.paths or any(needle in raw for raw in self.unparsed)

    def protected(self, candidates: Iterable[str | os.PathLike], chains: Mapping[str, Version]) -> set[str]:
        """Real paths a pruner of `candidates` must keep: the named weights and the candidates
        named, with every directory a rebuild of them reads (a delta's links back to its anchor;
        `chains`: weights_chain.versions of the publish directory)."""
        named = [*self.paths, *(path for path in candidates if self.names(path))]
        return {os.path.realpath(path) for path in needed(named, chains)}


def weights_named(spool_dir: str | os.PathLike) -> NamedWeights | None:
    """What requests in requests/ and claimed/ name as weights_dir (see NamedWeights). None when
    that cannot be known: a file this process may not read, or requests moving between states
    faster than the scan settles. Raises FileNotFoundError when `spool_dir` is not a spool."""
    spool_dir = Path(spool_dir)
    for state in STATES:
        if not (spool_dir / state).is_dir():
            raise FileNotFoundError(f"{spool_dir} is not a spool (no {state}/): pass the rollout spool, or None")
    previous = None
    for _ in range(_SCAN_ROUNDS):
        # A request moves requests/ -> claimed/ (claim) and back (a dead worker's lease): a file can
        # slip past one listing of each. Scan until two rounds see the same files and none vanished.
        seen, settled = set(), True
        paths: set[str] = set()
        raw: list[bytes] = []
        for state in STATES:
            for name in os.listdir(spool_dir / state):
                if not name.endswith(JSON_SUFFIX):
                    continue
                original = split_claimed_name(name)[0] if state == "claimed" else name
                try:
                    data = read_regular_file(spool_dir / state / name, MAX_REQUEST_BYTES)
                except FileNotFoundError:
                    settled = False  # moved on since the listing: it is somewhere the next round looks
                    continue
                except (NotRegularFile, ValueError):
                    continue  # a worker refuses it unread (not_a_file, too_large): it names nothing
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        continue  # a symlink: refused as not_a_file too
                    return None  # unreadable here: it might name anything
                seen.add(original)
                weights_dir = _weights_dir(data)
                if weights_dir is None:
                    raw.append(data)
                else:
                    paths.add(os.path.realpath(weights_dir))
        if settled and seen == previous:
            return NamedWeights(frozenset(paths), tuple(raw))
        previous = seen
    return None


def _weights_dir(data: bytes) -> str | None:
    """The absolute weights_dir a request file names, or None when it cannot be told."""
    try:
        value = _decoder.decode(data).weights_dir
    except (ValueError, RecursionError):  # msgspec's DecodeError and ValidationError are ValueErrors
        return None
    return value if isinstance(value, str) and os.path.isabs(value) else None
