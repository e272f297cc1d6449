#!/usr/bin/env python3
"""Write this golden spec's input tarballs, byte for byte the same on every run.

    python3 specs/golden/synthetic/make-inputs.py     # rewrites rootfs.tar.gz and overlay.tar

The tarballs are committed and pinned by sha256 in spec.yaml, so the golden
test never depends on this script (or on the zlib that compresses them); run it
only to change the inputs, then update spec.yaml's sha256 pins and the expected
listing and image id (tests/test_golden.py says how).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import struct
import tarfile
from pathlib import Path

HERE = Path(__file__).parent
T0 = 1_700_000_000
MiB = 1 << 20

# system.posix_acl_access: user::rwx user:1000:r-x group::r-x mask::r-x other::r--
ACL = struct.pack("<I", 2) + b"".join(
    struct.pack("<HHI", tag, perm, uid)
    for tag, perm, uid in [
        (1, 7, 0xFFFFFFFF),
        (2, 5, 1000),
        (4, 5, 0xFFFFFFFF),
        (0x10, 5, 0xFFFFFFFF),
        (0x20, 4, 0xFFFFFFFF),
    ]
)
CAPABILITY = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)  # cap_net_raw+ep


def stream(n: int, seed: bytes) -> bytes:
    """n deterministic bytes that compress well (64 equal lines at a time) yet differ in every
    4 KiB block (each run of lines is 3 KiB), so a block read from the wrong place shows."""
    out = bytearray()
    i = 0
    while len(out) < n:
        digest = hashlib.sha256(seed + str(i).encode()).hexdigest()[:32]
        out += f"{seed.decode()} {i:08d} {digest}\n".encode() * 64
        i += 1
    return bytes(out[:n])


def member(name: str, kind: bytes = tarfile.REGTYPE, **kw: object) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    ti.mtime = T0
    ti.uname = ti.gname = ""
    ti.pax_headers = {}
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def raw(value: bytes) -> str:
    return value.decode("utf-8", "surrogateescape")


def rootfs() -> bytes:
    buf = io.BytesIO()
    big = stream(3 * MiB + 12345, b"big")  # spans 4 pack chunks of 1 MiB, not 4 KiB aligned
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:

        def add(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, **kw: object) -> None:
            ti = member(name, kind, size=len(data) if kind == tarfile.REGTYPE else 0, **kw)
            tf.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("./", kind=tarfile.DIRTYPE, mtime=T0 - 100)
        for d, mode, owner in [
            ("bin", 0o755, 0),
            ("dev", 0o755, 0),
            ("etc", 0o755, 0),
            ("home", 0o755, 0),
            ("home/user", 0o700, 1000),
            ("srv", 0o755, 0),
            ("srv/shared", 0o2775, 0),
            ("tmp", 0o1777, 0),
            ("usr", 0o755, 0),
            ("usr/bin", 0o755, 0),
            ("usr/lib", 0o755, 0),
            ("usr/share", 0o755, 0),
            ("usr/share/many", 0o755, 0),
            ("var", 0o755, 0),
            ("var/lib", 0o755, 0),
        ]:
            add(d, kind=tarfile.DIRTYPE, mode=mode, uid=owner, gid=owner)
        # regular files: every size class the writer treats differently
        add("etc/empty", b"")
        add("etc/hostname", b"golden\n")
        add("etc/inline-2048", stream(2048, b"inline"))
        add("etc/extent-2049", stream(2049, b"extent"), mode=0o600, uid=1000, gid=1000)
        add("usr/lib/big.bin", big)
        add("var/lib/big-copy.bin", big)  # same content: one extent, two references
        add("usr/lib/aligned-64k", stream(65536, b"aligned"))
        add("usr/bin/su", b"#!/bin/sh\necho su\n", mode=0o4755)
        add("usr/bin/wall", b"#!/bin/sh\necho wall\n", mode=0o2755, gid=5)
        add("home/user/notes", b"mine\n", mode=0o640, uid=1000, gid=1000)
        add("srv/big-ids", b"ids\n", uid=4_000_000_000, gid=3_000_000_000)
        # nanosecond and pre-1970 times
        ti = member("etc/nanotime", size=3)
        ti.pax_headers = {"mtime": "1699999999.123456789"}
        tf.addfile(ti, io.BytesIO(b"ns\n"))
        ti = member("etc/old", size=4)
        ti.pax_headers = {"mtime": "-86400.5"}
        tf.addfile(ti, io.BytesIO(b"old\n"))
        # xattrs: capability, ACL, user namespace (binary value)
        ti = member("usr/bin/ping", size=5, mode=0o755)
        ti.pax_headers = {"SCHILY.xattr.security.capability": raw(CAPABILITY)}
        tf.addfile(ti, io.BytesIO(b"ping\n"))
        ti = member("srv/shared/acl", size=4)
        ti.pax_headers = {
            "SCHILY.xattr.system.posix_acl_access": raw(ACL),
            "SCHILY.xattr.user.comment": "shared file",
            "SCHILY.xattr.user.binary": raw(bytes(range(0, 256, 15))),
        }
        tf.addfile(ti, io.BytesIO(b"acl\n"))
        ti = member("srv/shared", tarfile.DIRTYPE, mode=0o2775)
        ti.pax_headers = {"SCHILY.xattr.user.dir": "on a directory"}
        tf.addfile(ti)
        # odd names
        add("srv/name with spaces = and \\ backslash", b"spaces\n")
        add("srv/caf\udce9-latin1", b"latin1\n")
        add("srv/caf\u00e9-utf8", b"utf8\n")
        add("srv/new\nline", b"newline\n")
        add("srv/" + "n" * 255, b"long name\n")
        # hardlinks: same dir, across dirs; a hardlinked empty file
        add("bin/busybox", stream(5000, b"busybox"), mode=0o755)
        for name in ("bin/ls", "bin/cat", "usr/bin/env"):
            add(name, kind=tarfile.LNKTYPE, linkname="bin/busybox")
        add("etc/empty-link", kind=tarfile.LNKTYPE, linkname="etc/empty")
        # symlinks: relative, absolute, dangling, long, to a directory
        add("bin/sh", kind=tarfile.SYMTYPE, linkname="busybox", mode=0o777)
        add("usr/bin/python", kind=tarfile.SYMTYPE, linkname="/usr/bin/python3", mode=0o777)
        add("etc/mtab", kind=tarfile.SYMTYPE, linkname="/proc/self/mounts", mode=0o777)
        add("srv/long-link", kind=tarfile.SYMTYPE, linkname="x/" * 1000 + "end", mode=0o777)
        add("lib", kind=tarfile.SYMTYPE, linkname="usr/lib", mode=0o777)
        # devices and a fifo
        add("dev/null", kind=tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666)
        add("dev/sda1", kind=tarfile.BLKTYPE, devmajor=8, devminor=1, mode=0o660, gid=6)
        add("dev/nvme-big", kind=tarfile.BLKTYPE, devmajor=259, devminor=1048575, mode=0o600)
        add("dev/initctl", kind=tarfile.FIFOTYPE, mode=0o600)
        # a directory big enough for several leaves of DIR_ITEMs / DIR_INDEXes
        for i in range(1500):
            add(f"usr/share/many/file-{i:04d}.txt", f"entry {i}\n".encode() * (1 + i % 5))
        # things the overlay replaces
        add("etc/replaced-by-dir", b"a file first\n")
        add("etc/symlink-then-file", kind=tarfile.SYMTYPE, linkname="hostname", mode=0o777)
    return buf.getvalue()


def overlay() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:

        def add(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, **kw: object) -> None:
            ti = member(name, kind, size=len(data) if kind == tarfile.REGTYPE else 0, mtime=T0 - 50, **kw)
            tf.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("etc/hostname", b"golden-overlay\n")  # later layer wins
        add("usr/bin", kind=tarfile.DIRTYPE, mode=0o751)  # dir on dir: metadata only
        add("etc/replaced-by-dir", kind=tarfile.DIRTYPE, mode=0o755)
        add("etc/replaced-by-dir/inside", b"inside\n")
        add("etc/symlink-then-file", b"now a file\n")
        add("opt/new/deep/file", b"parents created\n")  # missing parents are created
    return buf.getvalue()


def main() -> None:
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0, compresslevel=9, filename="") as f:
        f.write(rootfs())
    for name, data in (("rootfs.tar.gz", gz.getvalue()), ("overlay.tar", overlay())):
        (HERE / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes, sha256:{hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
