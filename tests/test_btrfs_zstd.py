"""btrfs compressed extents (spec ``pack_compression: btrfs-zstd``, docs/btrfs-layout.md):
file data stored as the kernel stores zstd extents, served as stored, decompressed by the
kernel. The same input built with and without it lists identically through our reader,
``btrfs check --check-data-csum`` accepts it, the kernel and ublkd (FUSE frontend) read
it, and a cold 4 KiB read over HTTP moves at most about one compressed extent.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import time
from pathlib import Path

import pytest
import zstandard
from servers import nginx_serving
from test_remote import settled_status
from test_ublkd import no_leftovers, status, ublkd
from test_zstd import _text

from btrfs_ublk_image import blockmap as bmap
from btrfs_ublk_image import listing
from btrfs_ublk_image import trace as tracefile
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.crc import crc32c
from btrfs_ublk_image.reader import COMPRESS_ZSTD, BundleReader, FileExtent

from bundletools import list_dir, list_tar, losetup, materialize_data_device, run

__all__ = ["no_leftovers"]  # the fixture, used by name

KiB = 1 << 10
MiB = 1 << 20


def make_tarball(tmp: Path) -> tuple[Path, dict[str, bytes]]:
    """Text (compresses), random bytes (stored raw), both in one file, a copy (dedup),
    zeros, small files (inline) and a GNU sparse member with compressible data runs."""
    src = tmp / "src"
    (src / "data").mkdir(parents=True)
    (src / "etc").mkdir()
    rnd = random.Random(7)
    files = {
        "etc/hostname": b"btrfs-zstd\n",
        "data/log.txt": _text(3 * MiB + 777, 1),
        "data/log-copy.txt": _text(3 * MiB + 777, 1),
        "data/random.bin": rnd.randbytes(MiB + 5),
        "data/mixed.bin": _text(300 * KiB, 2) + rnd.randbytes(200 * KiB) + _text(MiB, 3),
        "data/small.txt": _text(70_000, 4),
        "data/zeros.bin": bytes(2 * MiB),
        "data/tiny.txt": b"x" * 1000,
    }
    for name, data in files.items():
        (src / name).write_bytes(data)
    sparse = bytearray(64 * MiB)
    for at, n in ((12345, 300_000), (40 * MiB, 8192), (63 * MiB + 7, 5)):
        sparse[at : at + n] = _text(n, at)
    with open(src / "data" / "sparse.img", "wb") as f:
        f.truncate(len(sparse))
        for at, n in ((12345, 300_000), (40 * MiB, 8192), (63 * MiB + 7, 5)):
            f.seek(at)
            f.write(sparse[at : at + n])
    files["data/sparse.img"] = bytes(sparse)
    tarball = tmp / "rootfs.tar"
    run("tar", "--format=posix", "--sparse", "--sort=name", "-C", src, "-cf", tarball, ".")
    return tarball, files


def build(tmp: Path, tarball: Path, name: str, extra: str, in_place: bool = False) -> Path:
    spec = tmp / f"{name}.yaml"
    opt = ", in_place: true" if in_place else ""
    spec.write_text(
        f"version: 1\nname: {name}\n{extra}layers:\n  - tar: {{path: {tarball.name}{opt}}}\n"
    )
    bundle = tmp / "www" / f"{name}.bundle"
    bundle.parent.mkdir(exist_ok=True)
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    return bundle


BTRFS_ZSTD = "pack_compression: btrfs-zstd\npack_chunk_size: 65536\nprefetch: [/data/log.txt]\n"


def build_pair(tmp: Path, in_place: bool = False) -> tuple[Path, Path, Path, dict[str, bytes]]:
    tarball, files = make_tarball(tmp)
    plain = build(tmp, tarball, "plain", "")
    bz = build(tmp, tarball, "bz", BTRFS_ZSTD, in_place)
    return plain, bz, tarball, files


def _extents(r: BundleReader) -> list[FileExtent]:
    return [e for _, n in r.walk() if n.item.mode & 0o170000 == 0o100000 for e in n.extents]


def check_extents_and_csums(r: BundleReader) -> list[FileExtent]:
    """The kernel's layout for every compressed extent, and a CRC-32C in the csum tree for
    exactly the stored sectors of every data extent, matching device 2's bytes."""
    exts = _extents(r)
    dev2 = r.fs.dev2
    zstd = [e for e in exts if e.compression]
    assert all(e.compression == COMPRESS_ZSTD for e in zstd)
    for e in zstd:
        # the kernel's layout: <= 128 KiB of data in ONE frame (window <= 128 KiB)
        # padded with zeros to whole sectors, no longer than the data it holds
        assert e.num_bytes == e.ram_bytes <= 128 * KiB and e.offset == 0
        assert e.disk_num_bytes % 4096 == 0 and e.disk_num_bytes < e.ram_bytes
        stored = r._read_data(e.disk_bytenr, e.disk_num_bytes, "test")
        params = zstandard.get_frame_parameters(stored)
        assert params.window_size <= 128 * KiB and not params.has_checksum
    # every stored sector of every data extent has its CRC-32C in the csum tree
    csums: dict[int, int] = {}
    bytenr, level, _ = r.fs._find_root(d.CSUM_TREE_OBJECTID)
    for key, data in r.fs.items(bytenr, level, d.CSUM_TREE_OBJECTID):
        assert key[:2] == (d.EXTENT_CSUM_OBJECTID, d.EXTENT_CSUM_KEY)
        for i, (c,) in enumerate(struct.iter_unpack("<I", data)):
            csums[key[2] + i * 4096] = c
    sectors = {
        e.disk_bytenr + s
        for e in exts
        if e.kind == d.FILE_EXTENT_REG
        for s in range(0, e.disk_num_bytes, 4096)
    }
    assert set(csums) == sectors
    for logical in sorted(sectors)[::7]:
        _, _, physical = r.fs.map_logical(logical, 4096)
        assert crc32c(dev2.read(physical, 4096)) == csums[logical]
    return exts


@pytest.mark.unit
def test_btrfs_zstd_reads_and_lists_like_the_plain_build(tmp_path: Path) -> None:
    plain, bz, tarball, files = build_pair(tmp_path)
    with BundleReader(str(bz)) as r:
        for name, data in files.items():
            assert r.read(r.lookup("/" + name)) == data, name
        exts = check_extents_and_csums(r)
        assert any(e.compression for e in exts)
        assert any(not e.compression and e.kind == d.FILE_EXTENT_REG for e in exts), "raw"
        # a sparse file: extents for its data runs only (three runs, < 1 MiB of 64 MiB)
        sparse = r.lookup("/data/sparse.img").extents
        assert len(sparse) >= 3 and sum(e.num_bytes for e in sparse) < MiB
        # datasum inodes: no NODATASUM / NODATACOW in this mode
        assert all(n.item.flags == 0 for p, n in r.walk() if n.item.mode & 0o170000 == 0o100000)
    assert listing.format_listing(listing.from_bundle(str(bz))) == listing.format_listing(
        listing.from_bundle(str(plain))
    )
    # the packs hold device 2's bytes as stored: blockmap version 1, and much smaller
    bm = bmap.decode((bz / "blockmap").read_bytes())
    assert bm.version == 1
    size = {b.name: sum(p.stat().st_size for p in (b / "packs").iterdir()) for b in (plain, bz)}
    assert size["bz.bundle"] < size["plain.bundle"] * 0.6, size
    # the prefetch trace names the chunks of the file's STORED extents
    t = tracefile.read(str(bz / tracefile.FILE_NAME))
    with BundleReader(str(bz)) as r:
        want = set()
        for e in r.lookup("/data/log.txt").extents:
            _, _, dev = r.fs.map_logical(e.disk_bytenr, 4096)
            for rg in bm.ranges:
                if rg.dev_offset <= dev < rg.dev_offset + rg.length:
                    first = rg.pack_offset // 65536
                    last = (rg.pack_offset + rg.length - 1) // 65536
                    want |= {(rg.pack, c) for c in range(first, last + 1)}
    assert set(t.chunks) == want
    assert list_tar(tarball)


@pytest.mark.root
@pytest.mark.parametrize(
    "in_place",
    # the last one runs inside the VM harness: the 6.12 guest kernel (tests/vm/)
    [False, True, pytest.param(False, marks=pytest.mark.vm, id="guest-6.12")],
    ids=["packed", "in-place", "guest-6.12"],
)
def test_btrfs_check_and_the_kernel_read_it(tmp_path: Path, in_place: bool) -> None:
    plain, bz, tarball, files = build_pair(tmp_path, in_place)
    data = tmp_path / "data.img"
    materialize_data_device(bz, data)
    loops = [losetup(bz / "meta.img"), losetup(data)]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        run("btrfs", "device", "scan", *loops)
        check = run("btrfs", "check", "--readonly", "--check-data-csum", loops[0], check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "[5/7] checking csums against data" in check.stderr + check.stdout
        run("mount", "-t", "btrfs", "-o", f"ro,device={loops[0]},device={loops[1]}", loops[0], mnt)
        try:
            assert list_dir(mnt) == list_tar(tarball)
            for name, want in files.items():
                assert (mnt / name).read_bytes() == want, name
            # a read in the middle of a compressed extent, page cache dropped
            subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
            with open(mnt / "data" / "log.txt", "rb") as f:
                f.seek(2 * MiB + 12345)
                assert f.read(4096) == files["data/log.txt"][2 * MiB + 12345 :][:4096]
        finally:
            run("umount", mnt)
    finally:
        for lo in loops:
            run("losetup", "-d", lo, check=False)
        run("btrfs", "device", "scan", "-u", check=False)
    assert json.loads((bz / "manifest.json").read_text())["stats"]["files"] == len(files) + 0
    assert os.path.exists(plain)


@pytest.mark.root
def test_send_compressed_data_moves_the_extents_as_stored(tmp_path: Path) -> None:
    """``btrfs send --compressed-data`` of a read-only snapshot of a sprouted mount sends
    every zstd extent as an encoded write (not decompressed); ``btrfs receive`` into an
    ordinary btrfs writes them as compressed extents and the files are identical."""
    _, bz, _, files = build_pair(tmp_path)
    data = tmp_path / "data.img"
    materialize_data_device(bz, data)
    for name in ("rw.img", "recv.img"):
        with open(tmp_path / name, "wb") as f:
            f.truncate(1 << 30)
    mnt, recv = tmp_path / "mnt", tmp_path / "recv"
    mnt.mkdir()
    recv.mkdir()
    loops = [losetup(bz / "meta.img"), losetup(data)]
    mounted: list[Path] = []
    try:
        run("btrfs", "device", "scan", *loops)
        run("mount", "-t", "btrfs", "-o", f"ro,device={loops[0]},device={loops[1]}", loops[0], mnt)
        mounted.append(mnt)
        loops.append(losetup(tmp_path / "rw.img", readonly=False))
        run("btrfs", "device", "add", "-f", "-K", loops[2], mnt)
        run("mount", "-o", "remount,rw", mnt)
        run("btrfs", "subvolume", "snapshot", "-r", mnt, mnt / "snap")
        stream, plain_stream = tmp_path / "stream", tmp_path / "stream-v1"
        run("btrfs", "send", "--compressed-data", "-f", stream, mnt / "snap")
        run("btrfs", "send", "-f", plain_stream, mnt / "snap")
        dump = run("btrfs", "receive", "--dump", "-f", stream).stdout.splitlines()
        encoded = [line for line in dump if line.startswith("encoded_write")]
        with BundleReader(str(bz)) as r:
            n_zstd = len({e.disk_bytenr for e in _extents(r) if e.compression})
        # compression=2: BTRFS_ENCODED_IO_COMPRESSION_ZSTD; one per distinct extent (the
        # deduplicated copy of a file is sent as clones)
        assert len(encoded) == n_zstd > 0 and all("compression=2" in x for x in encoded)
        assert any(line.startswith("clone") for line in dump)
        assert stream.stat().st_size < plain_stream.stat().st_size * 0.6
        run("mkfs.btrfs", "-q", "-f", tmp_path / "recv.img")
        loops.append(losetup(tmp_path / "recv.img", readonly=False))
        run("mount", loops[3], recv)
        mounted.append(recv)
        run("btrfs", "receive", "-f", stream, recv)
        for name, want in files.items():
            assert (recv / "snap" / name).read_bytes() == want, name
        run("sync")
        tree = run("btrfs", "inspect-internal", "dump-tree", "-t", "5", loops[3]).stdout
        tree += run("btrfs", "inspect-internal", "dump-tree", "-t", "256", loops[3]).stdout
        assert tree.count("extent compression 3 (zstd)") >= n_zstd
    finally:
        for m in reversed(mounted):
            run("umount", m, check=False)
        for lo in loops:
            run("losetup", "-d", lo, check=False)
        run("btrfs", "device", "scan", "-u", check=False)


def read_at(path: Path, offset: int, n: int = 4096) -> bytes:
    """``n`` bytes at ``offset``, read with readahead off (POSIX_FADV_RANDOM), in a child
    with a timeout."""
    code = (
        "import os,sys;fd=os.open(sys.argv[1],os.O_RDONLY);"
        "os.posix_fadvise(fd,0,0,os.POSIX_FADV_RANDOM);"
        "sys.stdout.buffer.write(os.pread(fd,int(sys.argv[3]),int(sys.argv[2])))"
    )
    r = subprocess.run(
        ["python3", "-c", code, str(path), str(offset), str(n)], capture_output=True, timeout=60
    )
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout


@pytest.mark.root
def test_ublkd_fuse_lists_identically_and_a_cold_random_read_moves_one_extent(
    no_leftovers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp = no_leftovers
    plain, bz, _, files = build_pair(tmp)
    (bz / tracefile.FILE_NAME).unlink()  # no prefetch: only the reads below fetch
    mnt = tmp / "mnt"
    mnt.mkdir()
    listings = []
    for b in (plain, bz):
        ublkd("mount", b, mnt, "--frontend", "fuse")
        try:
            listings.append(list_dir(mnt))
        finally:
            ublkd("umount", mnt)
    assert listings[0] == listings[1]
    assert "sha256" in listings[1]["/data/log.txt"]
    rnd = random.Random(3)
    with nginx_serving(tmp, tmp / "nginx") as web:
        monkeypatch.setenv("UBLKD_CACHE_DIR", str(tmp / "cache"))
        ublkd("mount", f"{web.url}/www/{bz.name}/manifest.json", mnt, "--frontend", "fuse")
        try:
            # device 2 is read right after a mount (its superblock, and at times a few
            # more chunks): only the reads below are counted
            time.sleep(3)
            settled_status(mnt)
            moved = []
            for name in ("data/log.txt", "data/mixed.bin", "data/zeros.bin", "data/log.txt"):
                want = files[name]
                at = rnd.randrange(0, len(want) - 4096) // 4096 * 4096
                web.clear_log()
                assert read_at(mnt / name, at) == want[at : at + 4096], (name, at)
                settled_status(mnt)
                moved.append(sum(q.bytes_sent for q in web.requests() if "/packs/" in q.path))
            # one compressed extent (<= 128 KiB of data, stored smaller) lies in at most
            # two 64 KiB pack chunks
            assert all(0 <= m <= 128 * KiB for m in moved), moved
            assert max(moved) > 0
        finally:
            ublkd("umount", mnt)
    assert status() == []


@pytest.mark.unit
def test_in_place_tarball_extents_are_raw_and_checksummed(tmp_path: Path) -> None:
    tarball, files = make_tarball(tmp_path)
    spec = tmp_path / "ip.yaml"
    spec.write_text(
        "version: 1\nname: ip\npack_compression: btrfs-zstd\n"
        f"layers:\n  - tar: {{path: {tarball.name}, in_place: true}}\n"
    )
    bundle = tmp_path / "ip.bundle"
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    bm = bmap.decode((bundle / "blockmap").read_bytes())
    assert bm.version == 1 and len(bm.packs) == 2
    with BundleReader(str(bundle)) as r:
        for name, data in files.items():
            assert r.read(r.lookup("/" + name)) == data, name
        check_extents_and_csums(r)
        # members referenced in the tarball are its bytes as they are: ordinary extents
        # (sparse members, which the tarball does not hold expanded, are written to pack 0)
        log = r.lookup("/data/log.txt").extents
        assert log and not any(e.compression for e in log)
        assert sum(e.num_bytes for e in log) >= len(files["data/log.txt"])


@pytest.mark.vm
def test_ublk_frontend_in_the_guest(no_leftovers: Path) -> None:
    """ublkd's ublk frontend (the 6.12 guest kernel) serves the stored extents; the kernel
    decompresses: the tree lists like the tarball."""
    tmp = no_leftovers
    subprocess.run(["modprobe", "ublk_drv"], check=False)
    _, bz, tarball, files = build_pair(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    r = ublkd("mount", bz, mnt, "--frontend", "ublk")
    try:
        assert "frontend ublk" in r.stdout + r.stderr
        assert list_dir(mnt) == list_tar(tarball)
    finally:
        ublkd("umount", mnt)
    assert status() == []
