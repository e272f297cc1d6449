"""ThreadedGunzip reads gzip streams as gzip.GzipFile does (the oracle), on a worker thread."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import threading

import pytest

from btrfs_ublk_image.sources.gunzip import OUT_SIZE, GzipError, InflateError, ThreadedGunzip


def _gz(data: bytes, name: str = "") -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(filename=name, mode="wb", fileobj=buf, mtime=0) as f:
        f.write(data)
    return buf.getvalue()


def _read_all(r: ThreadedGunzip, size: int = 1 << 16) -> bytes:
    out = []
    while piece := r.read(size):
        assert len(piece) <= size
        out.append(piece)
    return b"".join(out)


STREAMS = {  # name -> gzip bytes
    "empty member": _gz(b""),
    "one member with a file name": _gz(os.urandom(300_000) + bytes(3 << 20), "x.tar"),
    "three members": _gz(b"a" * 1000) + _gz(os.urandom(70_000)) + _gz(b""),
    "zero padding after": _gz(b"abc" * 5000) + bytes(5000),
    "zero padding between": _gz(b"one") + bytes(3) + _gz(b"two"),
}


@pytest.mark.unit
@pytest.mark.parametrize("name", list(STREAMS))
@pytest.mark.parametrize("size", [1, 7, 1 << 16, 3 << 20])
def test_same_bytes_as_gzipfile(name: str, size: int) -> None:
    raw = STREAMS[name]
    want = gzip.GzipFile(fileobj=io.BytesIO(raw)).read()
    r = ThreadedGunzip(io.BytesIO(raw), digest=True)
    assert _read_all(r, size) == want
    assert r.hexdigest() == hashlib.sha256(want).hexdigest()
    assert r.read(10) == b""


@pytest.mark.unit
def test_reads_the_raw_stream_to_its_end() -> None:
    raw = io.BytesIO(_gz(b"x" * 100) + bytes(2 << 20))  # padding beyond one raw read
    r = ThreadedGunzip(raw)
    assert r.read() == b"x" * 100
    assert raw.tell() == len(raw.getvalue())
    with pytest.raises(ValueError):
        r.hexdigest()  # not asked for


@pytest.mark.unit
def test_bounded_pieces_for_a_bomb() -> None:
    # 256 MiB of zeros in ~256 KiB: pieces stay at most OUT_SIZE, at most `depth` wait
    raw = _gz(bytes(256 << 20))
    r = ThreadedGunzip(io.BytesIO(raw), depth=2)
    total = 0
    while piece := r.read(1 << 30):
        assert len(piece) <= OUT_SIZE
        total += len(piece)
    assert total == 256 << 20


@pytest.mark.unit
@pytest.mark.parametrize(
    ("raw", "error", "message"),
    [
        (_gz(os.urandom(200_000))[:-100], EOFError, "ended before the end-of-stream"),
        (_gz(b"data")[:-8] + b"\0\0\0\0" + _gz(b"data")[-4:], InflateError, None),
        (_gz(b"data")[:-4] + b"\1\0\0\0", InflateError, None),
        (_gz(b"data") + b"garbage", GzipError, "Not a gzipped file (b'ga')"),
        (_gz(b"data") + bytes(10) + b"x", GzipError, "Not a gzipped file (b'x')"),
        (b"\x1f\x8b\x08\0\0\0\0\0\0\x03\xff\xff\xff\xff", InflateError, None),
    ],
    ids=["truncated", "crc", "length", "garbage after", "garbage after padding", "bad deflate"],
)
def test_errors_like_gzipfile(raw: bytes, error: type[Exception], message: str | None) -> None:
    with pytest.raises(Exception) as oracle:  # noqa: B017, PT011 - the oracle fails too
        gzip.GzipFile(fileobj=io.BytesIO(raw)).read()
    assert isinstance(oracle.value, (EOFError, OSError, gzip.zlib.error))
    r = ThreadedGunzip(io.BytesIO(raw))
    with pytest.raises(error, match=None if message is None else re.escape(message)):
        _read_all(r)
    assert r.read(1) == b""  # the error ended the stream


@pytest.mark.unit
def test_raw_read_errors_reach_the_reader() -> None:
    class Failing(io.BytesIO):
        def read(self, n: int | None = -1, /) -> bytes:
            raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output error"):
        ThreadedGunzip(Failing()).read(10)


@pytest.mark.unit
def test_close_stops_the_worker_midway() -> None:
    r = ThreadedGunzip(io.BytesIO(_gz(os.urandom(1 << 20) * 16)), depth=1)
    assert r.read(10)
    r.close()
    assert not [t for t in threading.enumerate() if t.name == "gunzip"]
    assert r.read(10) == b""


def _helpers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("gunzip", "sha256")]


@pytest.mark.unit
def test_inflate_error_stops_every_helper_thread() -> None:
    """A stream that fails midway stops the inflating thread AND the diff_id hashing thread
    (which would otherwise wait on its queue until the process exits)."""
    assert _helpers() == []
    raw = _gz(os.urandom(3 << 20))
    r = ThreadedGunzip(io.BytesIO(raw[: len(raw) // 2]), digest=True)
    with pytest.raises(EOFError):
        _read_all(r)
    assert _helpers() == []
    with pytest.raises(ValueError):
        r.hexdigest()  # no digest of a stream that failed


@pytest.mark.unit
def test_close_midway_stops_the_hashing_thread() -> None:
    r = ThreadedGunzip(io.BytesIO(_gz(os.urandom(1 << 20) * 16)), digest=True, depth=1)
    while r.read(OUT_SIZE) and not _helpers().count("sha256"):
        pass  # until the hashing thread runs
    r.close()
    assert _helpers() == []
