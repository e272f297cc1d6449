"""btrfs zstd-compressed file extents (``pack_compression: btrfs-zstd``), stored as the
kernel stores them, so device 2 serves them as they are and the kernel decompresses.

What the kernel writes and reads (checked on 6.18 with ``mount -o compress-force=zstd``,
docs/btrfs-layout.md): a compressed extent holds at most 128 KiB of file data
(BTRFS_MAX_UNCOMPRESSED) as ONE zstd frame (window <= 128 KiB: the kernel's workspace
has windowLog 17) zero-padded to whole 4 KiB sectors; its file extent item has
compression 3, disk_num_bytes = the padded frame, ram_bytes = num_bytes = the data
rounded up to sectors (a short frame is zero-filled). Data that does not shrink is an
ordinary extent. Compressed extents must carry data checksums: ``btrfs check`` reports a
compressed extent of a NODATASUM inode as "some csum missing", so files in this mode are
datasum inodes and the csum tree holds a CRC-32C of every stored sector.

``EncodedExtents`` records, per stored blob, its extents in pack order as flat arrays:
the pack holds each extent's stored bytes back to back WITHOUT the sector padding (a
blockmap range may be shorter than the extent: the device reads zeros past it).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from btrfs_ublk_image.btrfs.ondisk import MAX_EXTENT_SIZE, SECTORSIZE
from btrfs_ublk_image.crc import crc32c

COMPRESSED_EXTENT = 128 * 1024  # BTRFS_MAX_UNCOMPRESSED: file bytes per compressed extent
ZSTD_WINDOW_LOG = 17  # ZSTD_BTRFS_MAX_WINDOWLOG: the kernel cannot decompress larger windows
ZSTD_LEVEL = 3  # the kernel's default zstd level
COMPRESS_ZSTD = 3  # BTRFS_COMPRESS_ZSTD (file extent item ``compression``)


def sector_csums(stored: bytes | memoryview) -> array[int]:
    """CRC-32C of each 4 KiB sector of ``stored`` zero-padded to whole sectors."""
    out = array("I")
    view = memoryview(stored)
    full = len(view) - len(view) % SECTORSIZE
    for at in range(0, full, SECTORSIZE):
        out.append(crc32c(view[at : at + SECTORSIZE]))
    if full < len(view):
        out.append(crc32c(bytes(view[full:]) + bytes(SECTORSIZE - (len(view) - full))))
    return out


@dataclass(frozen=True, slots=True)
class StoredExtent:
    """One extent of a stored blob: ``stored`` bytes at ``pack_offset`` (the padding to
    ``disk_bytes`` is zeros), holding file bytes [file_offset, file_offset + length)."""

    pack_offset: int
    stored: int
    length: int  # file bytes (the last extent of a blob may end mid-sector)
    zstd: bool
    csum_first: int  # index of its first sector's CRC in ``EncodedExtents.csums``

    @property
    def disk_bytes(self) -> int:
        return -(-self.stored // SECTORSIZE) * SECTORSIZE

    @property
    def ram_bytes(self) -> int:
        return -(-self.length // SECTORSIZE) * SECTORSIZE


class EncodedExtents:
    """The extents of every blob stored in btrfs-zstd form, keyed by (pack, offset)."""

    def __init__(self) -> None:
        self.stored = array("Q")
        self.length = array("Q")
        self.zstd = array("B")
        self.csum_first = array("Q")
        self.csums = array("I")
        self._blobs: dict[tuple[int, int], tuple[int, int]] = {}  # -> (first extent, count)
        self._pack_offset = array("Q")
        self._open = 0  # index of the first extent of the blob being added

    def __len__(self) -> int:
        return len(self.stored)

    def mark(self) -> tuple[int, int]:
        return len(self.stored), len(self.csums)

    def rollback(self, mark: tuple[int, int]) -> None:
        """Forget the extents added since ``mark`` (content deduplicated away)."""
        n, c = mark
        for a in (self.stored, self.length, self.zstd, self.csum_first, self._pack_offset):
            del a[n:]
        del self.csums[c:]

    def add(self, pack_offset: int, stored: bytes | memoryview, length: int, zstd: bool) -> None:
        """An extent whose stored bytes are ``stored``; a raw one continues the previous raw
        extent of the same blob when that stays within 128 MiB and sector-aligned."""
        csums = sector_csums(stored)
        if (
            not zstd
            and self.zstd
            and not self.zstd[-1]
            and len(self.stored) > self._open
            and self.length[-1] % SECTORSIZE == 0
            and self.length[-1] + length <= MAX_EXTENT_SIZE
        ):
            self.stored[-1] += len(stored)
            self.length[-1] += length
            self.csums.extend(csums)
            return
        self.stored.append(len(stored))
        self.length.append(length)
        self.zstd.append(1 if zstd else 0)
        self.csum_first.append(len(self.csums))
        self._pack_offset.append(pack_offset)
        self.csums.extend(csums)

    def begin(self) -> None:
        self._open = len(self.stored)

    def end(self, pack: int, offset: int) -> None:
        """The extents added since ``begin`` are the blob at (pack, offset)."""
        self._blobs[(pack, offset)] = (self._open, len(self.stored) - self._open)

    def stored_size(self, pack: int, offset: int) -> int | None:
        """The stored bytes of the blob at (pack, offset), or None when not recorded."""
        found = self._blobs.get((pack, offset))
        if found is None:
            return None
        first, count = found
        return sum(self.stored[first : first + count])

    def extents(self, pack: int, offset: int) -> list[StoredExtent] | None:
        found = self._blobs.get((pack, offset))
        if found is None:
            return None
        first, count = found
        return [
            StoredExtent(
                self._pack_offset[i],
                self.stored[i],
                self.length[i],
                bool(self.zstd[i]),
                self.csum_first[i],
            )
            for i in range(first, first + count)
        ]


class ZstdExtentEncoder:
    """Cuts a blob's bytes into 128 KiB pieces and stores each as the kernel would: one
    zstd frame when that is smaller in whole sectors, else the raw bytes."""

    def __init__(self) -> None:
        import zstandard  # btrfs-zstd builds only: its library is not loaded otherwise

        params = zstandard.ZstdCompressionParameters.from_level(
            ZSTD_LEVEL, window_log=ZSTD_WINDOW_LOG, write_content_size=1, write_checksum=0
        )
        self._cctx = zstandard.ZstdCompressor(compression_params=params)

    def encode(self, piece: bytes) -> tuple[bytes, bool]:
        """(stored bytes, is a zstd frame) of one piece of at most 128 KiB."""
        frame = self._cctx.compress(piece)
        # as the kernel: compressed only when it saves at least one sector
        if -(-len(frame) // SECTORSIZE) < -(-len(piece) // SECTORSIZE):
            return frame, True
        return piece, False
