"""systemd's notification protocol (sd_notify): READY, STATUS and WATCHDOG messages.

A no-op unless systemd set NOTIFY_SOCKET (Type=notify units). The protocol is one datagram per
message on a Unix socket; an address starting with '@' is in the abstract namespace.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None):
        environ = os.environ if environ is None else environ
        address = environ.get("NOTIFY_SOCKET", "")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        watchdog_usec = environ.get("WATCHDOG_USEC", "")
        watchdog_pid = environ.get("WATCHDOG_PID", "")
        applies = watchdog_usec.isdigit() and (not watchdog_pid or watchdog_pid == str(os.getpid()))
        self.watchdog_s = int(watchdog_usec) / 1e6 if applies else None

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, **fields: str | int) -> None:
        """notify(READY=1, STATUS="idle") sends 'READY=1\\nSTATUS=idle'."""
        if not self.address:
            return
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            try:
                sock.sendto(message, self.address)
            except OSError:  # systemd gone or socket not ours: notifications are best effort
                pass

    def ready(self, status: str) -> None:
        self.send(READY=1, STATUS=status)

    def status(self, status: str) -> None:
        self.send(STATUS=status)

    def watchdog(self) -> None:
        if self.watchdog_s is not None:
            self.send(WATCHDOG=1)

    def stopping(self) -> None:
        self.send(STOPPING=1)
