"""Delta images under ublkd (fuse frontend, root): a bundle built with ``--base`` whose
reused base pack is corrupt serves EIO for the files in the bad chunk only; every other
file, reused or new, reads right. Oracle: the source trees' bytes and where each file's
bytes lie in the base pack (found by content, not through the blockmap)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from test_delta import build, make_v1, make_v2, write_spec
from test_ublkd import CHUNK, fresh_seed, no_leftovers, read_file, status_of, ublkd

__all__ = ["no_leftovers"]  # the fixture, used by name

pytestmark = pytest.mark.root


def tree_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_corrupt_base_pack_fails_only_its_files(no_leftovers: Path) -> None:
    tmp = no_leftovers
    v1, v2 = tmp / "v1", tmp / "v2"
    make_v1(v1, seed=fresh_seed())
    make_v2(v1, v2)
    b1, b2 = tmp / "v1.bundle", tmp / "v2.bundle"
    build(write_spec(tmp / "v1.yaml", v1), b1)
    m2 = build(write_spec(tmp / "v2.yaml", v2), b2, "--base", b1)
    packs = m2["packs"]
    assert isinstance(packs, list) and len(packs) == 2
    base_pack = b2 / packs[1]["path"]
    data = bytearray(base_pack.read_bytes())
    files = tree_files(v2)
    in_base: dict[str, set[int]] = {}
    for name, content in files.items():
        if len(content) > 4096 and (at := data.find(content)) >= 0:
            in_base[name] = set(range(at // CHUNK, (at + len(content) - 1) // CHUNK + 1))
    new = [n for n, c in files.items() if len(c) > 4096 and n not in in_base]
    assert sorted(new) == ["d0/added", "d3/f3", "d7/f107"]
    bad = 4
    data[bad * CHUNK + 12345] ^= 0xFF
    base_pack.unlink()  # a hard link of v1's pack: v2 gets its own, corrupt, copy
    base_pack.write_bytes(bytes(data))
    affected = sorted(n for n, c in in_base.items() if bad in c)
    assert affected and len(affected) < len(in_base) // 5
    mnt = tmp / "mnt"
    mnt.mkdir()
    ublkd("mount", b2, mnt, "--frontend", "fuse")
    try:
        for name in affected * 2:  # again: a failed read leaves nothing in the page cache
            assert read_file(mnt / name) == errno.EIO, name
        for name, content in files.items():
            if name not in affected:
                assert read_file(mnt / name) == content, name
        st = status_of(mnt)
        assert isinstance(st["verify_failures"], int) and st["verify_failures"] >= 1
    finally:
        ublkd("umount", mnt)
