"""PackWriter: deduplication is exact, chunk digests cover the pack."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import threading
from pathlib import Path

import pytest

from btrfs_ublk_image import packs as packs_mod
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.tree import Blob


def put(pw: PackWriter, data: bytes) -> Blob:
    blob = pw.put_stream(io.BytesIO(data), len(data), "t")
    assert isinstance(blob, Blob)
    return blob


@pytest.mark.unit
def test_identical_content_is_stored_once(tmp_path: Path) -> None:
    pw = PackWriter(str(tmp_path), keep_inline=100, chunk_size=4096)
    a, b = put(pw, b"x" * 10000), put(pw, b"x" * 10000)
    assert a is b and pw.bytes_deduped == 10000
    (info,) = pw.finish()
    assert info.size == 10000
    data = Path(info.path).read_bytes()
    assert info.chunk_digests == [
        hashlib.sha256(data[i : i + 4096]).digest() for i in range(0, 10000, 4096)
    ]
    assert info.id == hashlib.sha256(b"".join(info.chunk_digests)).digest()


@pytest.mark.unit
def test_equal_checksums_but_different_bytes_are_kept_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every content gets the same CRC: only the byte comparison can tell them apart
    monkeypatch.setattr(packs_mod, "crc32c", lambda data, value=0, gil_release_mode=-1: 7)
    pw = PackWriter(str(tmp_path), keep_inline=0, chunk_size=4096)
    a, b, c = put(pw, b"a" * 5000), put(pw, b"b" * 5000), put(pw, b"a" * 5000)
    assert a is not b and c is a
    (info,) = pw.finish()
    assert Path(info.path).read_bytes() == b"a" * 5000 + b"b" * 5000


@pytest.mark.unit
def test_pack_written_back_while_it_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUI_NATIVE", "0")  # the Python writer's flusher thread (native: pack.rs)
    monkeypatch.setattr(packs_mod, "FLUSH_STEP", 8192)
    monkeypatch.setattr(packs_mod, "PACK_BUFFER", 8192)  # chunks submitted (and flushed) early
    flushed: list[tuple[str, int]] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        flushed.append((threading.current_thread().name, os.fstat(fd).st_size))
        real(fd)

    monkeypatch.setattr(packs_mod.os, "fdatasync", fdatasync)
    pw = PackWriter(str(tmp_path), keep_inline=0, chunk_size=4096)
    contents = [os.urandom(5000) for _ in range(20)]
    for data in contents:
        put(pw, data)
    (info,) = pw.finish()
    assert flushed and {name for name, _ in flushed} == {"pack-flush"}
    assert Path(info.path).read_bytes() == b"".join(contents)


@pytest.mark.unit
def test_failed_write_back_fails_finish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the kernel reports a write-back error once: the final fsync would not see it again
    monkeypatch.setenv("BUI_NATIVE", "0")  # the Python writer's flusher thread (native: pack.rs)
    monkeypatch.setattr(packs_mod, "FLUSH_STEP", 4096)

    def fdatasync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(packs_mod.os, "fdatasync", fdatasync)
    pw = PackWriter(str(tmp_path), keep_inline=0, chunk_size=4096)
    put(pw, os.urandom(10000))
    with pytest.raises(OSError, match="Input/output error"):
        pw.finish()
