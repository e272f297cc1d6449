"""B-trees from sorted items: leaves filled greedily, then internal nodes level by level.

A tree is planned in two steps because block addresses and item contents
depend on each other (the extent tree lists every tree block, including its
own): ``plan`` needs only item sizes and says how many blocks a tree takes;
``serialize`` takes the addresses and emits the blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from btrfs_ublk_image.btrfs import ondisk as d


def split_leaves(sizes: Sequence[int]) -> list[int]:
    """Number of items in each leaf, filling leaves in order."""
    counts: list[int] = []
    used = 0
    n = 0
    for size in sizes:
        if size > d.MAX_ITEM_DATA:
            raise ValueError(f"item of {size} bytes does not fit in a {d.NODESIZE}-byte leaf")
        need = d.ITEM_SIZE + size
        if used + need > d.LEAF_DATA_SIZE:
            counts.append(n)
            used, n = 0, 0
        used += need
        n += 1
    counts.append(n)  # an empty tree is one empty leaf
    return counts


def level_sizes(n_leaves: int) -> list[int]:
    """Blocks per level, leaves first: [leaves, level-1 nodes, ..., 1]."""
    sizes = [n_leaves]
    while sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // d.NODEPTRS_PER_BLOCK))
    return sizes


def block_levels(sizes: Sequence[int]) -> list[int]:
    """The level of each block of a tree with these item sizes, in ``serialize``'s order."""
    return [lvl for lvl, n in enumerate(level_sizes(len(split_leaves(sizes)))) for _ in range(n)]


@dataclass(frozen=True, slots=True)
class TreeInfo:
    owner: int
    root: int  # bytenr of the root block
    level: int
    blocks: list[int]  # bytenr of every block


def serialize(
    items: Sequence[tuple[d.Key, bytes]],
    addresses: Iterator[int],
    owner: int,
    generation: int,
    fsid: bytes,
    chunk_tree_uuid: bytes,
) -> tuple[TreeInfo, list[tuple[int, bytes]]]:
    """Blocks of one tree as (bytenr, 16 KiB); takes one address per block from ``addresses``."""
    out: list[tuple[int, bytes]] = []
    level: list[tuple[d.Key, int]] = []  # (first key, bytenr) of the blocks one level down
    pos = 0
    for count in split_leaves([len(data) for _, data in items]):
        chunk = items[pos : pos + count]
        pos += count
        bytenr = next(addresses)
        out.append(
            (bytenr, d.pack_leaf(list(chunk), bytenr, owner, generation, fsid, chunk_tree_uuid))
        )
        level.append((chunk[0][0] if chunk else (0, 0, 0), bytenr))
    height = 0
    while len(level) > 1:
        height += 1
        upper: list[tuple[d.Key, int]] = []
        for i in range(0, len(level), d.NODEPTRS_PER_BLOCK):
            ptrs = level[i : i + d.NODEPTRS_PER_BLOCK]
            bytenr = next(addresses)
            out.append(
                (
                    bytenr,
                    d.pack_node(ptrs, height, bytenr, owner, generation, fsid, chunk_tree_uuid),
                )
            )
            upper.append((ptrs[0][0], bytenr))
        level = upper
    return TreeInfo(owner, level[0][1], height, [b for b, _ in out]), out
