"""The btrfs writer and the bundle, checked by external oracles: btrfs check and the kernel."""

from __future__ import annotations

import dataclasses
import gc
import io
import itertools
import os
import random
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest

from btrfs_ublk_image import blockmap, listing, native
from btrfs_ublk_image.btrfs import ondisk, treeblocks
from btrfs_ublk_image.btrfs.layout import BaseLayout
from btrfs_ublk_image.btrfs.writer import WriterOptions
from btrfs_ublk_image.bundle import BuildResult, write_bundle
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.manifest import read_manifest
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.tree import Blob, FileType, Inode, Sparse, Tree

from bundletools import (
    ACL_XATTR,
    CAPABILITY_XATTR,
    dmesg_btrfs_problems,
    dmesg_len,
    list_dir,
    list_tree,
    materialize_data_device,
    mounted_bundle,
    run,
)

MiB = 1 << 20
NS = 1_700_000_000_123_456_789


def check(meta: Path) -> None:
    r = run("btrfs", "check", "--readonly", meta, check=False)
    assert r.returncode == 0 and "no error found" in r.stdout, r.stdout + r.stderr


def build(tmp: Path, fill: Any, name: str = "bundle", **opts: Any) -> BuildResult:
    def filler(packs: PackWriter) -> tuple[Tree, list[dict[str, Any]], None]:
        return fill(packs), [], None

    return write_bundle(
        str(tmp / name),
        name="test",
        opts=WriterOptions(**opts),
        fill=filler,
        spec_sha256="sha256:0",
    )


def every_type(packs: PackWriter) -> Tree:
    """One of every file type and attribute the writer must keep."""
    t = Tree()

    def reg(data: bytes, **kw: Any) -> Inode:
        return Inode(FileType.REG, content=packs.put_stream(io.BytesIO(data), len(data), "t"), **kw)

    big = os.urandom(3 * MiB + 123)
    t.put("/empty", reg(b""), "t")
    t.put("/small", reg(b"hello\n", mtime_ns=NS, xattrs={b"user.k": b"v"}), "t")
    t.put("/inline-max", reg(b"i" * 2048), "t")
    t.put("/not-inline", reg(b"n" * 2049), "t")
    t.put("/big", reg(big, mode=0o640, uid=1000, gid=100, mtime_ns=NS + 1), "t")
    t.put("/dir/big-copy", reg(big), "t")  # same content: one extent, two refs
    t.put("/setuid", reg(b"#!/bin/sh\n", mode=0o4755), "t")
    t.put("/setgid-dir", Inode(FileType.DIR, mode=0o2775, gid=50), "t")
    t.put("/sticky", Inode(FileType.DIR, mode=0o1777), "t")
    t.put("/cap", reg(b"ping", xattrs={b"security.capability": CAPABILITY_XATTR}), "t")
    t.put("/acl", reg(b"acl", xattrs={b"system.posix_acl_access": ACL_XATTR}), "t")
    hard = reg(b"hardlinked content that is long enough" * 100, mtime_ns=NS)
    t.put("/hard1", hard, "t")
    t.put("/dir/hard2", hard, "t")
    t.put("/dir/sub/hard3", hard, "t")
    t.put(
        "/symlink", Inode(FileType.SYMLINK, mode=0o777, target=b"dir/sub/hard3", mtime_ns=NS), "t"
    )
    t.put("/chr", Inode(FileType.CHR, mode=0o666, rdev=os.makedev(1, 3)), "t")
    t.put("/blk", Inode(FileType.BLK, mode=0o660, rdev=os.makedev(259, 70000)), "t")
    t.put("/fifo", Inode(FileType.FIFO, mode=0o600), "t")
    t.put("/sock", Inode(FileType.SOCK, mode=0o755), "t")
    t.put("/dir/" + "n" * 255, reg(b"long name"), "t")
    t.put("/utf8-名前", reg(b"x"), "t")
    return t


@pytest.mark.unit
def test_every_type_passes_btrfs_check(tmp_path: Path) -> None:
    res = build(tmp_path, every_type)
    check(Path(res.path) / "meta.img")
    manifest, image_id = read_manifest(res.path)
    assert image_id == res.image_id
    # big + its copy share one extent; not-inline and the hardlinked file have one each
    assert manifest["stats"]["data_extents"] == 3
    dump = run("btrfs", "inspect-internal", "dump-super", Path(res.path) / "meta.img").stdout
    assert "SEEDING" in dump and "NO_HOLES" in dump and "SKINNY_METADATA" in dump
    assert "FREE_SPACE_TREE_VALID" in dump


@pytest.mark.unit
def test_identical_files_share_one_extent(tmp_path: Path) -> None:
    res = build(tmp_path, every_type)
    dump = run(
        "btrfs", "inspect-internal", "dump-tree", "-t", "extent", Path(res.path) / "meta.img"
    ).stdout
    # the 3 MiB file and its copy: one EXTENT_ITEM with refs 2
    big_len = (3 * MiB + 123 + 4095) // 4096 * 4096
    block = dump.split(f"EXTENT_ITEM {big_len})")[1].split("item ")[0]
    assert "refs 2" in block and block.count("extent data backref") == 2


@pytest.mark.unit
def test_many_refs_to_one_extent_become_keyed_items(tmp_path: Path) -> None:
    """More refs than an EXTENT_ITEM holds inline (33): keyed EXTENT_DATA_REF items, which
    the writer sizes without making them (the plan must match what it then writes)."""

    def fill(packs: PackWriter) -> Tree:
        t = Tree()
        for i in range(80):
            t.put(f"/d/f{i:03d}", Inode(FileType.REG, content=packs.put_bytes(b"x" * 10_000)), "t")
        return t

    meta = Path(build(tmp_path, fill).path) / "meta.img"
    check(meta)
    dump = run("btrfs", "inspect-internal", "dump-tree", "-t", "extent", meta).stdout
    assert dump.count("EXTENT_DATA_REF") == 80 and "refs 80" in dump


@pytest.mark.unit
def test_builds_are_byte_identical(tmp_path: Path) -> None:
    content = os.urandom(MiB)

    def fill(packs: PackWriter) -> Tree:
        t = Tree()
        t.put(
            "/a", Inode(FileType.REG, content=packs.put_stream(io.BytesIO(content), MiB, "a")), "t"
        )
        t.put("/b", Inode(FileType.SYMLINK, target=b"a"), "t")
        return t

    a, b = build(tmp_path, fill, "a"), build(tmp_path, fill, "b")
    assert a.image_id == b.image_id
    for rel in ["manifest.json", "meta.img", "blockmap", *[p["path"] for p in a.manifest["packs"]]]:
        assert (Path(a.path) / rel).read_bytes() == (Path(b.path) / rel).read_bytes(), rel


@pytest.mark.unit
def test_inline_limit_zero_puts_everything_in_extents(tmp_path: Path) -> None:
    res = build(tmp_path, every_type, inline_limit=0)
    check(Path(res.path) / "meta.img")
    assert res.manifest["stats"]["inline_files"] == 0


@pytest.mark.unit
def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def fill(packs: PackWriter) -> Tree:
        packs.put_stream(io.BytesIO(b"x" * 10000), 10000, "a")
        raise ImageError("boom")

    with pytest.raises(ImageError, match="boom"):
        build(tmp_path, fill)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_cyclic_gc_is_off_during_a_build_and_restored(tmp_path: Path) -> None:
    """The build runs with the cyclic collector off (it would walk every entry's objects
    again and again) and leaves it as it found it, after an error too."""
    seen: list[bool] = []

    def fill(packs: PackWriter) -> Tree:
        seen.append(gc.isenabled())
        return every_type(packs)

    def failing(packs: PackWriter) -> Tree:
        seen.append(gc.isenabled())
        raise ImageError("boom")

    assert gc.isenabled()
    build(tmp_path, fill, name="ok")
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ImageError, match="boom"):
        build(tmp_path, failing, name="failed")
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        build(tmp_path, fill, name="disabled-before")
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disabled-before", "ok"]


@pytest.mark.unit
def test_existing_destination_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bundle").mkdir()
    with pytest.raises(ImageError, match="already exists"):
        build(tmp_path, every_type)


@pytest.mark.unit
def test_blockmap_roundtrip(tmp_path: Path) -> None:
    res = build(tmp_path, every_type)
    data = (Path(res.path) / "blockmap").read_bytes()
    bm = blockmap.decode(data)
    assert bm.encode() == data
    assert bm.ranges[0].dev_offset == ondisk.SUPER_INFO_OFFSET  # device 2's superblock
    assert bm.lookup(0) is None and bm.lookup(ondisk.SUPER_INFO_OFFSET) == bm.ranges[0]
    with pytest.raises(ImageError, match="bad magic"):
        blockmap.decode(b"X" * len(data))


@pytest.mark.unit
def test_blockmap_ranges_columns_match_records() -> None:
    """``Ranges`` (columns) encodes and decodes exactly as one ``struct`` record per range
    (the format's definition), whichever form the ranges come in."""
    rng = random.Random(7)
    rows, at = [], 0
    for _ in range(500):
        at += 4096 * rng.randrange(1, 9)
        length = 4096 * rng.randrange(1, 40)
        rows.append(blockmap.Range(at, length, rng.randrange(0, 3), rng.randrange(0, 2**40)))
        at += length
    records = b"".join(
        struct.pack("<QQIIQ", r.dev_offset, r.length, r.pack, 0, r.pack_offset) for r in rows
    )
    cols = blockmap.Ranges.of(rows)
    assert cols.encode() == records and cols == rows and list(cols) == rows
    back = blockmap.Ranges.decode(records, len(rows))
    assert back == cols and back[3] == rows[3] and back[-2:] == rows[-2:]
    first = blockmap.Range(0, 4096, 5, 0)
    assert list(cols.with_first(first)) == [first, *rows]
    assert [r.pack for r in cols.renumbered({0: 2, 1: 0, 2: 1})] == [
        (2, 0, 1)[r.pack] for r in rows
    ]
    bm = blockmap.BlockMap(12, at, [blockmap.PackEntry(b"\0" * 32, 2**41, [])] * 3, rows)
    assert bm.encode().endswith(records) and bm.lookup(rows[9].dev_offset + 1) == rows[9]
    assert bm.lookup(rows[9].dev_offset - 1) is None  # a gap between ranges
    with pytest.raises(ImageError, match="32 bits"):
        blockmap.Ranges.of([blockmap.Range(0, 4096, 2**32, 0)]).encode()


@pytest.mark.unit
def test_name_hashes_match_the_kernel() -> None:
    # values read from a kernel-made filesystem (shared/recipes/reference-seed.sh)
    assert ondisk.name_hash(b"default") == 2378154706
    assert ondisk.name_hash(b"user.k") == 170068536
    assert ondisk.name_hash(b"dir") == 481053471


def _packed(
    packer: treeblocks.Packer, items: list[tuple[ondisk.Key, bytes]], spill: Any
) -> tuple[list[tuple[ondisk.Key, int, bytes]], bytes | None]:
    for key, data in items:
        packer.add(key, data)
    leaves, digest = packer.finish()
    if spill is not None:
        leaves = list(treeblocks.unspill(leaves, spill))
    return [(leaf.first_key, leaf.nritems, leaf.payload) for leaf in leaves], digest


def _colliding_names() -> list[bytes]:
    """Three names, two of them with the same ``btrfs_name_hash``."""
    seen: dict[int, bytes] = {}
    rng = random.Random(1)  # random names: CRC-32C never maps short differences together
    for _ in range(1 << 20):
        name = rng.randbytes(8)
        other = seen.setdefault(ondisk.name_hash(name), name)
        if other != name:
            return [name, b"a", other]
    raise AssertionError("no crc32c collision among the names tried")


@pytest.mark.unit
@pytest.mark.skipif(native.module() is None, reason="native extension not built")
@pytest.mark.parametrize("spilled", [False, True])
def test_native_leaf_packer_packs_as_the_python_one(spilled: bool) -> None:
    """The fs tree's native leaf packer (native/src/leaves.rs) against ``LeafPacker``: the
    same leaf payloads, splits, spill offsets and item digest, for items of every size."""
    rng = random.Random(5)
    sizes = [0, 1, ondisk.MAX_ITEM_DATA, ondisk.MAX_ITEM_DATA - 1] + [
        rng.choice((rng.randrange(200), rng.randrange(4000), rng.randrange(ondisk.MAX_ITEM_DATA)))
        for _ in range(3000)
    ]
    items = [
        ((256 + i // 5, rng.randrange(256), rng.randrange(1 << 64)), rng.randbytes(size))
        for i, size in enumerate(sizes)
    ]
    for part in (items, items[:1], []):
        with tempfile.TemporaryFile() as a, tempfile.TemporaryFile() as b:
            ours = _packed(
                treeblocks._NativeLeafPacker(
                    native.module().LeafPacker,  # type: ignore[union-attr]
                    a if spilled else None,
                    True,
                ),
                part,
                a if spilled else None,
            )
            ref = _packed(
                treeblocks.LeafPacker(b if spilled else None, True), part, b if spilled else None
            )
            assert ours == ref
            if spilled:
                a.seek(0)
                b.seek(0)
                assert a.read() == b.read()
    assert len(ref[0]) == 1 and ref[0][0][1] == 0  # the empty tree: one empty leaf
    # inode items (times before the epoch and past 2**63 ns too) and directory entries
    # (names of one hash share a DIR_ITEM: crc32c collisions found by search below)
    packers = (
        treeblocks._NativeLeafPacker(native.module().LeafPacker, None, True),  # type: ignore[union-attr]
        treeblocks.LeafPacker(None, True),
    )
    times = (0, -1, -(10**18) - 7, 1_700_000_000_123_456_789, 2**70 + 5, -(2**70) - 3)
    for packer in packers:
        rng = random.Random(5)  # the same items for both
        for i in range(300):
            ino = 256 + i
            ref = (255 + i // 3, i + 2, rng.randbytes(rng.randrange(1, 256))) if i % 4 else None
            packer.add_inode(
                ino, 1, rng.randrange(1 << 64), rng.randrange(1 << 64), rng.randrange(1, 65536),
                rng.randrange(1 << 32), rng.randrange(1 << 32), rng.randrange(1 << 32),
                rng.randrange(1 << 64), rng.randrange(1 << 64), times[i % 6], times[(i + 1) % 6],
                times[(i + 2) % 6], times[(i + 3) % 6], ref,
            )  # fmt: skip
            names = sorted({rng.randbytes(rng.randrange(1, 256)) for _ in range(i % 40)})
            if i == 7:
                names = sorted(_colliding_names())
            packer.add_dir(
                ino, 1, names, [rng.randrange(1 << 64) for _ in names],
                bytes(rng.randrange(1, 8) for _ in names),
            )  # fmt: skip
    got, want = (p.finish() for p in packers)
    assert [(leaf.first_key, leaf.payload) for leaf in got[0]] == [
        (leaf.first_key, leaf.payload) for leaf in want[0]
    ]
    assert got[1] == want[1]
    # a build with a base: leaves also end before the base's leaves' first keys
    ordered = sorted(items)
    keys = [k for k, _ in ordered]
    breaks = sorted({*keys[::37], (300, 7, 0), (9999, 0, 0), *keys[5:9]})
    for part in (ordered, ordered[:1], []):
        got, want = (
            _packed(packer, part, None)
            for packer in (
                treeblocks._NativeLeafPacker(native.module().LeafPacker, None, True, breaks),  # type: ignore[union-attr]
                treeblocks.LeafPacker(None, True, breaks),
            )
        )
        assert got == want
        if part is ordered:
            firsts = [leaf[0] for leaf in want[0]]
    assert firsts == treeblocks.split_leaves(((k, len(v)) for k, v in ordered), breaks)
    greedy = treeblocks.split_leaves((k, len(v)) for k, v in ordered)
    assert set(keys[::37]) <= set(firsts) and len(firsts) > len(greedy)
    too_big = bytes(ondisk.MAX_ITEM_DATA + 1)
    for packer in (treeblocks.LeafPacker(), treeblocks.leaf_packer()):
        with pytest.raises(ValueError, match="item of 16259 bytes does not fit in a 16384-byte"):
            packer.add((256, 1, 0), too_big)


@pytest.mark.root
def test_kernel_mounts_every_type_identically(tmp_path: Path) -> None:
    tree_holder: list[Tree] = []

    def fill(packs: PackWriter) -> Tree:
        tree_holder.append(every_type(packs))
        return tree_holder[0]

    res = build(tmp_path, fill)
    expected = list_tree(tree_holder[0], Path(res.path) / "packs")
    before = dmesg_len()
    with mounted_bundle(Path(res.path), tmp_path) as m:
        got = list_dir(m.mountpoint)
        st = os.stat(m.mountpoint / "small")
        assert st.st_mtime_ns == NS
    assert got == expected
    assert dmesg_btrfs_problems(before, m.loops) == []


@pytest.mark.root
def test_sprout_write_remount(tmp_path: Path) -> None:
    res = build(tmp_path, every_type)
    bundle = Path(res.path)
    rw = tmp_path / "rw.img"
    with open(rw, "wb") as f:
        f.truncate(2 << 30)
    with mounted_bundle(bundle, tmp_path, rw=rw) as m:
        (m.mountpoint / "new").write_bytes(b"new file\n" * 1000)
        with open(m.mountpoint / "small", "ab") as f:
            f.write(b"appended\n")
        (m.mountpoint / "big").write_bytes(b"replaced")
        loops = list(m.loops)
        expected = list_dir(m.mountpoint)
    # mount again from all three devices: the sprout (device 3) is the filesystem now
    data = tmp_path / "data.img"
    from bundletools import losetup

    devs = [losetup(bundle / "meta.img"), losetup(data), losetup(rw, readonly=False)]
    mnt = tmp_path / "mnt2"
    mnt.mkdir()
    try:
        run("btrfs", "device", "scan", *devs)
        run("mount", devs[2], mnt)
        assert list_dir(mnt) == expected
        assert (mnt / "small").read_bytes() == b"hello\nappended\n"
        assert (mnt / "dir" / "big-copy").stat().st_size == 3 * MiB + 123
        run("umount", mnt)
        check_rw = run("btrfs", "check", "--readonly", devs[2], check=False)
        assert check_rw.returncode == 0, check_rw.stdout + check_rw.stderr
    finally:
        run("umount", mnt, check=False)
        for d in devs:
            run("losetup", "-d", d, check=False)
        run("btrfs", "device", "scan", "-u", check=False)
    assert loops


@pytest.mark.unit
@pytest.mark.slow
def test_100k_files_in_one_directory(tmp_path: Path) -> None:
    def fill(packs: PackWriter) -> Tree:
        t = Tree()
        d = Inode(FileType.DIR, mode=0o755)
        t.put("/d", d, "t")
        for i in range(100_000):
            d.entries[b"file-%06d" % i] = Inode(FileType.REG, content=packs.put_bytes(b"%d\n" % i))
        return t

    res = build(tmp_path, fill)
    check(Path(res.path) / "meta.img")
    levels = run(
        "btrfs", "inspect-internal", "dump-tree", "-t", "fs", Path(res.path) / "meta.img"
    ).stdout
    assert "node " in levels  # a multi-level fs tree


@pytest.mark.unit
@pytest.mark.slow
def test_1gib_file(tmp_path: Path) -> None:
    size = 1 << 30

    class Pattern(io.RawIOBase):
        """1 GiB of non-repeating bytes without holding them in memory."""

        def __init__(self) -> None:
            self.pos = 0

        def readable(self) -> bool:
            return True

        def readinto(self, b: Any) -> int:
            n = min(len(b), size - self.pos)
            block = (self.pos // MiB).to_bytes(8, "little") * (n // 8 + 1)
            b[:n] = block[:n]
            self.pos += n
            return n

    def fill(packs: PackWriter) -> Tree:
        t = Tree()
        t.put(
            "/huge",
            Inode(FileType.REG, content=packs.put_stream(io.BufferedReader(Pattern()), size, "h")),
            "t",
        )
        return t

    res = build(tmp_path, fill)
    meta = Path(res.path) / "meta.img"
    check(meta)
    dump = run("btrfs", "inspect-internal", "dump-tree", "-t", "fs", meta).stdout
    sizes = [int(line.split()[-1]) for line in dump.splitlines() if "extent data disk byte" in line]
    # at most 128 MiB each; chunk boundaries (and the 64 MiB superblock mirror) cut some shorter
    assert sum(sizes) == size and max(sizes) == 128 * MiB and len(sizes) >= 8
    data = tmp_path / "data.img"
    materialize_data_device(Path(res.path), data)
    assert data.stat().st_size > size


def many_links(packs: PackWriter) -> Tree:
    """One inode under 1,000 long names in one directory: more than an INODE_REF item holds."""
    t = Tree()
    inode = Inode(FileType.REG, content=packs.put_bytes(b"linked\n"))
    for i in range(1000):
        t.put(f"/d/{i:04d}-" + "x" * 200, inode, "t")
    t.put("/other/link", inode, "t")
    return t


@pytest.mark.unit
def test_many_hardlinks_spill_into_extrefs(tmp_path: Path) -> None:
    res = build(tmp_path, many_links)
    meta = Path(res.path) / "meta.img"
    check(meta)
    dump = run("btrfs", "inspect-internal", "dump-tree", "-t", "fs", meta).stdout
    assert "INODE_EXTREF" in dump and "INODE_REF" in dump
    # our own reader finds every name too (it checks names against INODE_REF/INODE_EXTREF)
    paths = [e.path for e in listing.from_bundle(res.path)]
    assert sum(p.startswith(b"/d/") for p in paths) == 1000 and b"/other/link" in paths


@pytest.mark.root
def test_many_hardlinks_mount(tmp_path: Path) -> None:
    res = build(tmp_path, many_links)
    with mounted_bundle(Path(res.path), tmp_path) as m:
        names = sorted(os.listdir(m.mountpoint / "d"))
        inos = {os.lstat(m.mountpoint / "d" / n).st_ino for n in names}
        st = os.stat(m.mountpoint / "other" / "link")
    assert len(names) == 1000 and inos == {st.st_ino} and st.st_nlink == 1001


@pytest.mark.unit
def test_failed_fsync_fails_the_build_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the bundle's files are fsynced on threads and waited for together: a failure on one
    # of them must still fail the build, name the file and remove the temporary bundle
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/blockmap"):
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(ImageError, match=r"/blockmap: fsync failed: Input/output error"):
        build(tmp_path, every_type)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_bundle_files_and_directories_are_fsynced_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename
    renamed: list[tuple[str, list[str]]] = []

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def rename(src: str, dst: str) -> None:
        renamed.append((str(dst), list(synced)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    res = build(tmp_path, every_type)
    final = [before for dst, before in renamed if dst == res.path]
    assert len(final) == 1
    tmp = {os.path.dirname(p) for p in final[0] if p.endswith("/manifest.json")}
    assert len(tmp) == 1
    t = tmp.pop()
    # every file and both directories were on disk before the bundle was renamed into place
    want = {f"{t}/{n}" for n in ("meta.img", "blockmap", "manifest.json", "packs")} | {t}
    assert want <= set(final[0])
    # and the parent directory after it (the rename itself)
    assert synced[-1] == str(tmp_path)


def varied(packs: PackWriter, aside: str, made_up: bool = True) -> Tree:
    """Every kind of inode the fs tree's loop handles: ``every_type``, hardlinks past one
    INODE_REF, xattrs of one name hash, sparse files, set-aside and in-memory inline
    content, content shared between files and segments."""
    t = every_type(packs)
    linked = Inode(FileType.REG, content=packs.put_bytes(b"linked\n" * 600))
    for i in range(120):  # > 16 KiB of names under /links: INODE_EXTREFs after the INODE_REF
        t.put(f"/links/{i:03d}-" + "x" * 200, linked, "t")
    t.put("/links-elsewhere/one", linked, "t")
    xattrs = {name: b"v" + name for name in _colliding_names()}
    t.put("/xattrs", Inode(FileType.REG, content=b"x", xattrs=xattrs), "t")
    t.put("/dir-xattrs", Inode(FileType.DIR, xattrs={b"user.a": b"1", b"user.b": b""}), "t")
    shared = packs.put_bytes(os.urandom(9000))
    assert isinstance(shared, int)
    rng = random.Random(3)
    for i in range(6):
        seg = packs.put_bytes(rng.randbytes(4096 * (i + 1) + i))
        assert isinstance(seg, int)
        segments = ((0, seg), (1 << 20, shared)) if i % 2 else ((8192, seg),)
        t.put(f"/sparse/{i}", Inode(FileType.REG, content=Sparse(3 << 20, segments)), "t")
    t.put("/shared", Inode(FileType.REG, content=shared), "t")
    for i in range(300):
        size = rng.choice((0, 1, 50, 97, 200, 1500, 2048, 2049, 5000))
        node = Inode(FileType.REG, content=packs.put_bytes(rng.randbytes(size)), mtime_ns=-i)
        if i % 3 == 0:
            t.set_content_aside(node, aside)  # read back from the tree's side file
        t.put(f"/files/{i % 7}/{i}", node, "t")
    t.put("/times", Inode(FileType.REG, mtime_ns=2**70, atime_ns=-(2**66), ctime_ns=5), "t")
    # more extents than the native loop appends to the placer's columns at a time, then
    # files sharing the first ones' content (read back from the columns): blobs made up
    # (the loop never reads pack content; not for a bundle)
    blobs = [Blob(i, 2049 + i, 0, (1 << 20) + 8192 * i) for i in range(9000 if made_up else 0)]
    for i, blob in enumerate(blobs + blobs[:50] + blobs[-20:]):
        t.put(f"/many/{i // 1000}/{i}", Inode(FileType.REG, content=blob), "t")
    return t


needs_native_loop = pytest.mark.skipif(
    getattr(native.module(), "fs_tree_items", None) is None, reason="native extension not built"
)


def _spy(fn: Any, calls: list[object]) -> Any:
    def spied(*args: Any) -> Any:
        calls.append(args)
        return fn(*args)

    return spied


def _fs_tree(
    tree: Tree,
    native_loop: bool,
    monkeypatch: pytest.MonkeyPatch,
    base: Any = None,
    encoded: Any = None,
) -> tuple[Any, ...]:
    """The fs tree's leaves (payloads read back), digest, stats, extent refs and the
    placer's columns and chunks, made by the native loop or the Python one."""
    from types import SimpleNamespace

    from btrfs_ublk_image.btrfs import fstree
    from btrfs_ublk_image.btrfs.layout import system_chunk
    from btrfs_ublk_image.btrfs.numbering import number
    from btrfs_ublk_image.btrfs.placement import DataPlacer

    calls: list[object] = []
    with monkeypatch.context() as m:
        if native_loop:
            m.setattr(fstree, "fs_tree_items_native", _spy(fstree.fs_tree_items_native, calls))
        else:  # the native leaf packer still packs: only the loop differs
            m.setattr(fstree, "native", SimpleNamespace(module=lambda: None))
        num = number(tree, base)
        placer = DataPlacer(system_chunk().end, encoded, base if encoded is None else None)
        breaks = treeblocks.NO_KEYS if base is None else base.breaks[ondisk.FS_TREE_OBJECTID].at(0)
        with tempfile.TemporaryFile() as spill:
            fs = fstree.fs_tree_items(num, placer, 2048, spill, breaks)
            leaves = [
                (x.first_key, x.nritems, x.payload) for x in treeblocks.unspill(fs.leaves, spill)
            ]
    assert len(calls) == native_loop
    chunks = placer.finish()
    columns = [
        bytes(col)
        for col in (
            placer.logical, placer.disk_bytes, placer.file_offset, placer.dev_offset,
            placer.length, placer.pack, placer.pack_offset, placer.num_bytes,
            placer.compression, fs.ref_extent, fs.ref_ino, fs.ref_offset,
        )
    ]  # fmt: skip
    return leaves, fs.digest, fs.stats, columns, chunks, placer.used


@pytest.mark.unit
@needs_native_loop
def test_native_fs_tree_loop_makes_the_python_loops_items(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """native/src/fsitems.rs against ``fs_tree_items``'s Python loop: the same leaves
    (bytes), item digest, stats, extent refs and data placement, without a base, on a
    base (its inode numbers and dir indexes, its extents) and with btrfs-zstd extents."""
    from btrfs_ublk_image.base import BaseImage

    def made(name: str, compression: str = "none") -> tuple[Tree, Any]:
        (tmp_path / name).mkdir()
        packs = PackWriter(str(tmp_path / name), keep_inline=2048, compression=compression)
        # btrfs-zstd: every blob needs its encoded extents, so none made up
        tree = varied(packs, str(tmp_path), made_up=compression == "none")
        return tree, packs

    tree, packs = made("plain")
    ours = _fs_tree(tree, True, monkeypatch)
    assert ours == _fs_tree(tree, False, monkeypatch)
    assert ours[2]["hardlinks"] == 122 and ours[2]["inline_files"] > 100
    packs.abort()

    # a base: the same paths keep their numbers and dir indexes, some names gone and new
    base = build(tmp_path, lambda p: varied(p, str(tmp_path), made_up=False), "base")
    layout = BaseImage(base.path).layout()
    tree, packs = made("v2")
    del tree.root.entries[b"files"].entries[b"0"].entries[b"7"]
    del tree.root.entries[b"links"].entries[b"005-" + b"x" * 200]
    tree.put("/files/0/new", Inode(FileType.REG, content=packs.put_bytes(b"n" * 3000)), "t")
    tree.put("/files/0/000-new", Inode(FileType.SYMLINK, target=b"x"), "t")
    ours = _fs_tree(tree, True, monkeypatch, base=layout)
    assert ours == _fs_tree(tree, False, monkeypatch, base=layout)
    packs.abort()

    tree, packs = made("zstd", "btrfs-zstd")
    assert packs.encoded is not None
    ours = _fs_tree(tree, True, monkeypatch, encoded=packs.encoded)
    assert ours == _fs_tree(tree, False, monkeypatch, encoded=packs.encoded)
    assert any(ours[3][8])  # compressed extents among them
    packs.abort()


@pytest.mark.unit
@needs_native_loop
def test_native_fs_tree_loop_errors_are_the_python_loops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad_symlink = Tree()
    bad_symlink.put("/a", Inode(FileType.SYMLINK, target=b""), "t")
    big_xattr = Tree()
    big_xattr.put("/a", Inode(FileType.REG, xattrs={b"user.big": bytes(16300)}), "t")
    too_many = Tree()
    linked = Inode(FileType.REG)
    for i in range(65536):
        too_many.put(f"/{i}", linked, "t")
    for tree, message in (
        (bad_symlink, "symlink target of inode 257 is empty or longer than 4095 bytes"),
        (big_xattr, "xattr b'user.big' of inode 257: name or value too large"),
        (too_many, "inode 257 has 65536 hardlinks; btrfs allows 65535"),
    ):
        for native_loop in (True, False):
            with pytest.raises(ImageError) as err:
                _fs_tree(tree, native_loop, monkeypatch)
            assert str(err.value) == message


# the extension's pieces of the writer after its fs tree loop: `number` without a base
# (numbering.rs), the extent tree's data extent items and the DATA block groups' free
# ranges (extents.rs), the fs tree's leaf blocks written from the spill file (blocks.rs)
_AFTER_LOOP = (
    "number_inodes", "number_on_base", "DataExtents", "data_free_ranges", "write_spilled_leaves",
)  # fmt: skip
needs_native_writer = pytest.mark.skipif(
    any(getattr(native.module(), name, None) is None for name in _AFTER_LOOP),
    reason="native extension not built",
)


def _written(
    tree: Tree,
    tmp: Path,
    with_native: bool,
    monkeypatch: pytest.MonkeyPatch,
    base: Any = None,
    encoded: Any = None,
) -> tuple[Any, ...]:
    """``write_image``'s meta.img bytes and layout with the extension's pieces after the fs
    tree loop (``_AFTER_LOOP``) or without them (their Python paths: everything else,
    the native fs tree loop and leaf packer included, the same)."""
    from types import SimpleNamespace

    from btrfs_ublk_image.btrfs import writer

    real = native.module()
    assert real is not None
    names = [n for n in dir(real) if with_native or n not in _AFTER_LOOP]
    partial = SimpleNamespace(**{n: getattr(real, n) for n in names})
    made: list[str] = []
    meta = tmp / f"meta-{with_native}.img"
    with monkeypatch.context() as m:
        m.setattr(native, "module", lambda: partial)
        pick = writer.data_extent_items

        def picked(fs: Any) -> Any:
            items = pick(fs)
            made.append(type(items).__name__)
            return items

        m.setattr(writer, "data_extent_items", picked)
        layout = writer.write_image(tree, str(meta), WriterOptions(), encoded, base)
    assert made == ["NativeDataExtentItems" if with_native else "DataExtentItems"]
    data = meta.read_bytes()
    meta.unlink()
    r = layout.data_ranges
    ranges = [bytes(col) for col in (r.dev_offset, r.length, r.pack, r.pack_offset)]
    return data, ranges, layout.stats, layout.meta_size, layout.data_size


def _shared_refs(packs: PackWriter, t: Tree) -> None:
    """Content referenced more often than an EXTENT_ITEM holds inline refs (keyed
    EXTENT_DATA_REFs then), by whole files and by sparse files' segments."""
    many = packs.put_bytes(b"many refs\n" * 900)
    assert isinstance(many, int)
    for i in range(45):
        t.put(f"/refs/{i}", Inode(FileType.REG, content=many), "t")
    for i in range(12):
        segments = ((i * 65536, many), ((i + 20) * 65536, many))
        t.put(f"/refs-sparse/{i}", Inode(FileType.REG, content=Sparse(64 << 20, segments)), "t")


@pytest.mark.unit
@needs_native_writer
def test_native_writer_after_the_loop_writes_the_python_ones_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """native/src/numbering.rs, extents.rs and blocks.rs against the Python paths they
    replace (``_AFTER_LOOP``): the same meta.img, byte for byte, and the same layout, on
    varied trees (hardlinks, many refs to one extent past the inline room, sparse files),
    an empty tree, a tree without data extents, a base, and btrfs-zstd extents."""
    from btrfs_ublk_image.base import BaseImage

    def same(tree: Tree, **kw: Any) -> tuple[Any, ...]:
        ours = _written(tree, tmp_path, True, monkeypatch, **kw)
        assert ours == _written(tree, tmp_path, False, monkeypatch, **kw)
        return ours

    def made(name: str, compression: str = "none") -> tuple[Tree, PackWriter]:
        (tmp_path / name).mkdir()
        packs = PackWriter(str(tmp_path / name), keep_inline=2048, compression=compression)
        tree = varied(packs, str(tmp_path), made_up=compression == "none")
        _shared_refs(packs, tree)
        return tree, packs

    tree, packs = made("plain")
    ours = same(tree)
    assert ours[2]["hardlinks"] == 122 and ours[2]["data_extents"] > 9000
    packs.abort()

    assert same(Tree())[2]["data_extents"] == 0
    inline_only = Tree()
    for i in range(50):
        inline_only.put(f"/d{i % 3}/f{i}", Inode(FileType.REG, content=b"x" * i), "t")
    inline_only.put("/d0/link", Inode(FileType.SYMLINK, target=b"f1"), "t")
    assert same(inline_only)[2]["data_extents"] == 0

    # a base: its inode numbers, dir indexes, extents and tree blocks kept
    def base_tree(p: PackWriter) -> Tree:
        t = varied(p, str(tmp_path), made_up=False)
        _shared_refs(p, t)
        return t

    base = build(tmp_path, base_tree, "base")
    layout = BaseImage(base.path).layout()
    tree, packs = made("v2")
    del tree.root.entries[b"files"].entries[b"0"].entries[b"7"]
    del tree.root.entries[b"refs"].entries[b"3"]
    tree.put("/files/0/new", Inode(FileType.REG, content=packs.put_bytes(b"n" * 3000)), "t")
    tree.put("/refs/new", Inode(FileType.REG, content=packs.put_bytes(b"many refs\n" * 900)), "t")
    same(tree, base=layout)
    packs.abort()

    tree, packs = made("zstd", "btrfs-zstd")
    assert packs.encoded is not None
    same(tree, encoded=packs.encoded)
    packs.abort()


def _random_tree(
    rng: random.Random, files: int, letters: str, depth: int, shared: int, every: tuple[int, int]
) -> Tree:
    """``files`` files at random paths up to ``depth`` deep: every ``every[0]``-th one of
    ``shared`` inodes (hardlinks in several directories), every ``every[1]``-th at a path
    that later files may make a directory's (directories reached before and after their
    siblings)."""
    tree = Tree()
    inodes = [Inode(FileType.REG) for _ in range(shared)]
    for i in range(files):
        path = "/" + "/".join(rng.choice(letters) for _ in range(rng.randint(1, depth)))
        node = rng.choice(inodes) if i % every[0] == 0 else Inode(FileType.REG)
        tree.put(f"{path}-{i}" if i % every[1] else path, node, "t")
    return tree


def _numbered(
    tree: Tree, with_native: bool, monkeypatch: pytest.MonkeyPatch, base: Any = None
) -> tuple[Any, ...]:
    """``number``'s columns, natively or by the Python passes (rows as the inodes' ids)."""
    from types import SimpleNamespace

    from btrfs_ublk_image.btrfs import numbering

    with monkeypatch.context() as m:
        if not with_native:
            m.setattr(numbering, "native", SimpleNamespace(module=lambda: None))
        num = numbering.number(tree, base)
    rows = [id(node) for node in num.inodes]
    inos = [node.ino if isinstance(node.ino, int) else None for node in num.inodes]
    return (
        rows, inos, bytes(num.parent), bytes(num.index), list(num.name),
        num.more_refs, num.child_base, num.dir_indexes, num.inos,
    )  # fmt: skip


@pytest.mark.unit
@needs_native_writer
def test_native_numbering_is_the_python_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """numbering.rs against ``number``'s Python passes: the same columns (hardlinks in
    several directories, directories reached before and after their siblings), and the
    same error for a hardlinked directory."""

    def numbered(tree: Tree, with_native: bool, base: Any = None) -> tuple[Any, ...]:
        return _numbered(tree, with_native, monkeypatch, base)

    tree = _random_tree(random.Random(5), 2000, "abcdefgh", 5, 20, (9, 5))
    ours = numbered(tree, True)
    assert ours[5] and ours[6]  # hardlinks, directories
    assert ours == numbered(tree, False)

    looped = Tree()
    sub = Inode(FileType.DIR)
    looped.put("/a/sub", sub, "t")
    looped.put("/b/again", sub, "t")
    messages = []
    for with_native, base in itertools.product((True, False), (None, _EMPTY_BASE)):
        with pytest.raises(ImageError) as err:
            numbered(looped, with_native, base)
        messages.append(str(err.value))
    assert messages == ["directory b'sub' appears twice in the tree (hardlinked dir)"] * 4


_EMPTY_BASE = BaseLayout(
    dirs={}, max_ino=0, extents={}, data_chunks=(), data_size=0, meta_start=0, breaks={},
    offsets={},
)  # fmt: skip


def _as_base(tree: Tree, base: BaseLayout) -> BaseLayout:
    """``base`` with the numbers and dir indexes ``tree`` gets on it (as base.py reads an
    image's back), for the next version of the tree."""
    from btrfs_ublk_image.btrfs.numbering import number

    num = number(tree, base)
    assert num.inos is not None
    dirs: dict[int, dict[bytes, tuple[int, int]]] = {}
    for node, ino in zip(num.inodes, num.inos, strict=True):
        if node.type is FileType.DIR:
            entries = node.entries
            names = sorted(entries)
            dirs[ino] = {
                n: (entries[n].ino, i) for n, i in zip(names, num.dir_indexes[ino], strict=True)
            }
    return dataclasses.replace(base, dirs=dirs, max_ino=max(num.inos))


def _changed(tree: Tree, rng: random.Random) -> None:
    """Renames, removals, re-added names, hardlinks split and made, directories replaced by
    files and back, new files."""
    for i in range(300):
        paths = [p for p, _ in tree.walk()][1:]
        path = rng.choice(paths)
        parent_path, _, name = path.rpartition(b"/")
        parent = tree.lookup(parent_path or b"/")
        assert parent is not None
        node = parent.entries[name]
        what = rng.randrange(7)
        if what == 0:  # renamed, maybe into another directory
            del parent.entries[name]
            tree.put(rng.choice(paths).rpartition(b"/")[0] + b"/r%d" % i, node, "t")
        elif what == 1:
            del parent.entries[name]
        elif what == 2:  # removed, then a new inode under the same name
            parent.entries[name] = Inode(FileType.SYMLINK, target=b"x")
        elif what == 3:  # another name of the same inode (a hardlink) or of a new one
            if node.type is not FileType.DIR:
                tree.put(path + b"-h%d" % i, node, "t")
        elif what == 4:  # a directory replaced by a file, a file by a directory
            if node.type is FileType.DIR:
                parent.entries[name] = Inode(FileType.REG)
            else:
                tree.put(path + b"/f%d" % i, Inode(FileType.REG), "t")
        elif what == 5:  # a hardlink split: this name gets an inode of its own
            parent.entries[name] = Inode(node.type) if node.type is not FileType.DIR else node
        else:
            tree.put(path.rpartition(b"/")[0] + b"/n%d" % i, Inode(FileType.FIFO), "t")


@pytest.mark.unit
@needs_native_writer
def test_native_numbering_on_a_base_is_the_python_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """numbering.rs's ``number_on_base`` against ``number_on_base``: the same columns on
    random trees, each numbered on the base its previous version made (renames, removals,
    re-added names, hardlinks split, directories replaced by files and back)."""
    rng = random.Random(7)
    tree = _random_tree(rng, 1500, "abcdef", 4, 30, (7, 4))
    base = _EMPTY_BASE
    for version in range(4):
        ours = _numbered(tree, True, monkeypatch, base)
        assert ours == _numbered(tree, False, monkeypatch, base), version
        assert ours[5] and len(ours[7]) > 20  # hardlinks, directories
        base = _as_base(tree, base)
        _changed(tree, rng)
        assert _numbered(tree, True, monkeypatch, base)[8] != ours[8]
