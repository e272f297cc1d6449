"""The tar reader (sources/tarheader.py): members as Python's tarfile and GNU tar see them,
and hostile headers refused with errors that name the tarball and the problem."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tartools import header, padded, rec

from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.sources import SourceRecord
from btrfs_ublk_image.sources.tarheader import (
    HeaderProblem,
    SparseData,
    TarFormatError,
    TarReader,
    parse_pax_records,
)
from btrfs_ublk_image.tree import Tree

Build = Callable[[str], tuple[Tree, list[SourceRecord]]]
unit = pytest.mark.unit


def ours(data: bytes) -> list[tuple[Any, ...]]:
    reader = TarReader(io.BytesIO(data))
    out: list[tuple[Any, ...]] = []
    while True:
        try:
            m = reader.next()
        except HeaderProblem as e:
            assert e.kind == "end", e
            return out
        if m.sparse is not None:
            content = SparseData(reader, m).read(m.size)
        else:
            content = reader.read(m.size) if m.is_regular else b""
        dev = (m.devmajor, m.devminor) if m.type in (b"3", b"4") else (0, 0)
        pax = {k: v for k, v in (m.pax or {}).items() if not k.startswith("GNU.sparse.")}
        out.append(
            (m.name, m.type, m.mode, m.uid, m.gid, m.size, m.mtime, m.linkname, dev, pax, content)
        )


def theirs(data: bytes) -> list[tuple[Any, ...]]:
    out = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        for ti in tf:
            f = tf.extractfile(ti) if ti.isreg() else None
            content = f.read() if f is not None else b""
            dev = (ti.devmajor, ti.devminor) if ti.type in (b"3", b"4") else (0, 0)
            mtime = ti.mtime if "mtime" not in ti.pax_headers else ours_mtime(data, ti.name)
            pax = {k: v for k, v in ti.pax_headers.items() if not k.startswith("GNU.sparse.")}
            name = ti.name
            out.append(
                (
                    name,
                    ti.type,
                    ti.mode,
                    ti.uid,
                    ti.gid,
                    ti.size,
                    int(mtime),
                    ti.linkname,
                    dev,
                    pax,
                    content,
                )
            )
    return out


def ours_mtime(data: bytes, name: str) -> int:
    """The header's own mtime field (tarfile replaces it by the PAX record's value)."""
    for m in ours(data):
        if m[0] == name:
            return int(m[6])
    raise AssertionError(name)


def tar_of(fmt: int, entries: list[tuple[tarfile.TarInfo, bytes]], **kw: Any) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding="utf-8", **kw) as tf:
        for ti, data in entries:
            tf.addfile(ti, io.BytesIO(data) if data else None)
    return buf.getvalue()


def ti(
    name: str, typ: bytes = tarfile.REGTYPE, data: bytes = b"", **attrs: Any
) -> tuple[tarfile.TarInfo, bytes]:
    t = tarfile.TarInfo(name)
    t.type = typ
    t.size = len(data)
    t.mtime = 1_700_000_000
    for k, v in attrs.items():
        setattr(t, k, v)
    return t, data


def sample(fmt: int) -> list[tuple[tarfile.TarInfo, bytes]]:
    long = "d" * 90 + "/" + "n" * 95  # needs the ustar prefix, or a GNU/PAX long name
    entries = [
        ti("dir/", tarfile.DIRTYPE, mode=0o755),
        ti("dir/file", data=b"hello\n" * 100, mode=0o4755, uid=1000, gid=100, uname="u", gname="g"),
        ti(long, data=b"x"),
        ti("dir/sym", tarfile.SYMTYPE, linkname="file"),
        ti("dir/hard", tarfile.LNKTYPE, linkname="dir/file"),
        ti("dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3),
        ti("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0),
        ti("fifo", tarfile.FIFOTYPE),
        ti("empty"),
        ti("exact", data=bytes(range(256)) * 2),  # exactly one block of data
        ti("old", mtime=0),
    ]
    if fmt != tarfile.USTAR_FORMAT:
        entries += [
            ti("l" * 300, data=b"long name"),
            ti("longlink", tarfile.SYMTYPE, linkname="t" * 200),
            ti("bigid", uid=1 << 30, gid=1 << 25),  # base-256 (GNU) or PAX records
            ti("past", mtime=-86400),  # base-256 negative (GNU) or a PAX record
            ti("unicodé/名前", data=b"u"),
        ]
    return entries


@unit
@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_members_as_tarfile_sees_them(fmt: int) -> None:
    data = tar_of(fmt, sample(fmt))
    assert ours(data) == theirs(data)


@unit
def test_pax_records_and_global_header() -> None:
    data = tar_of(
        tarfile.PAX_FORMAT,
        [
            ti(
                "a",
                data=b"a",
                pax_headers={"mtime": "1.5", "SCHILY.xattr.user.k": "v", "path": "renamed/"},
            ),
            ti("b", pax_headers={"uid": "7", "gid": "8", "linkpath": "ignored", "uname": "nobody"}),
        ],
        pax_headers={"comment": "global", "gid": "5"},
    )
    got = ours(data)
    assert [m[0] for m in got] == ["renamed", "b"]
    assert got[0][4] == 5 and got[0][9]["comment"] == "global"  # the global header applies
    assert (got[1][3], got[1][4]) == (7, 8)
    assert got == theirs(data)


@unit
@pytest.mark.parametrize(
    ("fmt", "sparse_version"),
    [("gnu", None), ("oldgnu", None), ("posix", "0.0"), ("posix", "0.1"), ("posix", "1.0")],
)
def test_gnu_tar_archives_incl_sparse(tmp_path: Path, fmt: str, sparse_version: str | None) -> None:
    """GNU tar (an external writer) for every sparse flavour; tarfile reads the same."""
    if shutil.which("tar") is None:
        pytest.skip("GNU tar missing")
    src = tmp_path / "src"
    (src / ("p" * 120)).mkdir(parents=True)
    (src / ("p" * 120) / ("q" * 150)).write_bytes(b"deep")
    os.symlink("x" * 150, src / "ln")
    with open(src / "sparse", "wb") as fh:
        for i in range(30):  # more segments than an 'S' header holds: extension blocks
            fh.seek(i * 65536)
            fh.write(b"seg%d" % i)
        fh.truncate(40 * 65536)
    cmd = ["tar", f"--format={fmt}", "--sparse", "-C", str(src), "-cf", "-", "."]
    if sparse_version:
        cmd.insert(2, f"--sparse-version={sparse_version}")
    data = subprocess.run(cmd, check=True, capture_output=True).stdout
    got = ours(data)
    assert got == theirs(data)
    sparse = [m for m in got if m[0].endswith("sparse")]
    assert len(sparse) == 1 and sparse[0][10] == (src / "sparse").read_bytes()


@unit
def test_pax_record_parser() -> None:
    pax: dict[str, str] = {}
    parse_pax_records(rec(b"a", b"b=c") + rec(b"k", b"v\xffv") + bytes(20), pax)
    assert pax == {"a": "b=c", "k": "v\udcffv"}
    for bad, why in [
        (b"99 a=b\n", "does not end at its newline"),  # longer than the header
        (b"5 a=bcdef\n", "does not end at its newline"),  # shorter than the record
        (b"0 a=b\n", "does not end at its newline"),
        (b"x5 a=b\n", "length"),
        (b"6 =bc\n", "no keyword"),
        (b"6 a=b\nrest", "no length"),
    ]:
        with pytest.raises(TarFormatError, match=why):
            parse_pax_records(bad, {})


# ---- hostile headers through the build: errors name the tarball ------------------------


def pax_member(records: bytes, name: bytes = b"f", data: bytes = b"") -> bytes:
    return (
        header(b"PaxHeader/f", b"x", len(records))
        + padded(records)
        + header(name, b"0", len(data))
        + padded(data)
    )


GOOD_A = header(b"a", b"0", 1) + padded(b"a")
END = bytes(1024)


def expect_error(tmp_path: Path, build: Build, data: bytes, *needles: str) -> None:
    path = tmp_path / "bad.tar"
    path.write_bytes(data)
    with pytest.raises(SourceError) as info:
        build(f"version: 1\nname: t\nlayers:\n  - tar: {{path: '{path}'}}\n")
    msg = str(info.value)
    assert msg.startswith(f"{path}: "), msg
    for needle in needles:
        assert needle in msg, msg


HOSTILE: dict[str, tuple[bytes, tuple[str, ...]]] = {
    "bad-checksum": (
        GOOD_A + header(b"b", checksum=b"0001234\0") + END,
        ("corrupt archive: invalid header (bad checksum) after member 'a'",),
    ),
    "truncated-header": (GOOD_A + header(b"b")[:300], ("ends inside a header", "after member 'a'")),
    "truncated-data": (
        header(b"f", b"0", 5000) + b"x" * 100,
        ("member 'f': truncated: expected 5000",),
    ),
    "missing-padding": (
        header(b"f", b"0", 10) + b"x" * 10,
        ("after member 'f': unexpected end of data",),
    ),
    "negative-size": (
        GOOD_A + header(b"b", b"0", b"\xff" * 11 + b"\xfb") + END,
        ("invalid header (negative size -5 in the header at byte 1024)", "after member 'a'"),
    ),
    "huge-size": (
        GOOD_A + header(b"big", b"0", b"\x80" + (1 << 60).to_bytes(11, "big")) + b"y" * 2048,
        ("member 'big': truncated: expected 1152921504606846976 bytes, got 2048",),
    ),
    "pax-length-too-long": (
        GOOD_A + pax_member(b"999 path=x\n") + END,
        ("after member 'a'", "PAX header at byte 1024", "(999) does not end at its newline"),
    ),
    "pax-length-too-short": (
        pax_member(b"9 path=xyz\n") + END,
        ("corrupt or truncated archive: PAX header at byte 0", "(9) does not end at its newline"),
    ),
    "pax-truncated": (
        GOOD_A + header(b"PaxHeader", b"x", 4000) + b"30 path=x\n",
        ("truncated archive: it ends inside the PAX header at byte 1024",),
    ),
    "pax-bad-size": (
        GOOD_A + pax_member(rec(b"size", b"ab")) + END,
        ("member 'f': invalid number in PAX record size: 'ab'",),
    ),
    "pax-negative-size": (
        GOOD_A + pax_member(rec(b"size", b"-5")) + END,
        ("member 'f': negative size in PAX record size: -5",),
    ),
    "pax-then-nothing": (
        GOOD_A + pax_member(b"10 path=x\n")[:1024],
        ("after member 'a'", "it ends after the extension header at byte 1024"),
    ),
    "huge-long-name": (
        GOOD_A + header(b"././@LongLink", b"L", 1 << 30) + bytes(4096),
        ("GNU long name at byte 1024 is 1073741824 bytes long",),
    ),
    "long-name-chain": (
        GOOD_A + (header(b"././@LongLink", b"L", 2) + padded(b"n\0")) * 70 + END,
        ("more than 64 extension headers in a row",),
    ),
    "sparse-map-beyond-file": (
        GOOD_A
        + pax_member(
            rec(b"GNU.sparse.size", b"10") + rec(b"GNU.sparse.map", b"0,5,100,5"),
            data=b"0123456789",
        )
        + END,
        ("member 'f': invalid sparse map: segment (100, 5)",),
    ),
    "sparse-map-more-data-than-stored": (
        GOOD_A
        + pax_member(
            rec(b"GNU.sparse.size", b"4096") + rec(b"GNU.sparse.map", b"0,2048"), data=b"abc"
        )
        + END,
        ("member 'f': invalid sparse map: 2048 data bytes, only 512 stored",),
    ),
}


@unit
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers(tmp_path: Path, build: Build, case: str) -> None:
    data, needles = HOSTILE[case]
    expect_error(tmp_path, build, data, *needles)


@unit
def test_first_header_broken_in_a_compressed_stream(tmp_path: Path, build: Build) -> None:
    import gzip

    expect_error(
        tmp_path,
        build,
        gzip.compress(header(b"a", checksum=b"0000001\0") + END),
        "(gzip): bad checksum",
    )


@unit
def test_empty_compressed_stream_is_an_empty_archive(
    tmp_path: Path, build: Build, capsys: pytest.CaptureFixture[str]
) -> None:
    """GNU tar and bsdtar read a gzip stream of nothing as an archive without members;
    no end-of-archive marker is warned about."""
    import gzip

    (tmp_path / "e.tar.gz").write_bytes(gzip.compress(b""))
    tree, _ = build("version: 1\nname: t\nlayers:\n  - tar: {path: e.tar.gz}\n")
    assert tree.root.entries == {}
    assert "no end-of-archive marker" in capsys.readouterr().err
