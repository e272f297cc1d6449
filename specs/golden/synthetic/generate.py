"""Inputs of this golden spec that git cannot carry (modes, mtimes, xattrs, a fifo, a socket):
tests/test_golden.py copies this directory to a scratch place and calls ``generate(there)``
before building. Everything is fixed, so the `dir:` source digest and the image id are too.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

T = 1_699_990_000_123_456_789  # before source_date_epoch: not clamped


def generate(where: Path) -> None:
    root = where / "overlay-dir"
    root.mkdir()
    entries: list[tuple[str, int]] = []  # (relative path, mtime offset), utime'd last

    def file(rel: str, data: bytes, mode: int = 0o644) -> None:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.chmod(p, mode)
        entries.append((rel, len(entries)))

    def directory(rel: str, mode: int = 0o755) -> None:
        (root / rel).mkdir(parents=True, exist_ok=True)
        os.chmod(root / rel, mode)
        entries.append((rel, len(entries)))

    directory("etc", 0o755)
    directory("etc/dirsrc", 0o750)
    file("etc/dirsrc/config", b"key = value\n", 0o640)
    file("etc/dirsrc/big.dat", b"".join(b"dir source block %06d\n" % i for i in range(20000)))
    os.setxattr(root / "etc/dirsrc/config", "user.origin", b"dir source")
    os.link(root / "etc/dirsrc/config", root / "etc/dirsrc/config.hardlink")
    os.symlink("config", root / "etc/dirsrc/config.symlink")
    entries.append(("etc/dirsrc/config.symlink", len(entries)))
    directory("run", 0o755)
    os.mkfifo(root / "run/fifo", 0o620)
    os.chmod(root / "run/fifo", 0o620)
    entries.append(("run/fifo", len(entries)))
    cwd = os.getcwd()
    try:  # bind by a relative name: the absolute path may exceed sun_path's 108 bytes
        os.chdir(root / "run")
        with socket.socket(socket.AF_UNIX) as s:
            s.bind("control.sock")
        os.chmod("control.sock", 0o660)
    finally:
        os.chdir(cwd)
    entries.append(("run/control.sock", len(entries)))
    # a directory the dir layer adds under an existing one (/etc: its metadata is replaced)
    file("etc/motd.d/10-dir", b"from a dir layer\n")
    directory("etc/motd.d")
    for rel, i in sorted(entries, key=lambda e: -e[0].count("/")):  # children before parents
        t = T + i * 1_000_000_007
        os.utime(root / rel, ns=(t, t), follow_symlinks=False)
