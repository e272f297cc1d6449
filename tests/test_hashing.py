"""BackgroundSha256 gives hashlib's digest, whatever the update sizes."""

from __future__ import annotations

import hashlib
import os

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
