"""BackgroundSha256 gives hashlib's digest, whatever the update sizes."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from btrfs_ublk_image.hashing import BackgroundSha256


@pytest.mark.unit
def test_background_sha256_matches_hashlib() -> None:
    pieces = [os.urandom(n) for n in (0, 1, 100, 70_000, 1 << 20, 5, 3 << 20, 64 * 1024)]
    h = BackgroundSha256(depth=2)
    for p in pieces:
        h.update(p)
    assert h.hexdigest() == hashlib.sha256(b"".join(pieces)).hexdigest()
    assert h.digest() == hashlib.sha256(b"".join(pieces)).digest()
    with pytest.raises(ValueError):
        h.update(b"late")


@pytest.mark.unit
def test_background_sha256_chunk_digests_in_the_same_pass() -> None:
    chunk = 1 << 16
    pieces = [os.urandom(n) for n in (1, 100, 70_000, 1 << 20, 5, chunk, 3 * chunk + 7)]
    data = b"".join(pieces)
    h = BackgroundSha256(depth=2, chunk_size=chunk)
    for p in pieces:
        h.update(p)
    assert h.digest() == hashlib.sha256(data).digest()
    want = [hashlib.sha256(data[i : i + chunk]).digest() for i in range(0, len(data), chunk)]
    assert h.chunk_digests() == want
    assert len(want[-1]) == 32 and len(data) % chunk != 0  # the short last chunk is digested
    exact = BackgroundSha256(chunk_size=chunk)
    exact.update(bytes(2 * chunk))
    assert exact.chunk_digests() == [hashlib.sha256(bytes(chunk)).digest()] * 2
    with pytest.raises(ValueError):
        BackgroundSha256().chunk_digests()


@pytest.mark.unit
def test_abandon_stops_the_thread_without_a_digest() -> None:
    h = BackgroundSha256(depth=1)
    for _ in range(4):
        h.update(bytes(1 << 20))  # large: hashed on the thread
    assert [t for t in threading.enumerate() if t.name == "sha256"]
    h.abandon()
    assert not [t for t in threading.enumerate() if t.name == "sha256"]
    with pytest.raises(ValueError, match="abandoned"):
        h.digest()
    h.abandon()  # again: nothing to stop
