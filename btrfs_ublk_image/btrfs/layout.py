"""Chunks: where each block group sits on its device and in the logical address space.

Device 1 (``meta.img``) holds the SYSTEM chunk and the METADATA chunks; device 2
holds only DATA chunks. Both skip the first MiB (superblock) and keep every
chunk clear of the superblock mirror windows (64 MiB, 256 GiB; the kernel
excludes ``STRIPE_LEN`` bytes there), so no block group needs excluded ranges.
The logical address space is: SYSTEM, then DATA, then METADATA, contiguous, so
data addresses are known before the metadata is sized. A build with a base keeps the
base's chunks where they were (its DATA chunks that it still uses, its METADATA start)
and puts new DATA chunks at ``DELTA_DATA_LOGICAL`` + their device-2 offset: above any
metadata, so metadata never moves for new data, and in device order across a lineage.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from btrfs_ublk_image.btrfs import ondisk as d

if TYPE_CHECKING:
    from btrfs_ublk_image.btrfs.treeblocks import Breaks
    from btrfs_ublk_image.tree import Blob

MiB = 1024 * 1024
GiB = 1024 * MiB
DEVICE_START = 1 * MiB  # nothing below 1 MiB but the superblock
CHUNK_ALIGN = 1 * MiB
SYSTEM_CHUNK_SIZE = 1 * MiB  # 64 chunk-tree blocks: thousands of chunks
MAX_CHUNK_SIZE = 1 * GiB  # conventional: mkfs/kernel data chunks are 1 GiB
SYSTEM_LOGICAL = 1 * MiB
DELTA_DATA_LOGICAL = 1 << 50  # 1 PiB: new data of a build with a base (see above)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk = one block group = one dev extent (SINGLE profile)."""

    logical: int
    length: int
    type: int  # BLOCK_GROUP_{SYSTEM,METADATA,DATA}
    devid: int
    physical: int

    @property
    def end(self) -> int:
        return self.logical + self.length


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def device_ranges(start: int) -> Iterator[tuple[int, int]]:
    """Physical [start, end) ranges a chunk may occupy: <= 1 GiB, never over a mirror."""
    cur = start
    while True:
        nxt = next((m for m in d.SUPER_MIRRORS if m >= cur), None)
        limit = cur + MAX_CHUNK_SIZE if nxt is None else min(cur + MAX_CHUNK_SIZE, nxt)
        if limit > cur:
            yield cur, limit
            cur = limit
        if nxt is not None and cur == nxt:
            cur = nxt + CHUNK_ALIGN  # skip the whole MiB holding the mirror


def allocate(
    nbytes: int, ctype: int, devid: int, physical_start: int, logical_start: int
) -> list[Chunk]:
    """Chunks that hold ``nbytes`` (at least one chunk of 1 MiB), contiguous in logical space."""
    want = max(align_up(nbytes, CHUNK_ALIGN), CHUNK_ALIGN)
    chunks: list[Chunk] = []
    logical = logical_start
    for start, end in device_ranges(physical_start):
        length = min(end - start, want)
        chunks.append(Chunk(logical, length, ctype, devid, start))
        logical += length
        want -= length
        if want == 0:
            return chunks
    raise AssertionError("unreachable")


def system_chunk() -> Chunk:
    return Chunk(SYSTEM_LOGICAL, SYSTEM_CHUNK_SIZE, d.BLOCK_GROUP_SYSTEM, 1, DEVICE_START)


@dataclass(frozen=True, slots=True)
class BaseLayout:
    """What a build with a base (``build --base``) keeps of the base's layout, read once from
    the base's meta.img (``base.py``): its inode numbering and data extents (steps 1-2 of
    ``writer``'s docstring) and its tree blocks (see that docstring's last paragraph)."""

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
