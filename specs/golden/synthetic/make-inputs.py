#!/usr/bin/env python3
"""Write this golden spec's input tarballs, byte for byte the same on every run.

    python3 specs/golden/synthetic/make-inputs.py   # rewrites rootfs.tar.gz, overlay.tar, oci/

The tarballs and the OCI layout are committed (the tarballs pinned by sha256 in spec.yaml,
the OCI layout by the digests inside it), so the golden
test never depends on this script (or on the zlib that compresses them); run it
only to change the inputs, then update spec.yaml's sha256 pins and the expected
listing and image id (tests/test_golden.py says how).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
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
            ti = member(
                name, kind, size=len(data) if kind == tarfile.REGTYPE else 0, mtime=T0 - 50, **kw
            )
            tf.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("etc/hostname", b"golden-overlay\n")  # later layer wins
        add("usr/bin", kind=tarfile.DIRTYPE, mode=0o751)  # dir on dir: metadata only
        add("etc/replaced-by-dir", kind=tarfile.DIRTYPE, mode=0o755)
        add("etc/replaced-by-dir/inside", b"inside\n")
        add("etc/symlink-then-file", b"now a file\n")
        add("opt/new/deep/file", b"parents created\n")  # missing parents are created
    return buf.getvalue()


def layer_tar(entries: list[tuple[str, bytes, bytes, dict[str, object]]]) -> bytes:
    """(name, type, content, attributes) -> an uncompressed tar stream (an OCI layer's diff)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, data, kw in entries:
            ti = member(name, kind, size=len(data) if kind == tarfile.REGTYPE else 0, **kw)
            tf.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return buf.getvalue()


def oci_layout(root: Path) -> None:
    """A two-layer OCI image layout (ref "v1"): files, then whiteouts and an opaque dir."""
    reg, dir_, sym, lnk = tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
    t = {"mtime": T0 - 10}
    layer1 = layer_tar(
        [
            ("app", dir_, b"", t),
            ("app/bin", dir_, b"", t),
            ("app/bin/tool", reg, b"#!/bin/sh\necho tool v1\n", {**t, "mode": 0o755}),
            ("app/bin/tool-hardlink", lnk, b"", {**t, "linkname": "app/bin/tool"}),
            ("app/link", sym, b"", {**t, "linkname": "bin/tool", "mode": 0o777}),
            ("app/data", dir_, b"", {**t, "mode": 0o750, "uid": 100, "gid": 101}),
            ("app/data/keep.txt", reg, b"version 1\n", {**t, "uid": 100, "gid": 101}),
            ("app/data/gone.txt", reg, b"whited out by layer 2\n", t),
            ("app/cache", dir_, b"", t),
            ("app/cache/old-1", reg, b"old 1\n", t),
            ("app/cache/old-2", reg, b"old 2\n", t),
            ("app/big.bin", reg, stream(300_000, b"oci"), t),
        ]
    )
    t2 = {"mtime": T0 - 5}
    layer2 = layer_tar(
        [
            ("app/data/.wh.gone.txt", reg, b"", t2),
            ("app/data/keep.txt", reg, b"version 2\n", {**t2, "uid": 100, "gid": 101}),
            ("app/cache", dir_, b"", t2),
            ("app/cache/.wh..wh..opq", reg, b"", t2),
            ("app/cache/new", reg, b"new\n", t2),
            ("etc/.wh.mtab", reg, b"", t2),  # a path from an earlier spec layer
        ]
    )
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes, media_type: str) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

    def gz(data: bytes) -> bytes:
        out = io.BytesIO()
        with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=9, filename="") as f:
            f.write(data)
        return out.getvalue()

    def js(doc: object) -> bytes:
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/app/bin:/usr/bin:/bin", "APP_MODE=golden"],
            "Entrypoint": ["/app/bin/tool"],
            "Cmd": ["--help"],
            "User": "100:101",
            "WorkingDir": "/app",
            "Labels": {"org.example.golden": "synthetic"},
        },
        "rootfs": {
            "type": "layers",
            "diff_ids": [
                "sha256:" + hashlib.sha256(layer1).hexdigest(),
                "sha256:" + hashlib.sha256(layer2).hexdigest(),
            ],
        },
        "history": [
            {"created_by": "make-inputs.py layer 1"},
            {"created_by": "make-inputs.py layer 2"},
        ],
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": put(js(config), "application/vnd.oci.image.config.v1+json"),
        "layers": [
            put(gz(layer1), "application/vnd.oci.image.layer.v1.tar+gzip"),
            put(layer2, "application/vnd.oci.image.layer.v1.tar"),
        ],
    }
    desc = put(js(manifest), "application/vnd.oci.image.manifest.v1+json")
    desc["annotations"] = {"org.opencontainers.image.ref.name": "v1"}
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [desc],
    }
    (root / "index.json").write_bytes(js(index))
    (root / "oci-layout").write_bytes(js({"imageLayoutVersion": "1.0.0"}))


def main() -> None:
    oci = HERE / "oci"
    if oci.exists():
        shutil.rmtree(oci)
    oci_layout(oci)
    print(
        f"oci/: index.json sha256:{hashlib.sha256((oci / 'index.json').read_bytes()).hexdigest()}"
    )
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0, compresslevel=9, filename="") as f:
        f.write(rootfs())
    for name, data in (("rootfs.tar.gz", gz.getvalue()), ("overlay.tar", overlay())):
        (HERE / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes, sha256:{hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
