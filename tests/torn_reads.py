"""A reader that proves no partial file is ever seen in a spool while writers publish.

It lists some of the spool's directories (requests/, results/, workers/) over and over, reads
every file there and decodes it with the decoder of its kind. A file that vanishes between the
listing and the read was moved (claimed, consumed, replaced): fine. A file that does not decode
was seen partial (or corrupt): an error, kept with its name and size.

    with TornReadReader(spool, ["results"]) as reader:
        ...publish...
    assert reader.errors == []
"""

from __future__ import annotations

import os
import threading

from protocol.messages import MessageError, decode_request, decode_result, decode_status
from protocol.spool import Spool

DECODERS = {"requests": decode_request, "results": decode_result, "workers": decode_status}


class TornReadReader(threading.Thread):
    """Reads and decodes every file of `states` until stopped; counts what it decoded.

    `pause_s` is a rest between passes over the directories (0: read flat out)."""

    def __init__(self, spool: Spool, states=tuple(DECODERS), pause_s: float = 0.0):
        super().__init__(name="torn-read-reader", daemon=True)
        self.directories = {state: getattr(spool, state) for state in states}
        self.pause_s = pause_s
        self.stopping = threading.Event()
        self.decoded = {state: 0 for state in states}
        self.passes = 0
        self.errors: list[str] = []

    @property
    def reads(self) -> int:
        """Files read whole so far, decoded or not."""
        return sum(self.decoded.values()) + len(self.errors)

    def run(self) -> None:
        while not self.stopping.is_set():
            for state, directory in self.directories.items():
                self.read_all(state, directory)
            self.passes += 1
            if self.pause_s:
                self.stopping.wait(self.pause_s)

    def read_all(self, state: str, directory) -> None:
        decode = DECODERS[state]
        for name in os.listdir(directory):
            try:
                data = (directory / name).read_bytes()
            except FileNotFoundError:
                continue
            try:
                decode(data)
            except MessageError as exc:
                self.errors.append(f"{state}/{name} ({len(data)} bytes): {exc}")
                continue
            self.decoded[state] += 1

    def finish(self, timeout_s: float = 30.0) -> None:
        """Stop after the current pass and wait for it; raises if the reader does not stop."""
        self.stopping.set()
        if self.ident is not None:
            self.join(timeout_s)
            assert not self.is_alive(), f"the reader did not stop within {timeout_s} s"

    def __enter__(self) -> TornReadReader:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.finish()
