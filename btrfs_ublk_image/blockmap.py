"""The blockmap (binary, version 1 or 2): device-2 ranges -> pack ranges, pack chunk digests.

The format is specified in ``docs/bundle-format.md``; ublkd reads it on its I/O path.
Version 2 (written only for bundles with pack compression) adds, per pack, its stored
size and, per chunk, where its stored bytes are and whether they are a zstd frame.
``read_chunk`` is the one way to turn a chunk's stored bytes into its verified content.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO, overload

from btrfs_ublk_image.errors import ImageError

MAGIC = b"BUIBMAP\0"
VERSION = 1
VERSION_COMPRESSED = 2
_HEADER = struct.Struct("<8sIIQII Q24x".replace(" ", ""))
_PACK = struct.Struct("<32sQQ")
_PACK_V2 = struct.Struct("<32sQQQI4x")
_RANGE = struct.Struct("<QQIIQ")
_CHUNK = struct.Struct("<QII")
DIGEST_SIZE = 32
PACK_COMPRESSED = 1  # v2 pack flag: its chunks may be zstd frames
CHUNK_ZSTD = 1  # v2 chunk flag: the stored bytes are one zstd frame


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """Where a chunk's bytes are in the pack file (v2), and how they are stored."""

    offset: int
    length: int
    zstd: bool


@dataclass(frozen=True, slots=True)
class PackEntry:
    id: bytes  # sha256 over chunk_digests
    size: int  # logical (uncompressed) size: ranges point into these bytes
    chunk_digests: list[bytes]  # sha256 of each chunk's STORED bytes
    # v2 only: per chunk, its stored bytes (None: stored raw at i * chunk_size)
    stored: list[StoredChunk] | None = None

    @property
    def compressed(self) -> bool:
        return self.stored is not None and any(c.zstd for c in self.stored)

    @property
    def stored_size(self) -> int:
        """The pack file's size."""
        if self.stored is None:
            return self.size
        return sum(c.length for c in self.stored)

    def stored_chunk(self, index: int, chunk_size: int) -> StoredChunk:
        if self.stored is not None:
            return self.stored[index]
        start = index * chunk_size
        return StoredChunk(start, min(chunk_size, self.size - start), False)


@dataclass(frozen=True, slots=True)
class Range:
    """Device-2 bytes [dev_offset, dev_offset + length) are pack ``pack`` from ``pack_offset``."""

    dev_offset: int
    length: int
    pack: int
    pack_offset: int


class Ranges(Sequence[Range]):
    """Ranges as four columns (``array("Q")`` each), one row per range: what the writer
    makes and ``decode`` reads, encoded and checked without a ``Range`` per row (an image
    has one per data extent, tens of thousands); a ``Range`` is made when a row is read."""

    __slots__ = ("dev_offset", "length", "pack", "pack_offset")

    def __init__(
        self,
        dev_offset: array[int],
        length: array[int],
        pack: array[int],
        pack_offset: array[int],
    ) -> None:
        if not len(dev_offset) == len(length) == len(pack) == len(pack_offset):
            raise ValueError("range columns of different lengths")
        self.dev_offset, self.length, self.pack, self.pack_offset = (
            dev_offset,
            length,
            pack,
            pack_offset,
        )

    @classmethod
    def of(cls, ranges: Iterable[Range]) -> Ranges:
        """``ranges`` as columns (itself when it is a ``Ranges``)."""
        if isinstance(ranges, Ranges):
            return ranges
        rows = list(ranges)
        return cls(
            array("Q", [r.dev_offset for r in rows]),
            array("Q", [r.length for r in rows]),
            array("Q", [r.pack for r in rows]),
            array("Q", [r.pack_offset for r in rows]),
        )

    def __len__(self) -> int:
        return len(self.dev_offset)

    @overload
    def __getitem__(self, i: int) -> Range: ...
    @overload
    def __getitem__(self, i: slice) -> list[Range]: ...
    def __getitem__(self, i: int | slice) -> Range | list[Range]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return Range(self.dev_offset[i], self.length[i], self.pack[i], self.pack_offset[i])

    def __iter__(self) -> Iterator[Range]:
        return map(Range, self.dev_offset, self.length, self.pack, self.pack_offset)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        o = Ranges.of(other)
        return (self.dev_offset, self.length, self.pack, self.pack_offset) == (
            o.dev_offset,
            o.length,
            o.pack,
            o.pack_offset,
        )

    __hash__ = None  # type: ignore[assignment]

    def with_first(self, r: Range) -> Ranges:
        """These ranges after ``r`` (which lies before the first of them)."""
        return Ranges(
            array("Q", [r.dev_offset]) + self.dev_offset,
            array("Q", [r.length]) + self.length,
            array("Q", [r.pack]) + self.pack,
            array("Q", [r.pack_offset]) + self.pack_offset,
        )

    def renumbered(self, packs: Mapping[int, int]) -> Ranges:
        """These ranges with pack ``n`` as ``packs[n]``."""
        return Ranges(
            self.dev_offset,
            self.length,
            array("Q", map(packs.__getitem__, self.pack)),
            self.pack_offset,
        )

    def encode(self) -> bytes:
        """The blockmap's range records (``_RANGE``, flags 0), in order."""
        rows = array("Q", bytes(8 * 4 * len(self)))
        # a record is 4 little-endian u64 words: the u32 pack and u32 flags (0) make one
        rows[0::4], rows[1::4], rows[2::4], rows[3::4] = (
            self.dev_offset,
            self.length,
            self.pack,
            self.pack_offset,
        )
        if max(self.pack, default=0) > 0xFFFFFFFF:
            raise ImageError("blockmap: a pack number does not fit 32 bits")
        if sys.byteorder == "big":
            rows.byteswap()
        return rows.tobytes()

    @classmethod
    def decode(cls, data: bytes | memoryview, n: int) -> Ranges:
        """``n`` range records (``_RANGE``) from ``data``; their flags are ignored."""
        words, halves = array("Q"), array("I")
        words.frombytes(data[: n * _RANGE.size])
        halves.frombytes(data[: n * _RANGE.size])
        if sys.byteorder == "big":
            words.byteswap()
            halves.byteswap()
        return cls(words[0::4], words[1::4], array("Q", halves[4::8]), words[3::4])


@dataclass(frozen=True, slots=True)
class BlockMap:
    chunk_shift: int
    device_size: int
    packs: list[PackEntry]
    ranges: Sequence[Range]  # sorted by dev_offset, non-overlapping (``Ranges`` from decode)
    version: int = VERSION  # VERSION_COMPRESSED: chunk tables (pack compression on)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", Ranges.of(self.ranges))  # columns, whatever came

    @property
    def chunk_size(self) -> int:
        return 1 << self.chunk_shift

    def encode(self) -> bytes:
        parts = [
            _HEADER.pack(
                MAGIC,
                self.version,
                self.chunk_shift,
                self.device_size,
                len(self.packs),
                0,
                len(self.ranges),
            )
        ]
        first = 0
        v2 = self.version == VERSION_COMPRESSED
        for p in self.packs:
            if v2:
                flags = PACK_COMPRESSED if p.compressed else 0
                parts.append(_PACK_V2.pack(p.id, p.size, first, p.stored_size, flags))
            else:
                assert p.stored is None, "a stored-chunk table needs blockmap version 2"
                parts.append(_PACK.pack(p.id, p.size, first))
            first += len(p.chunk_digests)
        parts.append(Ranges.of(self.ranges).encode())
        parts.extend(dg for p in self.packs for dg in p.chunk_digests)
        if v2:
            for p in self.packs:
                for i in range(len(p.chunk_digests)):
                    c = p.stored_chunk(i, self.chunk_size)
                    parts.append(_CHUNK.pack(c.offset, c.length, CHUNK_ZSTD if c.zstd else 0))
        return b"".join(parts)

    def check(self) -> None:
        """Invariants a writer must keep (and a reader may rely on)."""
        end = 0
        sizes = [p.size for p in self.packs]
        r = Ranges.of(self.ranges)
        for dev_offset, length, pack, pack_offset in zip(
            r.dev_offset, r.length, r.pack, r.pack_offset, strict=True
        ):
            if dev_offset % 4096 or dev_offset < end or length <= 0:
                raise ImageError(f"blockmap: bad range at device offset {dev_offset}")
            if pack >= len(sizes) or pack_offset + length > sizes[pack]:
                raise ImageError(f"blockmap: range at {dev_offset} points outside pack {pack}")
            end = dev_offset + length
        if end > self.device_size:
            raise ImageError("blockmap: a range ends past the device size")
        for i, p in enumerate(self.packs):
            if p.stored is None:
                continue
            if self.version != VERSION_COMPRESSED or len(p.stored) != len(p.chunk_digests):
                raise ImageError(f"blockmap: pack {i}: stored-chunk table does not fit")
            at = 0
            for n, c in enumerate(p.stored):
                logical = min(self.chunk_size, p.size - n * self.chunk_size)
                # stored chunks are contiguous, in order; a raw one is exactly its content
                if c.offset != at or c.length <= 0 or (not c.zstd and c.length != logical):
                    raise ImageError(f"blockmap: pack {i} chunk {n}: bad stored extent")
                at += c.length

    def lookup(self, offset: int) -> Range | None:
        """The range holding device-2 byte ``offset``, or None (the byte reads as zero)."""
        r = Ranges.of(self.ranges)
        i = bisect.bisect_right(r.dev_offset, offset) - 1
        if i >= 0 and offset < r.dev_offset[i] + r.length[i]:
            return r[i]
        return None


def decode(data: bytes, where: str = "blockmap") -> BlockMap:
    if len(data) < _HEADER.size:
        raise ImageError(f"{where}: truncated header")
    magic, version, shift, dev_size, n_packs, _, n_ranges = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ImageError(f"{where}: not a blockmap (bad magic)")
    if version not in (VERSION, VERSION_COMPRESSED):
        raise ImageError(f"{where}: unsupported blockmap version {version}")
    v2 = version == VERSION_COMPRESSED
    pack_struct = _PACK_V2 if v2 else _PACK
    pos = _HEADER.size
    heads = []
    for _ in range(n_packs):
        if len(data) < pos + pack_struct.size:
            raise ImageError(f"{where}: truncated pack table")
        head = pack_struct.unpack_from(data, pos)
        heads.append((head[0], head[1], head[2], head[4] if v2 else 0, head[3] if v2 else None))
        pos += pack_struct.size
    if len(data) < pos + n_ranges * _RANGE.size:
        raise ImageError(f"{where}: size does not match its tables (truncated?)")
    ranges = Ranges.decode(memoryview(data)[pos:], n_ranges)
    pos += n_ranges * _RANGE.size
    total = sum(-(-size // (1 << shift)) for _, size, _, _, _ in heads)
    table = pos + total * DIGEST_SIZE  # v2: the stored-chunk table follows the digests
    if len(data) != table + (total * _CHUNK.size if v2 else 0):
        raise ImageError(f"{where}: size does not match its tables (truncated?)")
    packs: list[PackEntry] = []
    for pid, size, first, flags, stored_size in heads:
        n = -(-size // (1 << shift))
        start = pos + first * DIGEST_SIZE
        digests = [data[start + i * DIGEST_SIZE : start + (i + 1) * DIGEST_SIZE] for i in range(n)]
        stored = None
        if v2:
            at = table + first * _CHUNK.size
            stored = []
            for i in range(n):
                off, length, cflags = _CHUNK.unpack_from(data, at + i * _CHUNK.size)
                stored.append(StoredChunk(off, length, bool(cflags & CHUNK_ZSTD)))
            if not flags & PACK_COMPRESSED and any(c.zstd for c in stored):
                raise ImageError(f"{where}: pack {len(packs)}: zstd chunks in an uncompressed pack")
        entry = PackEntry(pid, size, digests, stored)
        if stored_size is not None and stored_size != entry.stored_size:
            raise ImageError(f"{where}: pack {len(packs)}: stored size differs from its chunks")
        packs.append(entry)
    bm = BlockMap(shift, dev_size, packs, ranges, version)
    bm.check()
    return bm


def read_chunk(f: BinaryIO, bm: BlockMap, pack: int, index: int, where: str) -> bytes:
    """Chunk ``index`` of pack ``pack`` (open as ``f``, named ``where``): its stored bytes
    checked against the digest table, then (a zstd frame) decompressed to exactly the
    chunk's logical length. Any mismatch raises ``ImageError``."""
    entry = bm.packs[pack]
    c = entry.stored_chunk(index, bm.chunk_size)
    f.seek(c.offset)
    data = f.read(c.length)
    if hashlib.sha256(data).digest() != entry.chunk_digests[index]:
        raise ImageError(
            f"{where}: pack chunk {index} (bytes {c.offset}..{c.offset + c.length}) does"
            " not match its sha256 in the blockmap: the pack is corrupt or truncated"
        )
    if not c.zstd:
        return data
    import zstandard  # compressed packs only: its 11 MiB library is not loaded otherwise

    logical = min(bm.chunk_size, entry.size - index * bm.chunk_size)
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=logical)
    except zstandard.ZstdError as e:
        raise ImageError(f"{where}: pack chunk {index}: bad zstd frame: {e}") from None
    if len(out) != logical:
        raise ImageError(
            f"{where}: pack chunk {index} decompresses to {len(out)} bytes, not {logical}"
        )
    return out
