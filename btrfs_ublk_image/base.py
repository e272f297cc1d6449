"""A base image for ``build --base``: the content of an earlier bundle, to reuse as it lies.

A file whose data is one run of bytes in one of the base's packs (every file the
builder wrote, unless a hole or an in-place tarball's member split it) is indexed as a
``Blob`` pointing into that pack: its CRC-32C (read once, through the base's verified
chunks) is the deduplication key the ``PackWriter`` already uses, so new content equal
to base content (compared byte by byte against the base's verified chunks) is not
written again: the new blockmap maps it into the base's pack, which the new bundle
lists under the same id and holds as a hard link (else a reflink, else a copy) of the
base's pack file. Push and fetch then skip these packs and chunks: they are already
in the registry and the host cache.

Pack numbers: in the new bundle, pack 0 is the written pack, packs ``1..n`` are the
base's packs in the base's order (only those the new image uses are kept, see
``bundle.py``), in-place tarball packs follow.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any

from btrfs_ublk_image import blockmap as bmap
from btrfs_ublk_image import native, patch
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.btrfs.layout import BaseLayout, Chunk
from btrfs_ublk_image.btrfs.treeblocks import Breaks
from btrfs_ublk_image.crc import crc32c
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.manifest import BLOCKMAP, MANIFEST, read_bundle_file, read_manifest
from btrfs_ublk_image.reader import BundleReader, Filesystem, Inode
from btrfs_ublk_image.tree import Blob

# the CRC may keep the GIL (no other thread runs while the base is indexed)
_KEEP_GIL = 0


@dataclass(frozen=True, slots=True)
class BasePack:
    """A pack of the base: its blockmap entry and its file."""

    entry: bmap.PackEntry
    path: str
    name: str  # "packs/<hex>", as in the base's manifest

    @property
    def id(self) -> str:
        return "sha256:" + self.entry.id.hex()


# a blob's extents in the base: (file offset, logical, disk bytes, device-2 offset)
Extents = tuple[tuple[int, int, int, int], ...]
# a base file's bytes: (pack, numbered in the new image; offset; size)
Run = tuple[int, int, int]
# directory inode -> name -> (inode, DIR_INDEX index): ``layout.BaseLayout.dirs``
Dirs = dict[int, dict[bytes, tuple[int, int]]]


class BaseImage:
    """An open, indexed base bundle: its packs (``packs[i]`` becomes pack ``first + i``);
    ``blobs``, every distinct content of a regular file that lies in one run of one pack
    (numbered that way), in the base's walk order (so a build with this base is
    deterministic); ``extents``, how the base placed those of them it placed as the writer
    places a blob. Content is read through the base's verified chunks."""

    def __init__(self, bundle: str, *, chunk_size: int | None = None, first: int = 1) -> None:
        """``chunk_size``: the pack chunk size the new image uses (its packs must have it
        for the base's to be reused), checked before the base is indexed."""
        self.bundle = os.path.abspath(bundle)
        if not os.path.isdir(self.bundle):
            raise ImageError(f"{bundle}: base is not a bundle directory")
        self.fs = fs = Filesystem(self.bundle)
        try:
            self.image_id = fs.image_id
            self.first = first
            bm = fs.dev2.bm
            self.chunk_size = bm.chunk_size
            if chunk_size is not None and chunk_size != self.chunk_size:
                raise ImageError(
                    f"{bundle}: base image has {self.chunk_size}-byte pack chunks, the spec asks"
                    f" for {chunk_size} (pack_chunk_size): its packs cannot be reused"
                )
            self.packs = [
                BasePack(entry, path, p["path"])
                for entry, path, p in zip(
                    bm.packs, fs.dev2.pack_paths, fs.manifest["packs"], strict=True
                )
            ]
            # the extension's reader of the packs (None: compressed packs, or no extension)
            self.native_packs: Any = _native_packs(self.packs, self.chunk_size, first)
            nat = native.module()
            if self.native_packs is not None and hasattr(nat, "FsScan"):
                runs, placed, dirs, max_ino = self._scan(nat)
                crcs: list[int | None] = self.native_packs.crcs(runs)
            else:
                runs, placed, dirs, max_ino, crcs = self._read()
            self.blobs, self.extents = _blobs(runs, crcs, placed)
            self._layout = self._make_layout(dirs, max_ino)
        except BaseException:
            fs.close()
            raise

    def close(self) -> None:
        self.native_packs = None  # its files close with the pack's reference too
        self.fs.close()

    def __enter__(self) -> BaseImage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, pack: int, offset: int, length: int) -> bytes:
        """Bytes of base pack ``pack`` (numbered in the new bundle), from verified chunks."""
        return self.fs.dev2.pack_bytes(pack - self.first, offset, length)

    def _trees(
        self, meta_start: int
    ) -> tuple[dict[int, Breaks], dict[tuple[int, int, d.Key], int]]:
        """Per tree, the first keys of its blocks level by level; per block (tree id,
        level, first key), its address - ``meta_start`` where the writer could keep it."""
        fs = self.fs
        meta_size = os.path.getsize(fs.meta_path)
        breaks: dict[int, Breaks] = {}
        offsets: dict[tuple[int, int, d.Key], int] = {}
        for tree_id, (bytenr, level) in fs.tree_roots().items():
            firsts: list[list[d.Key]] = [[] for _ in range(level + 1)]
            for lvl, key, at in fs.blocks(bytenr, level, tree_id):
                firsts[lvl].append(key)
                if self._metadata_block(at, meta_start, meta_size):
                    offsets[(tree_id, lvl, key)] = at - meta_start
            breaks[tree_id] = Breaks(tuple(tuple(sorted(ks)) for ks in firsts))
        return breaks, offsets

    def _metadata_block(self, bytenr: int, meta_start: int, meta_size: int) -> bool:
        """Whether a base block's address is one this builder could have given it: in a
        METADATA chunk, in meta.img, a whole block after the start of metadata (a base made
        otherwise lends its breaks, not such an address)."""
        try:
            chunk, devid, physical = self.fs.map_logical(bytenr, d.NODESIZE)
        except ImageError:
            return False
        return (
            devid == 1
            and bool(chunk.type & d.BLOCK_GROUP_METADATA)
            and physical + d.NODESIZE <= meta_size
            and bytenr >= meta_start
            and (bytenr - meta_start) % d.NODESIZE == 0
        )

    def layout(self) -> BaseLayout:
        """What the writer keeps of the base (``layout.BaseLayout``): inode numbers and dir
        indexes by path, ``extents``, the DATA chunks, where metadata starts, and where each
        tree's blocks begin and their addresses."""
        return self._layout

    def _make_layout(self, dirs: Dirs, max_ino: int) -> BaseLayout:
        fs = self.fs
        if fs.root_dirid != d.FIRST_FREE_OBJECTID:
            raise ImageError(f"{fs.meta_path}: root directory is inode {fs.root_dirid}, not 256")
        data = [
            Chunk(c.logical, c.length, c.type, 2, c.stripes[0].offset)
            for c in fs.chunks
            if c.type & d.BLOCK_GROUP_DATA and [s.devid for s in c.stripes] == [2]
        ]
        # every tree but the chunk tree lives in METADATA chunks
        meta = [c.logical for c in fs.chunks if c.type & d.BLOCK_GROUP_METADATA]
        if not meta:
            raise ImageError(f"{fs.meta_path}: no METADATA chunk")
        meta_start = min(meta)
        breaks, offsets = self._trees(meta_start)
        return BaseLayout(
            dirs=dirs,
            max_ino=max_ino,
            extents=self.extents,
            data_chunks=data,
            data_size=fs.dev2.bm.device_size,
            meta_start=meta_start,
            breaks=breaks,
            offsets=offsets,
        )

    def _scan(self, nat: Any) -> tuple[list[Run], list[Extents | None], Dirs, int]:
        """The base's files and directories read by the extension (native/src/basescan.rs):
        no object per base inode. The same as ``_read``'s, which tests check."""
        fs = self.fs
        scan = nat.FsScan(fs.meta_path, fs.nodesize)
        for block, bytenr, first_key in fs.leaves(fs.fs_root, fs.fs_level, d.FS_TREE_OBJECTID):
            scan.add_leaf(block, bytenr, first_key)
        chunks = [(c.logical, c.length, c.stripes[0].devid, c.stripes[0].offset) for c in fs.chunks]
        r = bmap.Ranges.of(fs.dev2.bm.ranges)
        runs, placed, dirs, max_ino = scan.index(
            fs.root_dirid, chunks, r.dev_offset, r.length, r.pack, r.pack_offset, self.first
        )
        return runs, placed, dirs, max_ino

    def _read(self) -> tuple[list[Run], list[Extents | None], Dirs, int, list[int | None]]:
        """The base's files and directories through reader.py's ``BundleReader`` (an object
        per base inode, freed once the base is indexed), each file's CRC-32C read through
        the base's verified chunks (None: a chunk fails its digest)."""
        reader = BundleReader(self.bundle, self.fs)
        seen: set[int] = set()
        files: list[Inode] = []
        runs: list[Run] = []
        for _path, node in reader.walk():
            if not stat.S_ISREG(node.item.mode) or node.item.ino in seen:
                continue
            seen.add(node.item.ino)
            where = self._run(node)
            if where is not None:
                runs.append((where[0] + self.first, where[1], node.item.size))
                files.append(node)
        placed = [self._placed(node) for node in files]
        dirs = {
            ino: {e.name: (e.ino, e.index) for e in node.entries}
            for ino, node in reader.inodes.items()
            if node.is_dir
        }
        crcs: list[int | None] = []
        for node in files:
            crc = 0
            try:
                for piece in reader.read_chunks(node):
                    crc = crc32c(piece, crc, _KEEP_GIL)
            except ImageError:
                crcs.append(None)
                continue
            crcs.append(crc)
        return runs, placed, dirs, max(reader.inodes), crcs

    def _placed(self, node: Inode) -> Extents | None:
        """The file's extents as the writer places a blob: (file offset, logical, disk
        bytes, device-2 offset), whole extents back to back from file offset 0, each in
        one DATA chunk on device 2, the last holding the file's end; else None (the
        content is placed anew)."""
        size, pos = node.item.size, 0
        out = []
        for ext in node.extents:
            disk = ext.disk_num_bytes
            if (
                ext.kind != d.FILE_EXTENT_REG
                or ext.compression
                or ext.offset
                or ext.num_bytes != disk
                or ext.file_offset != pos
                or disk % d.SECTORSIZE
                or pos >= size
            ):
                return None
            try:
                _chunk, devid, physical = self.fs.map_logical(ext.disk_bytenr, disk)
            except ImageError:
                return None
            if devid != 2:
                return None
            out.append((pos, ext.disk_bytenr, disk, physical))
            pos += disk
        if not out or not size <= pos < size + d.SECTORSIZE:
            return None
        return tuple(out)

    def _run(self, node: Inode) -> tuple[int, int] | None:
        """(base pack, offset) when the file's bytes are one run of one pack, else None."""
        size = node.item.size
        fs = self.fs
        bm = fs.dev2.bm
        pos = 0
        at: tuple[int, int] | None = None  # the pack and offset of file byte `pos`
        start: tuple[int, int] | None = None
        for ext in node.extents:
            if (
                ext.kind != d.FILE_EXTENT_REG
                or ext.disk_bytenr == 0
                or ext.file_offset != pos
                or ext.compression
            ):
                return None
            length = min(ext.num_bytes, size - pos)
            logical = ext.disk_bytenr + ext.offset
            done = 0
            while done < length:
                try:
                    chunk, devid, physical = fs.map_logical(logical + done, 1)
                except ImageError:
                    return None
                if devid != 2:
                    return None
                r = bm.lookup(physical)
                if r is None:
                    return None
                n = min(
                    length - done,
                    r.dev_offset + r.length - physical,
                    chunk.logical + chunk.length - (logical + done),
                )
                here = (r.pack, r.pack_offset + (physical - r.dev_offset))
                if at is not None and here != at:
                    return None
                if start is None:
                    start = here
                at = (here[0], here[1] + n)
                done += n
            pos += length
            if pos >= size:
                break
        if pos != size or start is None or size == 0:
            return None
        return start


def _blobs(
    runs: list[Run], crcs: list[int | None], placed: list[Extents | None]
) -> tuple[tuple[Blob, ...], dict[Blob, Extents]]:
    """``BaseImage.blobs`` and ``extents`` from the base's runs in walk order, their CRCs
    (None: not indexed, written anew) and their extents as placed (None: placed anew)."""
    seen: set[Blob] = set()
    out: list[Blob] = []
    extents: dict[Blob, Extents] = {}
    for (pack, offset, size), crc, ext in zip(runs, crcs, placed, strict=True):
        if crc is None:
            continue  # a chunk fails its digest: that content is written anew
        blob = Blob(crc, size, pack, offset)
        if blob not in seen:  # hard links and reflinked copies: one blob
            seen.add(blob)
            out.append(blob)
            if ext is not None:
                extents[blob] = ext
    return tuple(out), extents


def _native_packs(packs: list[BasePack], chunk_size: int, first: int) -> Any:
    """The extension's reader of the base's packs (native/src/basepacks.rs), numbered from
    ``first``; None without the extension or where a pack is not stored raw."""
    nat = native.module()
    if nat is None:
        return None
    for p in packs:
        stored = p.entry.stored
        if stored is not None and any(
            c.zstd
            or c.offset != i * chunk_size
            or c.length != min(chunk_size, p.entry.size - c.offset)
            for i, c in enumerate(stored)
        ):
            return None
    return nat.BasePacks(
        [p.path for p in packs],
        [p.entry.size for p in packs],
        [b"".join(p.entry.chunk_digests) for p in packs],
        chunk_size,
        first,
    )


@dataclass(frozen=True, slots=True)
class Transfer:
    """What moving from bundle OLD to bundle NEW costs."""

    fetch_bytes: int  # stored bytes of NEW's chunks whose digest no chunk of OLD has
    fetch_chunks: int
    push_bytes: int  # stored bytes of NEW's packs whose id is not among OLD's
    push_packs: int
    new_bytes: int  # stored bytes of every chunk NEW maps (what a host holding nothing fetches)
    # manifest.json, and NEW's patches when OLD holds their patch base, else NEW's meta.img
    # and blockmap: the metadata a host (or registry) holding OLD gets for NEW
    meta_bytes: int


def mapped_chunks(bundle: str) -> dict[bytes, int]:
    """The pack chunks the blockmap of ``bundle`` maps a byte of: digest -> stored length
    (what a host that read every file of the image holds)."""
    path = os.path.join(bundle, BLOCKMAP)
    bm = bmap.decode(read_bundle_file(path), path)
    size = bm.chunk_size
    out: dict[bytes, int] = {}
    for r in bm.ranges:
        pack = bm.packs[r.pack]
        for i in range(r.pack_offset // size, (r.pack_offset + r.length - 1) // size + 1):
            out[pack.chunk_digests[i]] = pack.stored_chunk(i, size).length
    return out


def transfer(old: str, new: str) -> Transfer:
    """The bytes a host holding every chunk of ``old`` fetches to read all of ``new``, and
    the bytes a push of ``new`` uploads to a registry holding ``old``."""
    have = mapped_chunks(old)
    want = mapped_chunks(new)
    missing = [n for dg, n in want.items() if dg not in have]
    old_m, new_m = read_manifest(old)[0], read_manifest(new)[0]
    old_packs = {p["id"] for p in old_m["packs"]}
    new_packs = {p["id"]: p["size"] for p in new_m["packs"]}
    push = [size for pid, size in new_packs.items() if pid not in old_packs]
    # what OLD holds of metadata: its files and its patch base
    held = {e["sha256"] for e in old_m["files"].values()}
    held |= {p["base"]["sha256"] for p in patch.entries(old_m, old).values()}
    patches = patch.entries(new_m, new)
    meta = os.path.getsize(os.path.join(new, MANIFEST)) + sum(
        patches[name]["size"] if name in patches and patches[name]["base"]["sha256"] in held
        else e["size"]
        for name, e in new_m["files"].items()
    )  # fmt: skip
    return Transfer(sum(missing), len(missing), sum(push), len(push), sum(want.values()), meta)
