"""An independent reader of a bundle's btrfs filesystem: no root, no mount, no writer code.

It reads only what is on disk (``meta.img``, ``blockmap``, ``packs/``), following
the btrfs format as the kernel does:

* the superblock of ``meta.img`` (checksum, magic, fsid, devid 1) and its
  ``sys_chunk_array``, which maps the SYSTEM chunk so that the chunk tree can be
  read; the chunk tree then maps every logical address: metadata to device 1
  (``meta.img``), data to device 2;
* every tree block is checked before use: CRC-32C, ``bytenr``, fsid, level and
  owner, and its keys must be sorted;
* the root tree gives the fs tree, whose items are read into inodes, names
  (``DIR_INDEX`` order), ``INODE_REF``\\ s, xattrs and file extents;
* device 2 is read through the blockmap: a range maps device bytes onto a pack,
  unmapped bytes read as zeros, and every pack chunk's sha256 is checked against
  the blockmap before any of its bytes is used (the same rule ublkd applies).

Only the struct layouts needed here are spelled out below (from the kernel's
``fs/btrfs/accessors.h`` / btrfs-progs ``kernel-shared/uapi/btrfs_tree.h``); the
constants come from ``btrfs.ondisk``. Every problem is an ``ImageError`` that
names the file and the block or chunk.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import stat
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from btrfs_ublk_image import blockmap as bmap
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.crc import crc32c
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.manifest import BLOCKMAP, META_IMG, read_bundle_file, read_manifest

# --- on-disk layouts (little-endian) ----------------------------------------------------
# struct btrfs_super_block from offset 0x20 (after csum[32]) up to dev_item
_SUPER = struct.Struct("<16sQQ8sQQQQQQQQQIIIIIQQQQHBBB")
_SUPER_DEV_ITEM = 0xC9
_SUPER_SYS_ARRAY = 0x32B
_SUPER_SYS_ARRAY_MAX = 2048
# struct btrfs_header: csum fsid bytenr flags chunk_tree_uuid generation owner nritems level
_HEADER = struct.Struct("<32s16sQQ16sQQIB")
_ITEM = struct.Struct("<QBQII")  # disk key, data offset (from the end of the header), size
_KEY_PTR = struct.Struct("<QBQQQ")  # disk key, blockptr, generation
_DISK_KEY = struct.Struct("<QBQ")
# struct btrfs_dev_item: devid total_bytes bytes_used io_align io_width sector_size type
# generation start_offset dev_group seek_speed bandwidth uuid fsid
_DEV_ITEM = struct.Struct("<QQQIIIQQQIBB16s16s")
# struct btrfs_chunk (48 bytes) + num_stripes x struct btrfs_stripe (32 bytes)
_CHUNK = struct.Struct("<QQQQIIIHH")
_STRIPE = struct.Struct("<QQ16s")
# struct btrfs_inode_item (160 bytes)
_INODE = struct.Struct("<5Q4I3Q32xQIQIQIQI")
_INODE_REF = struct.Struct("<QH")  # index, name_len; name follows
_INODE_EXTREF = struct.Struct("<QQH")  # parent, index, name_len; name follows
_DIR_ITEM = struct.Struct("<QBQQHHB")  # location key, transid, data_len, name_len, type
_FILE_EXTENT = struct.Struct("<QQBBHB")  # generation ram_bytes compression encryption other type
_FILE_EXTENT_REG = struct.Struct("<QQQQ")  # disk_bytenr disk_num_bytes offset num_bytes
# struct btrfs_root_item: the inode item, then generation root_dirid bytenr ... level
_ROOT_ITEM = struct.Struct("<QQQQQQQI17sBB")

FILE_EXTENT_PREALLOC = 2
COMPRESS_ZSTD = 3  # BTRFS_COMPRESS_ZSTD
CSUM_TYPE_CRC32C = 0
BLOCK_GROUP_PROFILE_MASK = 0xFF8  # RAID0/1/10/5/6/DUP/RAID1C3/C4 bits: SINGLE when none set
BLOCK_GROUP_DUP = 1 << 5

_FT_NAMES = {
    d.FT_REG_FILE: stat.S_IFREG,
    d.FT_DIR: stat.S_IFDIR,
    d.FT_CHRDEV: stat.S_IFCHR,
    d.FT_BLKDEV: stat.S_IFBLK,
    d.FT_FIFO: stat.S_IFIFO,
    d.FT_SOCK: stat.S_IFSOCK,
    d.FT_SYMLINK: stat.S_IFLNK,
}
_TREE_NAMES = {
    d.ROOT_TREE_OBJECTID: "root tree",
    d.EXTENT_TREE_OBJECTID: "extent tree",
    d.CHUNK_TREE_OBJECTID: "chunk tree",
    d.DEV_TREE_OBJECTID: "dev tree",
    d.FS_TREE_OBJECTID: "fs tree",
    d.CSUM_TREE_OBJECTID: "csum tree",
    d.UUID_TREE_OBJECTID: "uuid tree",
    d.FREE_SPACE_TREE_OBJECTID: "free-space tree",
}


def _ns(sec: int, nsec: int) -> int:
    if sec >= 1 << 63:  # struct btrfs_timespec.sec is a signed 64-bit value
        sec -= 1 << 64
    return sec * 1_000_000_000 + nsec


def kernel_rdev_split(rdev: int) -> tuple[int, int]:
    """btrfs stores the kernel's dev_t (MKDEV: major << 20 | minor) -> (major, minor)."""
    return rdev >> 20, rdev & 0xFFFFF


# --- parsed structures -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Superblock:
    fsid: bytes
    generation: int
    root: int
    root_level: int
    chunk_root: int
    chunk_root_level: int
    nodesize: int
    sectorsize: int
    num_devices: int
    flags: int
    incompat: int
    devid: int
    dev_uuid: bytes
    sys_chunk_array: bytes


@dataclass(frozen=True, slots=True)
class Stripe:
    devid: int
    offset: int


@dataclass(frozen=True, slots=True)
class ChunkMapping:
    logical: int
    length: int
    type: int
    stripes: tuple[Stripe, ...]


@dataclass(slots=True)
class InodeItem:
    ino: int
    size: int
    nbytes: int
    nlink: int
    uid: int
    gid: int
    mode: int
    rdev: int
    flags: int
    atime_ns: int
    ctime_ns: int
    mtime_ns: int
    otime_ns: int


@dataclass(frozen=True, slots=True)
class DirEntry:
    index: int
    name: bytes
    ino: int
    ftype: int


@dataclass(frozen=True, slots=True)
class FileExtent:
    """One EXTENT_DATA item: ``num_bytes`` of the file at ``file_offset``."""

    file_offset: int
    kind: int  # FILE_EXTENT_INLINE, FILE_EXTENT_REG, FILE_EXTENT_PREALLOC
    inline: bytes  # inline data (kind INLINE)
    disk_bytenr: int  # logical address of the extent (0: a hole)
    offset: int  # offset into the extent
    num_bytes: int
    compression: int  # 0, or COMPRESS_ZSTD: one zstd frame in disk_num_bytes
    disk_num_bytes: int = 0
    ram_bytes: int = 0


@dataclass(slots=True)
class Inode:
    item: InodeItem
    refs: list[tuple[int, int, bytes]] = field(default_factory=list)  # (parent, index, name)
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    entries: list[DirEntry] = field(default_factory=list)  # DIR_INDEX order
    extents: list[FileExtent] = field(default_factory=list)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.item.mode)


# --- device 2 through the blockmap -------------------------------------------------------
class DataDevice:
    """Device 2 of a bundle: blockmap ranges onto packs; every pack chunk verified before use."""

    def __init__(self, bm: bmap.BlockMap, pack_paths: list[str], cache_chunks: int = 16) -> None:
        self.bm = bm
        self.pack_paths = pack_paths
        self._cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._cache_max = cache_chunks
        self._starts = [r.dev_offset for r in bm.ranges]

    def _chunk(self, pack: int, index: int) -> bytes:
        key = (pack, index)
        data = self._cache.get(key)
        if data is not None:
            self._cache.move_to_end(key)
            return data
        path = self.pack_paths[pack]
        try:
            with open(path, "rb") as f:
                # stored bytes verified, then decompressed (blockmap v2) to the chunk's length
                data = bmap.read_chunk(f, self.bm, pack, index, path)
        except OSError as e:
            raise ImageError(f"{path}: cannot read: {e.strerror}") from None
        self._cache[key] = data
        if len(self._cache) > self._cache_max:
            self._cache.popitem(last=False)
        return data

    def pack_bytes(self, pack: int, offset: int, length: int) -> bytes:
        size = self.bm.chunk_size
        out = []
        while length > 0:
            index, within = divmod(offset, size)
            chunk = self._chunk(pack, index)
            piece = chunk[within : within + length]
            if not piece:
                raise ImageError(f"{self.pack_paths[pack]}: read past the end of the pack")
            out.append(piece)
            offset += len(piece)
            length -= len(piece)
        return b"".join(out)

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or offset + length > self.bm.device_size:
            raise ImageError(
                f"device 2: read of {length} bytes at {offset} past its end ({self.bm.device_size})"
            )
        ranges = self.bm.ranges
        i = max(bisect.bisect_right(self._starts, offset) - 1, 0)
        end = offset + length
        if (
            i < len(ranges)
            and ranges[i].dev_offset <= offset
            and end <= ranges[i].dev_offset + ranges[i].length
        ):
            r = ranges[i]  # the common case: one range holds it all
            return self.pack_bytes(r.pack, r.pack_offset + (offset - r.dev_offset), length)
        out = bytearray(length)
        while i < len(ranges) and ranges[i].dev_offset < end:
            r = ranges[i]
            lo, hi = max(offset, r.dev_offset), min(end, r.dev_offset + r.length)
            if lo < hi:
                data = self.pack_bytes(r.pack, r.pack_offset + (lo - r.dev_offset), hi - lo)
                out[lo - offset : hi - offset] = data
            i += 1
        return bytes(out)


# --- the filesystem ------------------------------------------------------------------------
def _crc_ok(block: bytes | memoryview) -> tuple[bool, int, int]:
    stored = struct.unpack_from("<I", block, 0)[0]
    computed = crc32c(block[32:])
    return stored == computed, stored, computed


def parse_superblock(data: bytes, where: str) -> Superblock:
    if len(data) < d.SUPER_INFO_SIZE:
        raise ImageError(f"{where}: too small for a btrfs superblock")
    ok, stored, computed = _crc_ok(data)
    if not ok:
        raise ImageError(
            f"{where}: superblock checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
        )
    f = _SUPER.unpack_from(data, 0x20)
    (fsid, _bytenr, flags, magic, generation, root, chunk_root) = f[:7]
    nodesize, sectorsize, sys_size = f[14], f[13], f[17]
    num_devices, incompat, csum_type = f[12], f[21], f[22]
    root_level, chunk_root_level = f[23], f[24]
    if magic != d.MAGIC:
        raise ImageError(f"{where}: not a btrfs superblock (bad magic)")
    if csum_type != CSUM_TYPE_CRC32C:
        raise ImageError(f"{where}: unsupported checksum type {csum_type}")
    if sys_size > _SUPER_SYS_ARRAY_MAX:
        raise ImageError(f"{where}: sys_chunk_array_size {sys_size} too large")
    if nodesize < 4096 or nodesize & (nodesize - 1) or sectorsize != d.SECTORSIZE:
        raise ImageError(f"{where}: unsupported nodesize {nodesize} / sectorsize {sectorsize}")
    dev = _DEV_ITEM.unpack_from(data, _SUPER_DEV_ITEM)
    devid, dev_uuid, dev_fsid = dev[0], dev[12], dev[13]
    if dev_fsid != fsid:
        raise ImageError(f"{where}: dev_item fsid differs from the superblock's fsid")
    return Superblock(
        fsid=fsid,
        generation=generation,
        root=root,
        root_level=root_level,
        chunk_root=chunk_root,
        chunk_root_level=chunk_root_level,
        nodesize=nodesize,
        sectorsize=sectorsize,
        num_devices=num_devices,
        flags=flags,
        incompat=incompat,
        devid=devid,
        dev_uuid=dev_uuid,
        sys_chunk_array=bytes(data[_SUPER_SYS_ARRAY : _SUPER_SYS_ARRAY + sys_size]),
    )


def _parse_chunk(logical: int, data: bytes | memoryview, pos: int, where: str) -> ChunkMapping:
    length, _owner, _stripe_len, ctype, _ioa, _iow, _ss, num_stripes, _sub = _CHUNK.unpack_from(
        data, pos
    )
    if num_stripes < 1 or pos + _CHUNK.size + num_stripes * _STRIPE.size > len(data):
        raise ImageError(f"{where}: chunk at logical {logical}: bad stripe count {num_stripes}")
    stripes = []
    for i in range(num_stripes):
        devid, offset, _uuid = _STRIPE.unpack_from(data, pos + _CHUNK.size + i * _STRIPE.size)
        stripes.append(Stripe(devid, offset))
    if ctype & BLOCK_GROUP_PROFILE_MASK & ~BLOCK_GROUP_DUP and not all(
        s.devid == stripes[0].devid and s.offset == stripes[0].offset for s in stripes
    ):
        # striped/mirrored profiles across devices: a seed image never has them
        raise ImageError(f"{where}: chunk at logical {logical}: unsupported profile {ctype:#x}")
    return ChunkMapping(logical, length, ctype, tuple(stripes))


class Filesystem:
    """The btrfs filesystem of a bundle: trees read from ``meta.img``, data from device 2."""

    def __init__(self, bundle: str) -> None:
        self.bundle = bundle
        manifest, self.image_id = read_manifest(bundle)
        self.manifest = manifest
        self.meta_path = os.path.join(bundle, META_IMG)
        bm_path = os.path.join(bundle, BLOCKMAP)
        bm_bytes = read_bundle_file(bm_path)
        want = manifest.get("files", {}).get(BLOCKMAP, {}).get("sha256")
        if want != "sha256:" + hashlib.sha256(bm_bytes).hexdigest():
            raise ImageError(
                f"{bm_path}: sha256 differs from manifest.json: the blockmap is corrupt"
            )
        bm = bmap.decode(bm_bytes, bm_path)
        pack_paths = [os.path.join(bundle, p["path"]) for p in manifest["packs"]]
        if len(pack_paths) != len(bm.packs):
            raise ImageError(
                f"{bm_path}: {len(bm.packs)} packs, manifest.json lists {len(pack_paths)}"
            )
        for path, entry in zip(pack_paths, bm.packs, strict=True):
            try:
                size = os.path.getsize(path)
            except OSError as e:
                raise ImageError(f"{path}: cannot read: {e.strerror}") from None
            if size != entry.stored_size:
                raise ImageError(
                    f"{path}: {size} bytes, the blockmap says {entry.stored_size}: truncated?"
                )
        self.dev2 = DataDevice(bm, pack_paths)
        try:
            self._meta = open(self.meta_path, "rb")  # noqa: SIM115 - closed by close()
        except OSError as e:
            raise ImageError(f"{self.meta_path}: cannot read: {e.strerror}") from None
        try:
            self._open()
        except BaseException:
            self._meta.close()
            raise

    def close(self) -> None:
        self._meta.close()

    def __enter__(self) -> Filesystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- devices and chunks ------------------------------------------------------------
    def _read_meta(self, offset: int, length: int) -> bytes:
        self._meta.seek(offset)
        data = self._meta.read(length)
        if len(data) != length:
            raise ImageError(f"{self.meta_path}: truncated: {length} bytes at {offset} are missing")
        return data

    def _open(self) -> None:
        sb = parse_superblock(
            self._read_meta(d.SUPER_INFO_OFFSET, d.SUPER_INFO_SIZE), f"{self.meta_path}"
        )
        if sb.devid != 1:
            raise ImageError(f"{self.meta_path}: superblock of device {sb.devid}, expected 1")
        self.sb = sb
        self.nodesize = sb.nodesize
        sb2 = parse_superblock(
            self.dev2.read(d.SUPER_INFO_OFFSET, d.SUPER_INFO_SIZE), "device 2 (from the blockmap)"
        )
        if sb2.fsid != sb.fsid or sb2.devid != 2:
            raise ImageError("device 2: its superblock is not device 2 of this filesystem")
        self.chunks: list[ChunkMapping] = []
        arr, pos = sb.sys_chunk_array, 0
        while pos < len(arr):
            objectid, type_, offset = _DISK_KEY.unpack_from(arr, pos)
            pos += _DISK_KEY.size
            if type_ != d.CHUNK_ITEM_KEY:
                raise ImageError(f"{self.meta_path}: sys_chunk_array: unexpected key type {type_}")
            c = _parse_chunk(offset, arr, pos, f"{self.meta_path}: sys_chunk_array")
            self.chunks.append(c)
            pos += _CHUNK.size + len(c.stripes) * _STRIPE.size
        self._sort_chunks()
        # the chunk tree has every chunk, SYSTEM included
        chunks = []
        for (_oid, type_, offset), data in self.items(
            sb.chunk_root, sb.chunk_root_level, d.CHUNK_TREE_OBJECTID
        ):
            if type_ == d.CHUNK_ITEM_KEY:
                chunks.append(_parse_chunk(offset, data, 0, "chunk tree"))
        self.chunks = chunks
        self._sort_chunks()
        self.fs_root, self.fs_level, self.root_dirid = self._find_root(d.FS_TREE_OBJECTID)

    def _sort_chunks(self) -> None:
        self.chunks.sort(key=lambda c: c.logical)
        self._chunk_starts = [c.logical for c in self.chunks]
        for a, b in zip(self.chunks, self.chunks[1:], strict=False):
            if a.logical + a.length > b.logical:
                raise ImageError(f"chunk tree: chunks at {a.logical} and {b.logical} overlap")

    def map_logical(self, logical: int, length: int) -> tuple[ChunkMapping, int, int]:
        """logical -> (chunk, devid, physical offset on that device); the range must fit in it."""
        i = bisect.bisect_right(self._chunk_starts, logical) - 1
        if i < 0 or logical + length > self.chunks[i].logical + self.chunks[i].length:
            raise ImageError(f"logical address {logical} (+{length}) is in no chunk")
        c = self.chunks[i]
        s = c.stripes[0]
        return c, s.devid, s.offset + (logical - c.logical)

    # --- tree blocks -------------------------------------------------------------------
    def _block_where(self, owner: int, bytenr: int) -> str:
        """How errors name a tree block: meta.img, the tree, the block's address."""
        return f"{self.meta_path}: {_TREE_NAMES.get(owner, f'tree {owner}')} block {bytenr}"

    def read_block(self, bytenr: int, level: int, owner: int) -> bytes:
        try:
            chunk, devid, physical = self.map_logical(bytenr, self.nodesize)
        except ImageError as e:
            raise ImageError(f"{self._block_where(owner, bytenr)}: {e}") from None
        where = f"{self._block_where(owner, bytenr)} (physical {physical})"
        if devid != 1 or chunk.type & d.BLOCK_GROUP_DATA:
            raise ImageError(f"{where}: not in a metadata chunk of device 1")
        block = self._read_meta(physical, self.nodesize)
        ok, stored, computed = _crc_ok(block)
        if not ok:
            raise ImageError(
                f"{where}: checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
            )
        _csum, fsid, hb, _flags, _ctu, _gen, h_owner, _n, h_level = _HEADER.unpack_from(block, 0)
        if hb != bytenr:
            raise ImageError(f"{where}: header says bytenr {hb}")
        if fsid != self.sb.fsid:
            raise ImageError(f"{where}: fsid {fsid.hex()} is not this filesystem's")
        if h_level != level:
            raise ImageError(f"{where}: level {h_level}, expected {level}")
        if h_owner != owner:
            raise ImageError(f"{where}: owner {h_owner}, expected {owner}")
        return block

    def leaves(
        self, bytenr: int, level: int, owner: int
    ) -> Iterator[tuple[bytes, int, tuple[int, int, int] | None]]:
        """Every leaf of a tree, in key order: (block, bytenr, the first key its parent's
        pointer names; None for a root leaf). Each block is checked (``read_block``) and
        so are the pointers to it; the items are not (``items`` checks them)."""
        yield from self._leaves(bytenr, level, owner, None)

    def _leaves(
        self, bytenr: int, level: int, owner: int, first: tuple[int, int, int] | None
    ) -> Iterator[tuple[bytes, int, tuple[int, int, int] | None]]:
        block = self.read_block(bytenr, level, owner)
        if level == 0:
            yield block, bytenr, first
            return
        nritems = _HEADER.unpack_from(block, 0)[7]
        where = self._block_where(owner, bytenr)
        if nritems == 0 or d.HEADER_SIZE + nritems * d.KEY_PTR_SIZE > self.nodesize:
            raise ImageError(f"{where}: bad pointer count {nritems}")
        prev: tuple[int, int, int] | None = None
        for i in range(nritems):
            oid, type_, off, child, _gen = _KEY_PTR.unpack_from(
                block, d.HEADER_SIZE + i * d.KEY_PTR_SIZE
            )
            key = (oid, type_, off)
            if prev is not None and key <= prev:
                raise ImageError(f"{where}: pointer {i}: keys out of order")
            if i == 0 and first is not None and key != first:
                raise ImageError(f"{where}: first key differs from its parent's pointer")
            prev = key
            yield from self._leaves(child, level - 1, owner, key)

    def items(
        self, bytenr: int, level: int, owner: int
    ) -> Iterator[tuple[tuple[int, int, int], memoryview]]:
        """Every item of a tree, in key order: ((objectid, type, offset), data)."""
        for raw, at, first_key in self.leaves(bytenr, level, owner):
            block = memoryview(raw)
            nritems = _HEADER.unpack_from(block, 0)[7]
            where = self._block_where(owner, at)
            if d.HEADER_SIZE + nritems * d.ITEM_SIZE > self.nodesize:
                raise ImageError(f"{where}: {nritems} items do not fit")
            prev: tuple[int, int, int] | None = None
            for i in range(nritems):
                oid, type_, off, doff, size = _ITEM.unpack_from(
                    block, d.HEADER_SIZE + i * d.ITEM_SIZE
                )
                key = (oid, type_, off)
                if prev is not None and key <= prev:
                    raise ImageError(f"{where}: item {i}: keys out of order")
                if i == 0 and first_key is not None and key != first_key:
                    raise ImageError(f"{where}: first key differs from its parent's pointer")
                start = d.HEADER_SIZE + doff
                if start + size > self.nodesize:
                    raise ImageError(f"{where}: item {i}: data outside the block")
                prev = key
                yield key, block[start : start + size]

    def blocks(
        self, bytenr: int, level: int, owner: int
    ) -> Iterator[tuple[int, tuple[int, int, int], int]]:
        """(level, first key, bytenr) of every block of a tree, from its root down; leaves
        are named by their parents' pointers (only a root leaf is read)."""
        block = self.read_block(bytenr, level, owner)
        nritems = _HEADER.unpack_from(block, 0)[7]
        if level == 0:
            first = (0, 0, 0) if nritems == 0 else _ITEM.unpack_from(block, d.HEADER_SIZE)[:3]
            yield 0, first, bytenr
            return
        if nritems == 0 or d.HEADER_SIZE + nritems * d.KEY_PTR_SIZE > self.nodesize:
            raise ImageError(f"{self._block_where(owner, bytenr)}: bad pointer count {nritems}")
        ptrs = [
            _KEY_PTR.unpack_from(block, d.HEADER_SIZE + i * d.KEY_PTR_SIZE) for i in range(nritems)
        ]
        yield level, ptrs[0][:3], bytenr
        for oid, type_, off, child, _gen in ptrs:
            if level == 1:
                yield 0, (oid, type_, off), child
            else:
                yield from self.blocks(child, level - 1, owner)

    def tree_roots(self) -> dict[int, tuple[int, int]]:
        """tree id -> (root bytenr, level) of the root tree and every tree it lists."""
        roots = {d.ROOT_TREE_OBJECTID: (self.sb.root, self.sb.root_level)}
        for (oid, type_, _off), data in self.items(
            self.sb.root, self.sb.root_level, d.ROOT_TREE_OBJECTID
        ):
            if type_ == d.ROOT_ITEM_KEY:
                f = _ROOT_ITEM.unpack_from(data, d.INODE_ITEM_SIZE)
                roots[oid] = (f[2], f[10])
        return roots

    def _find_root(self, objectid: int) -> tuple[int, int, int]:
        found = None
        for (oid, type_, _off), data in self.items(
            self.sb.root, self.sb.root_level, d.ROOT_TREE_OBJECTID
        ):
            if oid == objectid and type_ == d.ROOT_ITEM_KEY:
                found = data
            elif oid > objectid:
                break
        if found is None:
            raise ImageError(f"{self.meta_path}: root tree has no ROOT_ITEM for tree {objectid}")
        f = _ROOT_ITEM.unpack_from(found, d.INODE_ITEM_SIZE)
        _gen, root_dirid, bytenr, level = f[0], f[1], f[2], f[10]
        return bytenr, level, root_dirid

    # --- the fs tree -------------------------------------------------------------------
    def inodes(self) -> dict[int, Inode]:
        """Every inode of the fs tree with its names, xattrs, directory entries and extents."""
        out: dict[int, Inode] = {}
        cur: Inode | None = None
        where = f"{self.meta_path}: fs tree"
        for (oid, type_, off), data in self.items(self.fs_root, self.fs_level, d.FS_TREE_OBJECTID):
            if type_ == d.INODE_ITEM_KEY:
                cur = Inode(_inode_item(oid, data))
                out[oid] = cur
                continue
            if cur is None or cur.item.ino != oid:
                if type_ in (d.ROOT_ITEM_KEY,) or oid < d.FIRST_FREE_OBJECTID:
                    continue  # the fs tree's own items (none expected) and orphans
                raise ImageError(f"{where}: item ({oid}, {type_}, {off}) has no INODE_ITEM")
            if type_ == d.INODE_REF_KEY:
                pos = 0
                while pos < len(data):
                    index, n = _INODE_REF.unpack_from(data, pos)
                    pos += _INODE_REF.size
                    cur.refs.append((off, index, bytes(data[pos : pos + n])))
                    pos += n
            elif type_ == d.INODE_EXTREF_KEY:
                pos = 0
                while pos < len(data):
                    parent, index, n = _INODE_EXTREF.unpack_from(data, pos)
                    pos += _INODE_EXTREF.size
                    cur.refs.append((parent, index, bytes(data[pos : pos + n])))
                    pos += n
            elif type_ == d.XATTR_ITEM_KEY:
                for _loc, _ft, name, value in _dir_items(data, where):
                    cur.xattrs[name] = value
            elif type_ == d.DIR_INDEX_KEY:
                items = list(_dir_items(data, where))
                if len(items) != 1:
                    raise ImageError(f"{where}: DIR_INDEX ({oid}, {off}) holds {len(items)} names")
                (loc, ftype, name, _v) = items[0]
                if loc[1] != d.INODE_ITEM_KEY:
                    raise ImageError(f"{where}: {name!r} in {oid} is a subvolume (unsupported)")
                cur.entries.append(DirEntry(off, name, loc[0], ftype))
            elif type_ == d.EXTENT_DATA_KEY:
                cur.extents.append(_file_extent(off, data, where))
        return out


def _inode_item(ino: int, data: memoryview) -> InodeItem:
    f = _INODE.unpack_from(data, 0)
    # generation transid size nbytes block_group nlink uid gid mode rdev flags sequence
    # atime.sec atime.nsec ctime.. mtime.. otime..
    return InodeItem(
        ino=ino,
        size=f[2],
        nbytes=f[3],
        nlink=f[5],
        uid=f[6],
        gid=f[7],
        mode=f[8],
        rdev=f[9],
        flags=f[10],
        atime_ns=_ns(f[12], f[13]),
        ctime_ns=_ns(f[14], f[15]),
        mtime_ns=_ns(f[16], f[17]),
        otime_ns=_ns(f[18], f[19]),
    )


def _dir_items(
    data: memoryview, where: str
) -> Iterator[tuple[tuple[int, int, int], int, bytes, bytes]]:
    """struct btrfs_dir_item entries packed in one item: (location, type, name, data)."""
    pos = 0
    while pos < len(data):
        if pos + _DIR_ITEM.size > len(data):
            raise ImageError(f"{where}: truncated dir item")
        oid, type_, off, _transid, data_len, name_len, ftype = _DIR_ITEM.unpack_from(data, pos)
        pos += _DIR_ITEM.size
        if pos + name_len + data_len > len(data):
            raise ImageError(f"{where}: dir item name/data past the item's end")
        name = bytes(data[pos : pos + name_len])
        value = bytes(data[pos + name_len : pos + name_len + data_len])
        pos += name_len + data_len
        yield (oid, type_, off), ftype, name, value


def _file_extent(file_offset: int, data: memoryview, where: str) -> FileExtent:
    _gen, ram_bytes, compression, encryption, _other, kind = _FILE_EXTENT.unpack_from(data, 0)
    if encryption:
        raise ImageError(f"{where}: encrypted extent (unsupported)")
    if kind == d.FILE_EXTENT_INLINE:
        inline = bytes(data[_FILE_EXTENT.size :])
        if compression:
            raise ImageError(f"{where}: compressed inline extent (unsupported)")
        return FileExtent(file_offset, kind, inline, 0, 0, len(inline), 0)
    if kind not in (d.FILE_EXTENT_REG, FILE_EXTENT_PREALLOC):
        raise ImageError(f"{where}: unknown file extent type {kind}")
    disk_bytenr, disk_num, offset, num_bytes = _FILE_EXTENT_REG.unpack_from(data, _FILE_EXTENT.size)
    if compression not in (0, COMPRESS_ZSTD):
        raise ImageError(f"{where}: extent compression {compression} (only zstd is supported)")
    return FileExtent(
        file_offset, kind, b"", disk_bytenr, offset, num_bytes, compression, disk_num, ram_bytes
    )


# --- reading files ---------------------------------------------------------------------------
class BundleReader:
    """Paths, attributes and file content of a bundle, read as described in the module docstring."""

    def __init__(self, bundle: str, fs: Filesystem | None = None) -> None:
        """``fs``: the bundle's filesystem, already open (it is closed with the reader)."""
        self.fs = Filesystem(bundle) if fs is None else fs
        try:
            self.inodes = self.fs.inodes()
            root = self.inodes.get(self.fs.root_dirid)
            if root is None or not root.is_dir:
                raise ImageError(f"{self.fs.meta_path}: fs tree has no root directory")
        except BaseException:
            self.fs.close()
            raise

    def close(self) -> None:
        self.fs.close()

    def __enter__(self) -> BundleReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def root(self) -> Inode:
        return self.inodes[self.fs.root_dirid]

    def walk(self) -> Iterator[tuple[bytes, Inode]]:
        """(path, inode) of every name, depth first, each directory's entries in DIR_INDEX order."""
        yield b"/", self.root
        stack: list[tuple[bytes, Inode, int]] = [(b"", self.root, 0)]
        seen_dirs = {self.root.item.ino}
        while stack:
            prefix, node, i = stack.pop()
            if i >= len(node.entries):
                continue
            stack.append((prefix, node, i + 1))
            entry = node.entries[i]
            child = self.child(node, entry)
            path = prefix + b"/" + entry.name
            yield path, child
            if child.is_dir:
                if child.item.ino in seen_dirs:
                    raise ImageError(f"{self.fs.meta_path}: directory loop at {path!r}")
                seen_dirs.add(child.item.ino)
                stack.append((path, child, 0))

    def child(self, parent: Inode, entry: DirEntry) -> Inode:
        child = self.inodes.get(entry.ino)
        where = f"{self.fs.meta_path}: fs tree"
        if child is None:
            raise ImageError(
                f"{where}: {entry.name!r} in directory {parent.item.ino} -> missing inode {entry.ino}"
            )
        want = _FT_NAMES.get(entry.ftype)
        if want != stat.S_IFMT(child.item.mode):
            raise ImageError(
                f"{where}: {entry.name!r}: dir entry type {entry.ftype} differs from inode {entry.ino}'s mode {child.item.mode:o}"
            )
        if (parent.item.ino, entry.index, entry.name) not in child.refs:
            raise ImageError(
                f"{where}: {entry.name!r} in directory {parent.item.ino}: inode {entry.ino} has no matching INODE_REF"
            )
        return child

    def lookup(self, path: bytes | str) -> Inode:
        raw = os.fsencode(path)
        node = self.root
        for comp in raw.split(b"/"):
            if not comp or comp == b".":
                continue
            if not node.is_dir:
                raise ImageError(f"{os.fsdecode(raw)}: not a directory")
            for entry in node.entries:
                if entry.name == comp:
                    node = self.child(node, entry)
                    break
            else:
                raise ImageError(f"{os.fsdecode(raw)}: no such file or directory in the image")
        return node

    def read_chunks(self, inode: Inode, piece: int = 1 << 20) -> Iterator[bytes]:
        """The content of a regular file or symlink (target), in order; holes read as zeros."""
        size = inode.item.size
        pos = 0
        where = f"{self.fs.meta_path}: inode {inode.item.ino}"
        for ext in inode.extents:
            if ext.file_offset < pos:
                raise ImageError(f"{where}: extents overlap at file offset {ext.file_offset}")
            if ext.file_offset >= size:
                break
            while pos < ext.file_offset:  # a hole (NO_HOLES: no item for it)
                n = min(piece, ext.file_offset - pos)
                yield bytes(n)
                pos += n
            length = min(ext.num_bytes, size - ext.file_offset)
            if ext.kind == d.FILE_EXTENT_INLINE:
                yield ext.inline[:length]
                pos += min(length, len(ext.inline))
                continue
            if ext.compression and ext.disk_bytenr:
                yield self._read_zstd(ext, where)[ext.offset : ext.offset + length]
                pos += length
                continue
            done = 0
            while done < length:
                n = min(piece, length - done)
                if ext.kind == FILE_EXTENT_PREALLOC or ext.disk_bytenr == 0:
                    yield bytes(n)
                else:
                    yield self._read_data(ext.disk_bytenr + ext.offset + done, n, where)
                done += n
            pos += length
        while pos < size:
            n = min(piece, size - pos)
            yield bytes(n)
            pos += n

    def _read_zstd(self, ext: FileExtent, where: str) -> bytes:
        """A zstd-compressed extent's ``ram_bytes``: its one frame (the rest of its sectors
        zeros) decompressed, zero-filled past the frame's end as the kernel does."""
        import zstandard

        stored = self._read_data(ext.disk_bytenr, ext.disk_num_bytes, where)
        dobj = zstandard.ZstdDecompressor().decompressobj()
        try:
            data = dobj.decompress(stored)
        except zstandard.ZstdError as e:
            raise ImageError(f"{where}: zstd extent at {ext.disk_bytenr}: {e}") from None
        if not dobj.eof or len(data) > ext.ram_bytes or any(dobj.unused_data):
            raise ImageError(
                f"{where}: zstd extent at {ext.disk_bytenr}: not one frame of at most"
                f" {ext.ram_bytes} bytes followed by zeros"
            )
        return data + bytes(ext.ram_bytes - len(data))

    def _read_data(self, logical: int, length: int, where: str) -> bytes:
        out = []
        while length > 0:
            try:
                chunk, devid, physical = self.fs.map_logical(logical, 1)
            except ImageError as e:
                raise ImageError(f"{where}: extent at {logical}: {e}") from None
            if devid != 2 or not chunk.type & d.BLOCK_GROUP_DATA:
                raise ImageError(f"{where}: extent at {logical} is not in a data chunk of device 2")
            n = min(length, chunk.logical + chunk.length - logical)
            out.append(self.fs.dev2.read(physical, n))
            logical += n
            length -= n
        return b"".join(out)

    def read(self, inode: Inode) -> bytes:
        return b"".join(self.read_chunks(inode))

    def sha256(self, inode: Inode) -> str:
        h = hashlib.sha256()
        for piece in self.read_chunks(inode):
            h.update(piece)
        return h.hexdigest()
