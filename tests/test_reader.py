"""The bundle reader (btrfs_ublk_image/reader.py): what it reads equals the input tarball and
what the kernel shows when the bundle is mounted; corrupt metadata and packs are named errors."""

from __future__ import annotations

import io
import os
import struct
import tarfile
from pathlib import Path

import pytest

from btrfs_ublk_image import listing
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.reader import BundleReader, Filesystem

from bundletools import Entry, list_dir, list_tar, mounted_bundle

MiB = 1 << 20
NS = "1700000000.123456789"
CAPABILITY = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)


def _pattern(n: int, seed: int) -> bytes:
    """Deterministic, incompressible-enough bytes."""
    block = bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(65536))
    return (block * (n // len(block) + 1))[:n]


def make_tarball(path: Path, many: int = 0) -> None:
    """Every member type, xattrs, odd names, a multi-chunk file, hardlinks across dirs;
    ``many`` extra small files make the fs tree several levels deep."""

    def member(name: str, kind: bytes = tarfile.REGTYPE, **kw: object) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type = kind
        ti.mode = 0o644
        ti.mtime = 1_700_000_000
        ti.pax_headers = {"mtime": NS}
        for k, v in kw.items():
            setattr(ti, k, v)
        return ti

    big = _pattern(3 * MiB + 4097, 1)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(member("./", tarfile.DIRTYPE, mode=0o755))
        tf.addfile(member("etc", tarfile.DIRTYPE, mode=0o750, uid=3, gid=4))
        tf.addfile(member("dir", tarfile.DIRTYPE, mode=0o700))
        for name, data, extra in [
            ("etc/empty", b"", {}),
            ("etc/hostname", b"image\n", {"uid": 1000, "gid": 100}),
            ("etc/inline-2048", b"x" * 2048, {}),
            ("etc/extent-2049", b"y" * 2049, {"mode": 0o600}),
            ("big", big, {"mode": 0o4755}),
            ("dir/big-copy", big, {}),
            ("name with spaces = and \\ backslash", b"odd\n", {}),
            ("caf\udce9-latin1", b"latin1\n", {}),
            ("nl\nname", b"newline\n", {}),
        ]:
            tf.addfile(member(name, **extra, size=len(data)), io.BytesIO(data))  # type: ignore[arg-type]
        cap = member("ping", size=4)
        cap.pax_headers["SCHILY.xattr.security.capability"] = CAPABILITY.decode(
            "utf-8", "surrogateescape"
        )
        cap.pax_headers["SCHILY.xattr.user.comment"] = "hello"
        tf.addfile(cap, io.BytesIO(b"ping"))
        tf.addfile(member("tmp", tarfile.DIRTYPE, mode=0o1777))
        tf.addfile(member("etc/link", tarfile.LNKTYPE, linkname="etc/hostname"))
        tf.addfile(member("tmp/link2", tarfile.LNKTYPE, linkname="etc/hostname"))
        tf.addfile(member("symlink", tarfile.SYMTYPE, linkname="etc/hostname", mode=0o777))
        tf.addfile(member("dev-null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666))
        tf.addfile(member("dev-disk", tarfile.BLKTYPE, devmajor=259, devminor=1048575))
        tf.addfile(member("fifo", tarfile.FIFOTYPE, mode=0o600))
        if many:
            tf.addfile(member("many", tarfile.DIRTYPE, mode=0o755))
            for i in range(13):
                tf.addfile(member(f"many/d{i}", tarfile.DIRTYPE, mode=0o755))
        for i in range(many):
            data = f"file {i}\n".encode() * (1 + i % 7)
            tf.addfile(member(f"many/d{i % 13}/f{i:05d}", size=len(data)), io.BytesIO(data))


def build(tmp: Path, name: str = "bundle", many: int = 0) -> tuple[Path, Path]:
    tarball = tmp / f"{name}.tar"
    make_tarball(tarball, many)
    spec = tmp / f"{name}.yaml"
    spec.write_text(f"version: 1\nname: {name}\nlayers:\n  - tar: {{path: {name}.tar}}\n")
    assert cli(["build", str(spec), "-o", str(tmp / name)]) == 0
    return tmp / name, tarball


def as_bundletools(entries: list[listing.Entry]) -> dict[str, Entry]:
    """The reader's listing in bundletools' shape (list_dir / list_tar), without the root."""
    out: dict[str, Entry] = {}
    for e in entries:
        if e.path == b"/":
            continue
        d: Entry = {"type": e.type, "mode": oct(e.mode), "uid": e.uid, "gid": e.gid}
        if e.type != "dir":
            d["mtime_ns"] = e.mtime_ns
        d["xattrs"] = {os.fsdecode(k): v.hex() for k, v in e.xattrs}
        if e.type == "file":
            d["sha256"] = e.sha256
            d["size"] = e.size
            if e.link is not None:
                d["link"] = os.fsdecode(e.link)
        elif e.type == "symlink":
            assert e.target is not None
            d["target"] = os.fsdecode(e.target)
        elif e.rdev is not None:
            d["rdev"] = e.rdev
        out[os.fsdecode(e.path)] = d
    return out


@pytest.mark.unit
def test_reader_equals_the_tarball(tmp_path: Path) -> None:
    bundle, tarball = build(tmp_path, many=3000)
    entries = listing.from_bundle(str(bundle))
    assert as_bundletools(entries) == list_tar(tarball)
    with Filesystem(str(bundle)) as fs:
        assert fs.fs_level >= 1  # 3000 files: internal nodes were walked


@pytest.mark.unit
def test_reader_reads_content_and_names(tmp_path: Path) -> None:
    bundle, _ = build(tmp_path)
    with BundleReader(str(bundle)) as r:
        big = r.lookup("/big")
        assert r.read(big) == _pattern(3 * MiB + 4097, 1)
        assert r.read(r.lookup("/symlink")) == b"etc/hostname"
        assert r.lookup(b"/caf\xe9-latin1").item.size == 7
        hostname = r.lookup("/etc/hostname")
        assert hostname.item.nlink == 3 and r.lookup("/tmp/link2") is hostname
        etc = r.lookup("/etc")
        names = [e.name for e in etc.entries]
        assert names == sorted(names)  # the writer numbers dir indexes in name order
        with pytest.raises(ImageError, match="no such file"):
            r.lookup("/etc/nope")


@pytest.mark.root
def test_reader_equals_the_kernel_mount(tmp_path: Path) -> None:
    bundle, _ = build(tmp_path, many=300)
    ours = listing.from_bundle(str(bundle))
    with mounted_bundle(bundle, tmp_path) as m:
        kernel = listing.from_directory(str(m.mountpoint))
        walked = list_dir(m.mountpoint)
    assert listing.diff(ours, kernel) == []
    assert listing.format_listing(ours) == listing.format_listing(kernel)
    assert as_bundletools(ours) == walked


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x55]))


@pytest.mark.unit
def test_corrupt_meta_block_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle, _ = build(tmp_path)
    with Filesystem(str(bundle)) as fs:
        bytenr = fs.fs_root
        _, devid, physical = fs.map_logical(bytenr, fs.nodesize)
    assert devid == 1
    _flip(bundle / "meta.img", physical + 3000)
    with pytest.raises(ImageError) as exc:
        listing.from_bundle(str(bundle))
    msg = str(exc.value)
    assert f"fs tree block {bytenr} (physical {physical})" in msg
    assert "checksum mismatch" in msg and "meta.img" in msg
    assert cli(["manifest", str(bundle)]) == 1
    err = capsys.readouterr().err
    assert f"fs tree block {bytenr}" in err and err.count("\n") == 1


@pytest.mark.unit
def test_corrupt_superblock_is_named(tmp_path: Path) -> None:
    bundle, _ = build(tmp_path)
    _flip(bundle / "meta.img", 65536 + 0x100)
    with pytest.raises(ImageError, match="meta.img: superblock checksum mismatch"):
        listing.from_bundle(str(bundle))


@pytest.mark.unit
def test_corrupt_pack_is_named(tmp_path: Path) -> None:
    bundle, _ = build(tmp_path)
    (pack,) = (bundle / "packs").iterdir()
    # the big file's second MiB lies in pack chunk 1 or 2, whatever the order of content
    _flip(pack, 2 * MiB + 5)
    with BundleReader(str(bundle)) as r:
        assert r.read(r.lookup("/etc/hostname")) == b"image\n"  # inline: no pack needed
        with pytest.raises(ImageError, match=r"packs/[0-9a-f]+: pack chunk 2 \(bytes 2097152\.\."):
            r.read(r.lookup("/big"))
    with pytest.raises(ImageError, match="does not match its sha256 in the blockmap"):
        listing.from_bundle(str(bundle))


@pytest.mark.unit
def test_truncated_pack_and_corrupt_blockmap(tmp_path: Path) -> None:
    bundle, _ = build(tmp_path)
    bm = bundle / "blockmap"
    data = bm.read_bytes()
    bm.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ImageError, match="blockmap: sha256 differs from manifest.json"):
        BundleReader(str(bundle))
    bm.write_bytes(data)
    (pack,) = (bundle / "packs").iterdir()
    os.truncate(pack, pack.stat().st_size - 1)
    with pytest.raises(ImageError, match="truncated"):
        BundleReader(str(bundle))


@pytest.mark.unit
def test_misplaced_leaf_is_named(tmp_path: Path) -> None:
    """Two fs-tree leaves swapped: each CRC is fine, the header's bytenr gives them away."""
    bundle, _ = build(tmp_path, many=3000)
    with Filesystem(str(bundle)) as fs:
        assert fs.fs_level >= 1
        node = fs.read_block(fs.fs_root, fs.fs_level, 5)
        children = [
            struct.unpack_from("<Q", node, 101 + i * 33 + 17)[0]
            for i in range(struct.unpack_from("<I", node, 96)[0])
        ]
        a, b = children[0], children[1]
        pa = fs.map_logical(a, fs.nodesize)[2]
        pb = fs.map_logical(b, fs.nodesize)[2]
        n = fs.nodesize
    meta = bytearray((bundle / "meta.img").read_bytes())
    meta[pa : pa + n], meta[pb : pb + n] = meta[pb : pb + n], meta[pa : pa + n]
    (bundle / "meta.img").write_bytes(bytes(meta))
    with pytest.raises(
        ImageError, match=rf"fs tree block {a} \(physical {pa}\): header says bytenr {b}"
    ):
        listing.from_bundle(str(bundle))
