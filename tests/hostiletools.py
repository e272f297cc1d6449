"""Crafting hostile bundles: one defect at a time in a copy of a good bundle's ``meta.img``
or blockmap, with the tree block's (or superblock's) crc32c recomputed and the manifest's
sha256 of the file fixed, so that only the structural check can find the defect, not a
checksum or a hash.

Layouts come from the project's reader (``btrfs_ublk_image.reader``: header, item, key
pointer structs; chunk mapping) and ``btrfs.ondisk`` (sizes, key types, checksums).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from btrfs_ublk_image import blockmap as bmap
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.reader import _HEADER, _ITEM, _KEY_PTR, Filesystem

Key = tuple[int, int, int]

# byte offsets inside structures, named as the kernel's struct members
CSUM_SIZE = 32  # btrfs_header.csum, btrfs_super_block.csum
HEADER_GENERATION = 80  # btrfs_header.generation
HEADER_OWNER = 88
HEADER_NRITEMS = 96
HEADER_LEVEL = 100
SUPER_ROOT_LEVEL = 198  # btrfs_super_block.root_level
SUPER_SYS_ARRAY = 0x32B  # btrfs_super_block.sys_chunk_array
ROOT_ITEM_GENERATION = 160  # btrfs_root_item.generation (after the inode item)
ROOT_ITEM_BYTENR = 176
ROOT_ITEM_LEVEL = 238
INODE_NBYTES = 24  # btrfs_inode_item.nbytes
DEV_ITEM_TOTAL_BYTES = 8  # btrfs_dev_item.total_bytes
CHUNK_LENGTH = 0  # btrfs_chunk.length
CHUNK_STRIPE0_OFFSET = 56  # btrfs_chunk.stripe[0].offset
FE_RAM_BYTES = 8  # btrfs_file_extent_item
FE_TYPE = 20
FE_DISK_BYTENR = 21
FE_OFFSET = 37
DIR_NAME_LEN = 27  # btrfs_dir_item.name_len


def set_file_digest(bundle: Path, name: str) -> None:
    """Make manifest.json's sha256 of `name` match the file again (a new image id)."""
    m = json.loads((bundle / "manifest.json").read_text())
    m["files"][name]["sha256"] = (
        "sha256:" + hashlib.sha256((bundle / name).read_bytes()).hexdigest()
    )
    (bundle / "manifest.json").write_text(json.dumps(m, indent=2))


@dataclass
class Block:
    """A copy of one tree block; change ``data`` and hand it to ``Meta.put``."""

    bytenr: int
    physical: int
    level: int
    owner: int
    data: bytearray

    @property
    def nritems(self) -> int:
        n: int = struct.unpack_from("<I", self.data, HEADER_NRITEMS)[0]
        return n

    def set(self, fmt: str, at: int, *values: int) -> None:
        struct.pack_into(fmt, self.data, at, *values)


@dataclass
class Item:
    """Leaf item ``index`` of ``block``: its key and where its data lies in the block."""

    block: Block
    index: int
    key: Key
    size: int
    data_at: int  # the data's position in the block

    @property
    def header_at(self) -> int:
        return d.HEADER_SIZE + self.index * d.ITEM_SIZE

    @property
    def data(self) -> bytes:
        return bytes(self.block.data[self.data_at : self.data_at + self.size])

    def set(self, fmt: str, at: int, *values: int) -> None:
        """Pack into the item's data at ``at``."""
        self.block.set(fmt, self.data_at + at, *values)

    def set_key(self, key: Key) -> None:
        self.block.data[self.header_at : self.header_at + d.DISK_KEY_SIZE] = d.pack_disk_key(key)

    def set_offset_size(self, offset: int, size: int) -> None:
        """The item header's data offset (from the end of the block header) and size."""
        self.block.set("<II", self.header_at + d.DISK_KEY_SIZE, offset, size)


@dataclass
class Pointer:
    """Key pointer ``index`` of a node."""

    block: Block
    index: int
    key: Key
    child: int
    generation: int

    @property
    def at(self) -> int:
        return d.HEADER_SIZE + self.index * d.KEY_PTR_SIZE

    def set_key(self, key: Key) -> None:
        self.block.data[self.at : self.at + d.DISK_KEY_SIZE] = d.pack_disk_key(key)

    def set_child(self, bytenr: int) -> None:
        self.block.set("<Q", self.at + d.DISK_KEY_SIZE, bytenr)


class Meta:
    """A bundle's meta.img in memory, its layout read by the project's reader."""

    def __init__(self, bundle: Path) -> None:
        self.bundle = bundle
        with Filesystem(str(bundle)) as fs:
            self.sb = fs.sb
            self.fs_root = fs.fs_root
            self.chunks = list(fs.chunks)
            self._map = fs.map_logical
        self.img = bytearray((bundle / "meta.img").read_bytes())
        self.fsid = self.sb.fsid

    # --- blocks ---------------------------------------------------------------------
    def block(self, bytenr: int) -> Block:
        _chunk, devid, physical = self._map(bytenr, self.sb.nodesize)
        assert devid == 1, f"tree block {bytenr} on devid {devid}"
        data = bytearray(self.img[physical : physical + self.sb.nodesize])
        h = _HEADER.unpack_from(data, 0)
        return Block(bytenr, physical, h[8], h[6], data)

    def blocks(self, root: int) -> Iterator[Block]:
        """Every block of the tree at ``root``, depth first, parents before children."""
        b = self.block(root)
        yield b
        for p in self.pointers(b):
            yield from self.blocks(p.child)

    def pointers(self, b: Block) -> list[Pointer]:
        if b.level == 0:
            return []
        out = []
        for i in range(b.nritems):
            oid, ty, off, child, gen = _KEY_PTR.unpack_from(
                b.data, d.HEADER_SIZE + i * d.KEY_PTR_SIZE
            )
            out.append(Pointer(b, i, (oid, ty, off), child, gen))
        return out

    def items(self, b: Block) -> list[Item]:
        out = []
        for i in range(b.nritems if b.level == 0 else 0):
            oid, ty, off, doff, size = _ITEM.unpack_from(b.data, d.HEADER_SIZE + i * d.ITEM_SIZE)
            out.append(Item(b, i, (oid, ty, off), size, d.HEADER_SIZE + doff))
        return out

    def find(self, root: int, want: Callable[[Item], bool]) -> Item:
        """The first leaf item of the tree at ``root`` that ``want`` accepts."""
        for b in self.blocks(root):
            for it in self.items(b):
                if want(it):
                    return it
        raise AssertionError(f"no such item in the tree at {root}")

    def fs_leaves(self) -> list[Block]:
        return [b for b in self.blocks(self.fs_root) if b.level == 0]

    def put(self, b: Block) -> None:
        """Write the block back with its checksum recomputed."""
        b.data[:CSUM_SIZE] = d.csum(b.data[CSUM_SIZE:])
        self.img[b.physical : b.physical + len(b.data)] = b.data

    # --- the superblock ---------------------------------------------------------------
    def patch_super(self, fmt: str, at: int, *values: int) -> None:
        """Change the superblock at ``at`` and recompute its checksum."""
        s = d.SUPER_INFO_OFFSET
        sb = bytearray(self.img[s : s + d.SUPER_INFO_SIZE])
        struct.pack_into(fmt, sb, at, *values)
        sb[:CSUM_SIZE] = d.csum(sb[CSUM_SIZE:])
        self.img[s : s + d.SUPER_INFO_SIZE] = sb

    def save(self) -> None:
        """meta.img written back, the manifest's digest of it fixed."""
        (self.bundle / "meta.img").write_bytes(self.img)
        set_file_digest(self.bundle, "meta.img")


def rewrite_blockmap(bundle: Path, change: Callable[[list[bmap.Range]], None]) -> None:
    """The blockmap with its ranges changed in place by ``change`` (the file re-encoded
    as it is, unchecked), the manifest's digest of it fixed."""
    bm = bmap.decode((bundle / "blockmap").read_bytes())
    ranges = list(bm.ranges)
    change(ranges)
    out = bmap.BlockMap(bm.chunk_shift, bm.device_size, bm.packs, ranges, bm.version)
    (bundle / "blockmap").write_bytes(out.encode())
    set_file_digest(bundle, "blockmap")


def kmsg_mark() -> int:
    """An open /dev/kmsg positioned after the last record so far (``kmsg_since`` reads on)."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    os.lseek(fd, 0, os.SEEK_END)
    return fd


def kmsg_since(fd: int) -> list[str]:
    """The kernel log records written since ``kmsg_mark`` (the fd is closed)."""
    out = []
    try:
        while True:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten before we read them: go on
                continue
            out.append(rec.decode(errors="replace").split(";", 1)[-1].rstrip("\n"))
    finally:
        os.close(fd)
    return out
