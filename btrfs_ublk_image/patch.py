"""Metadata patches of a delta image (bundle format_version 2 and 3, docs/bundle-format.md).

A bundle built with a base carries, beside its ``meta.img`` and ``blockmap``, each of them
as a patch against the same file of its *patch base* (``base/meta.img``,
``base/blockmap``): one zstd frame compressed with the patch base's bytes as a raw-content
dictionary, what ``zstd --patch-from=BASE`` writes and ``zstd -d --patch-from=BASE``
reads. Debian minbase with 18 of 5,231 files rewritten: meta.img's patch is 12.9 KB for
8 MiB (its zstd frame alone: 1.45 MB). The patch base is the lineage's root (the base's
own patch base when it has one), so every version of a lineage patches against one file
that the registry and a host's cache already hold. Since format_version 3 meta.img's
patch is made between the two files' *block forms* (``block_form``): checksums and leaf
item offsets stored as differences from what the block determines and the ids every
header repeats zeroed, so the offsets that an item growing or going shifts in its leaf,
the checksums of changed blocks and the new fsid cost nothing.

The frame is deterministic (fixed parameters, content size in the header, no checksum,
no dictionary id, one thread): same files, same patch, same image id. Parameters
(measured, docs/bundle-format.md): level 9's search with hash and chain tables of
2^(log2(size) - 2) entries. zstd indexes no more of a raw dictionary than 8 times the
larger table (it loads only the tail of a larger one), and finds a base block again only
through tables that big: with level 3 to 19's own tables (2^17 to 2^25) a 64 MiB
meta.img patched against itself alone took 10 MB at level 19; with these, 7 KB. Applying
a patch costs the same at any level.
"""

from __future__ import annotations

import struct
from functools import cache
from typing import Any

from btrfs_ublk_image import native
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.crc import crc32c
from btrfs_ublk_image.errors import ImageError

LEVEL = 9
# the largest window a reader must accept (zstd's maximum on 64-bit hosts)
MAX_WINDOW_LOG = 31
# hash and chain tables: 4 bytes an entry each, so at most 2 x 256 MiB (a 256 MiB meta.img)
MAX_TABLE_LOG = 26
BASE_DIR = "base"
SUFFIX = ".patch"


def _window_log(*sizes: int) -> int:
    """A window that spans the larger of the two files (the dictionary is referenced
    through it), at least zstd's minimum of 2^10."""
    return min(MAX_WINDOW_LOG, max(10, (max(sizes) - 1).bit_length()))


# meta.img's patch is made between the files' block forms (format_version 3)
BLOCK_FORM_NAME = "meta.img"
FORMAT_VERSION_BLOCK_FORM = 3
_NODESIZE_AT = d.SUPER_INFO_OFFSET + 0x94  # btrfs_super_block.nodesize
_FSID_AT = d.SUPER_INFO_OFFSET + 0x20
_NRITEMS_AT, _LEVEL_AT = 96, 100  # in the tree block header
_CTU_AT = 64  # the header's chunk tree uuid
_ZERO_ID, _ONES_ID = bytes(16), b"\xff" * 16


@cache
def _items(n: int) -> struct.Struct:
    """n item headers as (key, data offset, data size) triples."""
    return struct.Struct("<" + "17sII" * n)


def _block_form(img: bytes, inverse: bool) -> bytes:
    """meta.img's *block form* (``inverse``: meta.img from it), docs/bundle-format.md,
    "The block form". In every block of ``nodesize`` bytes (the superblock's) at a
    multiple of it, clear of the superblock copies, whose header carries the superblock's
    fsid (a tree block): the checksum's first 4 bytes are XORed with the CRC-32C of the
    block's bytes after the checksum, a leaf's item data offsets are stored as
    differences from the packed position (the previous item's offset minus this item's
    size; the first item's: the leaf's data size), the fsid becomes 0 and the chunk tree
    uuid is XORed with the first tree block's. A btrfs leaf packs item data back to back
    from its end, so an item that grows or goes shifts every later item's offset: in
    block form those stay 0 and the zstd patch finds the rest of the leaf unchanged;
    checksums of valid blocks and the ids every header of a version repeats become 0.
    Other blocks' fsid fields cycle (0 -> all ones -> fsid -> 0) so that the inverse
    tells tree blocks (0 there) from the rest: reversible whatever the file holds."""
    if len(img) < d.SUPER_INFO_OFFSET + d.SUPER_INFO_SIZE:
        return img
    (ns,) = struct.unpack_from("<I", img, _NODESIZE_AT)
    if ns < 4096 or ns > 65536 or ns & (ns - 1):
        return img
    fsid = bytes(img[_FSID_AT : _FSID_AT + 16])
    # the fsid field's cycle; without it (an fsid of 0 or all ones) tree blocks keep it
    cycle = fsid not in (_ZERO_ID, _ONES_ID)
    tree_id = _ZERO_ID if cycle and inverse else fsid  # what a tree block's field holds
    # the cycle's other steps (fsid -> 0 is a tree block's)
    step = {_ONES_ID: _ZERO_ID, fsid: _ONES_ID} if inverse else {_ZERO_ID: _ONES_ID, _ONES_ID: fsid}
    out = bytearray(img)
    view = memoryview(out)
    most = (ns - d.HEADER_SIZE) // d.ITEM_SIZE
    supers = [(s, s + d.SUPER_INFO_SIZE) for s in d.SUPER_MIRRORS]
    first_ctu: bytes | None = None
    for at in range(0, len(out) - ns + 1, ns):
        if any(at < e and s < at + ns for s, e in supers):
            continue
        blk = view[at : at + ns]
        field = bytes(blk[32:48])
        if field != tree_id:
            if cycle:
                blk[32:48] = step.get(field, field)
            continue
        if not inverse:
            csum = crc32c(blk[32:])
        if cycle:
            blk[32:48] = fsid if inverse else _ZERO_ID
            if first_ctu is None:
                first_ctu = bytes(blk[_CTU_AT : _CTU_AT + 16])
            else:
                ctu = int.from_bytes(blk[_CTU_AT : _CTU_AT + 16]) ^ int.from_bytes(first_ctu)
                blk[_CTU_AT : _CTU_AT + 16] = ctu.to_bytes(16)
        if blk[_LEVEL_AT] == 0:
            n = min(struct.unpack_from("<I", blk, _NRITEMS_AT)[0], most)
            items = _items(n)
            f = list(items.unpack_from(blk, d.HEADER_SIZE))
            end = ns - d.HEADER_SIZE  # where the first item's data ends: the leaf's end
            for i in range(1, 3 * n, 3):
                size = f[i + 1]
                if inverse:
                    f[i] = end = (f[i] + end - size) & 0xFFFFFFFF
                else:
                    f[i], end = (f[i] - end + size) & 0xFFFFFFFF, f[i]
            items.pack_into(blk, d.HEADER_SIZE, *f)
        if inverse:
            csum = crc32c(blk[32:])
        struct.pack_into("<I", blk, 0, struct.unpack_from("<I", blk, 0)[0] ^ csum)
    return bytes(out)


def block_form(img: bytes) -> bytes:
    return _native_or_python(img, inverse=False)


def from_block_form(form: bytes) -> bytes:
    return _native_or_python(form, inverse=True)


def _native_or_python(img: bytes, inverse: bool) -> bytes:
    """The extension's block form (native/src/blockform.rs: the same bytes in about a
    fifth of ``_block_form``'s time), else ``_block_form``."""
    nat = native.module()
    if nat is not None and hasattr(nat, "block_form"):
        form: bytes = nat.block_form(img, inverse)
        return form
    return _block_form(img, inverse)


def in_block_form(manifest: dict[str, Any], name: str) -> bool:
    """Whether the manifest's patch of ``name`` is made between block forms."""
    return manifest.get("format_version") == FORMAT_VERSION_BLOCK_FORM and name == BLOCK_FORM_NAME


def make(base: bytes, new: bytes) -> bytes:
    """``new`` as one zstd frame against ``base`` (raw-content dictionary). A meta.img
    patch of format_version 3 is made between block forms: the caller makes them
    (``block_form``), so that the files' own bytes can be freed first."""
    import zstandard  # its 11 MiB library is loaded only when patches are made or applied

    window_log = _window_log(len(base), len(new))
    table_log = max(min(window_log - 2, MAX_TABLE_LOG), 12)
    params = zstandard.ZstdCompressionParameters.from_level(
        LEVEL,
        source_size=len(new),
        dict_size=len(base),
        window_log=window_log,
        hash_log=table_log,
        chain_log=table_log,
        threads=0,
        write_checksum=False,
        write_content_size=True,
        write_dict_id=False,
    )
    d = zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    return bytes(zstandard.ZstdCompressor(dict_data=d, compression_params=params).compress(new))


def apply(base: bytes, patch: bytes, size: int, where: str, block_forms: bool = False) -> bytes:
    """The file ``patch`` (named ``where``) makes of ``base``: exactly ``size`` bytes, or a
    clear error; with ``block_forms``, ``patch`` makes the block form of the file from
    ``base``'s. The caller checks the result's digest."""
    import zstandard

    if block_forms:
        base = block_form(base)

    d = zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    try:
        out = zstandard.ZstdDecompressor(
            dict_data=d, max_window_size=1 << MAX_WINDOW_LOG
        ).decompress(patch, max_output_size=size + 1)
    except zstandard.ZstdError as e:
        raise ImageError(f"{where}: not a zstd patch of its base: {e}") from None
    if len(out) != size:
        raise ImageError(f"{where}: patches its base to {len(out)} bytes, expected {size}")
    return from_block_form(bytes(out)) if block_forms else bytes(out)


def base_path(name: str) -> str:
    """The bundle-relative path of ``name``'s patch base."""
    return f"{BASE_DIR}/{name}"


def patch_path(name: str) -> str:
    return name + SUFFIX


def entries(manifest: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """The manifest's ``patches`` (format_version 2 and 3), checked for shape: name ->
    ``{sha256, size, base: {sha256, size}}``; ``{}`` for format_version 1."""
    patches = manifest.get("patches")
    if manifest.get("format_version") == 1:
        if patches is not None:
            raise ImageError(f"{where}: format_version 1 has no patches")
        return {}
    if not isinstance(patches, dict) or set(patches) != {"meta.img", "blockmap"}:
        raise ImageError(f"{where}: patches must name meta.img and blockmap")
    for name, p in patches.items():
        base = p.get("base") if isinstance(p, dict) else None
        for e in (p, base):
            if (
                not isinstance(e, dict)
                or not isinstance(e.get("sha256"), str)
                or not isinstance(e.get("size"), int)
            ):
                raise ImageError(f"{where}: patches.{name}: expected sha256, size and base")
    return patches
