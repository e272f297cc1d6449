"""Hostile images through `ublkd mount` (issue 22): crafted meta.img and blockmap
variants of one good bundle, each breaking exactly one thing (tree-block and superblock
checksums recomputed, the manifest's digests fixed, tests/hostiletools.py), each refused
by the structural check before mount with its problem named, and none given to mount(2):
strace sees no mount syscall, the kernel log gains no line about the image's filesystem,
nothing is left attached, mounted or running (`no_leftovers`).

`btrfs check --readonly` on each crafted meta.img is the oracle that the variant is
really broken; the blockmap is ublkd's own format, which no outside tool reads.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tarfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hostiletools import (
    CHUNK_LENGTH,
    CHUNK_STRIPE0_OFFSET,
    DEV_ITEM_TOTAL_BYTES,
    DIR_NAME_LEN,
    FE_DISK_BYTENR,
    FE_OFFSET,
    FE_RAM_BYTES,
    FE_TYPE,
    HEADER_GENERATION,
    HEADER_LEVEL,
    HEADER_NRITEMS,
    HEADER_OWNER,
    INODE_NBYTES,
    ROOT_ITEM_BYTENR,
    ROOT_ITEM_GENERATION,
    ROOT_ITEM_LEVEL,
    SUPER_ROOT_LEVEL,
    SUPER_SYS_ARRAY,
    Item,
    Meta,
    kmsg_mark,
    kmsg_since,
    rewrite_blockmap,
)
from test_ublkd import UBLKD, no_leftovers, our_mounts, status, structure_record, ublkd

from btrfs_ublk_image import blockmap as bmap
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.reader import BundleReader

__all__ = ["no_leftovers"]  # the fixture, used by name

pytestmark = pytest.mark.root

MiB = 1 << 20
MANY = 400  # small files: the fs tree gets a level-1 root over ~10 leaves


@dataclass(frozen=True)
class Image:
    bundle: Path
    fsid: str
    inodes: dict[str, int]  # path -> inode number


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    """The good bundle every variant starts from: a two-level fs tree, inline files, a
    300 KB file (one regular extent), a sparse file (two extents), a symlink, an xattr."""
    work = tmp_path_factory.mktemp("hostile")
    root = work / "root"
    (root / "many").mkdir(parents=True)
    for i in range(MANY):
        (root / "many" / f"f{i:04d}").write_text(f"file {i}\n")
    (root / "big.bin").write_bytes(os.urandom(300_000))
    with open(root / "sparse.bin", "wb") as f:
        f.write(os.urandom(8192))
        f.seek(MiB)
        f.write(os.urandom(8192))
        f.truncate(3 * MiB)
    os.setxattr(root / "big.bin", "user.note", b"hello")
    (root / "link").symlink_to("big.bin")
    tarball = work / "rootfs.tar"
    # GNU tar: the sparse file as sparse members, the xattr as a PAX record
    subprocess.run(
        ["tar", "--format=pax", "--sparse", "--xattrs", "-cf", tarball, "-C", root, "."],
        check=True,
    )
    with tarfile.open(tarball) as tf:
        assert tf.getmember("./sparse.bin").pax_headers.get("GNU.sparse.major")
    spec = work / "spec.yaml"
    spec.write_text("version: 1\nname: hostile\nlayers:\n  - tar: {path: rootfs.tar}\n")
    bundle = work / "good.bundle"
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    assert btrfs_check_finds(bundle / "meta.img") == []  # the oracle accepts the good one
    with BundleReader(str(bundle)) as br:
        inodes = {p: br.lookup(p).item.ino for p in ("big.bin", "sparse.bin", "many/f0001")}
        extents = br.lookup("sparse.bin").extents
    assert [e.file_offset for e in extents] == [0, MiB]
    meta = Meta(bundle)
    assert meta.block(meta.fs_root).level == 1 and len(meta.fs_leaves()) > 5
    fsid = str(uuid.UUID(bytes=meta.fsid))
    return Image(bundle, fsid, inodes)


# --- the variants -------------------------------------------------------------------
Craft = Callable[[Path, Image], None]


def fs_item(m: Meta, want: Callable[[Item], bool]) -> Item:
    return m.find(m.fs_root, want)


def chunk_item(m: Meta, logical: int) -> Item:
    return m.find(m.sb.chunk_root, lambda it: it.key == (256, d.CHUNK_ITEM_KEY, logical))


def data_chunk(m: Meta) -> tuple[int, int, int]:
    """(logical, length, device-2 offset) of the data chunk."""
    (c,) = [c for c in m.chunks if c.type & d.BLOCK_GROUP_DATA]
    return c.logical, c.length, c.stripes[0].offset


def fs_root_item(m: Meta) -> Item:
    return m.find(m.sb.root, lambda it: it.key[:2] == (d.FS_TREE_OBJECTID, d.ROOT_ITEM_KEY))


def extent_of(m: Meta, ino: int, file_offset: int = 0) -> Item:
    return fs_item(m, lambda it: it.key == (ino, d.EXTENT_DATA_KEY, file_offset))


def dir_index_pair(m: Meta) -> tuple[Item, Item]:
    """Two neighbouring DIR_INDEX items of one leaf with names of one length (their data
    are interchangeable, so only the keys can be wrong)."""
    for b in m.fs_leaves():
        items = m.items(b)
        for a, n in zip(items, items[1:], strict=False):
            if a.key[1] == n.key[1] == d.DIR_INDEX_KEY and a.size == n.size:
                return a, n
    raise AssertionError("no DIR_INDEX pair")


def leaf(m: Meta, img: Image) -> Item:
    """Item 0 of the fs tree's third leaf."""
    return m.items(m.fs_leaves()[2])[0]


def crafted(change: Callable[[Meta, Image], None]) -> Craft:
    def craft(bundle: Path, img: Image) -> None:
        m = Meta(bundle)
        change(m, img)
        m.save()

    return craft


def in_block(change: Callable[[Item], None], pick: Callable[[Meta, Image], Item]) -> Craft:
    """Change an item (or its block's header) and write the block back, checksum fixed."""

    def craft(m: Meta, img: Image) -> None:
        it = pick(m, img)
        change(it)
        m.put(it.block)

    return crafted(craft)


def _super_root_level(m: Meta, img: Image) -> None:
    m.patch_super("<B", SUPER_ROOT_LEVEL, 8)


def _sys_chunk_array_length(m: Meta, img: Image) -> None:
    # the SYSTEM chunk's length in the superblock's copy: 2 MiB, the chunk tree says 1 MiB
    m.patch_super("<Q", SUPER_SYS_ARRAY + d.DISK_KEY_SIZE + CHUNK_LENGTH, 2 * MiB)


def _chunk_objectid(it: Item) -> None:
    it.set_key((257, it.key[1], it.key[2]))  # still the leaf's last, still sorted


def _last_chunk_item(m: Meta, img: Image) -> Item:
    last = max(c.logical for c in m.chunks)
    return chunk_item(m, last)


def _data_chunk_item(m: Meta, img: Image) -> Item:
    return chunk_item(m, data_chunk(m)[0])


def _dev2_item(m: Meta, img: Image) -> Item:
    return m.find(m.sb.chunk_root, lambda it: it.key == (1, d.DEV_ITEM_KEY, 2))


def _device_size(bundle: Path) -> int:
    return bmap.decode((bundle / "blockmap").read_bytes()).device_size


def _swap_keys(m: Meta, img: Image) -> None:
    a, n = dir_index_pair(m)
    ka, kn = a.key, n.key
    a.set_key(kn)
    n.set_key(ka)
    m.put(a.block)


def _duplicate_key(m: Meta, img: Image) -> None:
    a, n = dir_index_pair(m)
    n.set_key(a.key)
    m.put(a.block)


def _shift_data(it: Item) -> None:
    # 8 bytes later: its last 8 bytes are the item before's first
    it.set_offset_size(it.data_at - d.HEADER_SIZE + 8, it.size)


def _loop_to_itself(m: Meta, img: Image) -> None:
    root = m.block(m.fs_root)
    m.pointers(root)[3].set_child(root.bytenr)
    m.put(root)


def _two_pointers_one_leaf(m: Meta, img: Image) -> None:
    root = m.block(m.fs_root)
    p = m.pointers(root)
    p[3].set_child(p[2].child)
    m.put(root)


def _pointer_key(m: Meta, img: Image) -> None:
    root = m.block(m.fs_root)
    p = m.pointers(root)[3]
    p.set_key((p.key[0], p.key[1], p.key[2] + 1))  # between its neighbours, not its child's
    m.put(root)


def _bad_checksum(m: Meta, img: Image) -> None:
    it = leaf(m, img)
    m.img[it.block.physical + 300] ^= 0x40  # not put(): the checksum stays the old one


def _extent_tree_checksum(m: Meta, img: Image) -> None:
    # a tree our walk does not read (the extent tree): left to btrfs check
    root = m.find(m.sb.root, lambda it: it.key[:2] == (d.EXTENT_TREE_OBJECTID, d.ROOT_ITEM_KEY))
    bytenr = struct.unpack_from("<Q", root.data, ROOT_ITEM_BYTENR)[0]
    m.img[m.block(bytenr).physical + 300] ^= 0x40


def _unmapped_place(m: Meta) -> int:
    """A data-chunk address whose device-2 bytes no blockmap range maps."""
    bm = bmap.decode((m.bundle / "blockmap").read_bytes())
    end = max(r.dev_offset + r.length for r in bm.ranges)
    free = -(-end // d.SECTORSIZE) * d.SECTORSIZE
    logical, length, phys = data_chunk(m)
    assert free + 303_104 <= phys + length
    return logical + (free - phys)


def _big_extent(m: Meta, img: Image) -> Item:
    return extent_of(m, img.inodes["big.bin"])


def _extent_to_unmapped(m: Meta, img: Image) -> None:
    it = _big_extent(m, img)
    it.set("<Q", FE_DISK_BYTENR, _unmapped_place(m))
    m.put(it.block)


def _extent_past_device_2(m: Meta, img: Image) -> None:
    # the last 4 KiB of the data chunk, which ends where device 2 ends
    logical, length, phys = data_chunk(m)
    assert phys + length == _device_size(m.bundle)
    it = _big_extent(m, img)
    it.set("<Q", FE_DISK_BYTENR, logical + length - 4096)
    m.put(it.block)


def _set_u64(at: int, value: Callable[[Item], int]) -> Callable[[Item], None]:
    return lambda it: it.set("<Q", at, value(it))


def _sparse_second_extent(m: Meta, img: Image) -> Item:
    return extent_of(m, img.inodes["sparse.bin"], MiB)


def _inline_extent(m: Meta, img: Image) -> Item:
    return extent_of(m, img.inodes["many/f0001"])


def _big_inode(m: Meta, img: Image) -> Item:
    return fs_item(m, lambda it: it.key == (img.inodes["big.bin"], d.INODE_ITEM_KEY, 0))


def _dir_item(m: Meta, img: Image) -> Item:
    return fs_item(m, lambda it: it.key[1] == d.DIR_ITEM_KEY and it.key[0] == 256)


def _xattr_item(m: Meta, img: Image) -> Item:
    return fs_item(m, lambda it: it.key[:2] == (img.inodes["big.bin"], d.XATTR_ITEM_KEY))


def _rename_entry(it: Item) -> None:
    # the name's last byte changed: its hash no longer the key's offset
    at = it.data_at + d.DIR_ITEM_SIZE + it.data[DIR_NAME_LEN] - 1
    it.block.data[at] ^= 0x01


def _overlap_ranges(ranges: list[bmap.Range]) -> None:
    r = ranges[2]
    ranges[2] = bmap.Range(ranges[1].dev_offset + 4096, r.length, r.pack, r.pack_offset)


def _shorten_longest_range(ranges: list[bmap.Range]) -> None:
    # big.bin's range cut to its first 4 KiB: the rest of its extent lies on device-2
    # bytes no range maps (meta.img is untouched and passes btrfs check)
    i, r = max(enumerate(ranges), key=lambda e: e[1].length)
    ranges[i] = bmap.Range(r.dev_offset, 4096, r.pack, r.pack_offset)


def _range_past_pack(bundle: Path) -> Callable[[list[bmap.Range]], None]:
    size = bmap.decode((bundle / "blockmap").read_bytes()).packs[0].size

    def change(ranges: list[bmap.Range]) -> None:
        r = ranges[-1]
        ranges[-1] = bmap.Range(r.dev_offset, r.length, r.pack, size - r.length // 2)

    return change


@dataclass(frozen=True)
class Variant:
    name: str
    craft: Craft
    want: tuple[str, ...]  # in ublkd's error
    # None: `btrfs check --readonly` must find the crafted meta.img broken; else why not
    btrfs_check_blind: str | None = None
    # what follows the bundle's path in the error: the blockmap's parser refuses some
    refused_by: str = ": structural check: "


BLOCKMAP_ONLY = "the blockmap is ublkd's format: btrfs check never reads it"
BLOCKMAP = "/blockmap: invalid blockmap: "  # refused as the bundle is opened

VARIANTS = [
    # the superblock and the chunk tree
    Variant("super-root-level-8", crafted(_super_root_level),
            ("meta.img superblock", "tree level > 7")),
    Variant("sys-chunk-array-disagrees-with-chunk-tree", crafted(_sys_chunk_array_length),
            ("chunk at 1048576 differs between sys_chunk_array and chunk tree",),
            "btrfs check 6.2 does not compare the superblock's copy of the system chunk with "
            "the chunk tree's (the kernel maps the copy first and skips the tree's item)"),
    Variant("chunk-item-bad-objectid", in_block(_chunk_objectid, _last_chunk_item),
            ("chunk tree block", "chunk item of objectid 257"),
            "btrfs check 6.2 (and the kernel) read chunk items by key type alone; the format "
            "keys them under objectid 256, BTRFS_FIRST_CHUNK_TREE_OBJECTID"),
    Variant("data-chunk-past-device-2",
            in_block(lambda it: it.set("<Q", CHUNK_STRIPE0_OFFSET, 2 * MiB), _data_chunk_item),
            ("chunk tree: chunk at", "physical 2097152 past device 2's size 2097152")),
    Variant("chunks-overlap",
            in_block(lambda it: it.set("<Q", CHUNK_LENGTH, 2 * MiB), _data_chunk_item),
            ("chunk tree block", "chunk at 3145728 (+1048576) overlaps another chunk",)),
    Variant("dev-item-2-larger-than-device-2",
            in_block(lambda it: it.set("<Q", DEV_ITEM_TOTAL_BYTES, 4 * MiB), _dev2_item),
            ("chunk tree: devid 2 has 4194304 bytes, device 2 is 2097152",)),
    # the root tree's item for the fs tree
    Variant("fs-root-bytenr-in-no-chunk",
            in_block(lambda it: it.set("<Q", ROOT_ITEM_BYTENR, 1 << 40), lambda m, i: fs_root_item(m)),
            ("fs tree block 1099511627776: in no chunk",)),
    Variant("fs-root-bytenr-in-data-chunk",
            in_block(lambda it: it.set("<Q", ROOT_ITEM_BYTENR, 2 * MiB), lambda m, i: fs_root_item(m)),
            ("fs tree block 2097152: in a chunk of type 0x1, not metadata",)),
    Variant("fs-root-item-wrong-generation",
            in_block(lambda it: it.set("<Q", ROOT_ITEM_GENERATION, 6), lambda m, i: fs_root_item(m)),
            ("fs tree block", "generation 1, what points at it says 6")),
    Variant("fs-root-item-wrong-level",
            in_block(lambda it: it.set("<B", ROOT_ITEM_LEVEL, 0), lambda m, i: fs_root_item(m)),
            ("fs tree block", "level 1, its parent says 0")),
    # fs tree nodes: loops and pointers
    Variant("node-points-at-itself", crafted(_loop_to_itself),
            ("fs tree block", "visited twice (a loop or a shared block)")),
    Variant("two-pointers-to-one-leaf", crafted(_two_pointers_one_leaf),
            ("fs tree block", "visited twice (a loop or a shared block)")),
    Variant("pointer-key-not-its-childs-first", crafted(_pointer_key),
            ("fs tree block", "its parent says")),
    # fs tree leaves: header, keys, item layout
    Variant("leaf-bad-checksum", crafted(_bad_checksum), ("fs tree block", "checksum")),
    Variant("leaf-wrong-level", in_block(lambda it: it.block.set("<B", HEADER_LEVEL, 1), leaf),
            ("fs tree block", "level 1, its parent says 0")),
    Variant("leaf-wrong-generation",
            in_block(lambda it: it.block.set("<Q", HEADER_GENERATION, 2), leaf),
            ("fs tree block", "generation 2, what points at it says 1")),
    Variant("leaf-wrong-owner", in_block(lambda it: it.block.set("<Q", HEADER_OWNER, 7), leaf),
            ("fs tree block", "owner 7, not 5")),
    Variant("leaf-bytenr-of-another-block",
            in_block(lambda it: it.block.set("<Q", 48, it.block.bytenr + 16384), leaf),
            ("fs tree block", "header says bytenr")),
    Variant("leaf-keys-out-of-order", crafted(_swap_keys), ("fs tree block", "not after")),
    Variant("leaf-duplicate-key", crafted(_duplicate_key), ("fs tree block", "not after")),
    Variant("leaf-too-many-items",
            in_block(lambda it: it.block.set("<I", HEADER_NRITEMS, 700), leaf),
            ("fs tree block", "700 items do not fit in a leaf")),
    Variant("item-data-past-the-leaf",
            in_block(lambda it: it.set_offset_size(it.data_at - d.HEADER_SIZE, it.size + 100), leaf),
            ("fs tree block", "item 0", "outside the leaf")),
    Variant("item-size-4-GiB",
            in_block(lambda it: it.set_offset_size(it.data_at - d.HEADER_SIZE, 0xFFFFFF00), leaf),
            ("fs tree block", "item 0", "+4294967040 outside the leaf")),
    Variant("items-share-bytes", in_block(_shift_data, lambda m, i: m.items(m.fs_leaves()[2])[3]),
            ("fs tree block", "item 3", "does not end where the item before starts")),
    # fs tree items
    Variant("extent-on-unmapped-device-2-bytes", crafted(_extent_to_unmapped),
            ("fs tree block", "file extent at disk", "is mapped by no blockmap range")),
    Variant("extent-past-device-2", crafted(_extent_past_device_2),
            ("fs tree block", "(+303104): in no chunk")),
    Variant("extents-overlap",
            in_block(lambda it: it.set_key((it.key[0], it.key[1], 4096)), _sparse_second_extent),
            ("file extent at file offset 4096 overlaps the one before it, which ends at 8192",)),
    Variant("extent-offset-past-its-bytes",
            in_block(lambda it: it.set("<Q", FE_OFFSET, 4096), _big_extent),
            ("offset 4096 + 303104 bytes past its 303104 bytes",)),
    Variant("extent-bad-type", in_block(lambda it: it.set("<B", FE_TYPE, 5), _big_extent),
            ("file extent of type 5",)),
    Variant("inline-extent-larger-than-its-item",
            in_block(lambda it: it.set("<Q", FE_RAM_BYTES, 1000), _inline_extent),
            ("inline extent: ram_bytes 1000, 7 bytes inline",)),
    Variant("inode-claims-more-than-its-extents",
            in_block(_set_u64(INODE_NBYTES, lambda it: 303_104 + 4096), _big_inode),
            ("nbytes 307200 but its file extents hold 303104 bytes",)),
    Variant("dir-item-name-len-past-the-item",
            in_block(lambda it: it.set("<H", DIR_NAME_LEN, 200), _dir_item),
            ("dir item: entry at 0: name_len 200", "run past the item")),
    Variant("dir-item-name-hash-not-its-key", in_block(_rename_entry, _dir_item),
            ("dir item: entry at 0: name hash",)),
    Variant("xattr-name-len-past-the-item",
            in_block(lambda it: it.set("<H", DIR_NAME_LEN, 1000), _xattr_item),
            ("xattr item: entry at 0: name_len 1000", "run past the item")),
    # the extent tree, which only btrfs check reads
    Variant("extent-tree-bad-checksum", crafted(_extent_tree_checksum),
            ("btrfs check --readonly failed", "checksum verify failed")),
    # the blockmap
    Variant("blockmap-range-shortened", lambda b, img: rewrite_blockmap(b, _shorten_longest_range),
            ("fs tree block", "file extent at disk", "device 2 byte 1052672 is mapped by no blockmap range"),
            BLOCKMAP_ONLY),
    Variant("blockmap-ranges-overlap",
            lambda b, img: rewrite_blockmap(b, _overlap_ranges),
            ("range 2", "overlaps or precedes the previous range"), BLOCKMAP_ONLY, BLOCKMAP),
    Variant("blockmap-range-past-its-pack",
            lambda b, img: rewrite_blockmap(b, _range_past_pack(b)),
            ("range 3", "past pack 0 size"), BLOCKMAP_ONLY, BLOCKMAP),
]  # fmt: skip


# --- the test -----------------------------------------------------------------------
# what `btrfs check --readonly` prints about a filesystem it finds no fault in
CHECK_CLEAN = re.compile(
    r"Opening filesystem|Checking filesystem on|UUID:|found \d+ bytes used, no error found"
    r"|total .* bytes:|btree space waste|file data blocks allocated|referenced \d+|\[\d/7\] "
)


def btrfs_check_finds(meta_img: Path) -> list[str]:
    """What `btrfs check --readonly` reports about a meta.img: its exit status if it
    failed, and every line it prints beyond a clean run's (btrfs-progs 6.2 prints some
    faults, e.g. a chunk without its dev extent, and still exits 0)."""
    r = subprocess.run(
        ["btrfs", "check", "--readonly", "--force", meta_img],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = [
        ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip() and not CHECK_CLEAN.search(ln)
    ]
    return found + ([f"exit status {r.returncode}"] if r.returncode else [])


MOUNT_CALLS = ("mount", "fsopen", "fsconfig", "fsmount", "move_mount", "mount_setattr")


def traced_mount(
    bundle: Path, mnt: Path, trace: Path, children: bool = True
) -> subprocess.CompletedProcess[str]:
    """`ublkd mount` (fuse) under strace, which writes every mount-family syscall of it (and
    of its children: strace then waits for all of them, so not for a mount that succeeds
    and leaves its server running) to `trace`."""
    assert UBLKD is not None
    follow = ["-f"] if children else []
    return subprocess.run(
        ["strace", *follow, "-qq", "-o", trace, "-e", "trace=" + ",".join(MOUNT_CALLS), "--",
         UBLKD, "mount", bundle, mnt, "--frontend", "fuse"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def mount_calls(trace: Path) -> list[str]:
    """strace lines "[PID] call(...)" of mount-family syscalls."""
    call = re.compile(rf"^(\d+\s+)?({'|'.join(MOUNT_CALLS)})\(")
    return [ln for ln in trace.read_text().splitlines() if call.match(ln)]


def about(log: list[str], fsid: str) -> list[str]:
    """Kernel log lines of btrfs about the filesystem `fsid`: registering a device of it
    (a loop device scanned) and mounting it both name the fsid; other work on this
    machine logs btrfs lines about other filesystems, which do not count."""
    return [ln for ln in log if "btrfs" in ln.lower() and fsid in ln]


def test_kernel_log_and_strace_see_a_real_mount(no_leftovers: Path, image: Image) -> None:
    """The control: the good bundle mounts, and the same two probes the variants pass see
    it (mount syscalls in the trace, kernel lines naming its fsid), so they can fail."""
    tmp = no_leftovers
    mnt = tmp / "mnt"
    mnt.mkdir()
    trace = tmp / "strace.out"
    kmsg = kmsg_mark()
    r = traced_mount(image.bundle, mnt, trace, children=False)
    try:
        assert r.returncode == 0, r.stderr
        assert "structural check: passed in" in r.stderr, r.stderr
        assert (mnt / "many" / "f0001").read_text() == "file 1\n"
    finally:
        ublkd("umount", mnt, check=False)
    log = kmsg_since(kmsg)
    assert mount_calls(trace), trace.read_text()
    assert about(log, image.fsid), log


@pytest.mark.parametrize("v", VARIANTS, ids=[v.name for v in VARIANTS])
def test_hostile_image_refused_before_mount(no_leftovers: Path, image: Image, v: Variant) -> None:
    tmp = no_leftovers
    bundle = tmp / f"{v.name}.bundle"
    shutil.copytree(image.bundle, bundle)
    v.craft(bundle, image)
    good = (image.bundle / "manifest.json").read_bytes()
    assert (bundle / "manifest.json").read_bytes() != good, "the variant changed nothing"

    if v.btrfs_check_blind is None:
        assert btrfs_check_finds(bundle / "meta.img"), f"btrfs check accepts {v.name}"

    mnt = tmp / "mnt"
    mnt.mkdir()
    trace = tmp / "strace.out"
    kmsg = kmsg_mark()
    r = traced_mount(bundle, mnt, trace)
    log = kmsg_since(kmsg)
    assert r.returncode != 0, f"{v.name} was mounted:\n{r.stderr}"
    problem = r.stderr.strip().splitlines()[-1]
    print(problem)  # what a user sees (pytest -rP)
    assert problem.startswith("ublkd: error: ") and str(bundle) in problem, r.stderr
    assert f"{bundle}{v.refused_by}" in problem, r.stderr
    for w in v.want:
        assert w in problem, r.stderr
    # never given to mount(2): no mount syscall at all, no kernel line about this
    # filesystem (mounting it, or even a loop device of it being scanned, logs its fsid)
    assert mount_calls(trace) == []
    assert about(log, image.fsid) == []
    assert not os.path.ismount(mnt) and not our_mounts(tmp) and status() == []
    assert not structure_record(bundle).exists()
