"""Tarballs read as GNU tar reads them (issue 27): archives written by the real tools
(GNU tar incremental, sparse in every format, volume labels; bsdtar; git archive;
Python's tarfile; Go's archive/tar) and hand-made ones for the forms no tool writes
on demand. Each builds, passes `btrfs check` and mounts with what GNU tar extracts;
sparse holes are holes (no extent, no pack byte)."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import signal
import struct
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tartools import (
    END,
    GNU_MAGIC,
    gnu_tar_extract,
    have_root_and_gnu_tar,
    header,
    long_name,
    octal12,
    padded,
    pax,
    rec,
    regular,
)

from btrfs_ublk_image import trace
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.packs import PackWriter, sector_runs
from btrfs_ublk_image.progress import Progress
from btrfs_ublk_image.reader import BundleReader
from btrfs_ublk_image.sources import build_tree
from btrfs_ublk_image.spec import load_spec
from btrfs_ublk_image.tree import Blob, Sparse

from bundletools import dmesg_btrfs_problems, dmesg_len, list_dir, list_tree, mounted_bundle, run

unit = pytest.mark.unit
MIB = 1 << 20


# ---- archives written by the real tools --------------------------------------------------


def _tree(src: Path) -> None:
    """Files for the tool-written archives: long paths, a symlink, a hard link, owners."""
    deep = src / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    (deep / ("f" * 90)).write_bytes(b"deep file\n")
    (src / "plain").write_bytes(os.urandom(5000))
    os.link(src / "plain", src / "hard")
    os.symlink("plain", src / "sym")
    os.chown(src / "plain", 1000, 1001)
    os.utime(src / "plain", ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))


def _sparse_tree(src: Path) -> None:
    """Sparse files: data at unaligned offsets, two identical data runs (one extent for
    both), a hole at the end, a file of holes only, and one small enough to be inline."""
    src.mkdir(parents=True, exist_ok=True)
    same = os.urandom(8192)
    with open(src / "big", "wb") as f:
        f.truncate(1 << 30)
        f.seek(12345)
        f.write(os.urandom(100_000))
        for at in (512 * MIB, 768 * MIB):
            f.seek(at)
            f.write(same)
        f.seek(900 * MIB + 7)
        f.write(b"hello")
    with open(src / "holes", "wb") as f:
        f.truncate(MIB)
    with open(src / "small", "wb") as f:
        f.truncate(1500)
        f.write(b"ab")
    (src / "plain").write_bytes(b"not sparse\n")


def _gnu_tar(tmp: Path, *args: str, tree: Callable[[Path], None] = _tree) -> Path:
    src = tmp / "src"
    if not src.exists():
        src.mkdir()
        tree(src)
    out = tmp / "t.tar"
    run("tar", *args, "-C", src, "-cf", out, ".")
    return out


def _incremental(tmp: Path) -> Path:
    return _gnu_tar(tmp, f"--listed-incremental={tmp / 'snar'}")


def _old_incremental(tmp: Path) -> Path:
    return _gnu_tar(tmp, "-G", "--format=gnu")


def _sparse(fmt: str, version: str | None = None, raw: bool = False) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        args = [f"--format={fmt}", "--sparse"]
        if version is not None:
            args.append(f"--sparse-version={version}")
        if raw:  # 512-byte holes found by reading: segments at offsets of 512, not 4096
            args.append("--hole-detection=raw")
        return _gnu_tar(tmp, *args, tree=_sparse_tree)

    return make


def _acl_tree(src: Path) -> None:
    """Access and default ACLs, for ids no user database names (so GNU tar writes them
    as numbers): a named user and group with a mask, a minimal ACL, a default ACL."""
    (src / "f").write_bytes(b"acl\n")
    run("setfacl", "-m", "u:4242:r,g:4343:rw", src / "f")
    (src / "minimal").write_bytes(b"m")
    run("setfacl", "-m", "u::rw,g::r,o::-", src / "minimal")
    (src / "d").mkdir()
    run("setfacl", "-m", "u:4244:rx", src / "d")
    run("setfacl", "-d", "-m", "u:4242:rwx,g:4343:rx", src / "d")


def _acls(tool: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        if shutil.which("setfacl") is None or shutil.which(tool) is None:
            pytest.skip(f"setfacl (acl) or {tool} missing")
        if tool == "tar":
            return _gnu_tar(tmp, "--format=posix", "--acls", tree=_acl_tree)
        src = tmp / "src"
        src.mkdir()
        _acl_tree(src)
        run("bsdtar", "--format=pax", "--acls", "-C", src, "-cf", tmp / "t.tar", ".")
        return tmp / "t.tar"

    return make


def _volume_label(tmp: Path) -> Path:
    return _gnu_tar(tmp, "--format=gnu", "-V", "BACKUP 2026-11-26")


def _bsdtar(fmt: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        if shutil.which("bsdtar") is None:
            pytest.skip("bsdtar (libarchive-tools) missing")
        src = tmp / "src"
        src.mkdir()
        _tree(src)
        os.setxattr(src / "plain", "user.comment", b"from bsdtar")
        os.setxattr(src / "plain", "trusted.t", b"\x00\x01binary")
        out = tmp / "t.tar"
        run("bsdtar", f"--format={fmt}", "--xattrs", "-C", src, "-cf", out, ".")
        return out

    return make


def _git_archive_empty(tmp: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git missing")
    repo = tmp / "repo"
    run("git", "init", "-q", repo)
    empty = run("git", "-C", repo, "hash-object", "-t", "tree", "/dev/null").stdout.strip()
    out = tmp / "t.tar"
    with open(out, "wb") as f:
        subprocess.run(
            ["git", "-C", str(repo), "archive", "--format=tar", empty], stdout=f, check=True
        )
    return out


def _python_tarfile(fmt: int) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        out = tmp / "t.tar"
        with tarfile.open(out, "w", format=fmt) as tf:
            for name, data, kw in [
                ("l" * 150 + "/file", b"long", {}),
                ("owned", b"o", {"uid": 4242, "gid": 77, "mode": 0o4750}),
                ("big-uid", b"b", {"uid": 3_000_000, "gid": 3_000_001}),
            ]:
                ti = tarfile.TarInfo(name)
                ti.size, ti.mtime = len(data), 1_700_000_000
                for k, v in kw.items():
                    setattr(ti, k, v)
                if fmt == tarfile.PAX_FORMAT:
                    ti.pax_headers = {"mtime": "1700000000.5", "SCHILY.xattr.user.k": "v"}
                tf.addfile(ti, io.BytesIO(data))
            ti = tarfile.TarInfo("link-to-" + "t" * 120)
            ti.type, ti.linkname, ti.mtime = tarfile.SYMTYPE, "target/" + "x" * 120, 1
            tf.addfile(ti)
        return out

    return make


_GO_WRITER = """package main

import (
	"archive/tar"
	"os"
	"strings"
	"time"
)

func main() {
	format := tar.FormatPAX
	if os.Args[1] == "gnu" {
		format = tar.FormatGNU
	}
	w := tar.NewWriter(os.Stdout)
	add := func(h *tar.Header, data string) {
		h.Format = format
		h.Size = int64(len(data))
		if err := w.WriteHeader(h); err != nil {
			panic(err)
		}
		if _, err := w.Write([]byte(data)); err != nil {
			panic(err)
		}
	}
	mt := time.Unix(1700000000, 0)
	add(&tar.Header{Name: "dir/", Typeflag: tar.TypeDir, Mode: 0o750, ModTime: mt}, "")
	add(&tar.Header{Name: "dir/" + strings.Repeat("n", 150), Typeflag: tar.TypeReg, Mode: 0o640,
		Uid: 3000000, Gid: 5, ModTime: mt}, "go data\\n")
	add(&tar.Header{Name: "sym", Typeflag: tar.TypeSymlink, Linkname: strings.Repeat("t", 130),
		ModTime: mt}, "")
	if format == tar.FormatPAX {
		add(&tar.Header{Name: "xattr", Typeflag: tar.TypeReg, Mode: 0o600,
			ModTime: time.Unix(1700000000, 250000000),
			PAXRecords: map[string]string{"SCHILY.xattr.user.go": "yes"}}, "x")
	}
	if err := w.Close(); err != nil {
		panic(err)
	}
}
"""


def _go(fmt: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        # the Go scripts/setup.sh installs (PATH's may be older, or missing)
        found = subprocess.run(
            [Path(__file__).resolve().parent.parent / "scripts" / "find-go.sh"],
            capture_output=True,
            text=True,
        )
        assert found.returncode == 0, "no Go >= 1.21 (scripts/setup.sh installs one)"
        go = found.stdout.strip()
        (tmp / "gowriter").mkdir()
        (tmp / "gowriter" / "main.go").write_text(_GO_WRITER)
        env = {**os.environ, "GOCACHE": str(tmp / "gocache"), "GO111MODULE": "off"}
        binary = tmp / "gowriter" / "w"
        subprocess.run(
            [go, "build", "-o", str(binary), "main.go"], cwd=tmp / "gowriter", env=env, check=True
        )
        out = tmp / "t.tar"
        with open(out, "wb") as f:
            subprocess.run([str(binary), fmt], stdout=f, check=True)
        return out

    return make


# ---- hand-made archives: the forms no tool writes on demand ------------------------------


def _bytes(data: bytes) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        (tmp / "t.tar").write_bytes(data)
        return tmp / "t.tar"

    return make


def _sparse_10(
    name: bytes,
    segments: list[tuple[int, bytes]],
    realsize: int,
    size_first: bool,
    marker: bool = True,
) -> bytes:
    """A PAX GNU sparse 1.0 member; the header's size field is 0 and the PAX ``size``
    record gives the stored data size, before or after ``GNU.sparse.realsize``. With
    ``marker`` the map ends with a (real size, 0) entry, as GNU tar writes it (GNU
    tar's extraction ends the file at the map's last entry, not at the real size)."""
    if marker:
        segments = [*segments, (realsize, b"")]
    lines = b"%d\n" % len(segments) + b"".join(b"%d\n%d\n" % (o, len(d)) for o, d in segments)
    stored = (lines + bytes(-len(lines) % 512)) + b"".join(d for _, d in segments)
    size = rec(b"size", b"%d" % len(stored))
    real = rec(b"GNU.sparse.realsize", b"%d" % realsize)
    records = (
        rec(b"GNU.sparse.major", b"1")
        + rec(b"GNU.sparse.minor", b"0")
        + rec(b"GNU.sparse.name", name)
        + (size + real if size_first else real + size)
        + rec(b"path", b"./GNUSparseFile.1/" + name)
    )
    return (
        pax(records)
        + header(b"GNUSparseFile.1/" + name, b"0", 0)
        + stored
        + bytes(-len(stored) % 512)
    )


def _old_sparse(name: bytes, segments: list[tuple[int, bytes]], realsize: int) -> bytes:
    """A GNU old sparse ('S') member, its map in the header (up to 3 segments), ended
    by a (real size, 0) entry as GNU tar writes it: GNU tar's extraction takes the
    file's size from that entry, other readers (and ours) from the real size field."""
    extra: dict[int, bytes] = {483: octal12(realsize)}
    segments = [*segments, (realsize, b"")]
    for i, (off, data) in enumerate(segments):
        extra[386 + 24 * i] = octal12(off)
        extra[386 + 24 * i + 12] = octal12(len(data))
    stored = b"".join(d for _, d in segments)
    return (
        header(name, b"S", len(stored), magic=GNU_MAGIC, extra=extra)
        + stored
        + bytes(-len(stored) % 512)
    )


MINUS_ONE = 0xFFFFFFFF

HAND_MADE: dict[str, bytes] = {
    # the last 'L' / 'K' wins; a PAX path or linkpath wins over both, in either order
    "repeated-long-names": (
        long_name(b"first-" + b"a" * 100)
        + long_name(b"second-" + b"a" * 100)
        + regular(b"short-a", b"a")
        + long_name(b"t1", b"K")
        + long_name(b"t2-" + b"t" * 110, b"K")
        + header(b"sym", b"2", linkname=b"short")
        + long_name(b"from-L")
        + pax(rec(b"path", b"from-pax-1"))
        + regular(b"b", b"b")
        + pax(rec(b"path", b"from-pax-2"))
        + long_name(b"from-L-2")
        + regular(b"c", b"c")
        + END
    ),
    # several 'x' headers before one member: the last one wins whole (GNU tar, Go)
    "repeated-pax": (
        pax(rec(b"path", b"p1") + rec(b"mtime", b"1600000000.5") + rec(b"uid", b"42"))
        + pax(rec(b"path", b"p2") + rec(b"gid", b"43"))
        + regular(b"f", b"x")
        + END
    ),
    "volume-label": header(b"LABEL", b"V", magic=GNU_MAGIC) + regular(b"f", b"x") + END,
    "owner-minus-one": (
        regular(b"octal", b"x", uid=MINUS_ONE, gid=MINUS_ONE, magic=GNU_MAGIC)
        + pax(rec(b"uid", b"4294967295") + rec(b"gid", b"4294967295"))
        + regular(b"pax", b"y")
        + regular(b"other", b"z", uid=4294967294, gid=5, magic=GNU_MAGIC)
        + END
    ),
    "invalid-xattr-names": (
        pax(
            rec(b"SCHILY.xattr.noprefix", b"v")
            + rec(b"SCHILY.xattr.user.ok", b"v")
            + rec(b"SCHILY.xattr.system.foo", b"v")
            + rec(b"SCHILY.xattr.user.", b"v")
            + rec(b"SCHILY.xattr.trusted.t", b"v")
        )
        + regular(b"f", b"x")
        + END
    ),
    "pax-global-only": pax(rec(b"comment", b"an empty tree"), b"g") + END,
    "empty-pax-only": header(b"PaxHeader/x", b"x", 0) + END,
    "no-end-marker": regular(b"a", b"x") + regular(b"b", b"y" * 600),
    # GNU magic: the prefix bytes are atime/ctime (-G); POSIX magic: a path prefix
    "gnu-magic-prefix": (
        regular(b"file", b"x", magic=GNU_MAGIC, prefix=b"15301403051\x0015301403051")
        + header(b"dir", b"5", mode=0o755)
        + regular(b"name", b"y", prefix=b"dir")
        + END
    ),
    # `size` is the stored data, GNU.sparse.realsize the file's size, in either order
    # and without the trailing (size, 0) map entry: as bsdtar, Go and Python read them
    # (GNU tar's extraction ends the file at its last map entry and, with `size` last,
    # misreads the member: the oracle is bsdtar, ORACLE below)
    "pax-size-and-realsize": (
        _sparse_10(b"size-first", [(4096, b"hello"), (9000, b"xyz")], 20000, True, False)
        + _sparse_10(b"size-last", [(0, b"abc"), (12288, b"tail")], 12292, False, False)
        + _sparse_10(b"no-data", [], 3 * MIB, True, False)
        + END
    ),
    "old-sparse-unaligned": (
        # segments of 512-byte multiples, as GNU tar writes them (its extraction of others
        # loses bytes), at offsets that are not sector multiples
        _old_sparse(b"s", [(512, b"h" * 512), (5120, b"a" * 1024), (70144, b"z" * 512)], 200_000)
        + END
    ),
    # every member's data is skipped but a hard link's ("links 0 size on tape")
    "data-after-non-regular": (
        regular(b"f0", b"0")
        + header(b"sym", b"2", 5, linkname=b"f0")
        + padded(b"junk!")
        + header(b"dir", b"5", 700, mode=0o755)
        + padded(b"x" * 700)
        + header(b"hl", b"1", 600, linkname=b"f0")
        + regular(b"f", b"x")
        + END
    ),
    "dumpdir": (
        header(b"d/", b"D", 10, mode=0o750, magic=GNU_MAGIC)
        + b"Yfile\0\0".ljust(512, b"\0")
        + regular(b"d/file", b"f", magic=GNU_MAGIC)
        + END
    ),
}

TOOL_MADE: dict[str, Callable[[Path], Path]] = {
    "gnu-listed-incremental": _incremental,
    "gnu-G": _old_incremental,
    "gnu-volume-label": _volume_label,
    "gnu-acls": _acls("tar"),
    "bsdtar-acls": _acls("bsdtar"),
    "sparse-gnu": _sparse("gnu"),
    "sparse-gnu-raw": _sparse("gnu", raw=True),
    "sparse-oldgnu": _sparse("oldgnu"),
    "sparse-pax-0.0": _sparse("pax", "0.0"),
    "sparse-pax-0.1": _sparse("pax", "0.1"),
    "sparse-pax-1.0": _sparse("pax", "1.0"),
    "sparse-pax-1.0-raw": _sparse("pax", "1.0", raw=True),
    "bsdtar-pax": _bsdtar("pax"),
    "bsdtar-gnutar": _bsdtar("gnutar"),
    "bsdtar-ustar": _bsdtar("ustar"),
    "git-archive-empty-tree": _git_archive_empty,
    "python-pax": _python_tarfile(tarfile.PAX_FORMAT),
    "python-gnu": _python_tarfile(tarfile.GNU_FORMAT),
    "go-pax": _go("pax"),
    "go-gnu": _go("gnu"),
}
CASES: dict[str, Callable[[Path], Path]] = {
    **TOOL_MADE,
    **{k: _bytes(v) for k, v in HAND_MADE.items()},
}


# cases where GNU tar's extraction is not the reference (see the case)
ORACLE = {"pax-size-and-realsize": "bsdtar"}


def _spec(tmp: Path, tarball: Path) -> Path:
    spec = tmp / "spec.yaml"
    spec.write_text(f"version: 1\nname: fidelity\nlayers:\n  - tar: {{path: '{tarball}'}}\n")
    return spec


@pytest.mark.root
@pytest.mark.parametrize("case", sorted(CASES))
def test_mounts_as_gnu_tar_extracts(tmp_path: Path, case: str) -> None:
    if not have_root_and_gnu_tar():
        pytest.skip("needs root and GNU tar")
    tarball = CASES[case](tmp_path)
    bundle = tmp_path / "bundle"
    assert cli(["build", str(_spec(tmp_path, tarball)), "-o", str(bundle)]) == 0
    check = run("btrfs", "check", "--readonly", bundle / "meta.img", check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    if ORACLE.get(case) == "bsdtar":
        if shutil.which("bsdtar") is None:
            pytest.skip("bsdtar (libarchive-tools) missing")
        (tmp_path / "gnu").mkdir()
        run("bsdtar", "--xattrs", "--numeric-owner", "-p", "-C", tmp_path / "gnu", "-xf", tarball)
    else:
        gnu_tar_extract(tarball, tmp_path / "gnu")
    want = list_dir(tmp_path / "gnu")
    before = dmesg_len()
    with mounted_bundle(bundle, tmp_path) as m:
        got = list_dir(m.mountpoint)
        blocks = {p: os.lstat(m.mountpoint / p.lstrip("/")).st_blocks for p in got}
    assert got == want
    assert dmesg_btrfs_problems(before, m.loops) == []
    if case.startswith("sparse-"):  # holes are holes: the 1 GiB file has ~120 KiB of data
        assert blocks["/big"] * 512 < 256 << 10, blocks
        assert blocks["/holes"] == 0


# ---- what the reader decides, one rule at a time -----------------------------------------


def _build(
    tmp: Path, data: bytes, keep_inline: int = 2048
) -> tuple[dict[str, object], list[str], PackWriter]:
    (tmp / "t.tar").write_bytes(data)
    (tmp / "p").mkdir(exist_ok=True)
    packs = PackWriter(str(tmp / "p"), keep_inline=keep_inline)
    progress = Progress("test", stream=io.StringIO())
    spec = _spec(tmp, tmp / "t.tar")
    tree, _ = build_tree(load_spec(spec), spec, packs, progress)
    packs.finish()
    return list_tree(tree, tmp / "p"), progress.warnings, packs


@unit
def test_hand_made_rules(tmp_path: Path) -> None:
    got, warnings, _ = _build(tmp_path, HAND_MADE["repeated-long-names"])
    assert sorted(got) == ["/from-pax-1", "/from-pax-2", "/second-" + "a" * 100, "/sym"]
    assert got["/sym"]["target"] == "t2-" + "t" * 110
    (tmp_path / "2").mkdir()
    got, _, _ = _build(tmp_path / "2", HAND_MADE["repeated-pax"])
    assert list(got) == ["/p2"] and got["/p2"]["uid"] == 0 and got["/p2"]["gid"] == 43
    assert got["/p2"]["mtime_ns"] == 1_700_000_000 * 10**9
    (tmp_path / "3").mkdir()
    got, _, _ = _build(tmp_path / "3", HAND_MADE["volume-label"])
    assert list(got) == ["/f"]
    (tmp_path / "4").mkdir()
    got, _, _ = _build(tmp_path / "4", HAND_MADE["owner-minus-one"])
    assert [(got[p]["uid"], got[p]["gid"]) for p in ("/octal", "/pax", "/other")] == [
        (0, 0),
        (0, 0),
        (4294967294, 5),
    ]
    (tmp_path / "5").mkdir()
    got, warnings, _ = _build(tmp_path / "5", HAND_MADE["invalid-xattr-names"])
    assert got["/f"]["xattrs"] == {"trusted.t": b"v".hex(), "user.ok": b"v".hex()}
    assert len(warnings) == 3 and all("skipped" in w for w in warnings), warnings
    (tmp_path / "6").mkdir()
    got, warnings, _ = _build(tmp_path / "6", HAND_MADE["gnu-magic-prefix"])
    assert sorted(got) == ["/dir", "/dir/name", "/file"]
    for i, case in enumerate(("pax-global-only", "empty-pax-only")):
        (tmp_path / f"e{i}").mkdir()
        got, warnings, _ = _build(tmp_path / f"e{i}", HAND_MADE[case])
        assert got == {} and warnings == []
    (tmp_path / "7").mkdir()
    got, warnings, _ = _build(tmp_path / "7", HAND_MADE["no-end-marker"])
    assert sorted(got) == ["/a", "/b"]
    assert len(warnings) == 1 and "no end-of-archive marker" in warnings[0]
    assert "after member 'b'" in warnings[0]
    (tmp_path / "10").mkdir()
    got, _, _ = _build(tmp_path / "10", HAND_MADE["data-after-non-regular"])
    assert sorted(got) == ["/dir", "/f", "/f0", "/hl", "/sym"]
    assert got["/hl"]["link"] == "/f0" and got["/sym"]["target"] == "f0"
    (tmp_path / "8").mkdir()
    got, _, _ = _build(tmp_path / "8", HAND_MADE["dumpdir"])
    assert got["/d"]["type"] == "dir" and got["/d"]["mode"] == oct(0o750)
    (tmp_path / "9").mkdir()
    got, _, _ = _build(tmp_path / "9", HAND_MADE["pax-size-and-realsize"])
    assert [got[p]["size"] for p in ("/size-first", "/size-last", "/no-data")] == [
        20000,
        12292,
        3 * MIB,
    ]
    want = bytearray(20000)
    want[4096:4101], want[9000:9003] = b"hello", b"xyz"
    assert got["/size-first"]["sha256"] == hashlib.sha256(want).hexdigest()


@unit
def test_nul_in_an_xattr_name_is_skipped(tmp_path: Path) -> None:
    data = pax(rec(b"SCHILY.xattr.user.a\0b", b"v") + rec(b"SCHILY.xattr.user.ok", b"w"))
    got, warnings, _ = _build(tmp_path, data + regular(b"f", b"x") + END)
    assert got["/f"]["xattrs"] == {"user.ok": b"w".hex()}
    assert len(warnings) == 1 and "NUL" in warnings[0] and "member 'f'" in warnings[0]


@unit
def test_unknown_type_is_a_regular_file_with_a_warning(tmp_path: Path) -> None:
    got, warnings, _ = _build(tmp_path, header(b"odd", b"Q", 3) + b"abc".ljust(512, b"\0") + END)
    assert got["/odd"]["type"] == "file" and got["/odd"]["size"] == 3
    assert len(warnings) == 1 and "unknown type 'Q'" in warnings[0]


@unit
@pytest.mark.parametrize(
    ("cut", "needle"),
    [
        (512 + 100, "member 'a': truncated"),
        (1024 + 1, "truncated archive: it ends inside a header"),
    ],
)
def test_an_archive_ending_inside_a_member_is_refused(
    tmp_path: Path, cut: int, needle: str
) -> None:
    from btrfs_ublk_image.errors import SourceError

    data = regular(b"a", b"x" * 1000) + regular(b"b", b"y")
    data = data[:cut] if cut != 1024 + 1 else regular(b"a", b"x") + b"z"
    with pytest.raises(SourceError) as info:
        _build(tmp_path, data)
    assert str(info.value).startswith(f"{tmp_path / 't.tar'}: ") and needle in str(info.value)


@unit
def test_sparse_runs_and_dedup(tmp_path: Path) -> None:
    """Segments become sector-aligned runs (zeros before an unaligned start are stored,
    runs that share or touch a sector merge);
    identical runs are one blob; a file whose data fills it is a plain blob."""
    assert sector_runs([(100, 5), (5000, 3), (8192, 10), (20000, 1), (30000, 1)]) == [
        (0, 8202),  # the runs of (100, 5) and (5000, 3) touch, (8192, 10) shares a sector
        (16384, 20001),
        (28672, 30001),
    ]
    same = os.urandom(5000)
    data = _sparse_10(b"s", [(8192, same), (65536, same)], 1 << 20, True)
    data += _sparse_10(b"full", [(0, same)], 5000, True) + END
    (tmp_path / "t.tar").write_bytes(data)
    packs = PackWriter(str(tmp_path), keep_inline=2048)
    spec = _spec(tmp_path, tmp_path / "t.tar")
    tree, _ = build_tree(load_spec(spec), spec, packs)
    s, full = tree.lookup("/s"), tree.lookup("/full")
    assert s is not None and full is not None
    assert isinstance(s.content, Sparse) and s.size == 1 << 20
    (a, blob_a), (b, blob_b) = s.content.segments
    assert (a, b) == (8192, 65536) and blob_a == blob_b and blob_a.size == 5000
    assert isinstance(full.content, Blob) and full.content == blob_a
    assert packs.bytes_deduped == 10000
    # a trace's prefetch list names the chunks of the data runs (holes have none)
    assert trace.chunks_of_files(tree, ["/s"], 4096) == [(0, 0), (0, 1)]
    packs.abort()


# ---- a 60 GB sparse file from a small archive --------------------------------------------


def _nonzero_blocks(chunks: list[tuple[int, bytes]]) -> dict[int, str]:
    """offset -> sha256 of every 4 KiB block that is not all zeros."""
    out: dict[int, str] = {}
    for at, data in chunks:
        assert at % 4096 == 0
        for i in range(0, len(data), 4096):
            block = data[i : i + 4096]
            if block.strip(b"\0"):
                out[at + i] = hashlib.sha256(block.ljust(4096, b"\0")).hexdigest()
    return out


def _file_data(path: Path) -> list[tuple[int, bytes]]:
    """A file's data regions (SEEK_DATA / SEEK_HOLE), 4 KiB aligned."""
    out = []
    with open(path, "rb") as f:
        fd, pos, size = f.fileno(), 0, os.fstat(f.fileno()).st_size
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            start -= start % 4096
            out.append((start, os.pread(fd, end - start, start)))
            pos = end
    return out


@unit
@pytest.mark.parametrize("fmt", ["gnu", "pax"])
def test_60_gb_sparse_file(tmp_path: Path, fmt: str) -> None:
    """A ~10 KiB archive of a 60 GB sparse file: built in under a second, packs under
    1 MiB, its extents only where the data is, and the bytes GNU tar extracts."""
    if shutil.which("tar") is None:
        pytest.skip("GNU tar missing")
    src = tmp_path / "src"
    src.mkdir()
    size = 60 * 10**9
    with open(src / "huge", "wb") as f:
        f.truncate(size)
        for at in (12345, size - 5):  # two 4 KiB blocks of data: the archive is ~10 KiB
            f.seek(at)
            f.write(b"%05d" % (at % 99999))
    args = ["--format=pax", "--sparse-version=1.0"] if fmt == "pax" else ["--format=gnu"]
    tarball = tmp_path / "huge.tar"
    run("tar", *args, "--sparse", "-b", "1", "-C", src, "-cf", tarball, "huge")
    assert tarball.stat().st_size <= 11 * 1024
    bundle = tmp_path / "bundle"
    spec = _spec(tmp_path, tarball)
    started = time.monotonic()
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    # the size bound below is the check; this one only catches writing the holes out
    # (gigabytes: minutes), not a speed goal (0.2 s here; docs/sources.md)
    assert time.monotonic() - started < 30
    assert sum(p.stat().st_size for p in (bundle / "packs").iterdir()) < MIB
    r = BundleReader(str(bundle))
    inode = r.lookup("/huge")
    assert inode.item.size == size
    assert len(inode.extents) == 2 and inode.item.nbytes == 2 * 4096
    image = [
        (
            e.file_offset,
            r._read_data(e.disk_bytenr + e.offset, min(e.num_bytes, size - e.file_offset), "t"),
        )
        for e in inode.extents
    ]
    gnu = tmp_path / "gnu"
    gnu.mkdir()
    run("tar", "-C", gnu, "-xf", tarball)
    assert _nonzero_blocks(image) == _nonzero_blocks(_file_data(gnu / "huge"))


# ---- property: random mixes of these forms, against GNU tar ----------------------------

_FORMS = [
    "plain",
    "long",
    "long-twice",
    "pax-twice",
    "label",
    "global",
    "owner-1",
    "gnu-prefix",
    "old-sparse",
    "sparse-1.0",
]


@st.composite
def _archives(draw: st.DrawFn) -> bytes:
    out = b""
    for i in range(draw(st.integers(0, 8))):
        form = draw(st.sampled_from(_FORMS))
        name = b"m%d" % i
        data = draw(st.binary(max_size=700))
        mode = draw(st.integers(0, 0o777))
        uid, gid = draw(st.integers(0, 70000)), draw(st.integers(0, 70000))
        mtime = draw(st.integers(0, 2**33))
        kw = {"mode": mode, "uid": uid, "gid": gid, "mtime": mtime}
        if form == "plain":
            out += regular(name, data, **kw)
        elif form == "long":
            out += long_name(name + b"-" + b"l" * draw(st.integers(90, 250))) + regular(
                name, data, **kw
            )
        elif form == "long-twice":
            out += (
                long_name(b"x" * 120)
                + long_name(name + b"-" + b"l" * 110)
                + regular(b"n", data, **kw)
            )
        elif form == "pax-twice":
            out += (
                pax(rec(b"path", b"lost") + rec(b"uid", b"9"))
                + pax(rec(b"path", name + b"-pax"))
                + regular(b"n", data, **kw)
            )
        elif form == "label":
            out += header(b"VOL", b"V", magic=GNU_MAGIC) + regular(name, data, **kw)
        elif form == "global":
            out += pax(rec(b"comment", b"g"), b"g") + regular(name, data, **kw)
        elif form == "owner-1":
            out += regular(
                name, data, **{**kw, "uid": MINUS_ONE, "gid": MINUS_ONE, "magic": GNU_MAGIC}
            )
        elif form == "gnu-prefix":
            out += regular(name, data, **kw, magic=GNU_MAGIC, prefix=b"%011o" % mtime)
        else:
            n = draw(st.integers(0, 3))  # the map of an 'S' header holds 4 entries
            offsets = sorted(draw(st.sets(st.integers(0, 200), min_size=n, max_size=n)))
            segments = [(o * 1024, draw(st.binary(min_size=512, max_size=512))) for o in offsets]
            real = (segments[-1][0] + len(segments[-1][1]) if segments else 0) + draw(
                st.integers(0, 9000)
            )
            if form == "old-sparse":
                out += _old_sparse(name, segments, real)
            else:
                out += _sparse_10(name, segments, real, True)
    # no end-of-archive marker, unless there is no member (a 0-byte file is no archive)
    return out + (END if not out or draw(st.booleans()) else b"")


@pytest.mark.root
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(archive=_archives())
def test_reader_agrees_with_gnu_tar(
    tmp_path_factory: pytest.TempPathFactory, archive: bytes
) -> None:
    if not have_root_and_gnu_tar():
        pytest.skip("needs root and GNU tar")
    tmp = tmp_path_factory.mktemp("prop")
    got, _, _ = _build(tmp, archive, keep_inline=64)
    result = gnu_tar_extract(tmp / "t.tar", tmp / "gnu")
    assert result.returncode == 0 or not archive.endswith(END), result.stderr
    assert got == list_dir(tmp / "gnu")


@unit
def test_text_acls(tmp_path: Path) -> None:
    """PAX ACL records become the system.posix_acl_* xattrs the kernel would store."""
    access = "user::rw-\nuser:4242:r--\ngroup::r--\ngroup:4343:rw-\nmask::rw-\nother::r--\n"
    star = "user::rwx,group::r-x,other::---,user:bob:r-x:1000,mask::r-x"
    data = (
        pax(rec(b"SCHILY.acl.access", access.encode()))
        + regular(b"gnu", b"x", mode=0o600)
        + pax(rec(b"SCHILY.acl.access", star.encode()))
        + regular(b"star", b"x")
        + pax(rec(b"SCHILY.acl.access", b"user::r--,group::---,other::---"))
        + regular(b"minimal", b"x", mode=0o777)
        + pax(rec(b"SCHILY.acl.access", b"user::rw-,user:bob:r--,group::r--,mask::r--,other::---"))
        + regular(b"named", b"x")
        + pax(rec(b"SCHILY.acl.default", b"user::rwx,group::r-x,other::r-x"))
        + header(b"d", b"5", mode=0o755)
        + END
    )
    got, warnings, _ = _build(tmp_path, data)

    def acl(*entries: tuple[int, int, int]) -> str:
        import struct

        return (struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)).hex()

    no = 0xFFFFFFFF
    assert got["/gnu"]["xattrs"] == {
        "system.posix_acl_access": acl(
            (1, 6, no), (2, 4, 4242), (4, 4, no), (8, 6, 4343), (0x10, 6, no), (0x20, 4, no)
        )
    }
    assert got["/gnu"]["mode"] == oct(0o664)  # group bits: the mask
    assert got["/star"]["xattrs"]["system.posix_acl_access"] == acl(
        (1, 7, no), (2, 5, 1000), (4, 5, no), (0x10, 5, no), (0x20, 0, no)
    )
    assert got["/minimal"]["xattrs"] == {} and got["/minimal"]["mode"] == oct(0o400)
    assert got["/named"]["xattrs"] == {}
    assert len(warnings) == 1 and "'bob' without its numeric id" in warnings[0]
    assert got["/d"]["xattrs"] == {
        "system.posix_acl_default": acl((1, 7, no), (4, 5, no), (0x20, 5, no))
    }


# ---- interrupted builds; zstd's skippable frames ---------------------------------------------


def _build_blocked_on_a_fifo(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, int]:
    """A build reading its tarball from a FIFO that the test holds open after one member:
    the build is mid-way (its temporary directory exists) until the test lets go."""
    fifo = tmp_path / "in.tar"
    os.mkfifo(fifo)
    (tmp_path / "spec.yaml").write_text(
        f"version: 1\nname: t\nlayers:\n  - tar: {{path: {fifo}}}\n"
    )
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "btrfs_ublk_image", "build", str(tmp_path / "spec.yaml"), "-o", str(out)],
        stderr=subprocess.PIPE,
    )  # fmt: skip
    writer = os.open(fifo, os.O_WRONLY)  # blocks until the build opens it
    os.write(writer, regular(b"a", b"x" * 100))
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.*.tmp")):
        assert time.monotonic() < deadline and proc.poll() is None, "no temporary directory"
        time.sleep(0.05)
    return proc, out, writer


@unit
def test_sigterm_removes_the_temporary_bundle(tmp_path: Path) -> None:
    proc, out, writer = _build_blocked_on_a_fifo(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(writer)
    assert proc.returncode == 143, err
    assert b"terminated" in err
    assert not out.exists() and list(tmp_path.glob(".out.*")) == []


@unit
def test_the_next_build_removes_what_a_killed_build_left(tmp_path: Path) -> None:
    proc, out, writer = _build_blocked_on_a_fifo(tmp_path)
    try:
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        os.close(writer)
    (left,) = tmp_path.glob(".out.*.tmp")
    # a build still running beside it (this process's pid) is left alone
    alive = tmp_path / ".other.abc.tmp"
    alive.mkdir()
    (alive / ".building").write_text(f"{os.getpid()} {Path('/proc/sys/kernel/random/boot_id').read_text().strip()}\n")  # fmt: skip
    (tmp_path / "ok.tar").write_bytes(regular(b"b", b"y") + END)
    (tmp_path / "spec2.yaml").write_text(f"version: 1\nname: t\nlayers:\n  - tar: {{path: {tmp_path / 'ok.tar'}}}\n")  # fmt: skip
    assert cli(["build", str(tmp_path / "spec2.yaml"), "-o", str(tmp_path / "out2")]) == 0
    assert not left.exists() and alive.exists()


@unit
def test_zstd_stream_starting_with_a_skippable_frame(tmp_path: Path) -> None:
    import zstandard

    skippable = struct.pack("<II", 0x184D2A5E, 4) + b"meta"
    data = regular(b"f", b"content\n") + END
    (tmp_path / "in.tar.zst").write_bytes(skippable + zstandard.ZstdCompressor().compress(data))
    (tmp_path / "spec.yaml").write_text(
        f"version: 1\nname: t\nlayers:\n  - tar: {{path: {tmp_path / 'in.tar.zst'}}}\n"
    )
    assert cli(["build", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "out")]) == 0
    r = BundleReader(str(tmp_path / "out"))
    assert r.read(r.lookup("/f")) == b"content\n"
