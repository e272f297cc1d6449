"""ublkd serves a bundle whose tarball is used in place: verified reads from the tarball
pack, a corrupted byte in it fails the reads of its chunk only (root, fuse frontend)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_ublkd import (  # noqa: F401 - no_leftovers is a fixture
    CHUNK,
    assert_only_bad_chunk_fails,
    chunks_of_files,
    fresh_seed,
    make_tarball,
    no_leftovers,
    read_file,
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
    files = make_tarball(tarball, fresh_seed())
    (tmp / "spec.yaml").write_text(
        "version: 1\nname: inplace\nlayers:\n  - tar: {path: rootfs.tar, in_place: true}\n"
    )
    bundle = tmp / "in-place.bundle"
    assert cli(["build", str(tmp / "spec.yaml"), "-o", str(bundle)]) == 0
    bm = bmap.decode((bundle / "blockmap").read_bytes())
    assert len(bm.packs) == 2 and bm.packs[1].size == tarball.stat().st_size
    pack = bundle / "packs" / bm.packs[1].id.hex()
    tar_bytes = tarball.read_bytes()
    chunks = chunks_of_files(tar_bytes, files)  # chunks of the tarball pack
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
        # the log names the pack by its path
        want = f"pack {pack.relative_to(bundle)} chunk {bad_chunk} "
        assert_only_bad_chunk_fails(mnt, files, chunks, bad_chunk, want)
    finally:
        ublkd("umount", mnt)
