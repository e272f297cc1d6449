"""The extent tree's items for data extents (``data_extent_items``): made on demand from
the placer's rows, natively (native/src/extents.rs) when the extension has it."""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterator, Sequence
from types import ModuleType

from btrfs_ublk_image import native
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.btrfs.fstree import FsTree
from btrfs_ublk_image.btrfs.treeblocks import (
    Leaf,
    item_key,
    iter_leaves,
    split_leaves,
)

# the size of an EXTENT_ITEM with one flags word, of an inline data ref, of a keyed one
_EXTENT_HEAD_SIZE = 24
_INLINE_DATA_REF_SIZE = 29
_DATA_REF_SIZE = 28
_INLINE_ROOM = (d.MAX_EXTENT_ITEM_SIZE - _EXTENT_HEAD_SIZE) // _INLINE_DATA_REF_SIZE


class DataExtentItems:
    """The extent tree's items for data extents (EXTENT_ITEM with its refs inline while
    they fit, else keyed EXTENT_DATA_REF items), made on demand from the placer's rows.

    ``refs`` groups the fs tree's file extent refs by extent (rows ``start[e]`` ..
    ``start[e + 1]`` of ``ino``), as flat arrays."""

    def __init__(self, fs: FsTree) -> None:
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
        return split_leaves(heapq.merge(self.sizes(), others, key=item_key), breaks)

    def leaves(self, others: list[tuple[d.Key, bytes]], breaks: Sequence[d.Key]) -> Iterator[Leaf]:
        """The extent tree's leaves: these items, made as they are consumed, merged with
        ``others`` (sorted)."""
        return iter_leaves(heapq.merge(self.items(), others, key=item_key), breaks)

    def items(self) -> Iterator[tuple[d.Key, bytes]]:
        gen = d.GENERATION
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


class NativeDataExtentItems:
    """``DataExtentItems`` in the extension (native/src/extents.rs): the same leaf split
    and leaves, no Python object per extent."""

    def __init__(self, nat: ModuleType, fs: FsTree) -> None:
        placer = fs.placer
        order = None if isinstance(placer.order, range) else placer.order
        refs = (fs.ref_extent, fs.ref_ino, fs.ref_offset)
        self._native = nat.DataExtents(placer.logical, placer.disk_bytes, order, refs, d.GENERATION)

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
            others, list(breaks), out_fd, places, tree_id, d.GENERATION, *ids
        )
        return firsts


def data_extent_items(fs: FsTree) -> DataExtentItems | NativeDataExtentItems:
    """The extent tree's data extent items: the extension's when it has them."""
    nat = native.module()
    if nat is not None and hasattr(nat, "DataExtents"):
        return NativeDataExtentItems(nat, fs)
    return DataExtentItems(fs)
