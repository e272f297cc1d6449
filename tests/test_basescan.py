"""A base's fs tree read by the extension (native/src/basescan.rs, ``BaseImage._scan``)
against reader.py's ``BundleReader`` (``BaseImage._read``), the reference: the same
blobs, extents and layout on bases of every kind of file, and the same errors on crafted
bases (an item changed in meta.img, its block's checksum made right again)."""

from __future__ import annotations

import os
import random
import struct
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from btrfs_ublk_image import base as base_mod
from btrfs_ublk_image import native
from btrfs_ublk_image.base import BaseImage
from btrfs_ublk_image.btrfs import ondisk as d
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.crc import crc32c
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.reader import Filesystem

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        native.module() is None or not hasattr(native.module(), "FsScan"),
        reason="the extension is not built (scripts/setup.sh builds it)",
    ),
]

_ITEM = struct.Struct("<QBQII")


def _tree(root: Path) -> None:
    """Regular files (empty, inline, one extent, several, sparse), hard links, symlinks,
    a FIFO, nested and empty directories, names with odd bytes."""
    rnd = random.Random(7)
    for i in range(60):
        d_ = root / f"d{i % 6}" / f"e{i % 4}"
        d_.mkdir(parents=True, exist_ok=True)
        (d_ / f"f{i}").write_bytes(rnd.randbytes(rnd.choice([0, 100, 5000, 70_000, 300_000])))
    (root / "big").write_bytes(rnd.randbytes(3 << 20))
    with open(root / "sparse", "wb") as f:
        f.write(rnd.randbytes(9000))
        f.seek(1 << 20)
        f.write(rnd.randbytes(5000))
    os.link(root / "big", root / "d0" / "big-link")
    os.link(root / "d1" / "e1" / "f1", root / "d2" / "f1-link")
    (root / "d3" / "again").write_bytes((root / "d1" / "e1" / "f1").read_bytes())
    os.symlink("big", root / "to-big")
    os.mkfifo(root / "fifo")
    (root / "empty-dir").mkdir()
    (root / "d4" / "na\xefve name").write_bytes(b"x" * 7000)


def _build(tmp: Path, name: str, layer: str, extra: str = "") -> Path:
    spec = tmp / f"{name}.yaml"
    spec.write_text(
        f"version: 1\nname: {name}\nsource_date_epoch: 1\n{extra}layers:\n  - {layer}\n"
    )
    out = tmp / f"{name}.bundle"
    assert cli(["build", str(spec), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("bases")
    src = tmp / "src"
    _tree(src)
    tar = tmp / "src.tar"
    with tarfile.open(tar, "w", format=tarfile.GNU_FORMAT) as t:
        t.add(src, arcname=".")
    return {
        "dir": _build(tmp, "plain", f"dir: {{path: {src}}}"),
        "in-place": _build(tmp, "inplace", f"tar: {{path: {tar}, in_place: true}}"),
        "btrfs-zstd": _build(
            tmp, "bzstd", f"dir: {{path: {src}}}", "pack_compression: btrfs-zstd\n"
        ),
    }


def _python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The base read by reader.py (as for a base with compressed packs)."""
    monkeypatch.setattr(base_mod, "_native_packs", lambda *_: None)


def _both(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[BaseImage, BaseImage]:
    scanned = BaseImage(str(bundle))
    with monkeypatch.context() as m:
        _python_path(m)
        read = BaseImage(str(bundle))
    assert scanned.native_packs is not None and read.native_packs is None
    return scanned, read


@pytest.mark.parametrize("kind", ["dir", "in-place", "btrfs-zstd"])
def test_the_scan_indexes_a_base_as_the_reader_does(
    kind: str, bases: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    scanned, read = _both(bases[kind], monkeypatch)
    try:
        assert scanned.blobs == read.blobs
        assert scanned.extents == read.extents
        a, b = scanned.layout(), read.layout()
        for field in ("dirs", "max_ino", "extents", "data_chunks", "meta_start", "breaks"):
            assert getattr(a, field) == getattr(b, field), field
        if kind == "btrfs-zstd":  # "na\xefve name" is a compressed extent: no run of a pack
            assert scanned.blobs and all(b.size != 7000 for b in scanned.blobs)
        else:  # every file not inline but the sparse one; the hard links and the copy once
            assert len(scanned.blobs) == 37
        if kind == "dir":
            assert len(scanned.extents) == len(scanned.blobs)
    finally:
        scanned.close()
        read.close()


def _leaf_with(fs: Filesystem, kind: int) -> tuple[int, bytearray, int]:
    """(physical offset in meta.img, block, index of the first item of type ``kind``)."""
    for block, bytenr, _first in fs.leaves(fs.fs_root, fs.fs_level, d.FS_TREE_OBJECTID):
        nritems = struct.unpack_from("<I", block, 96)[0]
        for i in range(nritems):
            if _ITEM.unpack_from(block, d.HEADER_SIZE + i * d.ITEM_SIZE)[1] == kind:
                return fs.map_logical(bytenr, len(block))[2], bytearray(block), i
    raise AssertionError(f"no item of type {kind}")


def _item_data(block: bytearray, i: int) -> tuple[int, int]:
    _oid, _type, _off, doff, size = _ITEM.unpack_from(block, d.HEADER_SIZE + i * d.ITEM_SIZE)
    return d.HEADER_SIZE + doff, size


def _dangling_entry(block: bytearray, i: int) -> None:
    start, _ = _item_data(block, i)
    struct.pack_into("<Q", block, start, 999_999)  # the location's objectid


def _wrong_type(block: bytearray, i: int) -> None:
    start, _ = _item_data(block, i)
    block[start + 29] = 5 if block[start + 29] != 5 else 1  # FT_FIFO / FT_REG_FILE


def _name_past_the_end(block: bytearray, i: int) -> None:
    start, _ = _item_data(block, i)
    struct.pack_into("<H", block, start + 27, 4000)  # name_len


def _unknown_extent_type(block: bytearray, i: int) -> None:
    start, _ = _item_data(block, i)
    block[start + 20] = 9


def _keys_out_of_order(block: bytearray, i: int) -> None:
    at = d.HEADER_SIZE + (i + 1) * d.ITEM_SIZE
    struct.pack_into("<Q", block, at, 1)  # the next item's objectid: below this one's


def _data_outside(block: bytearray, i: int) -> None:
    struct.pack_into("<I", block, d.HEADER_SIZE + i * d.ITEM_SIZE + 17, 20_000)


CRAFTED: dict[str, tuple[int, Callable[[bytearray, int], None], str]] = {
    "dangling entry": (d.DIR_INDEX_KEY, _dangling_entry, "missing inode 999999"),
    "entry type": (d.DIR_INDEX_KEY, _wrong_type, "dir entry type"),
    "name past the end": (d.DIR_INDEX_KEY, _name_past_the_end, "past the item's end"),
    "extent type": (d.EXTENT_DATA_KEY, _unknown_extent_type, "unknown file extent type 9"),
    "key order": (d.INODE_ITEM_KEY, _keys_out_of_order, "keys out of order"),
    "item data": (d.INODE_ITEM_KEY, _data_outside, "data outside the block"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_base_fails_as_in_the_reader(
    case: str, bases: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind, change, message = CRAFTED[case]
    bundle = tmp_path / "crafted.bundle"
    os.mkdir(bundle)
    for name in os.listdir(bases["dir"]):
        src = bases["dir"] / name
        if name == "meta.img":
            (bundle / name).write_bytes(src.read_bytes())
        else:
            os.symlink(src, bundle / name)
    with Filesystem(str(bundle)) as fs:
        at, block, i = _leaf_with(fs, kind)
    change(block, i)
    struct.pack_into("<I", block, 0, crc32c(bytes(block[32:])))
    with open(bundle / "meta.img", "r+b") as f:
        f.seek(at)
        f.write(block)
    with pytest.raises(ImageError) as scanned:
        BaseImage(str(bundle))
    _python_path(monkeypatch)
    with pytest.raises(ImageError) as read:
        BaseImage(str(bundle))
    assert message in str(scanned.value)
    assert str(scanned.value) == str(read.value)
