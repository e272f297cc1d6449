"""Step 3 of the writer (``writer``): the fs tree's items for every inode
(``fs_tree_items``), generated sorted, natively (native/src/fsitems.rs) when the
extension has it."""

from __future__ import annotations

import os
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import IO

from btrfs_ublk_image import native
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.btrfs.numbering import Numbering
from btrfs_ublk_image.btrfs.placement import DataPlacer
from btrfs_ublk_image.btrfs.treeblocks import (
    NO_KEYS,
    Leaf,
    _NativeLeafPacker,
    add_dir_items,
    group_by_hash,
    leaf_packer,
)
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.tree import Blob, FileType, Inode, Sparse

MAX_INLINE = d.SECTORSIZE - 1  # btrfs check: inline ram_bytes <= sectorsize - 1
LINK_MAX = 65535  # BTRFS_LINK_MAX

_FT = {
    FileType.REG: d.FT_REG_FILE,
    FileType.DIR: d.FT_DIR,
    FileType.CHR: d.FT_CHRDEV,
    FileType.BLK: d.FT_BLKDEV,
    FileType.FIFO: d.FT_FIFO,
    FileType.SOCK: d.FT_SOCK,
    FileType.SYMLINK: d.FT_SYMLINK,
}


def kernel_rdev(rdev: int) -> int:
    # btrfs stores the kernel's dev_t: MKDEV(major, minor) = major << 20 | minor
    return (os.major(rdev) << 20) | os.minor(rdev)


@dataclass(slots=True)
class FsTree:
    leaves: list[Leaf]  # packed as generated: the items never sit in memory as a list
    # (their payloads spilled to a file when the writer gives one)
    digest: bytes  # sha256 over every item (key + data): the content the fsid derives from
    placer: DataPlacer  # the data extents
    # file extent refs, one row each, in inode order: the extent's row and the inode
    ref_extent: array[int]
    ref_ino: array[int]
    ref_offset: array[int]  # the file offset the ref maps the extent at
    stats: dict[str, int]


# the fs tree's counts, in the order both loops give them
FS_TREE_STATS = (
    "files",
    "directories",
    "symlinks",
    "devices",
    "hardlinks",
    "inline_files",
    "content_bytes",
)


def fs_tree_items(
    num: Numbering,
    placer: DataPlacer,
    imax: int,
    spill: IO[bytes] | None = None,
    breaks: Sequence[d.Key] = NO_KEYS,
) -> FsTree:
    # with the sha256 over every item's disk key and data, in order
    packer = leaf_packer(spill, digest=True, breaks=breaks)
    nat = native.module()
    if nat is not None and isinstance(packer, _NativeLeafPacker) and hasattr(nat, "fs_tree_items"):
        return fs_tree_items_native(nat, num, placer, imax, packer)
    gen = d.GENERATION
    add, add_inode, add_dir = packer.add, packer.add_inode, packer.add_dir
    ref_extent = array("Q")
    ref_ino = array("Q")
    ref_offset = array("Q")
    files = directories = symlinks = devices = hardlinks = inline_files = content_bytes = 0
    ext_logical, ext_disk, ext_offset = placer.logical, placer.disk_bytes, placer.file_offset
    more_refs = num.more_refs
    reg, dir_, symlink = FileType.REG, FileType.DIR, FileType.SYMLINK
    extent_data_key = d.EXTENT_DATA_KEY
    # btrfs-zstd: datasum inodes (compressed extents need checksums), extents of their own
    encoded = placer.encoded is not None
    ext_num, ext_comp = placer.num_bytes, placer.compression
    reg_flags = 0 if encoded else d.INODE_NODATASUM | d.INODE_NODATACOW
    inos, first, dir_indexes = num.inos, d.FIRST_FREE_OBJECTID, num.dir_indexes
    for n, node in enumerate(num.inodes):
        ino = n + first if inos is None else inos[n]
        ftype, perm, uid, gid, xattrs = node.meta()
        size, nbytes, flags = 0, 0, 0
        more = more_refs.get(ino)
        nlink = 1 if more is None else 1 + len(more)
        file_extents: list[tuple[d.Key, bytes]] = []
        entries: Mapping[bytes, Inode] = {}
        rdev = 0
        if ftype is reg:
            files += 1
            flags = reg_flags
            content = node.content
            if isinstance(content, Blob | Sparse):
                # a sparse file: extents for its data segments only, holes have no item
                segments = ((0, content),) if isinstance(content, Blob) else content.segments
                size = content.size
                for seg_offset, blob in segments:
                    for row in placer.place(blob):
                        offset = seg_offset + ext_offset[row]
                        if encoded:
                            held = ext_num[row]
                            item = d.pack_file_extent_reg(
                                gen, ext_logical[row], ext_disk[row], held, ext_comp[row]
                            )
                        else:
                            held = ext_disk[row]
                            item = d.pack_file_extent_reg(gen, ext_logical[row], held)
                        file_extents.append(((ino, extent_data_key, offset), item))
                        ref_extent.append(row)
                        ref_ino.append(ino)
                        ref_offset.append(offset)
                        nbytes += held
            elif content:
                if len(content) > imax:
                    raise AssertionError("in-memory content larger than the inline limit")
                size = nbytes = len(content)
                inline_files += 1
                file_extents.append(
                    ((ino, extent_data_key, 0), d.pack_file_extent_inline(gen, content))
                )
            content_bytes += size
            hardlinks += nlink - 1
        elif ftype is symlink:
            symlinks += 1
            target = node.target
            if not target or len(target) > MAX_INLINE:
                raise ImageError(
                    f"symlink target of inode {ino} is empty or longer than {MAX_INLINE} bytes"
                )
            size = nbytes = len(target)
            file_extents.append(((ino, extent_data_key, 0), d.pack_file_extent_inline(gen, target)))
        elif ftype is dir_:
            directories += 1
            entries = node.entries
            size = 2 * sum(map(len, entries))
        else:
            devices += 1
            if ftype is FileType.CHR or ftype is FileType.BLK:
                rdev = kernel_rdev(node.rdev)
        if nlink > LINK_MAX:
            raise ImageError(f"inode {ino} has {nlink} hardlinks; btrfs allows {LINK_MAX}")
        mtime, atime, ctime = node.times()
        add_inode(
            ino, gen, size, nbytes, 1 if ftype is dir_ else nlink, uid, gid,
            int(ftype) | (perm & 0o7777), rdev, flags, mtime if atime is None else atime,
            mtime if ctime is None else ctime, mtime, mtime,
            (num.parent[n], num.index[n], num.name[n]) if nlink == 1 else None,
        )  # fmt: skip
        if nlink != 1:
            # names per parent dir in one INODE_REF item while it fits in a leaf, the rest in
            # INODE_EXTREF items (EXTENDED_IREF), as the kernel does when a ref item is full
            by_parent: dict[int, bytes] = {}
            extrefs: dict[int, bytes] = {}
            for parent, index, name in sorted(num.refs(n, ino)):
                ref = d.pack_inode_ref(index, name)
                data = by_parent.get(parent, b"")
                if len(data) + len(ref) <= d.MAX_ITEM_DATA:
                    by_parent[parent] = data + ref
                else:
                    h = d.extref_hash(parent, name)
                    extrefs[h] = extrefs.get(h, b"") + d.pack_inode_extref(parent, index, name)
            for parent, data in sorted(by_parent.items()):
                add((ino, d.INODE_REF_KEY, parent), data)
            for h, data in sorted(extrefs.items()):
                add((ino, d.INODE_EXTREF_KEY, h), data)
        if xattrs:
            xattr_items = []
            for name, value in xattrs.items():
                if len(name) + len(value) > d.MAX_XATTR_SIZE or not name or len(name) > 255:
                    raise ImageError(f"xattr {name[:60]!r} of inode {ino}: name or value too large")
                xattr_items.append(
                    (d.name_hash(name), d.pack_dir_item((0, 0, 0), gen, d.FT_XATTR, name, value))
                )
            for h, data in group_by_hash(xattr_items):
                add((ino, d.XATTR_ITEM_KEY, h), data)
        if entries:
            names = sorted(entries)
            children = [entries[name] for name in names]
            child_inos = list(num.child_inos(ino, children))
            ftypes = bytes([_FT[child.type] for child in children])
            indexes = dir_indexes.get(ino)
            if indexes is None or indexes.tolist() == list(range(2, 2 + len(names))):
                add_dir(ino, gen, names, child_inos, ftypes)
            else:  # a base's indexes: not 2, 3, ... in name order
                add_dir_items(add, ino, gen, names, child_inos, ftypes, indexes)
        for key, data in file_extents:
            add(key, data)
    counts = (files, directories, symlinks, devices, hardlinks, inline_files, content_bytes)
    stats = dict(zip(FS_TREE_STATS, counts, strict=True))
    leaves, digest = packer.finish()
    assert digest is not None
    return FsTree(leaves, digest, placer, ref_extent, ref_ino, ref_offset, stats)


def fs_tree_items_native(
    nat: ModuleType, num: Numbering, placer: DataPlacer, imax: int, packer: _NativeLeafPacker
) -> FsTree:
    """``fs_tree_items``'s loop in the extension (native/src/fsitems.rs): the same items,
    errors and placement. A fresh placer without a base or encoded extents places there
    too (its columns and state come back here); otherwise the extension calls ``place``."""
    encoded = placer.encoded is not None
    native_placement = placer.base is None and not encoded and placer.fresh
    ref_extent, ref_ino, ref_offset = array("Q"), array("Q"), array("Q")
    stats, placed = nat.fs_tree_items(
        packer.native,
        num,
        placer,
        native_placement,
        imax,
        encoded,
        d.GENERATION,
        0 if encoded else d.INODE_NODATASUM | d.INODE_NODATACOW,
        (ref_extent, ref_ino, ref_offset),
    )
    if placed is not None:
        placer.adopt(*placed)
    leaves, digest = packer.finish()
    assert digest is not None
    return FsTree(
        leaves,
        digest,
        placer,
        ref_extent,
        ref_ino,
        ref_offset,
        dict(zip(FS_TREE_STATS, stats, strict=True)),
    )
