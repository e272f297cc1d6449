"""struct btrfs_super_block (4096 bytes at 64 KiB on every device)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from btrfs_ublk_image.btrfs import ondisk as d

# field offsets, from kernel-shared/ctree.h (struct btrfs_super_block)
_HEAD = struct.Struct("<16sQQ8sQQQQQQQQQIIIIIQQQQHBBB")  # fsid .. log_root_level, from offset 0x20
_DEV_ITEM_OFF = 0xC9
_LABEL_OFF = 0x12B
_CACHE_GEN_OFF = 0x22B
_SYS_CHUNK_ARRAY_OFF = 0x32B
_SYS_CHUNK_ARRAY_SIZE = 2048
_SUPER_ROOTS_OFF = 0xB2B
# struct btrfs_root_backup (168 bytes)
_BACKUP = struct.Struct("<15Q32x6B10x")


@dataclass(frozen=True, slots=True)
class TreeRoot:
    bytenr: int
    level: int


@dataclass(frozen=True, slots=True)
class SuperFields:
    fsid: bytes
    generation: int
    root: TreeRoot
    chunk_root: TreeRoot
    extent_root: TreeRoot
    fs_root: TreeRoot
    dev_root: TreeRoot
    csum_root: TreeRoot
    total_bytes: int
    bytes_used: int
    num_devices: int
    sys_chunk_array: bytes
    label: bytes


def pack_super(f: SuperFields, dev_item: bytes, bytenr: int = d.SUPER_INFO_OFFSET) -> bytes:
    if len(f.sys_chunk_array) > _SYS_CHUNK_ARRAY_SIZE:
        raise ValueError("sys_chunk_array overflow")
    sb = bytearray(d.SUPER_INFO_SIZE)
    _HEAD.pack_into(
        sb,
        0x20,
        f.fsid,
        bytenr,
        d.HEADER_FLAG_WRITTEN | d.SUPER_FLAG_SEEDING,
        d.MAGIC,
        f.generation,
        f.root.bytenr,
        f.chunk_root.bytenr,
        0,  # log_root
        0,  # log_root_transid
        f.total_bytes,
        f.bytes_used,
        d.ROOT_TREE_DIR_OBJECTID,
        f.num_devices,
        d.SECTORSIZE,
        d.NODESIZE,
        d.NODESIZE,  # leafsize
        d.SECTORSIZE,  # stripesize
        len(f.sys_chunk_array),
        f.generation,  # chunk_root_generation
        0,  # compat_flags
        d.COMPAT_RO_FREE_SPACE_TREE | d.COMPAT_RO_FREE_SPACE_TREE_VALID,
        d.INCOMPAT_MIXED_BACKREF
        | d.INCOMPAT_BIG_METADATA
        | d.INCOMPAT_EXTENDED_IREF
        | d.INCOMPAT_SKINNY_METADATA
        | d.INCOMPAT_NO_HOLES,
        0,  # csum_type crc32c
        f.root.level,
        f.chunk_root.level,
        0,  # log_root_level
    )
    assert len(dev_item) == d.DEV_ITEM_SIZE
    sb[_DEV_ITEM_OFF : _DEV_ITEM_OFF + len(dev_item)] = dev_item
    sb[_LABEL_OFF : _LABEL_OFF + len(f.label)] = f.label
    # cache_generation 0 (no v1 space cache), uuid_tree_generation = generation
    struct.pack_into("<QQ", sb, _CACHE_GEN_OFF, 0, f.generation)
    sb[_SYS_CHUNK_ARRAY_OFF : _SYS_CHUNK_ARRAY_OFF + len(f.sys_chunk_array)] = f.sys_chunk_array
    g = f.generation
    _BACKUP.pack_into(
        sb,
        _SUPER_ROOTS_OFF,
        f.root.bytenr,
        g,
        f.chunk_root.bytenr,
        g,
        f.extent_root.bytenr,
        g,
        f.fs_root.bytenr,
        g,
        f.dev_root.bytenr,
        g,
        f.csum_root.bytenr,
        g,
        f.total_bytes,
        f.bytes_used,
        f.num_devices,
        f.root.level,
        f.chunk_root.level,
        f.extent_root.level,
        f.fs_root.level,
        f.dev_root.level,
        f.csum_root.level,
    )
    sb[0:32] = d.csum(memoryview(sb)[32:])
    return bytes(sb)
