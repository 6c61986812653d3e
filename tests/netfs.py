"""Network-like filesystems, made by the tests themselves on this machine.

- `SshServer` + `sshfs_mount`: an sshd of the test's own (loopback port, throwaway host and user
  keys in a temporary directory; the machine's sshd and its configuration are never touched)
  and sshfs mounts of one exported directory, with the caches a network filesystem has:
  attributes, directory listings, and names, negative ones (absent names) included. Two mounts
  of the same export are two hosts: what one writes, the other sees only through its caches.
- `bindfs_mount`: a FUSE passthrough of a directory (no caches to speak of, but FUSE semantics:
  inotify sees only this host's changes, the filesystem type is `fuse`).

Where /dev/fuse or a tool is missing, `require` fails the test with what is missing and how to
get it: these tests never pass or skip silently. `.ci/run` installs the tools
(`sshfs openssh-server bindfs`, Debian packages).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
TOOLS = {
    "sshfs": ("sshfs", "ssh-keygen", "fusermount3", SSHD),
    "bindfs": ("bindfs", "fusermount3"),
}
PACKAGES = "sshfs openssh-server bindfs"

# Cache timeouts of the sshfs mounts, in seconds. A network filesystem's listing is as fresh as
# its directory cache (NFS: acdirmin/acdirmax; here dcache_timeout), and its attributes as their
# cache (attr_timeout); a name looked up while absent stays absent for negative_timeout, far
# longer than any wait in these tests: only code that never looks up an absent name sees new
# files in time.
DIR_CACHE_S = 1
ATTR_CACHE_S = 1
ENTRY_CACHE_S = 60
NEGATIVE_CACHE_S = 600


def missing_prerequisites(kind: str) -> list[str]:
    """What this machine lacks for `kind` ("sshfs" or "bindfs"); empty when nothing."""
    missing = []
    if not os.path.exists("/dev/fuse"):
        missing.append("/dev/fuse (run the tests where FUSE is available, e.g. a container with --device /dev/fuse)")
    elif not os.access("/dev/fuse", os.R_OK | os.W_OK):
        missing.append("read and write access to /dev/fuse")
    for tool in TOOLS[kind]:
        if not (os.access(tool, os.X_OK) if tool.startswith("/") else shutil.which(tool)):
            missing.append(tool)
    if kind == "sshfs" and os.geteuid() != 0 and not os.path.isdir("/run/sshd"):
        missing.append("/run/sshd (sshd's privilege-separation directory; created when running as root)")
    return missing


def require(kind: str) -> None:
    """Fail the calling test loudly when `kind` cannot be mounted here."""
    missing = missing_prerequisites(kind)
    if missing:
        pytest.fail(
            f"cannot mount {kind} for this test: missing {', '.join(missing)}. "
            f"Install the Debian packages with `apt-get install -y {PACKAGES}` (.ci/run does).",
            pytrace=False,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {' '.join(command)}\n{done.stdout}{done.stderr}")


class SshServer:
    """An sshd on a loopback port that lets in one throwaway key, for sshfs mounts."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.port = _free_port()
        self.user = os.environ.get("USER") or __import__("pwd").getpwuid(os.getuid()).pw_name
        self.key = directory / "user_key"
        self.log = directory / "sshd.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> SshServer:
        d = self.directory
        d.mkdir(parents=True, exist_ok=True)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key")], "ssh-keygen (host key)")
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], "ssh-keygen (user key)")
        shutil.copyfile(f"{self.key}.pub", d / "authorized_keys")
        config = d / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\nPidFile {d / 'sshd.pid'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
            "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nSubsystem sftp internal-sftp\n"
        )
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's empty privilege-separation chroot
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sshd did not start on port {self.port}: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def unmount(mountpoint: Path) -> None:
    """Unmount a FUSE mount; lazily when something still holds it open."""
    if subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True).returncode != 0:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)


@contextlib.contextmanager
def sshfs_mount(server: SshServer, export: Path, mountpoint: Path) -> Iterator[Path]:
    """Mount `export` over sftp at `mountpoint` with the caches on; unmounted on the way out."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    options = ",".join(
        [
            f"IdentityFile={server.key}",
            "StrictHostKeyChecking=no",
            "UserKnownHostsFile=/dev/null",
            "BatchMode=yes",
            "LogLevel=ERROR",
            "dir_cache=yes",
            f"dcache_timeout={DIR_CACHE_S}",
            f"attr_timeout={ATTR_CACHE_S}",
            f"entry_timeout={ENTRY_CACHE_S}",
            f"negative_timeout={NEGATIVE_CACHE_S}",
        ]
    )
    _run(
        ["sshfs", "-p", str(server.port), "-o", options, f"{server.user}@127.0.0.1:{export}", str(mountpoint)],
        "sshfs mount",
    )
    try:
        yield mountpoint
    finally:
        unmount(mountpoint)


@contextlib.contextmanager
def bindfs_mount(source: Path, mountpoint: Path) -> Iterator[Path]:
    """A FUSE passthrough of `source` at `mountpoint`; unmounted on the way out."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    _run(["bindfs", "--no-allow-other", str(source), str(mountpoint)], "bindfs mount")
    try:
        yield mountpoint
    finally:
        unmount(mountpoint)


class Storages:
    """Session-wide mounts, each test taking a fresh directory on them: `root(kind, name)`."""

    KINDS = ("local", "sshfs", "bindfs")

    def __init__(self, base: Path):
        self.base = base
        self._stack = contextlib.ExitStack()
        self._mounts: dict[str, Path] = {}
        self.server: SshServer | None = None

    def mount(self, kind: str) -> Path:
        if kind not in self._mounts:
            require(kind)
            export = self.base / f"{kind}-export"
            export.mkdir(parents=True, exist_ok=True)
            if kind == "sshfs":
                self.server = self.ssh_server()
                self._mounts[kind] = self._stack.enter_context(sshfs_mount(self.server, export, self.base / "sshfs"))
            else:
                self._mounts[kind] = self._stack.enter_context(bindfs_mount(export, self.base / "bindfs"))
        return self._mounts[kind]

    def ssh_server(self) -> SshServer:
        if self.server is None:
            self.server = SshServer(self.base / "sshd").start()
            self._stack.callback(self.server.stop)
        return self.server

    def second_host(self) -> Path:
        """Another sshfs mount of the sshfs export: another host's view of the same files."""
        if "sshfs-b" not in self._mounts:
            export = self.mount("sshfs") and self.base / "sshfs-export"
            self._mounts["sshfs-b"] = self._stack.enter_context(
                sshfs_mount(self.ssh_server(), export, self.base / "sshfs-b")
            )
        return self._mounts["sshfs-b"]

    def root(self, kind: str, name: str, local: Path) -> Path:
        """A new empty directory on `kind`'s mount (`local` itself for local storage)."""
        if kind == "local":
            return local
        path = self.mount(kind) / name
        path.mkdir()
        return path

    def close(self) -> None:
        self._stack.close()
