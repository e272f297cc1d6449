"""Pack compression (spec ``pack_compression: zstd``, blockmap version 2 in
docs/bundle-format.md): the same input built with and without it reads the same through
our reader, the kernel (materialized device 2) and ublkd (local and over nginx), moves
fewer bytes over HTTP, and a bad stored chunk fails only the reads that need it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import zstandard
from servers import nginx_serving
from test_remote import settled_status
from test_ublkd import CHUNK, no_leftovers, read_file, status, ublkd

from btrfs_ublk_image import blockmap as bmap
from btrfs_ublk_image import listing
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.push import verify_bundle
from btrfs_ublk_image.reader import BundleReader

from bundletools import list_dir, list_tar, mounted_bundle, write_pax_tar

__all__ = ["no_leftovers"]  # the fixture, used by name

MiB = 1 << 20


def _text(n: int, seed: int) -> bytes:
    """Compressible bytes (log-like lines), not repetitive enough to be trivial."""
    rnd = random.Random(seed)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"ublk", b"btrfs", b"chunk", b"pack"]
    out = bytearray()
    while len(out) < n:
        out += b"%08d %s %s %d\n" % (len(out), rnd.choice(words), rnd.choice(words), rnd.random())
    return bytes(out[:n])


def make_tree(path: Path) -> dict[str, bytes]:
    rnd = random.Random(5)
    files = {
        "etc/hostname": b"zstd\n",
        "data/log.txt": _text(3 * MiB + 777, 1),
        "data/random.bin": rnd.randbytes(2 * MiB + 5),  # stored raw: zstd does not help
        "data/mixed.bin": _text(MiB, 2) + rnd.randbytes(MiB // 2) + _text(MiB, 3),
        "data/small.txt": _text(70_000, 4),
        "data/victim.txt": _text(2 * MiB, 5),
        "data/zeros.bin": bytes(4 * MiB),
    }
    write_pax_tar(path, files, ("etc", "data"))
    return files


def build_pair(tmp: Path, in_place: bool = False) -> tuple[Path, Path, Path, dict[str, bytes]]:
    """The same tarball built without and with compression -> (plain, zstd, tarball, files)."""
    src = tmp / "src"
    src.mkdir()
    tarball = src / "rootfs.tar"
    files = make_tree(tarball)
    opt = ", in_place: true" if in_place else ""
    out = []
    for name, extra in (("plain", ""), ("zstd", "pack_compression: zstd\n")):
        spec = src / f"{name}.yaml"
        spec.write_text(
            f"version: 1\nname: {name}\n{extra}layers:\n  - tar: {{path: rootfs.tar{opt}}}\n"
        )
        bundle = tmp / "www" / f"{name}.bundle"
        bundle.parent.mkdir(exist_ok=True)
        assert cli(["build", str(spec), "-o", str(bundle)]) == 0
        out.append(bundle)
    return out[0], out[1], tarball, files


def blockmap_of(bundle: Path) -> bmap.BlockMap:
    return bmap.decode((bundle / "blockmap").read_bytes())


@pytest.mark.unit
def test_compressed_build_reads_like_the_uncompressed_one(tmp_path: Path) -> None:
    plain, zst, tarball, files = build_pair(tmp_path)
    bp, bz = blockmap_of(plain), blockmap_of(zst)
    assert bp.version == 1 and all(p.stored is None for p in bp.packs)
    assert bz.version == 2 and bz.packs[0].compressed
    # ranges map the same LOGICAL pack bytes; only how they are stored differs
    assert bz.ranges == bp.ranges and bz.packs[0].size == bp.packs[0].size
    kinds = {c.zstd for c in bz.packs[0].stored or []}
    assert kinds == {True, False}, "random chunks are stored raw, the rest as frames"
    (pz,) = (zst / "packs").iterdir()
    (pp,) = (plain / "packs").iterdir()
    manifest = json.loads((zst / "manifest.json").read_text())
    assert manifest["packs"][0]["size"] == pz.stat().st_size == bz.packs[0].stored_size
    assert pz.stat().st_size < pp.stat().st_size * 0.7
    # the pack id is still sha256 over the (stored) chunk digests
    assert bz.packs[0].id == hashlib.sha256(b"".join(bz.packs[0].chunk_digests)).digest()
    ours = listing.from_bundle(str(zst))
    assert listing.format_listing(ours) == listing.format_listing(listing.from_bundle(str(plain)))
    with BundleReader(str(zst)) as r:
        for name, data in files.items():
            assert r.read(r.lookup("/" + name)) == data, name
    verify_bundle(str(zst))  # push's check: stored chunks against their digests
    assert list_tar(tarball)  # the input is what both listings came from
    # blockmap v2 round trip
    assert bmap.decode(bz.encode()) == bz


@pytest.mark.unit
def test_in_place_pack_stays_uncompressed(tmp_path: Path) -> None:
    _, zst, tarball, files = build_pair(tmp_path, in_place=True)
    bz = blockmap_of(zst)
    assert bz.version == 2 and len(bz.packs) == 2
    assert bz.packs[0].compressed and not bz.packs[1].compressed
    manifest = json.loads((zst / "manifest.json").read_text())
    assert (zst / manifest["packs"][1]["path"]).read_bytes() == tarball.read_bytes()
    with BundleReader(str(zst)) as r:
        assert r.read(r.lookup("/data/log.txt")) == files["data/log.txt"]
    verify_bundle(str(zst))


def _tampered(bm: bmap.BlockMap, pack: int, index: int, stored: bytes) -> bmap.BlockMap:
    """``bm`` with chunk ``index``'s digest set to that of ``stored`` (same stored length)."""
    p = bm.packs[pack]
    digests = list(p.chunk_digests)
    digests[index] = hashlib.sha256(stored).digest()
    packs = list(bm.packs)
    packs[pack] = bmap.PackEntry(p.id, p.size, digests, p.stored)
    return bmap.BlockMap(bm.chunk_shift, bm.device_size, packs, bm.ranges, bm.version)


@pytest.mark.unit
def test_bad_stored_chunks_are_refused(tmp_path: Path) -> None:
    _, zst, _, _ = build_pair(tmp_path)
    bm = blockmap_of(zst)
    (pack,) = (zst / "packs").iterdir()
    data = bytearray(pack.read_bytes())
    assert bm.packs[0].stored is not None
    index = next(i for i, c in enumerate(bm.packs[0].stored) if c.zstd)
    c = bm.packs[0].stored[index]
    # a corrupt stored byte: caught by the digest, before the decompressor sees it
    data[c.offset + c.length // 2] ^= 0xFF
    bad = tmp_path / "bad.pack"
    bad.write_bytes(bytes(data))
    with open(bad, "rb") as f, pytest.raises(ImageError, match="does not match its sha256"):
        bmap.read_chunk(f, bm, 0, index, str(bad))
    # a frame (with a matching digest) that decompresses to the wrong length
    logical = bmap.read_chunk(open(pack, "rb"), bm, 0, index, str(pack))  # noqa: SIM115
    short = zstandard.ZstdCompressor(level=3).compress(logical[: len(logical) // 2])
    assert len(short) + 8 <= c.length
    # pad to the same stored length with a skippable frame (magic 0x184D2A50, length)
    pad = c.length - len(short) - 8
    frame = short + (0x184D2A50).to_bytes(4, "little") + pad.to_bytes(4, "little") + bytes(pad)
    data = bytearray(pack.read_bytes())
    data[c.offset : c.offset + c.length] = frame
    bad.write_bytes(bytes(data))
    with open(bad, "rb") as f, pytest.raises(ImageError, match="decompresses to"):
        bmap.read_chunk(f, _tampered(bm, 0, index, frame), 0, index, str(bad))


@pytest.mark.root
def test_compressed_bundle_kernel_mount_and_ublkd_tree(no_leftovers: Path) -> None:
    tmp = no_leftovers
    plain, zst, tarball, files = build_pair(tmp)
    want = list_tar(tarball)
    (tmp / "k").mkdir()
    with mounted_bundle(zst, tmp / "k") as m:  # device 2 materialized from the frames
        assert list_dir(m.mountpoint) == want
        assert (m.mountpoint / "data" / "mixed.bin").read_bytes() == files["data/mixed.bin"]
    mnt = tmp / "mnt"
    mnt.mkdir()
    ublkd("mount", zst, mnt, "--frontend", "fuse")
    try:
        assert list_dir(mnt) == want
        for name, data in files.items():
            assert read_file(mnt / name) == data, name
    finally:
        ublkd("umount", mnt)
    assert status() == []


def _read_all_over_nginx(
    bundle: Path, web_url: str, mnt: Path, files: dict[str, bytes]
) -> dict[str, object]:
    url = f"{web_url}/{bundle.parent.name}/{bundle.name}/manifest.json"
    ublkd("mount", url, mnt, "--frontend", "fuse")
    try:
        for name, data in files.items():
            assert read_file(mnt / name) == data, name
        return settled_status(mnt)
    finally:
        ublkd("umount", mnt)


@pytest.mark.root
def test_over_nginx_fewer_bytes_and_a_corrupt_frame_fails_its_chunk_only(
    no_leftovers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp = no_leftovers
    plain, zst, _, files = build_pair(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    with nginx_serving(tmp, tmp / "nginx") as web:
        moved = {}
        for b in (plain, zst):
            monkeypatch.setenv("UBLKD_CACHE_DIR", str(tmp / f"cache-{b.name}"))
            st = _read_all_over_nginx(b, web.url, mnt, files)
            assert st["verify_failures"] == 0
            moved[b.name] = st["fetch_bytes"]
        assert isinstance(moved["zstd.bundle"], int) and isinstance(moved["plain.bundle"], int)
        assert moved["zstd.bundle"] < moved["plain.bundle"] * 0.7, moved

        # one corrupt stored byte in the middle of a frame of victim.txt's data (the
        # logical packs are the same: find it in the uncompressed one)
        bm = blockmap_of(zst)
        (pack,) = (zst / "packs").iterdir()
        (plain_pack,) = (plain / "packs").iterdir()
        at = plain_pack.read_bytes().find(files["data/victim.txt"])
        assert at >= 0
        index = (at + MiB) // CHUNK
        assert bm.packs[0].stored is not None
        c = bm.packs[0].stored[index]
        assert c.zstd
        broken = tmp / "broken"
        shutil.copytree(zst.parent, broken / zst.parent.name)
        bpack = broken / zst.parent.name / zst.name / "packs" / pack.name
        data = bytearray(bpack.read_bytes())
        data[c.offset + c.length // 2] ^= 0xFF
        bpack.write_bytes(bytes(data))
        monkeypatch.setenv("UBLKD_CACHE_DIR", str(tmp / "cache-broken"))
        url = f"{web.url}/broken/{zst.parent.name}/{zst.name}/manifest.json"
        ublkd("mount", url, mnt, "--frontend", "fuse", "--fetch-timeout", "5")
        try:
            assert read_file(mnt / "data" / "victim.txt") == errno.EIO
            for name in ("data/log.txt", "data/random.bin", "etc/hostname"):
                assert read_file(mnt / name) == files[name], name
            st = settled_status(mnt)
            assert isinstance(st["verify_failures"], int) and st["verify_failures"] >= 1
        finally:
            ublkd("umount", mnt)
    assert status() == []
