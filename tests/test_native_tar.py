"""The native tar reader (``native/``, ``btrfs_ublk_image.native``) against the Python
reader (the reference) and GNU tar: generated archives, clean and hostile, built both
ways must give the same image id (so the same packs, tree, digests) or the same error."""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import os
import subprocess
import tarfile
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tartools import END, header, long_name, pax, rec, regular

from btrfs_ublk_image import native
from btrfs_ublk_image.bundle import build_spec
from btrfs_ublk_image.errors import ImageError, SourceError
from btrfs_ublk_image.spec import load_spec

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(native.module() is None, reason="native extension not built"),
]


_serial = itertools.count()


def _build(tmp: Path, spec_text: str, use_native: bool, tag: str) -> str:
    """The image id of the spec built with one reader, or 'error: MESSAGE'."""
    tag += str(next(_serial))
    spec_path = tmp / f"spec-{tag}.yaml"
    spec_path.write_text(spec_text)
    out = tmp / f"out-{tag}"
    old = os.environ.get(native.ENV)
    os.environ[native.ENV] = "1" if use_native else "0"
    try:
        result = build_spec(load_spec(spec_path), spec_path, str(out), None)
        return result.image_id
    except (SourceError, ImageError) as e:
        assert not out.exists(), "a failed build left its output behind"
        leftovers = [p.name for p in tmp.iterdir() if p.name.startswith(f".out-{tag}.")]
        assert not leftovers, leftovers
        return f"error: {e}"
    finally:
        if old is None:
            del os.environ[native.ENV]
        else:
            os.environ[native.ENV] = old


def both(tmp: Path, layer: str) -> tuple[str, str, list[str]]:
    """(python result, native result, native fallbacks) of a one-layer spec."""
    spec = f"version: 1\nname: t\nsource_date_epoch: 1\nlayers:\n  - {layer}\n"
    ref = _build(tmp, spec, False, "py")
    del native.fallbacks[:]
    got = _build(tmp, spec, True, "native")
    return ref, got, list(native.fallbacks)


# ---- generated archives -----------------------------------------------------------------

_names = st.text(alphabet=st.sampled_from("abcdé名-_."), min_size=1, max_size=12).filter(
    lambda s: s not in (".", "..")
)
_blobs = st.sampled_from([b"", b"x", b"hello\n" * 20, bytes(range(256)) * 40, b"\0" * 9000])
_content = st.one_of(_blobs, st.binary(max_size=3000))


@st.composite
def members(draw: Any) -> list[tuple[tarfile.TarInfo, bytes]]:
    out: list[tuple[tarfile.TarInfo, bytes]] = []
    files: list[str] = []
    for i in range(draw(st.integers(1, 14))):
        depth = draw(st.integers(0, 3))
        parts = [draw(_names) for _ in range(depth)] + [draw(_names) + str(i)]
        if draw(st.booleans()) and depth == 3:
            parts[0] = "l" * draw(st.integers(60, 120))  # long names: prefix, L or PAX path
        name = "/".join(parts)
        kind = draw(st.sampled_from(["file", "file", "file", "dir", "sym", "hard", "fifo", "chr"]))
        t = tarfile.TarInfo(name)
        t.mtime = draw(st.sampled_from([0, 1_700_000_000, 1_700_000_000.25]))
        t.mode = draw(st.sampled_from([0o644, 0o755, 0o4755, 0o600]))
        t.uid = draw(st.sampled_from([0, 1000, 65534, 1 << 21]))
        t.gid = draw(st.sampled_from([0, 100, 1 << 21]))
        data = b""
        if kind == "file":
            data = draw(_content)
            t.size = len(data)
            files.append(name)
        elif kind == "dir":
            t.type = tarfile.DIRTYPE
        elif kind == "sym":
            t.type = tarfile.SYMTYPE
            t.linkname = draw(st.sampled_from(["target", "/abs/t", "x" * 150]))
        elif kind == "hard":
            if not files:
                continue
            t.type = tarfile.LNKTYPE
            t.linkname = draw(st.sampled_from(files))
        elif kind == "fifo":
            t.type = tarfile.FIFOTYPE
        else:
            t.type = tarfile.CHRTYPE
            t.devmajor, t.devminor = 1, draw(st.integers(0, 300))
        if draw(st.booleans()):
            t.pax_headers = {"SCHILY.xattr.user.k": draw(st.sampled_from(["v", "é", ""]))}
        out.append((t, data))
    return out


def _archive(entries: list[tuple[tarfile.TarInfo, bytes]], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding="utf-8") as tf:
        for t, data in entries:
            if fmt == tarfile.USTAR_FORMAT and (len(t.linkname) > 100 or t.uid >= 1 << 21):
                continue  # not representable in ustar
            try:
                tf.addfile(t, io.BytesIO(data) if data else None)
            except ValueError:
                continue  # a name ustar cannot hold
    return buf.getvalue()


def _compress(data: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(data, mtime=0)
    if how == "zstd":
        import zstandard

        return bytes(zstandard.ZstdCompressor().compress(data))
    return data


_settings = settings(
    max_examples=int(os.environ.get("BUI_NATIVE_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_settings
@given(
    entries=members(),
    fmt=st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    how=st.sampled_from(["none", "gzip", "zstd"]),
)
def test_generated_archives_same_image(
    tmp_path_factory: pytest.TempPathFactory,
    entries: list[tuple[tarfile.TarInfo, bytes]],
    fmt: int,
    how: str,
) -> None:
    tmp = tmp_path_factory.mktemp("gen")
    (tmp / "in.tar").write_bytes(_compress(_archive(entries, fmt), how))
    ref, got, fellback = both(tmp, "tar: {path: in.tar}")
    assert got == ref
    if not ref.startswith("error:") and fmt != tarfile.GNU_FORMAT:
        # tarfile's GNU format writes negative base-256 times: left to the Python reader
        assert fellback == [], fellback


def _corrupt(data: bytes, where: float, how: str, byte: int) -> bytes:
    at = int(where * max(len(data) - 1, 0))
    if how == "truncate":
        return data[:at]
    if how == "flip":
        return data[:at] + bytes([data[at] ^ (byte or 1)]) + data[at + 1 :]
    if how == "garbage":
        return data + bytes([byte]) * 700
    return data[:at] + data[at + 512 :]  # a block dropped


@_settings
@given(
    entries=members(),
    fmt=st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    how=st.sampled_from(["none", "gzip", "zstd"]),
    damage=st.sampled_from(["truncate", "flip", "garbage", "drop"]),
    where=st.floats(0, 1),
    byte=st.integers(0, 255),
)
def test_hostile_archives_same_result(
    tmp_path_factory: pytest.TempPathFactory,
    entries: list[tuple[tarfile.TarInfo, bytes]],
    fmt: int,
    how: str,
    damage: str,
    where: float,
    byte: int,
) -> None:
    """Damaged archives (raw or compressed bytes): the same image or the same error."""
    tmp = tmp_path_factory.mktemp("bad")
    data = _archive(entries, fmt)
    data = _corrupt(_compress(data, how), where, damage, byte)
    (tmp / "in.tar").write_bytes(data)
    ref, got, _ = both(tmp, "tar: {path: in.tar}")
    assert got == ref


# ---- GNU tar as the archiver ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["gnu", "pax", "ustar", "posix"])
@pytest.mark.parametrize("how", ["none", "gzip"])
def test_gnu_tar_archives(tmp_path: Path, fmt: str, how: str) -> None:
    root = tmp_path / "root"
    (root / "d" / ("n" * 80)).mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"content\n" * 500)
    (root / "d" / "dup").write_bytes(b"content\n" * 500)
    (root / "d" / ("n" * 80) / ("m" * 60)).write_bytes(b"deep")
    (root / "small").write_bytes(b"s")
    (root / "big").write_bytes(os.urandom(5 << 20))
    os.symlink("d/f", root / "link")
    os.link(root / "d" / "f", root / "hard")
    os.mkfifo(root / "fifo")
    os.utime(root / "small", ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
    args = ["tar", f"--format={fmt}", "--sort=name", "--numeric-owner", "-C", str(root)]
    if how == "gzip":
        args.append("-z")
    out = tmp_path / "in.tar"
    subprocess.run([*args, "-cf", str(out), "."], check=True)
    ref, got, fellback = both(tmp_path, "tar: {path: in.tar}")
    assert not ref.startswith("error:"), ref
    assert got == ref
    assert fellback == [], fellback


def test_oci_layers_read_natively(tmp_path: Path) -> None:
    """An OCI layout's gzip layers (whiteouts, diff_id) through the native path."""
    from ocitools import Layout, entry

    layout = Layout(tmp_path / "oci")
    lower = [entry("a/x", data=b"x" * 5000), entry("a/y", data=b"y"), entry("k", data=b"k" * 3000)]
    upper = [entry("a/.wh.x"), entry("b", data=b"b" * 4000), entry("c", data=b"k" * 3000)]
    for compression in ("gzip", "zstd"):
        layout.tag(layout.image([lower, upper], compression=compression), compression)
    for ref_name in ("gzip", "zstd"):
        ref, got, fellback = both(tmp_path, f"oci: {{path: oci, ref: {ref_name}}}")
        assert not ref.startswith("error:"), ref
        assert got == ref
        assert fellback == [], fellback


@pytest.mark.parametrize("fmt", ["gnu", "pax"])
def test_fallback_after_packing_rolls_back(tmp_path: Path, fmt: str) -> None:
    """Content packed before a form the native reader leaves to Python (a GNU sparse member,
    sorted last) is rolled back: the image is the Python reader's, byte for byte."""
    root = tmp_path / "root"
    root.mkdir()
    for i in range(5):
        (root / f"a{i}").write_bytes(os.urandom(200_000))
    (root / "b-dup").write_bytes((root / "a1").read_bytes())
    with open(root / "z-sparse", "wb") as f:
        f.truncate(8 << 20)
        f.seek(4 << 20)
        f.write(b"data" * 1000)
    out = tmp_path / "in.tar"
    subprocess.run(
        ["tar", f"--format={fmt}", "-S", "--sort=name", "-C", str(root), "-cf", str(out), "."],
        check=True,
    )
    ref, got, fellback = both(tmp_path, "tar: {path: in.tar}")
    assert not ref.startswith("error:"), ref
    assert got == ref
    assert len(fellback) == 1, fellback


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("how", ["none", "gzip"])
def test_streamed_duplicates_and_rollbacks_same_image(
    tmp_path: Path, fallback: bool, how: str
) -> None:
    """The native pack hashes its chunks from the bytes as it writes them: streamed members
    (> 4 MiB) found to be duplicates after they were written, members cut by chunk
    boundaries, and (``fallback``) a whole layer rolled back after them for the Python
    reader must give the chunk digests, so the image id, of the Python path (which reads
    the finished chunks back). A second layer from a directory appends through the same
    pack from Python (gathered up to 4 MiB, streamed beyond)."""
    root = tmp_path / "root"
    root.mkdir()
    big = os.urandom((5 << 20) + 777)
    (root / "a-big").write_bytes(big)
    (root / "b-small").write_bytes(os.urandom(3001))
    (root / "c-big-dup").write_bytes(big)  # written, compared, rolled back
    (root / "d-big-other").write_bytes(big[:-1] + bytes([big[-1] ^ 1]))
    (root / "e-mid").write_bytes(os.urandom((1 << 20) + 5))  # spans read blocks
    (root / "f-mid-dup").write_bytes((root / "e-mid").read_bytes())
    if fallback:  # a GNU sparse member, sorted last: the layer goes to the Python reader
        with open(root / "z-sparse", "wb") as f:
            f.truncate(6 << 20)
            f.seek(3 << 20)
            f.write(b"data" * 1000)
    out = tmp_path / "in.tar"
    args = ["tar", "--format=gnu", "-S", "--sort=name", "-C", str(root), "-cf", str(out), "."]
    subprocess.run(args + (["-z"] if how == "gzip" else []), check=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "same-as-big").write_bytes(big)
    (other / "same-as-mid").write_bytes((root / "e-mid").read_bytes())
    (other / "new-big").write_bytes(os.urandom((4 << 20) + 1))
    (other / "new-small").write_bytes(os.urandom(5000))
    (other / "new-small-dup").write_bytes((other / "new-small").read_bytes())
    ref, got, fellback = both(tmp_path, "tar: {path: in.tar}\n  - dir: {path: other}")
    assert not ref.startswith("error:"), ref
    assert got == ref
    assert len(fellback) == (1 if fallback else 0), fellback


@_settings
@given(
    entries=members(),
    fmt=st.sampled_from([tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT]),
    how=st.sampled_from(["none", "gzip", "zstd"]),
)
def test_native_records_as_tarfile_sees_them(
    tmp_path_factory: pytest.TempPathFactory,
    entries: list[tuple[tarfile.TarInfo, bytes]],
    fmt: int,
    how: str,
) -> None:
    """The native reader's member records against Python's tarfile, field by field."""
    nat = native.module()
    assert nat is not None
    tmp = tmp_path_factory.mktemp("rec")
    raw = _archive(entries, fmt)
    (tmp / "in.tar").write_bytes(_compress(raw, how))
    fd = os.open(tmp / "pack", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    pack = nat.Pack(fd, 4096)
    try:
        got: list[tuple[Any, ...]] = []
        with open(tmp / "in.tar", "rb") as f:
            digest, _, kind, _, _ = nat.read_tar(
                pack, f.fileno(), 0, None, 64, False, False, False, got.extend
            )
        packed = Path(tmp / "pack").read_bytes()
    finally:
        pack.abort()
    assert kind == how
    want = []
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        for ti in tf:
            data = tf.extractfile(ti).read() if ti.isreg() else b""  # type: ignore[union-attr]
            mtime = ti.pax_headers.get("mtime")
            ns = int(ti.mtime) * 10**9 if mtime is None else int(Decimal(mtime) * 10**9)
            xattrs = {
                k[13:].encode(): v.encode("utf-8", "surrogateescape")
                for k, v in ti.pax_headers.items()
                if k.startswith("SCHILY.xattr.")
            }
            want.append(
                (ti.name.encode(), ti.type, ti.mode, ti.uid, ti.gid, ns, ti.linkname.encode(),
                 (ti.devmajor, ti.devminor) if ti.ischr() else (0, 0), xattrs or None, data)
            )  # fmt: skip
    assert len(got) == len(want)
    for record, w in zip(got, want, strict=True):
        name, t, mode, uid, gid, mtime_ns, _, _, xattrs, link, major, minor, content = record
        if isinstance(content, tuple):  # (crc32c, size, pack, offset): the bytes in the pack
            _, size, pack_no, offset = content
            assert pack_no == 0
            content = packed[offset : offset + size]
        dev = (major, minor) if t == tarfile.CHRTYPE else (0, 0)
        assert (name, t, mode, uid, gid, mtime_ns, link, dev, xattrs, content or b"") == w
    assert digest == hashlib.sha256((tmp / "in.tar").read_bytes()).hexdigest()


# ---- the reading rules of issue 27, hand-made: both readers give the same image ----------
def _rules_archives() -> dict[str, bytes]:
    minus_one = 0xFFFFFFFF
    return {
        # a PAX path beats a GNU long name that comes first
        "long-then-pax": long_name(b"l" * 120) + pax(rec(b"path", b"from-pax")) + regular(b"n"),
        # a symlink's size field: its "data" is skipped, as GNU tar does
        "symlink-with-data": header(b"s", b"2", 600, linkname=b"t") + bytes(1024)
        + regular(b"after", b"x" * 700),
        "owner-minus-one": regular(b"o", b"y" * 300, uid=minus_one, gid=minus_one),
        "xattr-without-namespace": pax(rec(b"SCHILY.xattr.nonamespace", b"v")
                                       + rec(b"SCHILY.xattr.user.ok", b"w")) + regular(b"x", b"z" * 200),
        "acl": pax(rec(b"SCHILY.acl.access", b"user::rw-\ngroup::r--\nother::---\nuser:1000:rwx:1000\nmask::rwx\n"))
        + regular(b"a", b"q" * 200),
    }  # fmt: skip


@pytest.mark.parametrize("case", sorted(_rules_archives()))
def test_reading_rules_same_image(tmp_path: Path, case: str) -> None:
    (tmp_path / "in.tar").write_bytes(_rules_archives()[case] + END)
    ref, got, _ = both(tmp_path, f"tar: {{path: {tmp_path / 'in.tar'}}}")
    assert not ref.startswith("error"), ref
    assert got == ref


@pytest.mark.parametrize("problem", ["unsupported", "error"])
def test_members_placed_before_a_fallback_are_undone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], problem: str
) -> None:
    """The native reader's members are placed while it still reads (segments of 4,096):
    when it then hands the archive back (a PAX global header, or damage past the first
    segments), what it placed on a lower layer's tree (entries replaced, directories'
    metadata taken, directories made, hard links) is undone and its warnings dropped, so the
    Python reader's image, error and warnings are the result, each warning once. (Placing
    the archive twice is not the same: a hard link to a lower file that the archive
    replaces after it would link the replacement.)"""
    d = tmp_path / "d"
    d.mkdir()
    lower = (
        header(b"./", b"5", mode=0o755)
        + header(b"d/", b"5", mode=0o755, mtime=1)
        + regular(b"d/keep", b"keep" * 300)
        + regular(b"r", b"lower r")
        + END
    )
    (d / "lower.tar").write_bytes(lower)
    upper = bytearray(
        header(b"./", b"5", mode=0o700, mtime=5)
        + header(b"d/", b"5", mode=0o750, mtime=7)
        + regular(b"r", b"upper r " * 100)
        + header(b"d/hard", b"1", linkname=b"d/keep")  # the lower layer's inode
        + regular(b"d/keep", b"replaced")  # placed again, d/hard must not link this one
        + pax(rec(b"SCHILY.xattr.bogus", b"v"))
        + regular(b"d/xattr", b"x")
    )
    for i in range(9000):
        upper += regular(b"n%d/f%d" % (i // 100, i), b"%d" % i * (i % 7))
    if problem == "unsupported":
        upper += pax(rec(b"comment", b"global"), b"g") + regular(b"z", b"z") + END
    else:
        upper += header(b"bad", b"0", 10, checksum=b"0000000\0") + bytes(512) + END
    (d / "upper.tar").write_bytes(bytes(upper))
    spec = (
        "version: 1\nname: t\nsource_date_epoch: 1\nlayers:\n"
        "  - tar: {path: d/lower.tar}\n  - tar: {path: d/upper.tar}\n"
    )
    capsys.readouterr()
    ref = _build(tmp_path, spec, False, "py")
    ref_err = capsys.readouterr().err
    del native.fallbacks[:]
    got = _build(tmp_path, spec, True, "native")
    got_err = capsys.readouterr().err
    assert (problem == "error") == ref.startswith("error:"), ref
    assert got == ref
    assert [f for f in native.fallbacks if "upper.tar" in f], native.fallbacks
    assert ref_err.count("xattr b'bogus' skipped") == 1, ref_err
    assert got_err == ref_err


def test_placement_error_while_reading_stops_the_read(tmp_path: Path) -> None:
    """An error placing a member of an early segment (a hard link to a name not in the
    image) while the parser still reads: the Python reader's error, nothing left behind,
    and the parser stopped (the build returns; a parser blocked on its queue would hang)."""
    data = bytearray()
    for i in range(20_000):
        if i == 5000:
            data += header(b"bad-link", b"1", linkname=b"missing")
        data += regular(b"n%d/f%d" % (i // 100, i), b"%d" % i * (i % 5))
    (tmp_path / "in.tar").write_bytes(bytes(data) + END)
    ref, got, fellback = both(tmp_path, "tar: {path: in.tar}")
    assert "hard link to 'missing', which is not in the image" in ref, ref
    assert got == ref
    assert fellback == [], fellback
