"""The blockmap (binary, version 1): device-2 ranges -> pack ranges, and pack chunk digests.

The format is specified in ``docs/bundle-format.md``; ublkd reads it on its I/O path.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

from btrfs_ublk_image.errors import ImageError

MAGIC = b"BUIBMAP\0"
VERSION = 1
_HEADER = struct.Struct("<8sIIQII Q24x".replace(" ", ""))
_PACK = struct.Struct("<32sQQ")
_RANGE = struct.Struct("<QQIIQ")
DIGEST_SIZE = 32


@dataclass(frozen=True, slots=True)
class PackEntry:
    id: bytes
    size: int
    chunk_digests: list[bytes]


@dataclass(frozen=True, slots=True)
class Range:
    dev_offset: int
    length: int
    pack: int
    pack_offset: int


@dataclass(frozen=True, slots=True)
class BlockMap:
    chunk_shift: int
    device_size: int
    packs: list[PackEntry]
    ranges: list[Range]  # sorted by dev_offset, non-overlapping

    @property
    def chunk_size(self) -> int:
        return 1 << self.chunk_shift

    def encode(self) -> bytes:
        parts = [
            _HEADER.pack(
                MAGIC,
                VERSION,
                self.chunk_shift,
                self.device_size,
                len(self.packs),
                0,
                len(self.ranges),
            )
        ]
        first = 0
        for p in self.packs:
            parts.append(_PACK.pack(p.id, p.size, first))
            first += len(p.chunk_digests)
        parts.extend(
            _RANGE.pack(r.dev_offset, r.length, r.pack, 0, r.pack_offset) for r in self.ranges
        )
        parts.extend(dg for p in self.packs for dg in p.chunk_digests)
        return b"".join(parts)

    def check(self) -> None:
        """Invariants a writer must keep (and a reader may rely on)."""
        end = 0
        for r in self.ranges:
            if r.dev_offset % 4096 or r.dev_offset < end or r.length <= 0:
                raise ImageError(f"blockmap: bad range at device offset {r.dev_offset}")
            if r.pack >= len(self.packs) or r.pack_offset + r.length > self.packs[r.pack].size:
                raise ImageError(f"blockmap: range at {r.dev_offset} points outside pack {r.pack}")
            end = r.dev_offset + r.length
        if end > self.device_size:
            raise ImageError("blockmap: a range ends past the device size")

    def lookup(self, offset: int) -> Range | None:
        """The range holding device-2 byte ``offset``, or None (the byte reads as zero)."""
        i = bisect.bisect_right(self.ranges, offset, key=lambda r: r.dev_offset) - 1
        if i >= 0 and offset < self.ranges[i].dev_offset + self.ranges[i].length:
            return self.ranges[i]
        return None


def decode(data: bytes, where: str = "blockmap") -> BlockMap:
    if len(data) < _HEADER.size:
        raise ImageError(f"{where}: truncated header")
    magic, version, shift, dev_size, n_packs, _, n_ranges = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ImageError(f"{where}: not a blockmap (bad magic)")
    if version != VERSION:
        raise ImageError(f"{where}: unsupported blockmap version {version}")
    pos = _HEADER.size
    heads = []
    for _ in range(n_packs):
        heads.append(_PACK.unpack_from(data, pos))
        pos += _PACK.size
    ranges = []
    for _ in range(n_ranges):
        off, length, pack, _flags, poff = _RANGE.unpack_from(data, pos)
        ranges.append(Range(off, length, pack, poff))
        pos += _RANGE.size
    packs = []
    for pid, size, first in heads:
        n = -(-size // (1 << shift))
        start = pos + first * DIGEST_SIZE
        digests = [data[start + i * DIGEST_SIZE : start + (i + 1) * DIGEST_SIZE] for i in range(n)]
        if len(data) < start + n * DIGEST_SIZE:
            raise ImageError(f"{where}: truncated digest table")
        packs.append(PackEntry(pid, size, digests))
    bm = BlockMap(shift, dev_size, packs, ranges)
    bm.check()
    return bm
