"""The tar source: every compression, every member type and attribute, errors, hardlinks, dedup."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import lzma
import os
import shutil
import stat
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tartools import rec

from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.sources import SourceRecord, build_tree
from btrfs_ublk_image.sources.tar import detect_compression, parse_pax_time
from btrfs_ublk_image.spec import load_spec
from btrfs_ublk_image.tree import Blob, FileType, Inode, Sparse, Tree

Build = Callable[[str], tuple[Tree, list[SourceRecord]]]

unit = pytest.mark.unit

# ---- helpers ----------------------------------------------------------------------------


def member(
    name: str,
    type: bytes = tarfile.REGTYPE,
    data: bytes = b"",
    *,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    mtime: int = 1_700_000_000,
    linkname: str = "",
    pax: dict[str, str] | None = None,
    dev: tuple[int, int] = (0, 0),
) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = type, mode, uid, gid, mtime
    ti.linkname = linkname
    ti.size = len(data) if type == tarfile.REGTYPE else 0
    ti.devmajor, ti.devminor = dev
    if pax:
        ti.pax_headers = pax
    return ti, data


def make_tar(members: list[tuple[tarfile.TarInfo, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding="utf-8") as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if ti.size else None)
    return buf.getvalue()


def raw_pax_member(ti: tarfile.TarInfo, data: bytes, records: list[tuple[bytes, bytes]]) -> bytes:
    """A PAX member whose extended header holds arbitrary BYTES (binary xattr values)."""
    payload = b"".join(rec(k, v) for k, v in records)
    xh = tarfile.TarInfo("././@PaxHeader")
    xh.type, xh.size = tarfile.XHDTYPE, len(payload)
    out = xh.tobuf(tarfile.USTAR_FORMAT) + payload + bytes(-len(payload) % 512)
    out += ti.tobuf(tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512)
    return out


def compress(data: bytes, kind: str) -> bytes:
    if kind == "none":
        return data
    if kind == "gzip":
        return gzip.compress(data, mtime=0)
    if kind == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    if kind == "xz":
        return lzma.compress(data)
    if kind == "bzip2":
        return bz2.compress(data)
    raise AssertionError(kind)


def spec_for(*paths: str | Path, extra: str = "") -> str:
    layers = "".join(f"  - tar: {{path: '{p}'}}\n" for p in paths)
    return f"version: 1\nname: t\n{extra}layers:\n{layers}"


def files_of(tree: Tree) -> dict[bytes, Inode]:
    return dict(tree.walk())


def content(inode: Inode, packs: PackWriter) -> bytes:
    c = inode.content
    if isinstance(c, bytes):
        return c
    packs._file.flush()
    segments = c.segments if isinstance(c, Sparse) else ((0, c),)
    out = bytearray(c.size)  # a sparse file's holes stay zeros
    with open(packs._path, "rb") as f:
        for offset, blob in segments:
            f.seek(blob.offset)
            out[offset : offset + blob.size] = f.read(blob.size)
    return bytes(out)


# ---- every member type and attribute ----------------------------------------------------

CAP = bytes.fromhex("0100000200200000000000000000000000000000")  # cap_net_raw+ep
ACL = bytes.fromhex(
    "02000000010006ffffffff020005e8030000040004ffffffff100004ffffffff200004ffffffff"
)


def all_types_tar() -> bytes:
    big = b"0123456789abcdef" * 300  # > keep_inline: goes to a Blob
    ms = [
        member("./", tarfile.DIRTYPE, mode=0o700, uid=5, gid=6, mtime=1_600_000_000),
        member("etc", tarfile.DIRTYPE, mode=0o755),
        member("etc/small", data=b"small\n", mode=0o640, uid=1000, gid=1001),
        member("etc/empty", data=b""),
        member("usr/bin/big", data=big, mode=0o4755),  # setuid; parents missing
        member("usr/bin/sgid", data=b"x", mode=0o2711),
        member("tmp", tarfile.DIRTYPE, mode=0o1777),
        member("link", tarfile.SYMTYPE, linkname="etc/small", mode=0o777),
        member("hard", tarfile.LNKTYPE, linkname="etc/small"),
        member("./etc/hard2", tarfile.LNKTYPE, linkname="./usr/bin/big"),
        member("dev/null", tarfile.CHRTYPE, mode=0o666, dev=(1, 3)),
        member("dev/sda", tarfile.BLKTYPE, mode=0o660, gid=6, dev=(8, 0)),
        member("dev/bigdev", tarfile.BLKTYPE, dev=(4095, 1048575)),
        member("run/fifo", tarfile.FIFOTYPE, mode=0o600),
        member(
            "ns",
            data=b"n",
            pax={
                "mtime": "1700000000.123456789",
                "atime": "1700000001.5",
                "ctime": "-1.25",
                "SCHILY.xattr.user.comment": "héllo",
                "LIBARCHIVE.xattr.user.b64": "AAEC/w",  # bytes 00 01 02 ff, unpadded base64
                "LIBARCHIVE.xattr.user.sp%20ace": "eA==",
            },
        ),
        member("big-ids", data=b"i", uid=3_000_000, gid=4_000_000_000),
        member("d" * 100 + "/" + "e" * 150, data=b"long"),  # PAX long path
        member("sym-long", tarfile.SYMTYPE, linkname="t" * 200),
    ]
    body = make_tar(ms)[: -2 * 512]
    body = body.rstrip(b"\0")
    body += bytes(-len(body) % 512)
    caps = tarfile.TarInfo("usr/bin/ping")
    caps.size, caps.mode, caps.mtime = 4, 0o755, 1_700_000_000
    body += raw_pax_member(
        caps,
        b"ping",
        [
            (b"SCHILY.xattr.security.capability", CAP),
            (b"SCHILY.xattr.system.posix_acl_access", ACL),
            (b"SCHILY.xattr.user.nul", b"a\0b\nc="),
        ],
    )
    return body + bytes(1024)


@unit
def test_every_member_type_and_attribute(tmp_path: Path, build: Build, packs: PackWriter) -> None:
    raw = all_types_tar()
    (tmp_path / "all.tar").write_bytes(raw)
    tree, records = build(spec_for("all.tar"))
    assert records == [SourceRecord("tar", "all.tar", "sha256:" + hashlib.sha256(raw).hexdigest())]
    f = files_of(tree)
    root = f[b"/"]
    assert (root.mode, root.uid, root.gid, root.mtime_ns) == (0o700, 5, 6, 1_600_000_000 * 10**9)

    small = f[b"/etc/small"]
    assert small.type == FileType.REG
    assert (small.mode, small.uid, small.gid) == (0o640, 1000, 1001)
    assert small.content == b"small\n"
    assert small.mtime_ns == 1_700_000_000 * 10**9
    assert small.atime_ns is None and small.ctime_ns is None
    assert f[b"/etc/empty"].content == b"" and f[b"/etc/empty"].type == FileType.REG

    big = f[b"/usr/bin/big"]
    assert isinstance(big.content, Blob)
    assert content(big, packs) == b"0123456789abcdef" * 300
    assert big.st_mode == stat.S_IFREG | 0o4755
    assert f[b"/usr/bin/sgid"].mode == 0o2711
    assert f[b"/usr/bin"].type == FileType.DIR and f[b"/usr/bin"].mode == 0o755  # created
    assert f[b"/tmp"].st_mode == stat.S_IFDIR | 0o1777

    link = f[b"/link"]
    assert (link.type, link.target, link.mode) == (FileType.SYMLINK, b"etc/small", 0o777)
    assert f[b"/hard"] is small
    assert f[b"/etc/hard2"] is big

    null = f[b"/dev/null"]
    assert (null.type, null.rdev, null.mode) == (FileType.CHR, os.makedev(1, 3), 0o666)
    sda = f[b"/dev/sda"]
    assert (sda.type, sda.rdev, sda.gid) == (FileType.BLK, os.makedev(8, 0), 6)
    assert f[b"/dev/bigdev"].rdev == os.makedev(4095, 1048575)
    assert f[b"/run/fifo"].type == FileType.FIFO and f[b"/run/fifo"].mode == 0o600

    ns = f[b"/ns"]
    assert ns.mtime_ns == 1_700_000_000_123_456_789
    assert ns.atime_ns == 1_700_000_001_500_000_000
    assert ns.ctime_ns == -1_250_000_000
    assert ns.xattrs == {
        b"user.comment": "héllo".encode(),
        b"user.b64": b"\x00\x01\x02\xff",
        b"user.sp ace": b"x",
    }
    ids = f[b"/big-ids"]
    assert (ids.uid, ids.gid) == (3_000_000, 4_000_000_000)
    assert f[b"/" + b"d" * 100 + b"/" + b"e" * 150].content == b"long"
    assert f[b"/sym-long"].target == b"t" * 200

    ping = f[b"/usr/bin/ping"]
    assert ping.xattrs == {
        b"security.capability": CAP,
        b"system.posix_acl_access": ACL,
        b"user.nul": b"a\0b\nc=",
    }
    assert ping.content == b"ping"


@unit
@pytest.mark.parametrize("kind", ["none", "gzip", "zstd", "xz", "bzip2"])
def test_every_compression_detected_by_magic(tmp_path: Path, build: Build, kind: str) -> None:
    raw = compress(all_types_tar(), kind)
    assert detect_compression(raw[:512]) == kind
    (tmp_path / "layer.tar").write_bytes(raw)  # the name says nothing about the compression
    tree, records = build(spec_for("layer.tar"))
    assert records[0].sha256 == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert tree.lookup("/usr/bin/ping") is not None
    assert tree.lookup("/hard") is tree.lookup("/etc/small")


@unit
def test_zstd_multiple_frames(tmp_path: Path, build: Build) -> None:
    raw = all_types_tar()
    half = len(raw) // 2
    cctx = zstandard.ZstdCompressor()
    (tmp_path / "l.tar.zst").write_bytes(cctx.compress(raw[:half]) + cctx.compress(raw[half:]))
    tree, _ = build(spec_for("l.tar.zst"))
    assert tree.lookup("/usr/bin/ping") is not None


@unit
def test_gnu_format_and_v7(tmp_path: Path, build: Build) -> None:
    long = "x" * 120 + "/" + "y" * 120
    gnu = make_tar(
        [
            member(long, data=b"gnu"),
            member("l", tarfile.SYMTYPE, linkname="z" * 150),
            member("u", data=b"u", uid=2**30, mtime=-100),
        ],
        tarfile.GNU_FORMAT,
    )
    (tmp_path / "gnu.tar").write_bytes(gnu)
    v7 = make_tar([member("v7dir/", tarfile.AREGTYPE), member("v7dir/f", data=b"v")], 0)
    (tmp_path / "v7.tar").write_bytes(v7)
    tree, _ = build(spec_for("gnu.tar", "v7.tar"))
    f = files_of(tree)
    assert f[b"/" + long.encode()].content == b"gnu"
    assert f[b"/l"].target == b"z" * 150
    assert f[b"/u"].uid == 2**30 and f[b"/u"].mtime_ns == -100 * 10**9
    assert f[b"/v7dir"].type == FileType.DIR and f[b"/v7dir/f"].content == b"v"


@unit
def test_non_utf8_names_are_kept_as_bytes(tmp_path: Path, build: Build) -> None:
    name = b"caf\xe9-\xff"
    ti = tarfile.TarInfo(name.decode("utf-8", "surrogateescape"))
    ti.size = 1
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt, errors="surrogateescape") as tf:
            tf.addfile(ti, io.BytesIO(b"1"))
        (tmp_path / "n.tar").write_bytes(buf.getvalue())
        tree, _ = build(spec_for("n.tar"))
        assert list(tree.root.entries) == [name]


# ---- real tools: GNU tar and the compressor CLIs ---------------------------------------


def populate(d: Path) -> None:
    """A directory with every file type tar can store, odd modes, xattrs, long and odd names."""
    (d / "etc").mkdir(parents=True)
    (d / "etc/small").write_bytes(b"hello\n")
    (d / "etc/big").write_bytes(os.urandom(200_000))
    (d / "etc/big-copy").write_bytes((d / "etc/big").read_bytes())
    (d / "empty").write_bytes(b"")
    os.link(d / "etc/small", d / "hardlink")
    os.symlink("etc/small", d / "symlink")
    os.symlink("/nowhere/" + "n" * 150, d / "dangling")
    os.mkfifo(d / "fifo")
    (d / "suid").write_bytes(b"s")
    os.chmod(d / "suid", 0o4755)
    (d / "sticky").mkdir()
    os.chmod(d / "sticky", 0o1777)
    deep = d / ("a" * 90) / ("b" * 90) / ("c" * 90)
    deep.mkdir(parents=True)
    (deep / ("f" * 200)).write_bytes(b"deep")
    (d / os.fsdecode(b"latin1-\xe9")).write_bytes(b"l")
    os.setxattr(d / "etc/small", "user.comment", b"a comment")
    os.setxattr(d / "etc/small", "user.binary", b"\x00\xff\x80")
    os.utime(d / "etc/small", ns=(1_600_000_000_123_456_789, 1_650_000_000_987_654_321))
    if os.geteuid() == 0:
        os.mknod(d / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        os.mknod(d / "loop9", 0o660 | stat.S_IFBLK, os.makedev(7, 9))
        os.chown(d / "empty", 1234, 5678)
        os.setxattr(d / "suid", "security.capability", CAP)


def check_against_dir(tree: Tree, d: Path, packs: PackWriter, ns: bool) -> None:
    seen: dict[int, Inode] = {}
    count = 0
    for dirpath, dirnames, filenames in os.walk(os.fsencode(d)):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = b"/" + os.path.relpath(full, os.fsencode(d))
            st = os.lstat(full)
            node = tree.lookup(rel)
            assert node is not None, rel
            count += 1
            assert node.st_mode == st.st_mode, rel
            assert (node.uid, node.gid) == (st.st_uid, st.st_gid), rel
            if ns:
                assert node.mtime_ns == st.st_mtime_ns, rel
            else:
                assert node.mtime_ns == st.st_mtime_ns // 10**9 * 10**9, rel
            if stat.S_ISREG(st.st_mode):
                with open(full, "rb") as fh:
                    assert content(node, packs) == fh.read(), rel
                if st.st_nlink > 1:
                    assert seen.setdefault(st.st_ino, node) is node, rel
            elif stat.S_ISLNK(st.st_mode):
                assert node.target == os.readlink(full), rel
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                assert node.rdev == st.st_rdev, rel
            if ns:
                want = {
                    n.encode(): os.getxattr(full, n, follow_symlinks=False)
                    for n in os.listxattr(full, follow_symlinks=False)
                }
                assert node.xattrs == want, rel
    assert count == sum(1 for _ in tree.walk()) - 1


@unit
@pytest.mark.parametrize(
    ("fmt", "compressor"),
    [
        ("gnu", None),
        ("pax", None),
        ("pax", "gzip"),
        ("pax", "zstd"),
        ("pax", "xz"),
        ("pax", "bzip2"),
        ("gnu", "zstd"),
    ],
)
def test_gnu_tar_cli(
    tmp_path: Path, build: Build, packs: PackWriter, fmt: str, compressor: str | None
) -> None:
    if shutil.which("tar") is None or (compressor and shutil.which(compressor) is None):
        pytest.skip("tar or compressor missing")
    src = tmp_path / "src"
    populate(src)
    out = tmp_path / "out.tar"
    cmd = ["tar", f"--format={fmt}", "-C", str(src), "-cf", "-", "."]
    if fmt == "pax":
        cmd[2:2] = ["--xattrs", "--xattrs-include=*"]
    tar = subprocess.run(cmd, check=True, capture_output=True).stdout
    if compressor:
        tar = subprocess.run([compressor, "-c"], input=tar, check=True, capture_output=True).stdout
    out.write_bytes(tar)
    tree, records = build(spec_for("out.tar"))
    assert records[0].sha256 == "sha256:" + hashlib.sha256(tar).hexdigest()
    check_against_dir(tree, src, packs, ns=fmt == "pax")
    assert tree.lookup("/hardlink") is tree.lookup("/etc/small")
    big, copy = tree.lookup("/etc/big"), tree.lookup("/etc/big-copy")
    assert big is not None and copy is not None and big is not copy
    assert big.content == copy.content  # dedup: one Blob for identical content


@unit
@pytest.mark.parametrize("fmt", ["gnu", "pax", "oldgnu"])
def test_sparse_files(tmp_path: Path, build: Build, packs: PackWriter, fmt: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse", "wb") as fh:
        fh.write(b"head")
        fh.seek(5 << 20)
        fh.write(b"middle")
        fh.truncate(12 << 20)
    cmd = [
        "tar",
        f"--format={fmt}",
        "--sparse",
        "-C",
        str(src),
        "-cf",
        str(tmp_path / "s.tar"),
        ".",
    ]
    subprocess.run(cmd, check=True)
    tree, _ = build(spec_for("s.tar"))
    node = tree.lookup("/sparse")
    assert node is not None
    assert node.size == 12 << 20
    want = (src / "sparse").read_bytes()
    assert content(node, packs) == want


# ---- layering, dedup --------------------------------------------------------------------


@unit
def test_later_layer_wins_and_directories_merge(tmp_path: Path, build: Build) -> None:
    (tmp_path / "a.tar").write_bytes(
        make_tar(
            [
                member("d", tarfile.DIRTYPE, mode=0o700),
                member("d/keep", data=b"keep"),
                member("d/replace", data=b"old"),
                member("x", tarfile.DIRTYPE),
                member("x/child", data=b"c"),
                member("f", data=b"file"),
            ]
        )
    )
    (tmp_path / "b.tar").write_bytes(
        make_tar(
            [
                member("d", tarfile.DIRTYPE, mode=0o750, uid=7),
                member("d/replace", data=b"new"),
                member("x", tarfile.SYMTYPE, linkname="d"),  # a symlink replaces the directory
                member("f/sub", data=b"s"),  # a directory replaces the file in its way
            ]
        )
    )
    tree, records = build(spec_for("a.tar", "b.tar"))
    f = files_of(tree)
    assert (f[b"/d"].mode, f[b"/d"].uid) == (0o750, 7)
    assert f[b"/d/keep"].content == b"keep"
    assert f[b"/d/replace"].content == b"new"
    assert f[b"/x"].type == FileType.SYMLINK and b"/x/child" not in f
    assert f[b"/f"].type == FileType.DIR and f[b"/f/sub"].content == b"s"
    assert [r.path for r in records] == ["a.tar", "b.tar"]


@unit
def test_directory_replaced_within_one_tar(tmp_path: Path, build: Build) -> None:
    # place() reuses the directory it resolved last: a directory replaced in the same
    # archive (by a symlink, by a file and then a new directory), or a symlink on the
    # resolved path replaced by a directory (w/s below: only place()'s own forget-on-replace
    # catches that one), must still lead later entries to the new place
    (tmp_path / "a.tar").write_bytes(
        make_tar(
            [
                member("t", tarfile.DIRTYPE),
                member("d", tarfile.DIRTYPE),
                member("d/e", tarfile.DIRTYPE),
                member("d/e/one", data=b"1"),
                member("d", tarfile.SYMTYPE, linkname="t"),  # d/e is gone with d
                member("d/e/two", data=b"2"),  # through the symlink: t/e/two
                member("u/v", tarfile.DIRTYPE),
                member("u/v/x", data=b"x"),
                member("u/v", data=b"file"),  # a file replaces the directory
                member("u/v/y", data=b"y"),  # and a new directory replaces the file
                member("w", tarfile.DIRTYPE),
                member("w/s", tarfile.SYMTYPE, linkname="."),
                member("w/s/one", data=b"1"),  # w/one: w/s resolved to w
                member("w/s/s", tarfile.DIRTYPE),  # in w: the symlink s becomes a directory
                member("w/s/two", data=b"2"),  # so the same path leads into it now
            ]
        )
    )
    tree, _ = build(spec_for("a.tar"))
    f = files_of(tree)
    assert f[b"/d"].type == FileType.SYMLINK and b"/d/e/one" not in f
    assert f[b"/t/e/two"].content == b"2"
    assert f[b"/u/v"].type == FileType.DIR and b"/u/v/x" not in f
    assert f[b"/u/v/y"].content == b"y"
    assert f[b"/w/one"].content == b"1" and f[b"/w/s"].type == FileType.DIR
    assert f[b"/w/s/two"].content == b"2" and b"/w/two" not in f


@unit
def test_same_name_twice_in_one_tar(tmp_path: Path, build: Build) -> None:
    (tmp_path / "a.tar").write_bytes(
        make_tar([member("f", data=b"first"), member("f", data=b"second")])
    )
    tree, _ = build(spec_for("a.tar"))
    node = tree.lookup("/f")
    assert node is not None and node.content == b"second"


@unit
def test_identical_files_share_one_blob(tmp_path: Path, build: Build, packs: PackWriter) -> None:
    data = os.urandom(10_000)
    (tmp_path / "a.tar").write_bytes(
        make_tar(
            [member("one", data=data), member("two", data=data), member("three", data=b"x" * 999)]
        )
    )
    (tmp_path / "b.tar.gz").write_bytes(gzip.compress(make_tar([member("four", data=data)])))
    tree, _ = build(spec_for("a.tar", "b.tar.gz"))
    blobs = [tree.lookup(p).content for p in ("/one", "/two", "/four")]  # type: ignore[union-attr]
    assert all(isinstance(b, Blob) for b in blobs)
    assert blobs[0] == blobs[1] == blobs[2]
    assert packs.bytes_deduped == 2 * len(data)
    assert tree.lookup("/one") is not tree.lookup("/two")  # dedup shares data, not inodes


@unit
def test_dot_dot_and_absolute_names_stay_inside(tmp_path: Path, build: Build) -> None:
    (tmp_path / "a.tar").write_bytes(
        make_tar(
            [
                member("../../etc/evil", data=b"1"),
                member("/abs/file", data=b"2"),
                member("a/../../b", data=b"3"),
                member("hl", tarfile.LNKTYPE, linkname="../../etc/evil"),
            ]
        )
    )
    tree, _ = build(spec_for("a.tar"))
    assert sorted(p for p, _ in tree.walk()) == [
        b"/",
        b"/abs",
        b"/abs/file",
        b"/b",
        b"/etc",
        b"/etc/evil",
        b"/hl",
    ]
    assert tree.lookup("/hl") is tree.lookup("/etc/evil")


@unit
def test_source_date_epoch_sets_created_dir_mtime(tmp_path: Path, build: Build) -> None:
    (tmp_path / "a.tar").write_bytes(make_tar([member("x/y/z", data=b"z", mtime=5)]))
    tree, _ = build(spec_for("a.tar", extra="source_date_epoch: 1234\n"))
    for p in ("/", "/x", "/x/y"):
        node = tree.lookup(p)
        assert node is not None and node.mtime_ns == 1234 * 10**9
    z = tree.lookup("/x/y/z")
    assert z is not None and z.mtime_ns == 5 * 10**9


# ---- errors -----------------------------------------------------------------------------


def expect_error(tmp_path: Path, build: Build, data: bytes, match: str) -> str:
    p = tmp_path / "bad.tar"
    p.write_bytes(data)
    with pytest.raises(SourceError) as info:
        build(spec_for("bad.tar"))
    msg = str(info.value)
    assert msg.startswith(str(p) + ":"), msg
    assert match in msg, msg
    return msg


@unit
def test_hardlink_to_missing_target(tmp_path: Path, build: Build) -> None:
    data = make_tar([member("a", data=b"a"), member("h", tarfile.LNKTYPE, linkname="nope")])
    msg = expect_error(tmp_path, build, data, "hard link to 'nope', which is not in the image")
    assert "member 'h'" in msg


@unit
def test_hardlink_to_directory(tmp_path: Path, build: Build) -> None:
    data = make_tar([member("d", tarfile.DIRTYPE), member("h", tarfile.LNKTYPE, linkname="d")])
    expect_error(tmp_path, build, data, "hard link to directory 'd'")


@unit
def test_hardlink_across_layers(tmp_path: Path, build: Build) -> None:
    (tmp_path / "a.tar").write_bytes(make_tar([member("f", data=b"f")]))
    (tmp_path / "b.tar").write_bytes(make_tar([member("h", tarfile.LNKTYPE, linkname="f")]))
    tree, _ = build(spec_for("a.tar", "b.tar"))
    assert tree.lookup("/h") is tree.lookup("/f")


@unit
@pytest.mark.parametrize(
    ("cut", "match"),
    [
        (512 + 100, "member 'a': truncated: expected 1000 bytes, got 100"),
        (512 + 1024 + 200, "truncated archive: it ends inside a header"),
    ],
)
def test_truncated_plain_tar(tmp_path: Path, build: Build, cut: int, match: str) -> None:
    data = make_tar(
        [member("a", data=b"a" * 1000), member("b", data=b"b" * 1000)], tarfile.GNU_FORMAT
    )
    expect_error(tmp_path, build, data[:cut], match)


@unit
@pytest.mark.parametrize("kind", ["gzip", "zstd", "xz", "bzip2"])
def test_truncated_compressed_tar(tmp_path: Path, build: Build, kind: str) -> None:
    raw = make_tar([member(f"f{i}", data=os.urandom(3000)) for i in range(20)])
    data = compress(raw, kind)
    msg = expect_error(tmp_path, build, data[: len(data) * 2 // 3], "truncated")
    assert "corrupt or truncated archive" in msg


@unit
@pytest.mark.parametrize("kind", ["gzip", "zstd", "xz", "bzip2"])
def test_truncated_in_trailing_padding(tmp_path: Path, build: Build, kind: str) -> None:
    """The tar part is complete but the compressed stream is cut: still an error."""
    raw = make_tar([member("f", data=b"x")])  # padded to 10240 bytes
    data = compress(raw, kind)
    expect_error(tmp_path, build, data[:-6], "corrupt or truncated archive")


@unit
def test_error_stops_the_hashing_thread(tmp_path: Path, build: Build) -> None:
    """A tarball that fails midway leaves no thread behind: the source digest's hashing
    thread (started for reads of 64 KiB and more) is stopped, not left waiting on its queue
    until the process exits."""
    data = make_tar([member(f"f{i}", data=os.urandom(400_000)) for i in range(8)])
    before = set(threading.enumerate())
    expect_error(tmp_path, build, data[: len(data) * 2 // 3], "truncated")
    left = [t.name for t in threading.enumerate() if t not in before]
    assert [n for n in left if n != "pack-sha256"] == []  # the pack writer's: the fixture's


@unit
def test_corrupt_header_in_the_middle(tmp_path: Path, build: Build) -> None:
    data = bytearray(make_tar([member("a", data=b"a"), member("b", data=b"b")], tarfile.GNU_FORMAT))
    data[1024 + 10] ^= 0xFF  # second header's name: checksum no longer matches
    msg = expect_error(tmp_path, build, bytes(data), "invalid header")
    assert "after member 'a'" in msg


@unit
def test_corrupt_gzip_data(tmp_path: Path, build: Build) -> None:
    data = bytearray(gzip.compress(make_tar([member("a", data=os.urandom(5000))])))
    data[len(data) // 2] ^= 0xFF
    expect_error(tmp_path, build, bytes(data), "corrupt or truncated archive (gzip)")


@unit
@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty file, not a tar archive"),
        (b"hello world, this is not a tar" * 40, "unknown compression or not a tar archive"),
        (b"\x04\x22\x4d\x18" + bytes(600), "unsupported compression: lz4"),
        (b"PK\x03\x04" + bytes(600), "unsupported compression: zip"),
        (os.urandom(100), "unknown compression or not a tar archive"),
    ],
)
def test_unknown_compression(tmp_path: Path, build: Build, data: bytes, match: str) -> None:
    expect_error(tmp_path, build, data, match)


@unit
def test_missing_tarball(build: Build) -> None:
    with pytest.raises(SourceError, match="nope.tar: cannot open tarball"):
        build(spec_for("nope.tar"))


@unit
def test_non_directory_root_entry(tmp_path: Path, build: Build) -> None:
    expect_error(tmp_path, build, make_tar([member("./", data=b"x")]), "the image root")


@unit
def test_bad_pax_values(tmp_path: Path, build: Build) -> None:
    expect_error(
        tmp_path,
        build,
        make_tar([member("a", pax={"mtime": "12.x"})]),
        "member 'a': invalid PAX time '12.x'",
    )
    expect_error(
        tmp_path,
        build,
        make_tar([member("a", pax={"LIBARCHIVE.xattr.user.x": "!!!"})]),
        "invalid base64",
    )


@unit
def test_empty_archive(tmp_path: Path, build: Build) -> None:
    (tmp_path / "e.tar").write_bytes(bytes(10240))
    tree, _ = build(spec_for("e.tar"))
    assert tree.root.entries == {}


@unit
@pytest.mark.parametrize(
    ("text", "ns"),
    [
        ("0", 0),
        ("1.5", 1_500_000_000),
        ("1700000000.123456789123", 1_700_000_000_123_456_789),
        ("-1.25", -1_250_000_000),
        ("+7", 7_000_000_000),
        (".5", 500_000_000),
    ],
)
def test_parse_pax_time(text: str, ns: int) -> None:
    assert parse_pax_time(text) == ns


# ---- speed ------------------------------------------------------------------------------


@pytest.mark.slow
def test_100k_files_in_a_few_seconds(tmp_path: Path, build: Build) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for d in range(100):
            ti = tarfile.TarInfo(f"d{d}")
            ti.type = tarfile.DIRTYPE
            tf.addfile(ti)
            for i in range(1000):
                data = b"%d\n" % (d * 1000 + i)
                ti = tarfile.TarInfo(f"d{d}/file{i}")
                ti.size = len(data)
                ti.mtime = 1_700_000_000
                tf.addfile(ti, io.BytesIO(data))
    (tmp_path / "many.tar").write_bytes(buf.getvalue())
    start = time.process_time()
    tree, _ = build(spec_for("many.tar"))
    spent = time.process_time() - start
    assert sum(1 for _ in tree.walk()) == 100_101
    assert spent < 20, f"{spent:.1f} s of CPU for 100k entries"


# ---- property: random archives round-trip into the tree ---------------------------------

_names = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="/\0"), max_size=40)


@st.composite
def archives(draw: st.DrawFn) -> tuple[int, list[dict[str, Any]]]:
    fmt = draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    dirs = [""]
    regular: list[str] = []
    entries: list[dict[str, Any]] = []
    for i in range(draw(st.integers(0, 25))):
        kinds = ["file", "dir", "symlink", "fifo", "chr"] + (["hardlink"] if regular else [])
        kind = draw(st.sampled_from(kinds))
        path = f"{draw(st.sampled_from(dirs))}/{draw(_names)}~{i}".lstrip("/")
        e: dict[str, Any] = {
            "path": path,
            "kind": kind,
            "mode": draw(st.integers(0, 0o7777)),
            "uid": draw(st.integers(0, 2**32 - 1)),
            "gid": draw(st.integers(0, 2**32 - 1)),
            "mtime": draw(st.integers(0, 2**36)),
            "ns": draw(st.integers(0, 10**9 - 1)) if fmt == tarfile.PAX_FORMAT else 0,
            "xattrs": (
                draw(st.dictionaries(st.from_regex(r"user\.[a-z]{1,8}", fullmatch=True), _names))
                if fmt == tarfile.PAX_FORMAT
                else {}
            ),
        }
        if kind == "file":
            e["data"] = draw(st.binary(max_size=300))
            regular.append(path)
        elif kind == "dir":
            dirs.append(path)
        elif kind == "symlink":
            e["target"] = draw(_names.filter(bool))
        elif kind == "hardlink":
            e["target"] = draw(st.sampled_from(regular))
        elif kind == "chr":
            e["dev"] = (draw(st.integers(0, 4095)), draw(st.integers(0, 2**20 - 1)))
        entries.append(e)
    return fmt, entries


_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "fifo": tarfile.FIFOTYPE,
    "chr": tarfile.CHRTYPE,
}
_FILETYPES = {
    "file": FileType.REG,
    "dir": FileType.DIR,
    "symlink": FileType.SYMLINK,
    "fifo": FileType.FIFO,
    "chr": FileType.CHR,
}


@unit
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(archive=archives(), kind=st.sampled_from(["none", "gzip", "zstd", "xz", "bzip2"]))
def test_random_archives_round_trip(
    tmp_path: Path, archive: tuple[int, list[dict[str, Any]]], kind: str
) -> None:
    fmt, entries = archive
    ms = []
    for e in entries:
        pax = {f"SCHILY.xattr.{k}": v for k, v in e["xattrs"].items()}
        if e["ns"]:
            pax["mtime"] = f"{e['mtime']}.{e['ns']:09d}"
        ms.append(
            member(
                e["path"],
                _TYPES[e["kind"]],
                e.get("data", b""),
                mode=e["mode"],
                uid=e["uid"],
                gid=e["gid"],
                mtime=e["mtime"],
                linkname=e.get("target", ""),
                pax=pax or None,
                dev=e.get("dev", (0, 0)),
            )
        )
    raw = compress(make_tar(ms, fmt), kind)
    (tmp_path / "r.tar").write_bytes(raw)
    (tmp_path / "p").mkdir(exist_ok=True)
    packs = PackWriter(str(tmp_path / "p"), keep_inline=64)
    try:
        spec = tmp_path / "spec.yaml"
        spec.write_text(spec_for("r.tar"))
        tree, records = build_tree(load_spec(spec), spec, packs)
        assert records[0].sha256 == "sha256:" + hashlib.sha256(raw).hexdigest()
        assert sum(1 for _ in tree.walk()) == len(entries) + 1
        for e in entries:
            node = tree.lookup(e["path"].encode())
            assert node is not None, e
            if e["kind"] == "hardlink":
                assert node is tree.lookup(e["target"].encode())
                continue
            assert node.type == _FILETYPES[e["kind"]]
            mode = 0o777 if e["kind"] == "symlink" else e["mode"]  # as symlink(2) makes them
            # (uid_t)-1: "leave unchanged" to chown(2), so root's 0 after GNU tar
            owner = tuple(0 if n == 2**32 - 1 else n for n in (e["uid"], e["gid"]))
            assert (node.mode, node.uid, node.gid) == (mode, *owner)
            assert node.mtime_ns == e["mtime"] * 10**9 + e["ns"]
            assert node.xattrs == {k.encode(): v.encode() for k, v in e["xattrs"].items()}
            if e["kind"] == "file":
                assert content(node, packs) == e["data"]
            elif e["kind"] == "symlink":
                assert node.target == e["target"].encode()
            elif e["kind"] == "chr":
                assert node.rdev == os.makedev(*e["dev"])
    finally:
        packs.abort()


# ---- options: sha256 pinning, dest, strip_components ----------------------------------


@unit
def test_sha256_pin(tmp_path: Path, build: Build) -> None:
    raw = gzip.compress(make_tar([member("f", data=b"f")]))
    (tmp_path / "a.tar.gz").write_bytes(raw)
    digest = hashlib.sha256(raw).hexdigest()
    for pin in (digest, "sha256:" + digest):
        tree, _ = build(
            f"version: 1\nname: t\nlayers:\n  - tar: {{path: a.tar.gz, sha256: '{pin}'}}\n"
        )
        assert tree.lookup("/f") is not None
    wrong = "0" * 64
    with pytest.raises(SourceError) as info:
        build(f"version: 1\nname: t\nlayers:\n  - tar: {{path: a.tar.gz, sha256: '{wrong}'}}\n")
    assert str(info.value) == (
        f"{tmp_path / 'a.tar.gz'}: sha256 mismatch: the spec pins {wrong}, the file is {digest}"
    )


@unit
def test_dest_and_strip_components(tmp_path: Path, build: Build) -> None:
    (tmp_path / "a.tar").write_bytes(
        make_tar(
            [
                member("./", tarfile.DIRTYPE, mode=0o700),
                member("pkg-1.0", tarfile.DIRTYPE, mode=0o750),
                member("pkg-1.0/bin/tool", data=b"t"),
                member("pkg-1.0/bin/alias", tarfile.LNKTYPE, linkname="pkg-1.0/bin/tool"),
                member("pkg-1.0/../../escape", data=b"e"),
            ]
        )
    )
    tree, _ = build(
        "version: 1\nname: t\nlayers:\n"
        "  - tar: {path: a.tar, dest: /opt/pkg, strip_components: 1}\n"
    )
    assert sorted(p for p, _ in tree.walk()) == [
        b"/",
        b"/opt",
        b"/opt/pkg",
        b"/opt/pkg/bin",
        b"/opt/pkg/bin/alias",
        b"/opt/pkg/bin/tool",
    ]
    assert tree.lookup("/opt/pkg/bin/alias") is tree.lookup("/opt/pkg/bin/tool")
    assert tree.root.mode == 0o755  # "./" and "pkg-1.0" were stripped away
    tree, _ = build("version: 1\nname: t\nlayers:\n  - tar: {path: a.tar, dest: /srv}\n")
    srv = tree.lookup("/srv")
    assert srv is not None and srv.mode == 0o700  # the archive's "./" describes dest
    assert tree.lookup("/srv/escape") is not None  # '..' stops at the image root, then dest
