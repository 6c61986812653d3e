"""Which weights the spool's waiting and claimed requests name, for a publisher that prunes old
weights (a trainer must not delete what a request is about to load).

Guarantees (tests/unit/test_hostile_spool_reads.py):
- No file in requests/ or claimed/ makes this raise or block: request files are read with
  fsio.read_regular_file (a FIFO, a device, a symlink or an oversized file is refused at once),
  and every decoding failure (deep nesting's RecursionError, bytes that are not UTF-8, not JSON)
  turns the file into raw bytes for the caller to search.
- A file a worker would refuse without reading its content (not a regular file, a symlink, too
  large: `not_a_file`, `too_large`) names no weights. One that this process may not read (or a
  scan that keeps changing) makes the answer unknown (None): it might name anything.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import msgspec

from .fsio import NotRegularFile, read_regular_file
from .spool_entries import JSON_SUFFIX, split_claimed_name
from .spool_worker import MAX_REQUEST_BYTES

STATES = ("requests", "claimed")  # where a request is waiting or being served
_SCAN_ROUNDS = 5


class _NamesWeights(msgspec.Struct):
    """The one field read here; the rest of a request (valid or not) is the worker's to judge."""

    weights_dir: object = None


_decoder = msgspec.json.Decoder(_NamesWeights)


def weights_named(spool_dir: Path) -> tuple[set[str], list[bytes]] | None:
    """Real paths that requests in requests/ and claimed/ name as weights_dir, and the raw bytes of
    request files that do not parse (a caller protects what their bytes mention). None when that
    cannot be known: a file this process may not read, or requests moving between states faster
    than the scan settles. Raises FileNotFoundError when `spool_dir` is not a spool."""
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
            return paths, raw
        previous = seen
    return None


def _weights_dir(data: bytes) -> str | None:
    """The absolute weights_dir a request file names, or None when it cannot be told."""
    try:
        value = _decoder.decode(data).weights_dir
    except (ValueError, RecursionError):  # msgspec's DecodeError and ValidationError are ValueErrors
        return None
    return value if isinstance(value, str) and os.path.isabs(value) else None
