"""btrfs on-disk constants and structures, named as in btrfs-progs ``kernel-shared/``.

Every integer is little-endian. Each ``pack_*`` function returns the exact bytes
of one on-disk structure; the layout comments give the C struct it mirrors.
"""

from __future__ import annotations

import struct
from typing import Protocol

from btrfs_ublk_image.crc import crc32c

# --- sizes ---------------------------------------------------------------
SECTORSIZE = 4096
NODESIZE = 16384
STRIPE_LEN = 64 * 1024
SUPER_INFO_OFFSET = 64 * 1024
SUPER_INFO_SIZE = 4096
SUPER_MIRRORS = (64 * 1024, 64 * 1024 * 1024, 256 * 1024**3)
HEADER_SIZE = 101  # struct btrfs_header
ITEM_SIZE = 25  # struct btrfs_item: disk key + offset + size
DISK_KEY_SIZE = 17  # struct btrfs_disk_key: objectid, type, offset
KEY_PTR_SIZE = 33  # struct btrfs_key_ptr: disk key + blockptr + generation
LEAF_DATA_SIZE = NODESIZE - HEADER_SIZE
MAX_ITEM_DATA = LEAF_DATA_SIZE - ITEM_SIZE
NODEPTRS_PER_BLOCK = LEAF_DATA_SIZE // KEY_PTR_SIZE
MAX_EXTENT_SIZE = 128 * 1024 * 1024  # BTRFS_MAX_EXTENT_SIZE
# BTRFS_MAX_EXTENT_ITEM_SIZE: inline backrefs stop here, the rest become keyed items
MAX_EXTENT_ITEM_SIZE = (LEAF_DATA_SIZE >> 4) - ITEM_SIZE
DIR_ITEM_SIZE = 30  # struct btrfs_dir_item without the name
MAX_XATTR_SIZE = LEAF_DATA_SIZE - ITEM_SIZE - DIR_ITEM_SIZE  # name + value
FILE_EXTENT_INLINE_HEADER = 21
FILE_EXTENT_ITEM_SIZE = 53
# the generation of every item and tree block an image holds: all written in one transaction
GENERATION = 1

# --- tree objectids -----------------------------------------------------
ROOT_TREE_OBJECTID = 1
EXTENT_TREE_OBJECTID = 2
CHUNK_TREE_OBJECTID = 3
DEV_TREE_OBJECTID = 4
FS_TREE_OBJECTID = 5
ROOT_TREE_DIR_OBJECTID = 6
CSUM_TREE_OBJECTID = 7
EXTENT_CSUM_OBJECTID = 2**64 - 10  # BTRFS_EXTENT_CSUM_OBJECTID
UUID_TREE_OBJECTID = 9
FREE_SPACE_TREE_OBJECTID = 10
DATA_RELOC_TREE_OBJECTID = 2**64 - 9
DEV_ITEMS_OBJECTID = 1
FIRST_CHUNK_TREE_OBJECTID = 256
FIRST_FREE_OBJECTID = 256

# --- item types ---------------------------------------------------------
INODE_ITEM_KEY = 1
INODE_REF_KEY = 12
INODE_EXTREF_KEY = 13
XATTR_ITEM_KEY = 24
DIR_ITEM_KEY = 84
DIR_INDEX_KEY = 96
EXTENT_DATA_KEY = 108
EXTENT_CSUM_KEY = 128
ROOT_ITEM_KEY = 132
EXTENT_ITEM_KEY = 168
METADATA_ITEM_KEY = 169
TREE_BLOCK_REF_KEY = 176
EXTENT_DATA_REF_KEY = 178
BLOCK_GROUP_ITEM_KEY = 192
FREE_SPACE_INFO_KEY = 198
FREE_SPACE_EXTENT_KEY = 199
DEV_EXTENT_KEY = 204
DEV_ITEM_KEY = 216
CHUNK_ITEM_KEY = 228
UUID_KEY_SUBVOL = 251

# --- flags --------------------------------------------------------------
BLOCK_GROUP_DATA = 1 << 0
BLOCK_GROUP_SYSTEM = 1 << 1
BLOCK_GROUP_METADATA = 1 << 2
HEADER_FLAG_WRITTEN = 1 << 0
MIXED_BACKREF_REV = 1
SUPER_FLAG_SEEDING = 1 << 32
EXTENT_FLAG_DATA = 1 << 0
EXTENT_FLAG_TREE_BLOCK = 1 << 1
INODE_NODATASUM = 1 << 0
INODE_NODATACOW = 1 << 1
FILE_EXTENT_INLINE = 0
FILE_EXTENT_REG = 1
INCOMPAT_MIXED_BACKREF = 1 << 0
INCOMPAT_BIG_METADATA = 1 << 5
INCOMPAT_EXTENDED_IREF = 1 << 6
INCOMPAT_SKINNY_METADATA = 1 << 8
INCOMPAT_NO_HOLES = 1 << 9
COMPAT_RO_FREE_SPACE_TREE = 1 << 0
COMPAT_RO_FREE_SPACE_TREE_VALID = 1 << 1
MAGIC = b"_BHRfS_M"

# dir item types (BTRFS_FT_*)
FT_REG_FILE = 1
FT_DIR = 2
FT_CHRDEV = 3
FT_BLKDEV = 4
FT_FIFO = 5
FT_SOCK = 6
FT_SYMLINK = 7
FT_XATTR = 8

Key = tuple[int, int, int]  # (objectid, type, offset): tuples sort as btrfs keys do

_KEY = struct.Struct("<QBQ")
_MASK32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF


# --- checksums and hashes -------------------------------------------------
def csum(data: bytes | bytearray | memoryview) -> bytes:
    """CRC-32C of a tree block or superblock (from byte 32), as stored: 4 bytes LE + zero pad."""
    return struct.pack("<I", crc32c(data)) + bytes(28)


def _raw_crc32c(seed: int, data: bytes) -> int:
    """The kernel's ``crc32c(seed, data)``: no pre/post inversion."""
    return (~crc32c(data, (~seed) & _MASK32)) & _MASK32


def name_hash(name: bytes) -> int:
    """``btrfs_name_hash``: DIR_ITEM and XATTR_ITEM key offsets: ``_raw_crc32c(~1, name)``,
    written out (one call per directory entry)."""
    return crc32c(name, 1) ^ _MASK32


def extent_data_ref_hash(root: int, owner: int, offset: int) -> int:
    """``hash_extent_data_ref`` (kernel-shared/extent-tree.c)."""
    high = _raw_crc32c(_MASK32, struct.pack("<Q", root))
    low = _raw_crc32c(_MASK32, struct.pack("<Q", owner))
    low = _raw_crc32c(low, struct.pack("<Q", offset))
    return ((high << 31) ^ low) & 0xFFFFFFFFFFFFFFFF


# --- structures -----------------------------------------------------------
def pack_disk_key(key: Key) -> bytes:
    return _KEY.pack(key[0], key[1], key[2])


_TIMESPEC = struct.Struct("<QI")


def pack_timespec(ns: int) -> bytes:
    sec, nsec = divmod(ns, 1_000_000_000)
    return _TIMESPEC.pack(sec & 0xFFFFFFFFFFFFFFFF, nsec)


# struct btrfs_inode_item: generation transid size nbytes block_group nlink uid gid mode
# rdev flags sequence reserved[4] atime ctime mtime otime
_INODE_ITEM = struct.Struct("<5Q4I3Q32xQIQIQIQI")
_NS = 1_000_000_000


def pack_inode_item(
    *,
    generation: int,
    size: int,
    nbytes: int,
    nlink: int,
    uid: int,
    gid: int,
    mode: int,
    rdev: int = 0,
    flags: int = 0,
    atime_ns: int = 0,
    ctime_ns: int = 0,
    mtime_ns: int = 0,
    otime_ns: int = 0,
) -> bytes:
    a, c, m, o = (
        divmod(atime_ns, _NS),
        divmod(ctime_ns, _NS),
        divmod(mtime_ns, _NS),
        divmod(otime_ns, _NS),
    )
    return _INODE_ITEM.pack(
        generation, generation, size, nbytes, 0, nlink, uid, gid, mode, rdev, flags, 0,
        a[0] & _U64, a[1], c[0] & _U64, c[1], m[0] & _U64, m[1], o[0] & _U64, o[1],
    )  # fmt: skip


INODE_ITEM_SIZE = 160

_INODE_REF = struct.Struct("<QH")


def pack_inode_ref(index: int, name: bytes) -> bytes:
    return _INODE_REF.pack(index, len(name)) + name


_INODE_EXTREF = struct.Struct("<QQH")


def pack_inode_extref(parent: int, index: int, name: bytes) -> bytes:
    """struct btrfs_inode_extref: the names that no longer fit the INODE_REF item."""
    return _INODE_EXTREF.pack(parent, index, len(name)) + name


def extref_hash(parent: int, name: bytes) -> int:
    """``btrfs_extref_hash``: INODE_EXTREF key offset."""
    return _raw_crc32c(parent & _MASK32, name)


# struct btrfs_dir_item: location key, transid, data_len, name_len, type
_DIR_ITEM = struct.Struct("<QBQQHHB")


def pack_dir_item(location: Key, transid: int, ftype: int, name: bytes, data: bytes = b"") -> bytes:
    return (
        _DIR_ITEM.pack(location[0], location[1], location[2], transid, len(data), len(name), ftype)
        + name
        + data
    )


# struct btrfs_file_extent_item
_FILE_EXTENT_HEAD = struct.Struct("<QQBBHB")
_FILE_EXTENT_REG = struct.Struct("<QQBBHBQQQQ")


def pack_file_extent_inline(generation: int, data: bytes) -> bytes:
    return _FILE_EXTENT_HEAD.pack(generation, len(data), 0, 0, 0, FILE_EXTENT_INLINE) + data


def pack_file_extent_reg(
    generation: int,
    disk_bytenr: int,
    disk_num_bytes: int,
    num_bytes: int | None = None,
    compression: int = 0,
) -> bytes:
    """A regular extent referenced whole; uncompressed (``num_bytes`` None) it holds
    ``disk_num_bytes`` of file data, compressed ``num_bytes`` (= ram_bytes)."""
    ram = disk_num_bytes if num_bytes is None else num_bytes
    return _FILE_EXTENT_REG.pack(
        generation,
        ram,  # ram_bytes
        compression,
        0,
        0,
        FILE_EXTENT_REG,
        disk_bytenr,
        disk_num_bytes,
        0,  # offset into the extent
        ram,  # num_bytes
    )


_EXTENT_ITEM = struct.Struct("<QQQ")  # refs generation flags
_EXTENT_DATA_REF = struct.Struct("<QQQI")  # root objectid offset count
_TREE_BLOCK_INLINE_REF = struct.Struct("<BQ")


def pack_extent_item(refs: int, generation: int, flags: int) -> bytes:
    return _EXTENT_ITEM.pack(refs, generation, flags)


def pack_extent_data_ref(root: int, objectid: int, offset: int, count: int) -> bytes:
    return _EXTENT_DATA_REF.pack(root, objectid, offset, count)


def pack_inline_data_ref(root: int, objectid: int, offset: int, count: int) -> bytes:
    return bytes([EXTENT_DATA_REF_KEY]) + _EXTENT_DATA_REF.pack(root, objectid, offset, count)


def pack_metadata_item(generation: int, owner: int) -> bytes:
    """Skinny METADATA_ITEM body: extent item + one inline TREE_BLOCK_REF to ``owner``."""
    return _EXTENT_ITEM.pack(1, generation, EXTENT_FLAG_TREE_BLOCK) + _TREE_BLOCK_INLINE_REF.pack(
        TREE_BLOCK_REF_KEY, owner
    )


_BLOCK_GROUP_ITEM = struct.Struct("<QQQ")


def pack_block_group_item(used: int, flags: int) -> bytes:
    return _BLOCK_GROUP_ITEM.pack(used, FIRST_CHUNK_TREE_OBJECTID, flags)


_FREE_SPACE_INFO = struct.Struct("<II")


def pack_free_space_info(extent_count: int) -> bytes:
    return _FREE_SPACE_INFO.pack(extent_count, 0)


_DEV_EXTENT = struct.Struct("<QQQQ16s")


def pack_dev_extent(chunk_offset: int, length: int, chunk_tree_uuid: bytes) -> bytes:
    return _DEV_EXTENT.pack(
        CHUNK_TREE_OBJECTID, FIRST_CHUNK_TREE_OBJECTID, chunk_offset, length, chunk_tree_uuid
    )


# struct btrfs_dev_item (98 bytes)
_DEV_ITEM = struct.Struct("<QQQIIIQQQIBB16s16s")


def pack_dev_item(devid: int, total_bytes: int, bytes_used: int, uuid: bytes, fsid: bytes) -> bytes:
    return _DEV_ITEM.pack(
        devid,
        total_bytes,
        bytes_used,
        SECTORSIZE,
        SECTORSIZE,
        SECTORSIZE,
        0,
        0,
        0,
        0,
        0,
        0,
        uuid,
        fsid,
    )


DEV_ITEM_SIZE = _DEV_ITEM.size

# struct btrfs_chunk + one struct btrfs_stripe
_CHUNK = struct.Struct("<QQQQIIIHH")
_STRIPE = struct.Struct("<QQ16s")


def pack_chunk(length: int, ctype: int, devid: int, physical: int, dev_uuid: bytes) -> bytes:
    return _CHUNK.pack(
        length, EXTENT_TREE_OBJECTID, STRIPE_LEN, ctype, STRIPE_LEN, STRIPE_LEN, SECTORSIZE, 1, 1
    ) + _STRIPE.pack(devid, physical, dev_uuid)


# struct btrfs_root_item (439 bytes)
_ROOT_ITEM_MID = struct.Struct("<QQQQQQQI17sBBQ16s16s16sQQQQ")


def pack_root_item(
    *,
    generation: int,
    root_dirid: int,
    bytenr: int,
    bytes_used: int,
    level: int,
    uuid: bytes = bytes(16),
    ctransid: int = 0,
    otransid: int = 0,
    ctime_ns: int = 0,
    otime_ns: int = 0,
) -> bytes:
    inode = pack_inode_item(
        generation=1, size=3, nbytes=NODESIZE, nlink=1, uid=0, gid=0, mode=0o40755
    )
    mid = _ROOT_ITEM_MID.pack(
        generation,
        root_dirid,
        bytenr,
        0,  # byte_limit
        bytes_used,
        0,  # last_snapshot
        0,  # flags
        1,  # refs
        bytes(17),  # drop_progress
        0,  # drop_level
        level,
        generation,  # generation_v2
        uuid,
        bytes(16),
        bytes(16),
        ctransid,
        otransid,
        0,
        0,
    )
    out = (
        inode
        + mid
        + pack_timespec(ctime_ns)
        + pack_timespec(otime_ns)
        + pack_timespec(0)
        + pack_timespec(0)
        + bytes(64)
    )
    assert len(out) == 439
    return out


# --- tree blocks ----------------------------------------------------------
_HEADER = struct.Struct("<32s16sQQ16sQQIB")
_ITEM = struct.Struct("<QBQII")
_KEY_PTR = struct.Struct("<QBQQQ")


class Digest(Protocol):
    """What ``pack_leaf_payload`` feeds the items to (a ``hashlib`` hash)."""

    def update(self, data: bytes, /) -> None: ...


def pack_leaf_payload(items: list[tuple[Key, bytes]], digest: Digest | None = None) -> bytes:
    """A leaf without its header: item headers from the front, data from the back.

    With ``digest``, each item's disk key and data are fed to it too, in item order (one
    ``update`` per leaf: the key is the first ``DISK_KEY_SIZE`` bytes of the item header)."""
    end = LEAF_DATA_SIZE
    heads = []
    datas = []
    hashed: list[bytes] = []
    pack = _ITEM.pack
    for (objectid, type_, offset), data in items:
        size = len(data)
        end -= size
        head = pack(objectid, type_, offset, end, size)
        heads.append(head)
        datas.append(data)
        if digest is not None:
            hashed += (head[:DISK_KEY_SIZE], data)
    gap = end - len(items) * ITEM_SIZE
    if gap < 0:
        raise AssertionError("leaf overflow")
    if digest is not None:
        digest.update(b"".join(hashed))
    heads.append(bytes(gap))
    datas.reverse()
    return b"".join(heads + datas)


def pack_block(
    payload: bytes,
    nritems: int,
    level: int,
    bytenr: int,
    owner: int,
    generation: int,
    fsid: bytes,
    chunk_tree_uuid: bytes,
) -> bytes:
    """Header + payload (leaf items or node key pointers) + checksum: one tree block."""
    flags = HEADER_FLAG_WRITTEN | (MIXED_BACKREF_REV << 56)
    head = _HEADER.pack(
        bytes(32), fsid, bytenr, flags, chunk_tree_uuid, generation, owner, nritems, level
    )
    body = head[32:] + payload + bytes(NODESIZE - HEADER_SIZE - len(payload))
    return csum(body) + body


def pack_node_payload(ptrs: list[tuple[Key, int]], generation: int) -> bytes:
    pack = _KEY_PTR.pack
    return b"".join(pack(k[0], k[1], k[2], child, generation) for k, child in ptrs)
