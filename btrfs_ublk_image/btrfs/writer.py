"""The btrfs writer: a merged ``Tree`` -> device 1 (``meta.img``) + device 2's layout.

Order of work (each step decides the bytes named; steps 1-3 and the extent tree's data
extent items have modules of their own beside this one):
1. ``numbering.number``: inode numbers (DFS, sorted names; a hardlink reuses its inode),
   dir indexes, nlink (one native call, native/src/numbering.rs). With a
   base (``BaseLayout``): a path the base has keeps its inode number and dir index, new
   ones come after the base's highest.
2. ``placement.DataPlacer``: every distinct ``Blob`` gets extents (<= 128 MiB) at device-2
   offsets inside DATA chunks; identical content -> one extent, many refs. With a
   base: content the base holds keeps its extents (logical and device-2 offsets),
   new content goes after the base's device-2 end.
3. ``fstree.fs_tree_items`` (one native call when the extension has it, native/src/fsitems.rs):
   INODE_ITEM, INODE_REF, XATTR_ITEM, DIR_ITEM, DIR_INDEX,
   EXTENT_DATA for every inode, generated already sorted.
4. ``_write_image``'s planning loop (``_Metadata``, ``_assign``): sizes every other tree,
   then METADATA chunks, iterating until the extent tree (which lists every tree block)
   stops growing.
5. Addresses, real items, tree blocks, both superblocks; ``meta.img`` written (the extent
   tree's data extent items, ``extenttree``, and the fs tree's leaf blocks natively when
   the extension has them: native/src/extents.rs, blocks.rs).
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
import itertools
import os
import tempfile
import threading
import uuid
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO

from btrfs_ublk_image import native
from btrfs_ublk_image.blockmap import Ranges
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.btrfs.encoded import EncodedExtents
from btrfs_ublk_image.btrfs.extenttree import (
    DataExtentItems,
    NativeDataExtentItems,
    data_extent_items,
)
from btrfs_ublk_image.btrfs.fstree import MAX_INLINE, fs_tree_items
from btrfs_ublk_image.btrfs.layout import (
    DELTA_DATA_LOGICAL,
    BaseLayout,
    Chunk,
    allocate,
    system_chunk,
)
from btrfs_ublk_image.btrfs.numbering import number
from btrfs_ublk_image.btrfs.placement import DataPlacer, free_ranges
from btrfs_ublk_image.btrfs.superblock import SuperFields, TreeRoot, pack_super
from btrfs_ublk_image.btrfs.treeblocks import (
    EMPTY_KEY,
    NO_KEYS,
    BlockPlan,
    Breaks,
    Leaf,
    TreeInfo,
    item_key,
    pack_leaves,
    plan_blocks,
    plan_items,
    serialize,
    serialize_nodes,
    unspill,
)
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.tree import Tree

# the fs tree spill file's write buffer: one write(2) per MiB, not one per 16 KiB leaf
SPILL_BUFFER = 1 << 20


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


def inline_max(opts: WriterOptions) -> int:
    """Largest regular file stored inline; the pack writer keeps files this small in memory."""
    return min(max(opts.inline_limit, 0), MAX_INLINE)


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
        generation=d.GENERATION,
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
        data_extents: DataExtentItems | NativeDataExtentItems,
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
        data refs with a stand-in offset, see ``DataExtentItems.sizes``)."""
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
        sizes.sort(key=item_key)
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
            ((bytenr, d.METADATA_ITEM_KEY, level), d.pack_metadata_item(d.GENERATION, owner))
            for bytenr, level, owner in blocks
        )
        items.sort(key=item_key)
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
                free = free_ranges(c, ((b, d.NODESIZE) for b in starts[lo:hi]))
            items.append(
                ((c.logical, d.FREE_SPACE_INFO_KEY, c.length), d.pack_free_space_info(len(free)))
            )
            items.extend(((start, d.FREE_SPACE_EXTENT_KEY, n), b"") for start, n in free)
        return items

    def root_tree(
        self, roots: dict[int, TreeInfo], nblocks: dict[int, int]
    ) -> list[tuple[d.Key, bytes]]:
        gen, t = d.GENERATION, self.opts.time_ns
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
    numbering = number(tree, base)
    sys_chunk = system_chunk()
    # btrfs-zstd: extents are laid out afresh (the base's content is not reused as it lies)
    placer = DataPlacer(sys_chunk.end, encoded, base if encoded is None else None)

    tree_breaks = {} if base is None else dict(base.breaks)
    extent_breaks = tree_breaks.get(d.EXTENT_TREE_OBJECTID)
    if extent_breaks is not None:
        # keyed data refs are planned with a stand-in offset (DataExtentItems.sizes): no
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

    fs = fs_tree_items(numbering, placer, imax, spill, leaf_breaks(d.FS_TREE_OBJECTID))
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
    meta = _Metadata(ids, opts, data_extent_items(fs))
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
                d.GENERATION,
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
                level, nodes, tree_id, d.GENERATION, fsid, chunk_tree_uuid, sink, breaks(tree_id)
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
                    spill.fileno(), f.fileno(), spilled, places, fs_id, d.GENERATION, *ids_uuids
                )
                return [leaf.first_key for leaf in fs_leaves]

            infos = {fs_id: written_tree(fs_id, write_fs)}
        else:
            infos = {fs_id: tree_blocks(fs_id, unspill(fs_leaves, spill))}
        ext_id = d.EXTENT_TREE_OBJECTID
        data_extents = meta.data_extents
        others = meta.block_items(chunks, used, blocks)
        if isinstance(data_extents, NativeDataExtentItems):
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
            generation=d.GENERATION,
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
        generation=d.GENERATION,
        meta_size=dev_sizes[0],
        data_size=dev_sizes[1],
        data_ranges=placer.ranges,
        data_super=super2,
        stats=stats,
    )
