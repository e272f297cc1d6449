"""The btrfs writer: a merged ``Tree`` -> device 1 (``meta.img``) + device 2's layout.

Order of work (each step decides the bytes named):
1. ``_number``: inode numbers (DFS, sorted names; a hardlink reuses its inode),
   dir indexes, nlink (one native call, native/src/numbering.rs). With a
   base (``BaseLayout``): a path the base has keeps its inode number and dir index, new
   ones come after the base's highest.
2. ``_DataPlacer``: every distinct ``Blob`` gets extents (<= 128 MiB) at device-2
   offsets inside DATA chunks; identical content -> one extent, many refs. With a
   base: content the base holds keeps its extents (logical and device-2 offsets),
   new content goes after the base's device-2 end.
3. ``_fs_tree_items`` (one native call when the extension has it, native/src/fsitems.rs):
   INODE_ITEM, INODE_REF, XATTR_ITEM, DIR_ITEM, DIR_INDEX,
   EXTENT_DATA for every inode, generated already sorted.
4. ``_plan_metadata``: sizes every other tree, then METADATA chunks, iterating
   until the extent tree (which lists every tree block) stops growing.
5. Addresses, real items, tree blocks, both superblocks; ``meta.img`` written (the extent
   tree's data extent items and the fs tree's leaf blocks natively when the extension has
   them: native/src/extents.rs, blocks.rs).
The result says which device-2 ranges hold which pack bytes (the blockmap).

With a base image (``BaseLayout``, ``build --base``), metadata changes stay local: every
tree breaks its blocks where the base's did (``treeblocks.Breaks``), a block beginning at
the key (and level) of a base block takes that block's address (relative to the start
of metadata), and the other blocks take the slots the base's unused blocks left, then
addresses after the base's last block. So a new version's meta.img differs from the
base's in the blocks whose items changed (and in every block header's fsid and
checksum), which is what its patch (patch.py) carries.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import os
import sys
import tempfile
import threading
import uuid
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import IO

from btrfs_ublk_native import Names, Rows

from btrfs_ublk_image import native
from btrfs_ublk_image.blockmap import Ranges
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.btrfs.encoded import COMPRESS_ZSTD, EncodedExtents
from btrfs_ublk_image.btrfs.layout import (
    CHUNK_ALIGN,
    DELTA_DATA_LOGICAL,
    DEVICE_START,
    Chunk,
    align_up,
    allocate,
    device_ranges,
    system_chunk,
)
from btrfs_ublk_image.btrfs.superblock import SuperFields, TreeRoot, pack_super
from btrfs_ublk_image.btrfs.treeblocks import (
    EMPTY_KEY,
    NO_KEYS,
    BlockPlan,
    Breaks,
    Leaf,
    TreeInfo,
    _NativeLeafPacker,
    add_dir_items,
    group_by_hash,
    iter_leaves,
    leaf_packer,
    pack_leaves,
    plan_blocks,
    plan_items,
    serialize,
    serialize_nodes,
    split_leaves,
    unspill,
)
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.tree import Blob, FileType, Inode, Sparse, Tree

GENERATION = 1
MAX_INLINE = d.SECTORSIZE - 1  # btrfs check: inline ram_bytes <= sectorsize - 1
LINK_MAX = 65535  # BTRFS_LINK_MAX
# the fs tree spill file's write buffer: one write(2) per MiB, not one per 16 KiB leaf
SPILL_BUFFER = 1 << 20
# MAX_CSUM_ITEMS of the kernel's file-item.c for 16 KiB nodes and 4-byte CRC-32C
MAX_CSUMS_PER_ITEM = (d.LEAF_DATA_SIZE - 2 * d.ITEM_SIZE) // 4 - 1

_FT = {
    FileType.REG: d.FT_REG_FILE,
    FileType.DIR: d.FT_DIR,
    FileType.CHR: d.FT_CHRDEV,
    FileType.BLK: d.FT_BLKDEV,
    FileType.FIFO: d.FT_FIFO,
    FileType.SOCK: d.FT_SOCK,
    FileType.SYMLINK: d.FT_SYMLINK,
}


@dataclass(frozen=True, slots=True)
class WriterOptions:
    inline_limit: int = 2048  # regular files up to this size become inline extents; 0: never
    label: str = ""
    fsid: uuid.UUID | None = None  # None: derived from the content
    time_ns: int = 0  # timestamps of objects the writer itself creates


@dataclass(frozen=True, slots=True)
class ImageLayout:
    fsid: uuid.UUID
    dev_uuids: tuple[uuid.UUID, uuid.UUID]
    generation: int
    meta_size: int  # device 1 == meta.img size
    data_size: int  # device 2 size
    data_ranges: Ranges  # sorted by dev_offset; the superblock range is not included
    data_super: bytes  # device 2's superblock (4096 bytes at SUPER_INFO_OFFSET)
    stats: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BaseLayout:
    """What a build with a base (``build --base``) keeps of the base's layout, read once from
    the base's meta.img (``base.py``): its inode numbering and data extents (steps 1-2 of
    the module's docstring) and its tree blocks (see the docstring's last paragraph)."""

    # base directory inode -> name -> (inode number, dir index) of each entry
    dirs: Mapping[int, Mapping[bytes, tuple[int, int]]]
    max_ino: int  # new inodes are numbered after it
    # content -> its extents in the base: (file offset, logical, disk bytes, device-2 offset)
    extents: Mapping[Blob, Sequence[tuple[int, int, int, int]]]
    data_chunks: Sequence[Chunk]  # the base's DATA chunks
    data_size: int  # the base's device-2 size: new extents go after it
    meta_start: int  # where the base's METADATA chunks start in the logical space
    breaks: Mapping[int, Breaks]  # tree id -> its blocks' first keys, level by level
    # (tree id, level, first key) -> the block's address - ``meta_start``
    offsets: Mapping[tuple[int, int, d.Key], int]


class _Numbering:
    """Inode numbers and the names that point at each inode.

    Kept as flat arrays, one row per inode in number order: an image's writer holds
    them for every entry at once, so a row costs a few machine words, not objects.
    Without a base an inode's number is its row (+ FIRST_FREE_OBJECTID); ``Inode.ino``
    holds it only for directories and hardlinked files (``once`` marks every other
    inode), and a directory's new children (those not named earlier) take consecutive
    numbers from ``child_base``, so ``child_inos`` finds every child's number without an
    int object per inode. With a base numbers have gaps: ``inos`` holds each row's and
    ``Inode.ino`` every inode's.
    """

    __slots__ = (
        "child_base",
        "dir_indexes",
        "index",
        "inodes",
        "inos",
        "more_refs",
        "name",
        "once",
        "parent",
    )

    def __init__(self, root: Inode, once: object) -> None:
        self.once = once  # this numbering's mark of an inode with one name
        # row -> inode: the natively numbered rows name a directory's entries and a slot
        # (no object for a child held inline there); reading a row from Python promotes it
        self.inodes = Rows([root])
        self.inos: array[int] | None = None  # row -> inode number, with a base
        # with a base: dir ino -> its entries' dir indexes in name order (else 2, 3, ...)
        self.dir_indexes: dict[int, array[int]] = {}
        # the first name of each inode: parent dir's ino, dir index, name
        self.parent = array("Q", [d.FIRST_FREE_OBJECTID])
        self.index = array("Q", [0])
        self.name = Names([b".."])
        # hardlinks: ino -> its other names (parent ino, index, name)
        self.more_refs: dict[int, list[tuple[int, int, bytes]]] = {}
        self.child_base: dict[int, int] = {}  # dir ino -> the number of its first new child

    def refs(self, n: int, ino: int) -> list[tuple[int, int, bytes]]:
        """Every name of inode ``ino`` (row ``n``)."""
        return [(self.parent[n], self.index[n], self.name[n]), *self.more_refs.get(ino, ())]

    def child_inos(self, dir_ino: int, children: Iterable[Inode]) -> Iterator[int]:
        """The numbers of a directory's children, given in sorted name order."""
        if self.inos is not None:  # with a base: every inode holds its number
            for child in children:
                assert isinstance(child.ino, int)
                yield child.ino
            return
        once, k = self.once, self.child_base[dir_ino]
        for child in children:
            ino = child.ino
            if ino is once:
                yield k
                k += 1
                continue
            assert isinstance(ino, int)
            if ino == k:  # numbered here (a directory, or a hardlink's first name)
                k += 1
            yield ino


def inline_max(opts: WriterOptions) -> int:
    """Largest regular file stored inline; the pack writer keeps files this small in memory."""
    return min(max(opts.inline_limit, 0), MAX_INLINE)


def _kernel_rdev(rdev: int) -> int:
    # btrfs stores the kernel's dev_t: MKDEV(major, minor) = major << 20 | minor
    return (os.major(rdev) << 20) | os.minor(rdev)


def _number(tree: Tree, base: BaseLayout | None = None) -> _Numbering:
    """DFS, sorted names; a directory's new children take consecutive numbers when it is
    reached; a hardlink reuses its inode's number. With a base: see ``_number_on_base``."""
    # pass 1: which inodes have more than one name (marks of this run: whatever ``ino``
    # held before is overwritten)
    once, more = object(), object()
    root = tree.root
    nat = native.module()
    # both passes in the extension (native/src/numbering.rs): the same columns and errors
    if nat is not None and base is None and hasattr(nat, "number_inodes"):
        num = _Numbering(root, once)
        nat.number_inodes(root, num, more)
        return num
    if nat is not None and base is not None and hasattr(nat, "number_on_base"):
        num = _Numbering(root, once)
        nat.number_on_base(root, num, more, base.dirs, base.max_ino)
        return num
    root.ino = once
    stack = [root]
    while stack:
        for name, child in stack.pop().entries.items():
            mark = child.ino
            if mark is once:
                if child.type is FileType.DIR:
                    raise ImageError(
                        f"directory {name!r} appears twice in the tree (hardlinked dir)"
                    )
                child.ino = more
            elif mark is not more:
                child.ino = once
                if child.type is FileType.DIR:
                    stack.append(child)
    # pass 2: numbers
    first = d.FIRST_FREE_OBJECTID
    root.ino = first
    num = _Numbering(root, once)
    if base is not None:
        return _number_on_base(num, base, more)
    inodes, parents, indexes, names = num.inodes, num.parent, num.index, num.name
    dirs = [(root, first)]
    while dirs:
        parent, pino = dirs.pop()
        entries = parent.entries
        num.child_base[pino] = first + len(inodes)
        pending: list[tuple[Inode, int]] = []
        for index, name in enumerate(sorted(entries), start=2):
            child = entries[name]
            mark = child.ino
            if mark is not once and mark is not more:  # numbered already: another name
                assert isinstance(mark, int)
                num.more_refs.setdefault(mark, []).append((pino, index, name))
                continue
            ino = first + len(inodes)
            if child.type is FileType.DIR:
                child.ino = ino
                pending.append((child, ino))
            elif mark is more:
                child.ino = ino
            inodes.append(child)
            parents.append(pino)
            indexes.append(index)
            names.append(name)
        dirs.extend(reversed(pending))
    return num


def _number_on_base(num: _Numbering, base: BaseLayout, more: object) -> _Numbering:
    """Pass 2 of ``_number`` with a base: a name the base has (same parent directory,
    same name) keeps its dir index, and its inode keeps the base's number unless an
    inode reached earlier took it (hardlinks split). A new inode takes the number and dir
    index of a name its directory lost (the removed names', in name order, to the new
    names, in name order; only numbers the base gave one name), so a renamed or re-added
    file's items stay where the base had them in the fs tree instead of moving to its end;
    other new names get dir indexes after the highest of their directory in the base,
    their inodes numbers after the base's highest. Same DFS as without a base. The
    reference (and ``BUI_NATIVE=0``'s path) for numbering.rs's ``number_on_base``."""
    once, first = num.once, d.FIRST_FREE_OBJECTID
    inodes, parents, indexes, names = num.inodes, num.parent, num.index, num.name
    inos = array("Q", [first])
    taken = {first}
    next_ino = max(base.max_ino, first) + 1
    named = Counter(ino for entries in base.dirs.values() for ino, _ in entries.values())
    dirs: list[tuple[Inode, int]] = [(inodes[0], first)]
    while dirs:
        parent, pino = dirs.pop()
        entries = parent.entries
        old = base.dirs.get(pino)  # the same path's directory in the base, if it was one
        next_index = 2 if not old else max(i for _, i in old.values()) + 1
        pending: list[tuple[Inode, int]] = []
        dir_indexes = num.dir_indexes[pino] = array("Q")
        # (number, dir index) of the names this directory lost, popped from the end
        freed = (
            []
            if old is None
            else [was for n, was in sorted(old.items()) if n not in entries and named[was[0]] == 1]
        )
        freed.reverse()
        for name in sorted(entries):
            child = entries[name]
            was = None if old is None else old.get(name)
            mark = child.ino
            numbered = mark is not once and mark is not more  # another name's inode
            lost = None
            if was is None and not numbered:
                while freed and freed[-1][0] in taken:
                    freed.pop()
                lost = freed.pop() if freed else None
            if was is not None:
                index = was[1]
            elif lost is not None:
                index = lost[1]
            else:
                index, next_index = next_index, next_index + 1
            dir_indexes.append(index)
            if numbered:
                assert isinstance(mark, int)
                num.more_refs.setdefault(mark, []).append((pino, index, name))
                continue
            if was is not None and was[0] not in taken:
                ino = was[0]
            elif lost is not None:
                ino = lost[0]
            else:
                ino, next_ino = next_ino, next_ino + 1
            taken.add(ino)
            child.ino = ino
            if child.type is FileType.DIR:
                pending.append((child, ino))
            inodes.append(child)
            inos.append(ino)
            parents.append(pino)
            indexes.append(index)
            names.append(name)
        dirs.extend(reversed(pending))
    # rows in number order: the fs tree's items are made in that order
    order = sorted(range(len(inos)), key=inos.__getitem__)
    num.inodes = Rows(inodes[i] for i in order)
    num.inos = array("Q", [inos[i] for i in order])
    num.parent = array("Q", [parents[i] for i in order])
    num.index = array("Q", [indexes[i] for i in order])
    num.name = Names(names[i] for i in order)
    return num


def _free_ranges(chunk: Chunk, taken: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The free ranges (logical, length) of ``chunk`` around ``taken`` (sorted ranges in it)."""
    free: list[tuple[int, int]] = []
    at = chunk.logical
    for start, length in taken:
        if start > at:
            free.append((at, start - at))
        at = max(at, start + length)
    if at < chunk.end:
        free.append((at, chunk.end - at))
    return free


class _DataPlacer:
    """Lays extents out on device 2, chunk after chunk, in first-use order.

    Extents are rows of flat arrays in placement order; a blob's extents are
    consecutive rows, the first with file offset 0. Without a base, placement order is
    also logical and device order. With a base (``base``), content the base holds gets
    its base extents (in the base's chunks, kept) and new content new chunks after the
    base's device-2 end, at logical ``DELTA_DATA_LOGICAL + device offset`` (clear of the
    base's metadata, which stays where it was); ``order`` then lists the rows in logical
    (and device) order.
    """

    def __init__(
        self,
        data_logical: int,
        encoded: EncodedExtents | None = None,
        base: BaseLayout | None = None,
    ) -> None:
        self.chunks: list[Chunk] = []
        self.base = base
        self.order: Sequence[int] = range(0)  # rows in logical order, set by finish()
        # btrfs-zstd: blobs stored as btrfs extents (their own cut, compressed or not,
        # checksummed); these columns are filled only then
        self.encoded = encoded
        self.num_bytes = array("Q")  # file bytes the extent holds (= ram_bytes), sector-aligned
        self.compression = array("B")
        self.csum_first = array("Q")  # its first sector's CRC in encoded.csums
        self.first_extent: dict[Blob, int] = {}  # blob -> row of its first extent
        self.logical = array("Q")
        self.disk_bytes = array("Q")  # on disk, 4 KiB aligned
        self.file_offset = array("Q")
        self.dev_offset = array("Q")  # device 2 physical
        self.length = array("Q")  # bytes of content (the rest of disk_bytes is zeros)
        self.pack = array("Q")
        self.pack_offset = array("Q")
        self._ranges_iter = device_ranges(DEVICE_START if base is None else base.data_size)
        self._logical = data_logical
        self._cur = 0  # physical cursor
        self._end = 0  # physical end of the current chunk range
        self._chunk_phys = 0
        self._chunk_logical = 0
        self.used = 0

    def _next_chunk(self) -> None:
        self._close_chunk()
        self._chunk_phys, self._end = next(self._ranges_iter)
        self._cur = self._chunk_phys
        if self.base is not None:
            self._logical = DELTA_DATA_LOGICAL + self._chunk_phys
        self._chunk_logical = self._logical

    def _close_chunk(self) -> None:
        if self._end:
            length = align_up(self._cur - self._chunk_phys, CHUNK_ALIGN)
            if length:
                self.chunks.append(
                    Chunk(self._chunk_logical, length, d.BLOCK_GROUP_DATA, 2, self._chunk_phys)
                )
                self._logical += length

    @property
    def fresh(self) -> bool:
        """Nothing placed yet (``adopt`` takes over only from a fresh placer)."""
        return not self.logical and not self._end

    def adopt(
        self, chunks: Sequence[tuple[int, int, int]], state: tuple[int, int, int, int, int, int]
    ) -> None:
        """Take over what the native fs tree loop placed into this (fresh) placer's columns:
        its closed chunks (logical, length, physical) and its cursors, as if ``place`` had
        placed those extents."""
        self.chunks.extend(
            Chunk(logical, length, d.BLOCK_GROUP_DATA, 2, phys) for logical, length, phys in chunks
        )
        self._cur, self._end, self._chunk_phys, self._chunk_logical, self._logical, self.used = (
            state
        )
        # where the next chunk would start had ``place`` placed these extents
        self._ranges_iter = device_ranges(self._end or DEVICE_START)

    def place(self, blob: Blob) -> range:
        """The rows of ``blob``'s extents (placed on first use)."""
        first = self.first_extent.get(blob)
        if first is not None:
            end, offsets = first + 1, self.file_offset
            while end < len(offsets) and offsets[end] != 0:
                end += 1
            return range(first, end)
        size = blob.size
        if size == 0:
            return range(0)
        first = len(self.logical)
        if self.encoded is not None:
            self._place_encoded(blob)
            self.first_extent[blob] = first
            return range(first, len(self.logical))
        held = None if self.base is None else self.base.extents.get(blob)
        if held is not None:  # where the base has it
            for file_offset, logical, disk, dev_offset in held:
                self.logical.append(logical)
                self.disk_bytes.append(disk)
                self.file_offset.append(file_offset)
                self.dev_offset.append(dev_offset)
                self.length.append(min(disk, size - file_offset))
                self.pack.append(blob.pack)
                self.pack_offset.append(blob.offset + file_offset)
                self.used += disk
            self.first_extent[blob] = first
            return range(first, len(self.logical))
        done = 0
        while done < size:
            if self._cur >= self._end:
                self._next_chunk()
            disk = min(
                align_up(size - done, d.SECTORSIZE), d.MAX_EXTENT_SIZE, self._end - self._cur
            )
            length = min(disk, size - done)
            self.logical.append(self._chunk_logical + (self._cur - self._chunk_phys))
            self.disk_bytes.append(disk)
            self.file_offset.append(done)
            self.dev_offset.append(self._cur)
            self.length.append(length)
            self.pack.append(blob.pack)
            self.pack_offset.append(blob.offset + done)
            self._cur += disk
            self.used += disk
            done += length
        self.first_extent[blob] = first
        return range(first, len(self.logical))

    def _place_encoded(self, blob: Blob) -> None:
        assert self.encoded is not None
        extents = self.encoded.extents(blob.pack, blob.offset)
        if extents is None:
            raise AssertionError(f"blob at pack {blob.pack} offset {blob.offset} has no extents")
        done = 0
        for e in extents:
            disk = e.disk_bytes
            if self._cur + disk > self._end:  # an extent never crosses a chunk's end
                self._next_chunk()
            self.logical.append(self._chunk_logical + (self._cur - self._chunk_phys))
            self.disk_bytes.append(disk)
            self.file_offset.append(done)
            self.dev_offset.append(self._cur)
            self.length.append(e.stored)  # the padding to ``disk`` reads as zeros
            self.pack.append(blob.pack)
            self.pack_offset.append(e.pack_offset)
            self.num_bytes.append(e.ram_bytes)
            self.compression.append(COMPRESS_ZSTD if e.zstd else 0)
            self.csum_first.append(e.csum_first)
            self._cur += disk
            self.used += disk
            done += e.length

    def csum_items(self) -> list[tuple[d.Key, bytes]]:
        """The csum tree: a CRC-32C per stored sector of every extent (btrfs-zstd only),
        one item per run of contiguous extents, at most ``MAX_CSUMS_PER_ITEM`` each."""
        if self.encoded is None:
            return []
        csums = self.encoded.csums
        items: list[tuple[d.Key, bytes]] = []
        run_start, run = 0, array("I")

        def flush() -> None:
            for i in range(0, len(run), MAX_CSUMS_PER_ITEM):
                part = run[i : i + MAX_CSUMS_PER_ITEM]
                if sys.byteorder == "big":
                    part.byteswap()
                key = (d.EXTENT_CSUM_OBJECTID, d.EXTENT_CSUM_KEY, run_start + i * d.SECTORSIZE)
                items.append((key, part.tobytes()))

        for logical, disk, first in zip(
            self.logical, self.disk_bytes, self.csum_first, strict=True
        ):
            if logical != run_start + len(run) * d.SECTORSIZE:
                flush()
                run_start, run = logical, array("I")
            run.extend(csums[first : first + disk // d.SECTORSIZE])
        flush()
        return items

    def finish(self) -> list[Chunk]:
        """The DATA chunks, in logical order (with a base: the base's that hold an extent
        of this image, then the new ones)."""
        self._close_chunk()
        self.first_extent = {}  # placing is over
        n = len(self.logical)
        self.order = range(n)
        if self.base is not None:
            logical = self.logical
            self.order = array("Q", sorted(range(n), key=logical.__getitem__))
            new_chunks, self.chunks = self.chunks, []
            rows = iter(self.order)
            row = next(rows, None)
            for c in sorted(self.base.data_chunks, key=lambda c: c.logical):
                if row is not None and logical[row] < c.logical:
                    raise ImageError(f"base: data extent at logical {logical[row]} is in no chunk")
                if row is not None and logical[row] < c.end:
                    self.chunks.append(c)
                while row is not None and logical[row] < c.end:
                    row = next(rows, None)
            self.chunks.extend(new_chunks)
            prev_end = prev_dev = 0
            for row in self.order:  # only a damaged base has overlapping extents
                if logical[row] < prev_end or self.dev_offset[row] < prev_dev:
                    raise ImageError(f"base: data extents overlap at logical {logical[row]}")
                prev_end = logical[row] + self.disk_bytes[row]
                prev_dev = self.dev_offset[row] + self.disk_bytes[row]
        if not self.chunks:  # no data at all: still one (empty) DATA block group
            self.chunks.append(
                Chunk(self._logical, CHUNK_ALIGN, d.BLOCK_GROUP_DATA, 2, DEVICE_START)
            )
        self._end = 0
        return self.chunks

    def block_groups(self, chunks: Sequence[Chunk]) -> dict[int, list[tuple[int, int]]]:
        """Free ranges (logical, length) of each DATA chunk (by its logical address): the
        gaps between its extents and its tail."""
        nat = native.module()
        if nat is not None and hasattr(nat, "data_free_ranges"):  # the same loop, natively
            order = None if isinstance(self.order, range) else self.order
            bounds = [(c.logical, c.end) for c in chunks]
            free_of = nat.data_free_ranges(self.logical, self.disk_bytes, order, bounds)
            return {c.logical: free for c, free in zip(chunks, free_of, strict=True)}
        free: dict[int, list[tuple[int, int]]] = {}
        logical, disk = self.logical, self.disk_bytes
        rows = iter(self.order)
        row = next(rows, None)
        for c in chunks:
            taken: list[tuple[int, int]] = []
            while row is not None and logical[row] < c.end:
                taken.append((logical[row], disk[row]))
                row = next(rows, None)
            free[c.logical] = _free_ranges(c, taken)
        if row is not None:
            raise AssertionError(f"data extent at logical {logical[row]} is in no chunk")
        return free

    @property
    def ranges(self) -> Ranges:
        """The extents' device-2 ranges in device order (only the columns they need stay
        alive with the layout)."""
        order = self.order
        if isinstance(order, range):  # without a base: placement order is device order
            return Ranges(self.dev_offset, self.length, self.pack, self.pack_offset)
        return Ranges(
            *(
                array("Q", map(col.__getitem__, order))
                for col in (self.dev_offset, self.length, self.pack, self.pack_offset)
            )
        )


@dataclass(slots=True)
class _FsTree:
    leaves: list[Leaf]  # packed as generated: the items never sit in memory as a list
    # (their payloads spilled to a file when the writer gives one)
    digest: bytes  # sha256 over every item (key + data): the content the fsid derives from
    placer: _DataPlacer  # the data extents
    # file extent refs, one row each, in inode order: the extent's row and the inode
    ref_extent: array[int]
    ref_ino: array[int]
    ref_offset: array[int]  # the file offset the ref maps the extent at
    stats: dict[str, int]


# the fs tree's counts, in the order both loops give them
_FS_TREE_STATS = (
    "files",
    "directories",
    "symlinks",
    "devices",
    "hardlinks",
    "inline_files",
    "content_bytes",
)


def _fs_tree_items(
    num: _Numbering,
    placer: _DataPlacer,
    imax: int,
    spill: IO[bytes] | None = None,
    breaks: Sequence[d.Key] = NO_KEYS,
) -> _FsTree:
    # with the sha256 over every item's disk key and data, in order
    packer = leaf_packer(spill, digest=True, breaks=breaks)
    nat = native.module()
    if nat is not None and isinstance(packer, _NativeLeafPacker) and hasattr(nat, "fs_tree_items"):
        return _fs_tree_items_native(nat, num, placer, imax, packer)
    gen = GENERATION
    add, add_inode, add_dir = packer.add, packer.add_inode, packer.add_dir
    ref_extent = array("Q")
    ref_ino = array("Q")
    ref_offset = array("Q")
    files = directories = symlinks = devices = hardlinks = inline_files = content_bytes = 0
    ext_logical, ext_disk, ext_offset = placer.logical, placer.disk_bytes, placer.file_offset
    more_refs = num.more_refs
    reg, dir_, symlink = FileType.REG, FileType.DIR, FileType.SYMLINK
    extent_data_key = d.EXTENT_DATA_KEY
    # btrfs-zstd: datasum inodes (compressed extents need checksums), extents of their own
    encoded = placer.encoded is not None
    ext_num, ext_comp = placer.num_bytes, placer.compression
    reg_flags = 0 if encoded else d.INODE_NODATASUM | d.INODE_NODATACOW
    inos, first, dir_indexes = num.inos, d.FIRST_FREE_OBJECTID, num.dir_indexes
    for n, node in enumerate(num.inodes):
        ino = n + first if inos is None else inos[n]
        ftype, perm, uid, gid, xattrs = node.meta()
        size, nbytes, flags = 0, 0, 0
        more = more_refs.get(ino)
        nlink = 1 if more is None else 1 + len(more)
        file_extents: list[tuple[d.Key, bytes]] = []
        entries: Mapping[bytes, Inode] = {}
        rdev = 0
        if ftype is reg:
            files += 1
            flags = reg_flags
            content = node.content
            if isinstance(content, Blob | Sparse):
                # a sparse file: extents for its data segments only, holes have no item
                segments = ((0, content),) if isinstance(content, Blob) else content.segments
                size = content.size
                for seg_offset, blob in segments:
                    for row in placer.place(blob):
                        offset = seg_offset + ext_offset[row]
                        if encoded:
                            held = ext_num[row]
                            item = d.pack_file_extent_reg(
                                gen, ext_logical[row], ext_disk[row], held, ext_comp[row]
                            )
                        else:
                            held = ext_disk[row]
                            item = d.pack_file_extent_reg(gen, ext_logical[row], held)
                        file_extents.append(((ino, extent_data_key, offset), item))
                        ref_extent.append(row)
                        ref_ino.append(ino)
                        ref_offset.append(offset)
                        nbytes += held
            elif content:
                if len(content) > imax:
                    raise AssertionError("in-memory content larger than the inline limit")
                size = nbytes = len(content)
                inline_files += 1
                file_extents.append(
                    ((ino, extent_data_key, 0), d.pack_file_extent_inline(gen, content))
                )
            content_bytes += size
            hardlinks += nlink - 1
        elif ftype is symlink:
            symlinks += 1
            target = node.target
            if not target or len(target) > MAX_INLINE:
                raise ImageError(
                    f"symlink target of inode {ino} is empty or longer than {MAX_INLINE} bytes"
                )
            size = nbytes = len(target)
            file_extents.append(((ino, extent_data_key, 0), d.pack_file_extent_inline(gen, target)))
        elif ftype is dir_:
            directories += 1
            entries = node.entries
            size = 2 * sum(map(len, entries))
        else:
            devices += 1
            if ftype is FileType.CHR or ftype is FileType.BLK:
                rdev = _kernel_rdev(node.rdev)
        if nlink > LINK_MAX:
            raise ImageError(f"inode {ino} has {nlink} hardlinks; btrfs allows {LINK_MAX}")
        mtime, atime, ctime = node.times()
        add_inode(
            ino, gen, size, nbytes, 1 if ftype is dir_ else nlink, uid, gid,
            int(ftype) | (perm & 0o7777), rdev, flags, mtime if atime is None else atime,
            mtime if ctime is None else ctime, mtime, mtime,
            (num.parent[n], num.index[n], num.name[n]) if nlink == 1 else None,
        )  # fmt: skip
        if nlink != 1:
            # names per parent dir in one INODE_REF item while it fits in a leaf, the rest in
            # INODE_EXTREF items (EXTENDED_IREF), as the kernel does when a ref item is full
            by_parent: dict[int, bytes] = {}
            extrefs: dict[int, bytes] = {}
            for parent, index, name in sorted(num.refs(n, ino)):
                ref = d.pack_inode_ref(index, name)
                data = by_parent.get(parent, b"")
                if len(data) + len(ref) <= d.MAX_ITEM_DATA:
                    by_parent[parent] = data + ref
                else:
                    h = d.extref_hash(parent, name)
                    extrefs[h] = extrefs.get(h, b"") + d.pack_inode_extref(parent, index, name)
            for parent, data in sorted(by_parent.items()):
                add((ino, d.INODE_REF_KEY, parent), data)
            for h, data in sorted(extrefs.items()):
                add((ino, d.INODE_EXTREF_KEY, h), data)
        if xattrs:
            xattr_items = []
            for name, value in xattrs.items():
                if len(name) + len(value) > d.MAX_XATTR_SIZE or not name or len(name) > 255:
                    raise ImageError(f"xattr {name[:60]!r} of inode {ino}: name or value too large")
                xattr_items.append(
                    (d.name_hash(name), d.pack_dir_item((0, 0, 0), gen, d.FT_XATTR, name, value))
                )
            for h, data in group_by_hash(xattr_items):
                add((ino, d.XATTR_ITEM_KEY, h), data)
        if entries:
            names = sorted(entries)
            children = [entries[name] for name in names]
            child_inos = list(num.child_inos(ino, children))
            ftypes = bytes([_FT[child.type] for child in children])
            indexes = dir_indexes.get(ino)
            if indexes is None or indexes.tolist() == list(range(2, 2 + len(names))):
                add_dir(ino, gen, names, child_inos, ftypes)
            else:  # a base's indexes: not 2, 3, ... in name order
                add_dir_items(add, ino, gen, names, child_inos, ftypes, indexes)
        for key, data in file_extents:
            add(key, data)
    counts = (files, directories, symlinks, devices, hardlinks, inline_files, content_bytes)
    stats = dict(zip(_FS_TREE_STATS, counts, strict=True))
    leaves, digest = packer.finish()
    assert digest is not None
    return _FsTree(leaves, digest, placer, ref_extent, ref_ino, ref_offset, stats)


def _fs_tree_items_native(
    nat: ModuleType, num: _Numbering, placer: _DataPlacer, imax: int, packer: _NativeLeafPacker
) -> _FsTree:
    """``_fs_tree_items``'s loop in the extension (native/src/fsitems.rs): the same items,
    errors and placement. A fresh placer without a base or encoded extents places there
    too (its columns and state come back here); otherwise the extension calls ``place``."""
    encoded = placer.encoded is not None
    native_placement = placer.base is None and not encoded and placer.fresh
    ref_extent, ref_ino, ref_offset = array("Q"), array("Q"), array("Q")
    stats, placed = nat.fs_tree_items(
        packer.native,
        num,
        placer,
        native_placement,
        imax,
        encoded,
        GENERATION,
        0 if encoded else d.INODE_NODATASUM | d.INODE_NODATACOW,
        (ref_extent, ref_ino, ref_offset),
    )
    if placed is not None:
        placer.adopt(*placed)
    leaves, digest = packer.finish()
    assert digest is not None
    return _FsTree(
        leaves,
        digest,
        placer,
        ref_extent,
        ref_ino,
        ref_offset,
        dict(zip(_FS_TREE_STATS, stats, strict=True)),
    )


# the size of an EXTENT_ITEM with one flags word, of an inline data ref, of a keyed one
_EXTENT_HEAD_SIZE = 24
_INLINE_DATA_REF_SIZE = 29
_DATA_REF_SIZE = 28
_INLINE_ROOM = (d.MAX_EXTENT_ITEM_SIZE - _EXTENT_HEAD_SIZE) // _INLINE_DATA_REF_SIZE


class _DataExtentItems:
    """The extent tree's items for data extents (EXTENT_ITEM with its refs inline while
    they fit, else keyed EXTENT_DATA_REF items), made on demand from the placer's rows.

    ``refs`` groups the fs tree's file extent refs by extent (rows ``start[e]`` ..
    ``start[e + 1]`` of ``ino``), as flat arrays."""

    def __init__(self, fs: _FsTree) -> None:
        placer = fs.placer
        self.logical, self.disk_bytes, self.order = placer.logical, placer.disk_bytes, placer.order
        n = len(self.logical)
        start = array("Q", bytes(8 * (n + 1)))
        for e in fs.ref_extent:
            start[e + 1] += 1
        for e in range(n):
            start[e + 1] += start[e]
        fill = array("Q", start[:n])
        ino = array("Q", bytes(8 * len(fs.ref_ino)))
        offset = array("Q", bytes(8 * len(fs.ref_ino)))
        for e, i, o in zip(fs.ref_extent, fs.ref_ino, fs.ref_offset, strict=True):
            ino[fill[e]] = i
            offset[fill[e]] = o
            fill[e] += 1
        self.start, self.ino, self.offset = start, ino, offset

    def sizes(self) -> Iterator[tuple[d.Key, int]]:
        """(key, item size) of every item, keyed refs with a stand-in offset: enough to
        order them among other extent tree items (their objectid and type decide)."""
        start, disk_bytes, logicals = self.start, self.disk_bytes, self.logical
        for e in self.order:
            logical = logicals[e]
            nrefs = start[e + 1] - start[e]
            key = (logical, d.EXTENT_ITEM_KEY, disk_bytes[e])
            if nrefs <= _INLINE_ROOM:
                yield key, _EXTENT_HEAD_SIZE + nrefs * _INLINE_DATA_REF_SIZE
                continue
            yield key, _EXTENT_HEAD_SIZE
            for _ in range(nrefs):
                yield (logical, d.EXTENT_DATA_REF_KEY, 0), _DATA_REF_SIZE

    def leaf_firsts(self, others: list[tuple[d.Key, int]], breaks: Sequence[d.Key]) -> list[d.Key]:
        """The first key of each leaf of the extent tree: these items (``sizes``) merged with
        ``others`` ((key, item size), sorted), split as ``split_leaves`` does."""
        return split_leaves(heapq.merge(self.sizes(), others, key=_item_key), breaks)

    def leaves(self, others: list[tuple[d.Key, bytes]], breaks: Sequence[d.Key]) -> Iterator[Leaf]:
        """The extent tree's leaves: these items, made as they are consumed, merged with
        ``others`` (sorted)."""
        return iter_leaves(heapq.merge(self.items(), others, key=_item_key), breaks)

    def items(self) -> Iterator[tuple[d.Key, bytes]]:
        gen = GENERATION
        root = d.FS_TREE_OBJECTID
        start, inos, offsets, logicals = self.start, self.ino, self.offset, self.logical
        for e in self.order:
            logical = logicals[e]
            refs = inos[start[e] : start[e + 1]]
            head = d.pack_extent_item(len(refs), gen, d.EXTENT_FLAG_DATA)
            key = (logical, d.EXTENT_ITEM_KEY, self.disk_bytes[e])
            if len(refs) == 1:  # nearly every extent: one inline ref, no order to sort out
                yield key, head + d.pack_inline_data_ref(root, refs[0], offsets[start[e]], 1)
                continue
            hashed = sorted(
                (
                    (d.extent_data_ref_hash(root, ino, off), ino, off)
                    for ino, off in zip(refs, offsets[start[e] : start[e + 1]], strict=True)
                ),
                reverse=True,  # inline data refs: descending hash (tree-checker)
            )
            if len(refs) <= _INLINE_ROOM:
                body = b"".join(d.pack_inline_data_ref(root, ino, off, 1) for _, ino, off in hashed)
                yield key, head + body
                continue
            yield key, head
            used: set[int] = set()
            keyed = []
            for h, ino, off in sorted(hashed):
                while h in used:  # a hash collision takes the next free offset, as the kernel does
                    h += 1
                used.add(h)
                keyed.append(
                    ((logical, d.EXTENT_DATA_REF_KEY, h), d.pack_extent_data_ref(root, ino, off, 1))
                )
            yield from sorted(keyed)


class _NativeDataExtentItems:
    """``_DataExtentItems`` in the extension (native/src/extents.rs): the same leaf split
    and leaves, no Python object per extent."""

    def __init__(self, nat: ModuleType, fs: _FsTree) -> None:
        placer = fs.placer
        order = None if isinstance(placer.order, range) else placer.order
        refs = (fs.ref_extent, fs.ref_ino, fs.ref_offset)
        self._native = nat.DataExtents(placer.logical, placer.disk_bytes, order, refs, GENERATION)

    def leaf_firsts(self, others: list[tuple[d.Key, int]], breaks: Sequence[d.Key]) -> list[d.Key]:
        firsts: list[d.Key] = self._native.leaf_firsts(others, list(breaks))
        return firsts

    def write_leaves(
        self,
        others: list[tuple[d.Key, bytes]],
        breaks: Sequence[d.Key],
        out_fd: int,
        places: list[tuple[int, int]],
        ids: tuple[bytes, bytes],
    ) -> list[d.Key]:
        """The extent tree's leaves (these items merged with ``others``) written as blocks to
        ``out_fd`` at ``places`` (each block's address and offset there, the leaves taking
        the first ones), each as soon as it is full: their first keys."""
        tree_id = d.EXTENT_TREE_OBJECTID
        firsts: list[d.Key] = self._native.write_leaves(
            others, list(breaks), out_fd, places, tree_id, GENERATION, *ids
        )
        return firsts


def _data_extent_items(fs: _FsTree) -> _DataExtentItems | _NativeDataExtentItems:
    """The extent tree's data extent items: the extension's when it has them."""
    nat = native.module()
    if nat is not None and hasattr(nat, "DataExtents"):
        return _NativeDataExtentItems(nat, fs)
    return _DataExtentItems(fs)


def _derive_uuid(seed: bytes, purpose: bytes) -> uuid.UUID:
    raw = bytearray(hashlib.sha256(seed + b"\0" + purpose).digest()[:16])
    raw[6] = (raw[6] & 0x0F) | 0x40  # shaped as a version-4 UUID
    raw[8] = (raw[8] & 0x3F) | 0x80
    return uuid.UUID(bytes=bytes(raw))


# trees in metadata chunks, in allocation order (the chunk tree lives in the SYSTEM chunk)
_META_TREES = (
    d.FS_TREE_OBJECTID,
    d.EXTENT_TREE_OBJECTID,
    d.ROOT_TREE_OBJECTID,
    d.DEV_TREE_OBJECTID,
    d.CSUM_TREE_OBJECTID,
    d.UUID_TREE_OBJECTID,
    d.FREE_SPACE_TREE_OBJECTID,
    d.DATA_RELOC_TREE_OBJECTID,
)


# trees whose items change with the chunk layout and block addresses (and the extent tree,
# sized without making its items: see _Metadata.extent_tree_plan)
_ADDRESS_DEPENDENT = (
    d.DEV_TREE_OBJECTID,
    d.FREE_SPACE_TREE_OBJECTID,
    d.CHUNK_TREE_OBJECTID,
)


@dataclass(slots=True)
class _Ids:
    fsid: bytes
    chunk_tree_uuid: bytes
    dev_uuid: tuple[bytes, bytes]
    subvol_uuid: bytes


def _internal_dir_inode(nbytes: int, time_ns: int, otime_ns: int) -> bytes:
    """INODE_ITEM of a directory btrfs keeps for itself (root tree dir, data-reloc root)."""
    return d.pack_inode_item(
        generation=GENERATION,
        size=0,
        nbytes=nbytes,
        nlink=1,
        uid=0,
        gid=0,
        mode=0o40755,
        atime_ns=time_ns,
        ctime_ns=time_ns,
        mtime_ns=time_ns,
        otime_ns=otime_ns,
    )


# the item sizes of a block group and of a tree block (``_Metadata.block_items``)
_BLOCK_GROUP_SIZE = len(d.pack_block_group_item(0, 0))
_METADATA_ITEM_SIZE = len(d.pack_metadata_item(0, 0))


class _Metadata:
    """Items of every tree but the fs tree, given the chunk list and block addresses."""

    def __init__(
        self,
        ids: _Ids,
        opts: WriterOptions,
        data_extents: _DataExtentItems | _NativeDataExtentItems,
    ) -> None:
        self.ids = ids
        self.opts = opts
        self.data_extents = data_extents

    def chunk_tree(
        self, chunks: list[Chunk], dev_sizes: tuple[int, int]
    ) -> list[tuple[d.Key, bytes]]:
        used = [0, 0]
        for c in chunks:
            used[c.devid - 1] += c.length
        items: list[tuple[d.Key, bytes]] = [
            (
                (d.DEV_ITEMS_OBJECTID, d.DEV_ITEM_KEY, devid),
                d.pack_dev_item(
                    devid,
                    dev_sizes[devid - 1],
                    used[devid - 1],
                    self.ids.dev_uuid[devid - 1],
                    self.ids.fsid,
                ),
            )
            for devid in (1, 2)
        ]
        for c in sorted(chunks, key=lambda c: c.logical):
            items.append(self.chunk_item(c))
        return items

    def chunk_item(self, c: Chunk) -> tuple[d.Key, bytes]:
        return (
            (d.FIRST_CHUNK_TREE_OBJECTID, d.CHUNK_ITEM_KEY, c.logical),
            d.pack_chunk(c.length, c.type, c.devid, c.physical, self.ids.dev_uuid[c.devid - 1]),
        )

    def dev_tree(self, chunks: list[Chunk]) -> list[tuple[d.Key, bytes]]:
        return sorted(
            (
                (c.devid, d.DEV_EXTENT_KEY, c.physical),
                d.pack_dev_extent(c.logical, c.length, self.ids.chunk_tree_uuid),
            )
            for c in chunks
        )

    def extent_tree_plan(
        self, chunks: list[Chunk], blocks: list[tuple[int, int, int]], breaks: Breaks | None
    ) -> BlockPlan:
        """``plan_items`` of the extent tree's items (``blocks``: (bytenr, level, owner) of every
        tree block; a block group item's size does not depend on its bytes used): the data
        extents' merged with ``block_items``, without making the data extents' items (keyed
        data refs with a stand-in offset, see ``_DataExtentItems.sizes``)."""
        others = self.block_item_sizes(chunks, blocks)
        leaf_breaks = NO_KEYS if breaks is None else breaks.at(0)
        return plan_blocks(self.data_extents.leaf_firsts(others, leaf_breaks), breaks)

    @staticmethod
    def block_item_sizes(
        chunks: list[Chunk], blocks: list[tuple[int, int, int]]
    ) -> list[tuple[d.Key, int]]:
        """(key, item size) of ``block_items``, sorted, without making the items."""
        sizes = [((c.logical, d.BLOCK_GROUP_ITEM_KEY, c.length), _BLOCK_GROUP_SIZE) for c in chunks]
        sizes.extend(
            ((bytenr, d.METADATA_ITEM_KEY, level), _METADATA_ITEM_SIZE)
            for bytenr, level, _ in blocks
        )
        sizes.sort(key=_item_key)
        return sizes

    @staticmethod
    def block_items(
        chunks: list[Chunk], used: dict[int, int], blocks: list[tuple[int, int, int]]
    ) -> list[tuple[d.Key, bytes]]:
        """Block group and tree block (METADATA_ITEM) items, sorted."""
        items = [
            (
                (c.logical, d.BLOCK_GROUP_ITEM_KEY, c.length),
                d.pack_block_group_item(used.get(c.logical, 0), c.type),
            )
            for c in chunks
        ]
        items.extend(
            ((bytenr, d.METADATA_ITEM_KEY, level), d.pack_metadata_item(GENERATION, owner))
            for bytenr, level, owner in blocks
        )
        items.sort(key=_item_key)
        return items

    def free_space_tree(
        self,
        chunks: list[Chunk],
        data_free: dict[int, list[tuple[int, int]]],
        blocks: list[tuple[int, int, int]],
    ) -> list[tuple[d.Key, bytes]]:
        """Free ranges of each block group: a DATA one's are ``data_free`` (the gaps between
        its extents, where a base's unused extents were, and its tail); any other holds the
        tree blocks of ``blocks`` (sorted) in it, with gaps where a base's unused blocks were."""
        starts = [bytenr for bytenr, _, _ in blocks]
        items: list[tuple[d.Key, bytes]] = []
        for c in sorted(chunks, key=lambda c: c.logical):
            if c.type & d.BLOCK_GROUP_DATA:
                free = data_free[c.logical]
            else:
                lo, hi = bisect.bisect_left(starts, c.logical), bisect.bisect_left(starts, c.end)
                free = _free_ranges(c, ((b, d.NODESIZE) for b in starts[lo:hi]))
            items.append(
                ((c.logical, d.FREE_SPACE_INFO_KEY, c.length), d.pack_free_space_info(len(free)))
            )
            items.extend(((start, d.FREE_SPACE_EXTENT_KEY, n), b"") for start, n in free)
        return items

    def root_tree(
        self, roots: dict[int, TreeInfo], nblocks: dict[int, int]
    ) -> list[tuple[d.Key, bytes]]:
        gen, t = GENERATION, self.opts.time_ns
        items: list[tuple[d.Key, bytes]] = []

        def root_item(objectid: int, **kw: int | bytes) -> None:
            info = roots[objectid]
            items.append(
                (
                    (objectid, d.ROOT_ITEM_KEY, 0),
                    d.pack_root_item(
                        generation=gen,
                        bytenr=info.root,
                        level=info.level,
                        bytes_used=nblocks[objectid] * d.NODESIZE,
                        **kw,  # type: ignore[arg-type]
                    ),
                )
            )

        root_item(d.EXTENT_TREE_OBJECTID, root_dirid=0)
        root_item(d.DEV_TREE_OBJECTID, root_dirid=0)
        items.append(
            (
                (d.FS_TREE_OBJECTID, d.INODE_REF_KEY, d.ROOT_TREE_DIR_OBJECTID),
                d.pack_inode_ref(0, b"default"),
            )
        )
        root_item(
            d.FS_TREE_OBJECTID,
            root_dirid=d.FIRST_FREE_OBJECTID,
            uuid=self.ids.subvol_uuid,
            ctransid=gen,
            ctime_ns=t,
            otime_ns=t,
        )
        items.append(
            (
                (d.ROOT_TREE_DIR_OBJECTID, d.INODE_ITEM_KEY, 0),
                _internal_dir_inode(nbytes=d.NODESIZE, time_ns=t, otime_ns=t),
            )
        )
        items.append(
            (
                (d.ROOT_TREE_DIR_OBJECTID, d.INODE_REF_KEY, d.ROOT_TREE_DIR_OBJECTID),
                d.pack_inode_ref(0, b".."),
            )
        )
        items.append(
            (
                (d.ROOT_TREE_DIR_OBJECTID, d.DIR_ITEM_KEY, d.name_hash(b"default")),
                d.pack_dir_item(
                    (d.FS_TREE_OBJECTID, d.ROOT_ITEM_KEY, 2**64 - 1), 0, d.FT_DIR, b"default"
                ),
            )
        )
        root_item(d.CSUM_TREE_OBJECTID, root_dirid=0)
        root_item(d.UUID_TREE_OBJECTID, root_dirid=0)
        root_item(d.FREE_SPACE_TREE_OBJECTID, root_dirid=0)
        root_item(d.DATA_RELOC_TREE_OBJECTID, root_dirid=d.FIRST_FREE_OBJECTID)
        return items

    def uuid_tree(self) -> list[tuple[d.Key, bytes]]:
        u = self.ids.subvol_uuid
        key = (int.from_bytes(u[:8], "little"), d.UUID_KEY_SUBVOL, int.from_bytes(u[8:], "little"))
        return [(key, d.FS_TREE_OBJECTID.to_bytes(8, "little"))]

    def data_reloc_tree(self) -> list[tuple[d.Key, bytes]]:
        t = self.opts.time_ns
        ino = d.FIRST_FREE_OBJECTID
        return [
            (
                (ino, d.INODE_ITEM_KEY, 0),
                _internal_dir_inode(nbytes=0, time_ns=t, otime_ns=0),
            ),
            ((ino, d.INODE_REF_KEY, ino), d.pack_inode_ref(0, b"..")),
        ]


def _sizes(items: list[tuple[d.Key, bytes]]) -> Iterator[tuple[d.Key, int]]:
    return ((key, len(data)) for key, data in items)


def _item_key(item: tuple[d.Key, object]) -> d.Key:
    return item[0]


def _no_overlap(meta_chunks: list[Chunk], data_chunks: list[Chunk]) -> None:
    """Data and metadata share the logical space, and a base fixes where both begin (its
    kept data chunks, its metadata start): they must not meet."""
    start, end = meta_chunks[0].logical, meta_chunks[-1].end
    for c in data_chunks:
        if c.logical < end and start < c.end:
            raise ImageError(
                f"metadata at logical {start}..{end} would overlap the data chunk at"
                f" {c.logical}: the base's layout leaves no room"
            )


def _assign(
    plans: dict[int, BlockPlan], sys_chunk: Chunk, meta_start: int, base: BaseLayout | None
) -> tuple[dict[int, list[int]], list[tuple[int, int, int]], int]:
    """Block addresses per tree, (bytenr, level, owner) of every block (sorted), and the
    bytes from ``meta_start`` to the end of the last metadata block. Without a base, the
    trees lie one after another; with one, see the module's docstring."""
    addr_of: dict[int, list[int]] = {}
    offsets = {} if base is None else base.offsets
    taken: set[int] = set()
    pending: list[tuple[list[int], int]] = []  # (a tree's addresses, a block's index there)
    cursor = 0
    for tree_id in _META_TREES:
        addrs: list[int] = []
        for i, (level, key) in enumerate(plans[tree_id]):
            off = offsets.get((tree_id, level, key))
            if off is None or off in taken:
                if base is not None:
                    pending.append((addrs, i))
                off = cursor if base is None else -1
            else:
                taken.add(off)
            addrs.append(off)
            cursor += d.NODESIZE
        addr_of[tree_id] = addrs
    free = (off for off in itertools.count(0, d.NODESIZE) if off not in taken)
    for addrs, i in pending:
        addrs[i] = next(free)
    span = 0
    for addrs in addr_of.values():
        for i, off in enumerate(addrs):
            addrs[i] = meta_start + off
            span = max(span, off + d.NODESIZE)
    addr_of[d.CHUNK_TREE_OBJECTID] = [
        sys_chunk.logical + i * d.NODESIZE for i in range(len(plans[d.CHUNK_TREE_OBJECTID]))
    ]
    blocks = [
        (a, level, tree_id)
        for tree_id, addrs in addr_of.items()
        for a, (level, _) in zip(addrs, plans[tree_id], strict=True)
    ]
    blocks.sort()
    return addr_of, blocks, span


def _used(
    chunks: list[Chunk], data_used: dict[int, int], blocks: list[tuple[int, int, int]]
) -> dict[int, int]:
    """Bytes used per block group (by its logical start): ``data_used`` for DATA, the
    tree blocks in it for the others."""
    used = dict(data_used)
    starts = sorted(c.logical for c in chunks)
    for c in chunks:
        if not c.type & d.BLOCK_GROUP_DATA:
            used[c.logical] = 0
    for bytenr, _, _ in blocks:
        used[starts[bisect.bisect_right(starts, bytenr) - 1]] += d.NODESIZE
    return used


def write_image(
    tree: Tree,
    meta_path: str,
    opts: WriterOptions,
    encoded: EncodedExtents | None = None,
    base: BaseLayout | None = None,
) -> ImageLayout:
    """Write ``meta.img`` (device 1) for ``tree`` (not fsynced: the caller's job); return
    device 2's layout. ``encoded``: the blobs' btrfs extents when the packs store them so
    (btrfs-zstd). ``base``: the layout of the base image to keep (``build --base``)."""
    # the fs tree's leaf payloads wait on disk (unnamed, next to meta.img), not in memory
    spill = tempfile.TemporaryFile(  # noqa: SIM115 (closed below, on a thread)
        "w+b", buffering=SPILL_BUFFER, dir=os.path.dirname(meta_path) or "."
    )
    try:
        return _write_image(tree, meta_path, opts, spill, encoded, base)
    finally:
        # closing it frees its pages (~600 MB at 1,000,000 entries, ~0.3 s of kernel time,
        # the GIL released): on a thread of its own, while the build goes on
        threading.Thread(target=spill.close, name="fs-tree-spill-close").start()


def _write_image(
    tree: Tree,
    meta_path: str,
    opts: WriterOptions,
    spill: IO[bytes],
    encoded: EncodedExtents | None,
    base: BaseLayout | None,
) -> ImageLayout:
    imax = inline_max(opts)
    numbering = _number(tree, base)
    sys_chunk = system_chunk()
    # btrfs-zstd: extents are laid out afresh (the base's content is not reused as it lies)
    placer = _DataPlacer(sys_chunk.end, encoded, base if encoded is None else None)

    tree_breaks = {} if base is None else dict(base.breaks)
    extent_breaks = tree_breaks.get(d.EXTENT_TREE_OBJECTID)
    if extent_breaks is not None:
        # keyed data refs are planned with a stand-in offset (_DataExtentItems.sizes): no
        # break at one, so the planned split is the built one
        tree_breaks[d.EXTENT_TREE_OBJECTID] = Breaks(
            tuple(
                tuple(k for k in keys if k[1] != d.EXTENT_DATA_REF_KEY)
                for keys in extent_breaks.levels
            )
        )

    def breaks(tree_id: int) -> Breaks | None:
        return tree_breaks.get(tree_id)

    def leaf_breaks(tree_id: int) -> Sequence[d.Key]:
        b = breaks(tree_id)
        return NO_KEYS if b is None else b.at(0)

    fs = _fs_tree_items(numbering, placer, imax, spill, leaf_breaks(d.FS_TREE_OBJECTID))
    del numbering  # it is in the items now
    data_chunks = placer.finish()
    csum_items = placer.csum_items()
    data_free = placer.block_groups(data_chunks)
    data_used = {c.logical: c.length - sum(n for _, n in data_free[c.logical]) for c in data_chunks}

    # identity: derived from the fs tree's items unless the spec fixes the fsid
    fsid = opts.fsid or _derive_uuid(fs.digest, b"fsid")
    fb = fsid.bytes
    ids = _Ids(
        fsid=fb,
        chunk_tree_uuid=_derive_uuid(fb, b"chunk-tree").bytes,
        dev_uuid=(_derive_uuid(fb, b"devid-1").bytes, _derive_uuid(fb, b"devid-2").bytes),
        subvol_uuid=_derive_uuid(fb, b"fs-tree").bytes,
    )
    meta = _Metadata(ids, opts, _data_extent_items(fs))
    fs.ref_extent, fs.ref_ino, fs.ref_offset = array("Q"), array("Q"), array("Q")  # grouped now
    data_end = max(c.physical + c.length for c in data_chunks)

    # Plan: blocks per tree -> addresses -> chunks -> real items -> blocks, until nothing
    # changes (the extent tree lists every block, including its own). Metadata starts
    # after the data (a base's new data lies far above, at DELTA_DATA_LOGICAL), and with a
    # base no lower than the base's: block addresses are kept relative to that start.
    meta_logical = max(
        (c.end for c in data_chunks if c.logical < DELTA_DATA_LOGICAL), default=sys_chunk.end
    )
    if base is not None:
        meta_logical = max(meta_logical, base.meta_start)
    uuid_items, reloc_items = meta.uuid_tree(), meta.data_reloc_tree()
    placeholder = {t: TreeInfo(t, 0, 0) for t in _META_TREES}
    empty = [(0, EMPTY_KEY)]
    plans: dict[int, BlockPlan] = {
        d.FS_TREE_OBJECTID: plan_blocks(
            [leaf.first_key for leaf in fs.leaves], breaks(d.FS_TREE_OBJECTID)
        ),
        d.EXTENT_TREE_OBJECTID: empty,
        d.ROOT_TREE_OBJECTID: plan_items(
            _sizes(meta.root_tree(placeholder, dict.fromkeys(_META_TREES, 0))),
            breaks(d.ROOT_TREE_OBJECTID),
        ),
        d.DEV_TREE_OBJECTID: empty,
        d.CSUM_TREE_OBJECTID: plan_items(_sizes(csum_items), breaks(d.CSUM_TREE_OBJECTID)),
        d.UUID_TREE_OBJECTID: plan_items(_sizes(uuid_items), breaks(d.UUID_TREE_OBJECTID)),
        d.FREE_SPACE_TREE_OBJECTID: empty,
        d.DATA_RELOC_TREE_OBJECTID: plan_items(
            _sizes(reloc_items), breaks(d.DATA_RELOC_TREE_OBJECTID)
        ),
        d.CHUNK_TREE_OBJECTID: empty,
    }
    for _ in range(20):
        addr_of, blocks, span = _assign(plans, sys_chunk, meta_logical, base)
        meta_chunks = allocate(span, d.BLOCK_GROUP_METADATA, 1, sys_chunk.end, meta_logical)
        _no_overlap(meta_chunks, data_chunks)
        chunks = [sys_chunk, *data_chunks, *meta_chunks]
        dev_sizes = (meta_chunks[-1].physical + meta_chunks[-1].length, data_end)
        used = _used(chunks, data_used, blocks)
        # the extent tree, by far the largest of these, is made only once the layout is final
        items: dict[int, list[tuple[d.Key, bytes]]] = {
            d.DEV_TREE_OBJECTID: meta.dev_tree(chunks),
            d.CSUM_TREE_OBJECTID: csum_items,
            d.UUID_TREE_OBJECTID: uuid_items,
            d.FREE_SPACE_TREE_OBJECTID: meta.free_space_tree(chunks, data_free, blocks),
            d.DATA_RELOC_TREE_OBJECTID: reloc_items,
            d.CHUNK_TREE_OBJECTID: meta.chunk_tree(chunks, dev_sizes),
        }
        new = dict(plans)
        new[d.EXTENT_TREE_OBJECTID] = meta.extent_tree_plan(
            chunks, blocks, breaks(d.EXTENT_TREE_OBJECTID)
        )
        for tree_id in _ADDRESS_DEPENDENT:
            new[tree_id] = plan_items(_sizes(items[tree_id]), breaks(tree_id))
        if new == plans:
            break
        plans = new
    else:
        raise AssertionError("metadata layout did not converge")

    # superblocks: identical but for dev_item (and checksum)
    sys_array = b"".join(d.pack_disk_key(k) + v for k, v in [meta.chunk_item(sys_chunk)])
    dev_items = items[d.CHUNK_TREE_OBJECTID][:2]
    dev1_chunks = sorted([sys_chunk, *meta_chunks], key=lambda c: c.logical)

    def physical(logical: int) -> int:
        for c in dev1_chunks:
            if c.logical <= logical < c.end:
                return c.physical + (logical - c.logical)
        raise AssertionError(f"logical {logical} outside device 1 chunks")

    with open(meta_path, "wb") as f:
        f.truncate(dev_sizes[0])

        def sink(bytenr: int, block: bytes) -> None:
            f.seek(physical(bytenr))
            f.write(block)

        def tree_blocks(tree_id: int, leaves: Iterable[Leaf]) -> TreeInfo:
            addrs = addr_of[tree_id]
            info, n = serialize(
                leaves,
                iter(addrs),
                tree_id,
                GENERATION,
                ids.fsid,
                ids.chunk_tree_uuid,
                sink,
                breaks(tree_id),
            )
            if n != len(addrs):
                raise AssertionError(f"tree {tree_id}: planned {len(addrs)} blocks, built {n}")
            return info

        def written_tree(
            tree_id: int, write: Callable[[list[tuple[int, int]]], list[d.Key]]
        ) -> TreeInfo:
            """A tree whose leaf blocks ``write`` writes (given every block's address and
            offset in meta.img, the leaves taking the first ones; it returns their first
            keys) in the extension, its nodes written here."""
            addrs = addr_of[tree_id]
            f.flush()
            firsts = write([(a, physical(a)) for a in addrs])
            level = list(zip(firsts, addrs, strict=False))
            nodes = iter(addrs[len(level) :])
            fsid, chunk_tree_uuid = ids_uuids
            info, n = serialize_nodes(
                level, nodes, tree_id, GENERATION, fsid, chunk_tree_uuid, sink, breaks(tree_id)
            )
            if n + len(level) != len(addrs):
                raise AssertionError(
                    f"tree {tree_id}: planned {len(addrs)} blocks, built {n + len(level)}"
                )
            return info

        ids_uuids = (ids.fsid, ids.chunk_tree_uuid)
        nat = native.module()
        fs_id, fs_leaves = d.FS_TREE_OBJECTID, fs.leaves
        write_spilled = getattr(nat, "write_spilled_leaves", None)
        if write_spilled is not None and all(leaf.spilled_at >= 0 for leaf in fs_leaves):
            # the fs tree's leaves straight from the spill file (native/src/blocks.rs)
            spilled = [(leaf.spilled_at, leaf.nritems) for leaf in fs_leaves]

            def write_fs(places: list[tuple[int, int]]) -> list[d.Key]:
                spill.flush()
                write_spilled(
                    spill.fileno(), f.fileno(), spilled, places, fs_id, GENERATION, *ids_uuids
                )
                return [leaf.first_key for leaf in fs_leaves]

            infos = {fs_id: written_tree(fs_id, write_fs)}
        else:
            infos = {fs_id: tree_blocks(fs_id, unspill(fs_leaves, spill))}
        ext_id = d.EXTENT_TREE_OBJECTID
        data_extents = meta.data_extents
        others = meta.block_items(chunks, used, blocks)
        if isinstance(data_extents, _NativeDataExtentItems):
            infos[ext_id] = written_tree(
                ext_id,
                lambda places: data_extents.write_leaves(
                    others, leaf_breaks(ext_id), f.fileno(), places, ids_uuids
                ),
            )
        else:
            infos[ext_id] = tree_blocks(ext_id, data_extents.leaves(others, leaf_breaks(ext_id)))
        for tree_id, tree_items in items.items():
            infos[tree_id] = tree_blocks(tree_id, pack_leaves(tree_items, leaf_breaks(tree_id)))
        nblocks = {t: len(addr_of[t]) for t in _META_TREES}
        root_items = meta.root_tree(infos, nblocks)
        infos[d.ROOT_TREE_OBJECTID] = tree_blocks(
            d.ROOT_TREE_OBJECTID, pack_leaves(root_items, leaf_breaks(d.ROOT_TREE_OBJECTID))
        )

        def root(tree_id: int) -> TreeRoot:
            return TreeRoot(infos[tree_id].root, infos[tree_id].level)

        fields = SuperFields(
            fsid=ids.fsid,
            generation=GENERATION,
            root=root(d.ROOT_TREE_OBJECTID),
            chunk_root=root(d.CHUNK_TREE_OBJECTID),
            extent_root=root(d.EXTENT_TREE_OBJECTID),
            fs_root=root(d.FS_TREE_OBJECTID),
            dev_root=root(d.DEV_TREE_OBJECTID),
            csum_root=root(d.CSUM_TREE_OBJECTID),
            total_bytes=dev_sizes[0] + dev_sizes[1],
            bytes_used=sum(used.values()),
            num_devices=2,
            sys_chunk_array=sys_array,
            label=opts.label.encode()[:255],
        )
        for mirror in d.SUPER_MIRRORS:
            if mirror + d.SUPER_INFO_SIZE <= dev_sizes[0]:
                f.seek(mirror)
                f.write(pack_super(fields, dev_items[0][1], bytenr=mirror))
        # not fsynced here: the bundle syncs it together with its other files (files.Syncer)
    super2 = pack_super(fields, dev_items[1][1])

    stats = dict(fs.stats)
    stats["data_extents"] = len(placer.logical)
    stats["metadata_bytes"] = len(blocks) * d.NODESIZE
    stats["data_bytes"] = placer.used
    return ImageLayout(
        fsid=fsid,
        dev_uuids=(uuid.UUID(bytes=ids.dev_uuid[0]), uuid.UUID(bytes=ids.dev_uuid[1])),
        generation=GENERATION,
        meta_size=dev_sizes[0],
        data_size=dev_sizes[1],
        data_ranges=placer.ranges,
        data_super=super2,
        stats=stats,
    )
