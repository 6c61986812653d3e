#!/usr/bin/env bash
# The Debian packages the tests use beyond Python: systemd-analyze checks the systemd units;
# sshfs (with an sshd of the tests' own) and bindfs mount the spool like a network filesystem;
# mount (util-linux) makes the really full filesystems of the full-disk tests; fusefat and
# dosfstools mount a FAT image, a filesystem without hard links, for the spool's start check.
# Installs what is missing where it can (root, or sudo without a password, and apt-get);
# otherwise stops at once with one message naming the packages.
set -euo pipefail

missing=()
command -v systemd-analyze >/dev/null || missing+=(systemd)
command -v sshfs >/dev/null || missing+=(sshfs)
command -v ssh-keygen >/dev/null || missing+=(openssh-client)
test -x /usr/sbin/sshd || missing+=(openssh-server)
command -v bindfs >/dev/null || missing+=(bindfs)
command -v fusermount3 >/dev/null || missing+=(fuse3)
command -v mount >/dev/null || missing+=(mount)
command -v fusefat >/dev/null || missing+=(fusefat)
command -v mkfs.vfat >/dev/null || missing+=(dosfstools)
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    as_root=(none)
fi
if [ "${as_root[*]}" = none ] || ! command -v apt-get >/dev/null; then
    echo "The tests need these Debian packages, which this user cannot install here: ${missing[*]}." >&2
    echo "Install them (sudo apt-get install -y ${missing[*]}), then run the command again." >&2
    exit 1
fi
echo "installing the packages the tests need: ${missing[*]}"
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
