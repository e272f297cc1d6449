"""ublkd serves a bundle whose tarball is used in place: verified reads from the tarball
pack, a corrupted byte in it fails the reads of its chunk only (root, fuse frontend)."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from test_ublkd import (  # noqa: F401 - no_leftovers is a fixture
    CHUNK,
    make_tarball,
    no_leftovers,
    read_file,
    status_of,
    ublkd,
)

from btrfs_ublk_image import blockmap as bmap
from btrfs_ublk_image.cli import main as cli

from bundletools import list_dir, list_tar

pytestmark = pytest.mark.root


def test_in_place_mount_then_corrupt_tar_byte_fails_that_chunk(
    no_leftovers: Path,  # noqa: F811 - the fixture imported above
) -> None:
    tmp = no_leftovers
    tarball = tmp / "rootfs.tar"
    files = make_tarball(tarball, 7)
    (tmp / "spec.yaml").write_text(
        "version: 1\nname: inplace\nlayers:\n  - tar: {path: rootfs.tar, in_place: true}\n"
    )
    bundle = tmp / "in-place.bundle"
    assert cli(["build", str(tmp / "spec.yaml"), "-o", str(bundle)]) == 0
    bm = bmap.decode((bundle / "blockmap").read_bytes())
    assert len(bm.packs) == 2 and bm.packs[1].size == tarball.stat().st_size
    pack = bundle / "packs" / bm.packs[1].id.hex()
    tar_bytes = tarball.read_bytes()
    # which chunks of the tarball pack each file's data lies in
    chunks: dict[str, set[int]] = {}
    for name, content in files.items():
        if len(content) > 4096:
            at = tar_bytes.find(content)
            assert at >= 0, name
            chunks[name] = set(range(at // CHUNK, (at + len(content) - 1) // CHUNK + 1))
    mnt = tmp / "mnt"
    mnt.mkdir()
    ublkd("mount", bundle, mnt, "--frontend", "fuse")
    try:
        assert list_dir(mnt) == list_tar(tarball)
        for name, content in files.items():
            assert read_file(mnt / name) == content, name
    finally:
        ublkd("umount", mnt)
    # the user's tarball changes after the build: the bundle holds its own copy
    with open(tarball, "r+b") as f:
        f.write(b"\0" * 4096)
    # a byte of the bundle's copy changes: reads of that chunk fail, nothing else does
    victim = (tar_bytes.find(files["data/b.bin"]) + len(files["data/b.bin"]) // 2) // CHUNK * CHUNK
    victim += 5
    with open(pack, "r+b") as f:
        f.seek(victim)
        f.write(bytes([tar_bytes[victim] ^ 0xFF]))
    bad_chunk = victim // CHUNK
    ublkd("mount", bundle, mnt, "--frontend", "fuse")
    try:
        affected = sorted(n for n, c in chunks.items() if bad_chunk in c)
        fine = sorted(n for n, c in chunks.items() if bad_chunk not in c)
        assert "data/b.bin" in affected and fine
        for name in affected:
            assert read_file(mnt / name) == errno.EIO, name
        for name in fine:
            assert read_file(mnt / name) == files[name], name
        for name in ("etc/hostname", "usr/bin/tool"):  # inline in metadata
            assert read_file(mnt / name) == files[name]
        deadline = time.monotonic() + 3
        while status_of(mnt)["verify_failures"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        st = status_of(mnt)
        assert isinstance(st["verify_failures"], int) and st["verify_failures"] >= 1
        log = Path(os.environ["UBLKD_RUN_DIR"], "bundles").glob("*/server.log")
        want = f"pack {pack.relative_to(bundle)} chunk {bad_chunk} "  # pack named by its path
        assert any(want in p.read_text() for p in log), want
    finally:
        ublkd("umount", mnt)
