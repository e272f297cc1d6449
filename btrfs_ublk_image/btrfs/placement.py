"""Step 2 of the writer (``writer``): data extents laid out on device 2 (``DataPlacer``)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

from btrfs_ublk_image import native
from btrfs_ublk_image.blockmap import Ranges
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.btrfs.encoded import COMPRESS_ZSTD, EncodedExtents
from btrfs_ublk_image.btrfs.layout import (
    CHUNK_ALIGN,
    DELTA_DATA_LOGICAL,
    DEVICE_START,
    BaseLayout,
    Chunk,
    align_up,
    device_ranges,
)
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.tree import Blob

# MAX_CSUM_ITEMS of the kernel's file-item.c for 16 KiB nodes and 4-byte CRC-32C
MAX_CSUMS_PER_ITEM = (d.LEAF_DATA_SIZE - 2 * d.ITEM_SIZE) // 4 - 1


def free_ranges(chunk: Chunk, taken: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
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


class DataPlacer:
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
            free[c.logical] = free_ranges(c, taken)
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
