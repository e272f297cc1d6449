"""B-trees from sorted items: leaves filled greedily, then internal nodes level by level.

A tree is built in two steps because block addresses and item contents depend
on each other (the extent tree lists every tree block, including its own):
``plan_items``/``plan_blocks`` need only item keys and sizes and say which blocks
(level, first key) a tree takes; ``serialize`` takes their addresses and emits them.

Leaves are packed once into ``Leaf`` payloads (the block minus its header,
which holds the address). The fs tree, by far the largest, is packed while its
items are generated (``leaf_packer``), so its items never sit in memory as a list,
and its payloads wait in a spill file (not in memory) until their addresses and
the fsid are known. That packer is the native extension's (``native/src/leaves.rs``,
the same bytes, one call per item) when it is built, else ``LeafPacker``.

Built with a base image (``build --base``), every tree breaks its blocks where the base's
did (``Breaks``): a block ends before the key that began the base's next block at its
level, or when full, so an item that grows or appears changes only its own block (the
blocks after it keep their bytes and, see ``writer._assign``, their addresses).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

from btrfs_ublk_image import native
from btrfs_ublk_image.btrfs import ondisk as d

EMPTY_KEY: d.Key = (0, 0, 0)
NO_KEYS: tuple[d.Key, ...] = ()
# (level, first key) of each block of a tree, in ``serialize``'s order
BlockPlan = list[tuple[int, d.Key]]


@dataclass(frozen=True, slots=True)
class Breaks:
    """Where a base image's tree began its blocks: ``levels[i]``, the sorted first keys of
    its level-i blocks. A block ends before the key that began the base's next block at
    its level (or when full)."""

    levels: tuple[tuple[d.Key, ...], ...]

    def at(self, level: int) -> Sequence[d.Key]:
        return self.levels[level] if level < len(self.levels) else NO_KEYS


class _Cuts:
    """One level's breaks, walked in key order: ``ends_before(first, key)`` says whether a
    block that began at ``first`` must end before ``key``."""

    __slots__ = ("i", "keys")

    def __init__(self, keys: Sequence[d.Key]) -> None:
        self.keys = keys
        self.i = 0

    def ends_before(self, first: d.Key, key: d.Key) -> bool:
        keys, i = self.keys, self.i
        while i < len(keys) and keys[i] <= first:
            i += 1
        self.i = i
        return i < len(keys) and keys[i] <= key


def split_leaves(
    items: Iterable[tuple[d.Key, int]], breaks: Sequence[d.Key] = NO_KEYS
) -> list[d.Key]:
    """The first key of each leaf of these (key, item size), filling leaves in order and
    breaking where ``breaks`` (the base's leaves' first keys) say."""
    firsts: list[d.Key] = []
    cuts = _Cuts(breaks) if breaks else None
    used = 0
    first: d.Key | None = None
    for key, size in items:
        if size > d.MAX_ITEM_DATA:
            raise ValueError(f"item of {size} bytes does not fit in a {d.NODESIZE}-byte leaf")
        need = d.ITEM_SIZE + size
        if first is not None and (
            used + need > d.LEAF_DATA_SIZE or (cuts is not None and cuts.ends_before(first, key))
        ):
            firsts.append(first)
            first = None
        if first is None:
            first, used = key, 0
        used += need
    firsts.append(EMPTY_KEY if first is None else first)  # an empty tree is one empty leaf
    return firsts


def group_nodes(firsts: Sequence[d.Key], breaks: Sequence[d.Key] = NO_KEYS) -> list[int]:
    """How many of one level's blocks (given by first key) each block of the level above
    points at: up to a node's capacity, breaking where ``breaks`` say."""
    counts: list[int] = []
    cuts = _Cuts(breaks) if breaks else None
    n = 0
    first = EMPTY_KEY
    for key in firsts:
        if n and (n == d.NODEPTRS_PER_BLOCK or (cuts is not None and cuts.ends_before(first, key))):
            counts.append(n)
            n = 0
        if n == 0:
            first = key
        n += 1
    counts.append(n)
    return counts


def plan_blocks(leaf_firsts: Sequence[d.Key], breaks: Breaks | None = None) -> BlockPlan:
    """(level, first key) of every block of a tree with leaves beginning at these keys,
    in ``serialize``'s order (leaves, then each level of nodes up to the root)."""
    plan: BlockPlan = [(0, k) for k in leaf_firsts]
    level = list(leaf_firsts)
    height = 0
    while len(level) > 1:
        height += 1
        upper = []
        at = 0
        for n in group_nodes(level, NO_KEYS if breaks is None else breaks.at(height)):
            upper.append(level[at])
            at += n
        plan.extend((height, k) for k in upper)
        level = upper
    return plan


def plan_items(items: Iterable[tuple[d.Key, int]], breaks: Breaks | None = None) -> BlockPlan:
    """``plan_blocks`` of a tree of these (key, item size), in key order."""
    return plan_blocks(split_leaves(items, NO_KEYS if breaks is None else breaks.at(0)), breaks)


def item_key(item: tuple[d.Key, object]) -> d.Key:
    """An item's key (a sort or merge key for ``(key, data)`` and ``(key, size)`` items)."""
    return item[0]


@dataclass(frozen=True, slots=True)
class Leaf:
    first_key: d.Key
    nritems: int
    payload: bytes  # everything after the header (b"" while spilled)
    spilled_at: int = -1  # offset of the payload in the packer's spill file


def group_by_hash(entries: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """(hash, packed dir item) -> one item per hash, concatenated (name collisions share one item)."""
    grouped: dict[int, bytes] = {}
    for h, packed in entries:
        grouped[h] = grouped.get(h, b"") + packed
    return sorted(grouped.items())


class LeafPacker:
    """Packs sorted items into leaves as they arrive (same split as ``split_leaves``);
    with ``spill``, the payloads go to that file (see ``unspill``); with ``digest``, every
    item's disk key and data are hashed, in order; with ``breaks``, a leaf also ends before
    each of these keys (the base's leaves' first keys)."""

    def __init__(
        self,
        spill: IO[bytes] | None = None,
        digest: bool = False,
        breaks: Sequence[d.Key] = NO_KEYS,
    ) -> None:
        self.leaves: list[Leaf] = []
        self.spill = spill
        self.digest = hashlib.sha256() if digest else None
        self._spill_pos = 0
        self._items: list[tuple[d.Key, bytes]] = []
        self._used = 0
        self._cuts = _Cuts(breaks) if breaks else None

    def add(self, key: d.Key, data: bytes) -> None:
        size = len(data)
        if size > d.MAX_ITEM_DATA:
            raise ValueError(f"item of {size} bytes does not fit in a {d.NODESIZE}-byte leaf")
        used = self._used + d.ITEM_SIZE + size
        if used > d.LEAF_DATA_SIZE or (
            self._cuts is not None
            and self._items
            and self._cuts.ends_before(self._items[0][0], key)
        ):
            self._flush()
            used = d.ITEM_SIZE + size
        self._items.append((key, data))
        self._used = used

    def add_inode(
        self,
        ino: int,
        generation: int,
        size: int,
        nbytes: int,
        nlink: int,
        uid: int,
        gid: int,
        mode: int,
        rdev: int,
        flags: int,
        atime_ns: int,
        ctime_ns: int,
        mtime_ns: int,
        otime_ns: int,
        inode_ref: tuple[int, int, bytes] | None,
    ) -> None:
        """INODE_ITEM and, for an inode of one name, its INODE_REF (parent, index, name)."""
        item = d.pack_inode_item(
            generation=generation, size=size, nbytes=nbytes, nlink=nlink, uid=uid, gid=gid,
            mode=mode, rdev=rdev, flags=flags, atime_ns=atime_ns, ctime_ns=ctime_ns,
            mtime_ns=mtime_ns, otime_ns=otime_ns,
        )  # fmt: skip
        self.add((ino, d.INODE_ITEM_KEY, 0), item)
        if inode_ref is not None:
            parent, index, name = inode_ref
            self.add((ino, d.INODE_REF_KEY, parent), d.pack_inode_ref(index, name))

    def add_dir(
        self, ino: int, generation: int, names: list[bytes], inos: list[int], ftypes: bytes
    ) -> None:
        """A directory's entries (``names`` sorted): DIR_ITEMs by name hash, then DIR_INDEXes
        from 2 in name order."""
        add_dir_items(self.add, ino, generation, names, inos, ftypes, range(2, 2 + len(names)))

    def _flush(self) -> None:
        items = self._items
        first = items[0][0] if items else EMPTY_KEY
        payload = d.pack_leaf_payload(items, self.digest)
        if self.spill is None:
            self.leaves.append(Leaf(first, len(items), payload))
        else:
            self.spill.write(payload)
            self.leaves.append(Leaf(first, len(items), b"", self._spill_pos))
            self._spill_pos += len(payload)
        self._items, self._used = [], 0

    def finish(self) -> tuple[list[Leaf], bytes | None]:
        if self._items or not self.leaves:
            self._flush()
        return self.leaves, None if self.digest is None else self.digest.digest()


def add_dir_items(
    add: Callable[[d.Key, bytes], None],
    ino: int,
    generation: int,
    names: list[bytes],
    inos: list[int],
    ftypes: bytes,
    indexes: Sequence[int],
) -> None:
    """A directory's entries (``names`` sorted, ``indexes`` their dir indexes): DIR_ITEMs
    by name hash, then DIR_INDEXes in index order."""
    packed = [
        d.pack_dir_item((child, d.INODE_ITEM_KEY, 0), generation, ftype, name)
        for name, child, ftype in zip(names, inos, ftypes, strict=True)
    ]
    by_hash = [(d.name_hash(name), item) for name, item in zip(names, packed, strict=True)]
    for h, data in group_by_hash(by_hash):
        add((ino, d.DIR_ITEM_KEY, h), data)
    for index, data in sorted(zip(indexes, packed, strict=True)):
        add((ino, d.DIR_INDEX_KEY, index), data)


class _NativeLeafPacker:
    """``LeafPacker`` in the native extension: the same methods, leaves and digest."""

    add: Callable[[d.Key, bytes], None]
    add_inode: Callable[..., None]  # LeafPacker.add_inode's arguments, positional
    add_dir: Callable[[int, int, list[bytes], list[int], bytes], None]

    def __init__(
        self,
        packer_class: Callable[..., object],
        spill: IO[bytes] | None,
        digest: bool,
        breaks: Sequence[d.Key] = NO_KEYS,
    ) -> None:
        fd = None
        if spill is not None:
            spill.flush()
            if spill.tell() != 0:
                raise AssertionError("the leaf spill file must be empty")
            fd = spill.fileno()
        packer: Any = packer_class(fd, digest, breaks) if breaks else packer_class(fd, digest)
        self._packer = packer
        self.native = packer  # the extension's packer itself (the native fs tree loop's)
        self.add = packer.add
        self.add_inode = packer.add_inode
        self.add_dir = packer.add_dir

    def finish(self) -> tuple[list[Leaf], bytes | None]:
        raw, digest = self._packer.finish()
        return [Leaf(key, n, payload, at) for key, n, payload, at in raw], digest


# sorted items in (add, add_inode, add_dir), leaves out (finish: the leaves and, when asked
# for, the sha256 of every item's disk key and data, in order)
Packer = LeafPacker | _NativeLeafPacker


def leaf_packer(
    spill: IO[bytes] | None = None, digest: bool = False, breaks: Sequence[d.Key] = NO_KEYS
) -> Packer:
    """The native packer when the extension is built (and ``BUI_NATIVE`` is not 0), else
    ``LeafPacker``."""
    nat = native.module()
    packer_class = getattr(nat, "LeafPacker", None)  # None too for an extension built before it
    # and an extension built before breaks packs only builds without a base
    if packer_class is None or (
        breaks and "breaks" not in (getattr(packer_class, "__text_signature__", None) or "")
    ):
        return LeafPacker(spill, digest, breaks)
    return _NativeLeafPacker(packer_class, spill, digest, breaks)


def unspill(leaves: Sequence[Leaf], spill: IO[bytes]) -> Iterator[Leaf]:
    """The leaves with their payloads read back from the spill file, one at a time."""
    spill.flush()
    fd = spill.fileno()
    for leaf in leaves:
        if leaf.spilled_at < 0:
            yield leaf
            continue
        payload = os.pread(fd, d.LEAF_DATA_SIZE, leaf.spilled_at)
        if len(payload) != d.LEAF_DATA_SIZE:
            raise OSError(f"leaf spill file: short read at {leaf.spilled_at}")
        yield Leaf(leaf.first_key, leaf.nritems, payload)


def iter_leaves(
    items: Iterable[tuple[d.Key, bytes]], breaks: Sequence[d.Key] = NO_KEYS
) -> Iterator[Leaf]:
    """Sorted items -> leaves, each made as soon as it is full (same split as ``split_leaves``):
    a large tree's items and leaves need not sit in memory together."""
    batch: list[tuple[d.Key, bytes]] = []
    used = 0
    cuts = _Cuts(breaks) if breaks else None
    for key, data in items:
        need = d.ITEM_SIZE + len(data)
        if len(data) > d.MAX_ITEM_DATA:
            raise ValueError(f"item of {len(data)} bytes does not fit in a {d.NODESIZE}-byte leaf")
        if batch and (
            used + need > d.LEAF_DATA_SIZE
            or (cuts is not None and cuts.ends_before(batch[0][0], key))
        ):
            yield Leaf(batch[0][0], len(batch), d.pack_leaf_payload(batch))
            batch, used = [], 0
        batch.append((key, data))
        used += need
    yield Leaf(batch[0][0] if batch else EMPTY_KEY, len(batch), d.pack_leaf_payload(batch))


def pack_leaves(
    items: Iterable[tuple[d.Key, bytes]], breaks: Sequence[d.Key] = NO_KEYS
) -> list[Leaf]:
    return list(iter_leaves(items, breaks))


@dataclass(frozen=True, slots=True)
class TreeInfo:
    owner: int
    root: int  # bytenr of the root block
    level: int


BlockSink = Callable[[int, bytes], None]  # (bytenr, 16 KiB block)


def serialize(
    leaves: Iterable[Leaf],
    addresses: Iterator[int],
    owner: int,
    generation: int,
    fsid: bytes,
    chunk_tree_uuid: bytes,
    sink: BlockSink,
    breaks: Breaks | None = None,
) -> tuple[TreeInfo, int]:
    """Emit every block of one tree to ``sink``; one address per block from ``addresses``
    (nodes grouped as ``plan_blocks`` does).

    Returns the tree's root and the number of blocks emitted.
    """
    level: list[tuple[d.Key, int]] = []  # (first key, bytenr) of the blocks one level down
    for leaf in leaves:
        bytenr = next(addresses)
        sink(
            bytenr,
            d.pack_block(
                leaf.payload, leaf.nritems, 0, bytenr, owner, generation, fsid, chunk_tree_uuid
            ),
        )
        level.append((leaf.first_key, bytenr))
    info, n = serialize_nodes(
        level, addresses, owner, generation, fsid, chunk_tree_uuid, sink, breaks
    )
    return info, n + len(level)


def serialize_nodes(
    level: list[tuple[d.Key, int]],
    addresses: Iterator[int],
    owner: int,
    generation: int,
    fsid: bytes,
    chunk_tree_uuid: bytes,
    sink: BlockSink,
    breaks: Breaks | None = None,
) -> tuple[TreeInfo, int]:
    """``serialize`` above the leaves, which are written already (``level``: each one's
    first key and address, in order): the tree's root and the number of nodes emitted."""
    n = 0
    height = 0
    while len(level) > 1:
        height += 1
        upper: list[tuple[d.Key, int]] = []
        at = 0
        cuts = NO_KEYS if breaks is None else breaks.at(height)
        for count in group_nodes([k for k, _ in level], cuts):
            ptrs = level[at : at + count]
            at += count
            bytenr = next(addresses)
            payload = d.pack_node_payload(ptrs, generation)
            sink(
                bytenr,
                d.pack_block(
                    payload, len(ptrs), height, bytenr, owner, generation, fsid, chunk_tree_uuid
                ),
            )
            upper.append((ptrs[0][0], bytenr))
            n += 1
        level = upper
    return TreeInfo(owner, level[0][1], height), n
