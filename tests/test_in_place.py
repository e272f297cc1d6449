"""Tar sources used in place (`tar: {in_place: true}`): the tarball is a pack of the bundle.

The image must be the same as the copying build's (same listing, same meta.img); only
the pack layout differs: pack 0 holds device 2's superblock and what could not be
referenced (sparse members, other sources' content), pack 1 is the tarball, byte for
byte, never the original file itself.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from servers import docker_registry
from test_build_tar import assert_kernel_mount_matches, make_tarball
from test_push import ok, push, skopeo

from btrfs_ublk_image import blockmap as bmap
from btrfs_ublk_image import trace
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.listing import format_listing, load
from btrfs_ublk_image.packs import InPlacePack, PackWriter, sector_runs
from btrfs_ublk_image.push import verify_bundle

from bundletools import run

SPARSE_SIZE = 3 * 1024 * 1024 + 5
CHUNK = 1 << 20


def build(
    tmp: Path, tarball: Path, out: str, in_place: bool, before: str = "", after: str = ""
) -> Path:
    """Build a bundle of ``tarball`` (between the ``before`` and ``after`` layers, YAML)."""
    spec = tmp / f"{out}.yaml"
    flag = ", in_place: true" if in_place else ""
    tar = f"  - tar: {{path: {tarball.name}{flag}}}\n"
    spec.write_text(f"version: 1\nname: inplace\nlayers:\n{before}{tar}{after}")
    assert tarball.parent == tmp
    bundle = tmp / out
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    return bundle


def listing(bundle: Path) -> str:
    return format_listing(load(str(bundle)))


def manifest(bundle: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((bundle / "manifest.json").read_bytes())
    return data


def pack_paths(bundle: Path) -> list[Path]:
    packs = manifest(bundle)["packs"]
    assert isinstance(packs, list)
    return [bundle / p["path"] for p in packs]


def ranges_into(bundle: Path, pack: int) -> list[bmap.Range]:
    bm = bmap.decode((bundle / "blockmap").read_bytes())
    return [r for r in bm.ranges if r.pack == pack]


def same_image(copied: Path, in_place: Path) -> None:
    """Same tree, metadata and statistics; only the packs differ."""
    assert listing(in_place) == listing(copied)
    assert (in_place / "meta.img").read_bytes() == (copied / "meta.img").read_bytes()
    a, b = manifest(copied), manifest(in_place)
    assert a["stats"] == b["stats"] and a["sources"] == b["sources"]


@pytest.mark.unit
def test_in_place_image_equals_the_copying_build(tmp_path: Path) -> None:
    tarball = tmp_path / "rootfs.tar"
    make_tarball(tarball)
    copied = build(tmp_path, tarball, "copied", False)
    in_place = build(tmp_path, tarball, "in-place", True)
    same_image(copied, in_place)
    pack0, pack1 = pack_paths(in_place)
    assert pack0.stat().st_size == 4096  # device 2's superblock only: nothing else copied
    assert pack1.read_bytes() == tarball.read_bytes()
    assert os.stat(pack1).st_ino != os.stat(tarball).st_ino and os.stat(pack1).st_nlink == 1
    # every range into the tarball lies within one regular member's data
    with tarfile.open(tarball) as tf:
        regular = [m for m in tf.getmembers() if m.isreg()]
    into = ranges_into(in_place, 1)
    assert into
    for r in into:
        assert any(
            m.offset_data <= r.pack_offset and r.pack_offset + r.length <= m.offset_data + m.size
            for m in regular
        ), r
    # big and big-copy: one extent, mapped once, at big's data in the tarball
    (big,) = [m for m in regular if m.name == "big"]
    mapped = [r for r in into if big.offset_data <= r.pack_offset < big.offset_data + big.size]
    assert sum(r.length for r in mapped) == big.size
    assert sum(r.length for r in into) == big.size + 2049  # + etc/extent-2049 (not inline)
    # push's check: every pack chunk against the blockmap, pack ids against the manifest
    assert len(verify_bundle(str(in_place)).layers) == 4
    # the tarball is changed after the build: the bundle is not (a copy, not a link)
    with open(tarball, "r+b") as f:
        f.seek(big.offset_data)
        f.write(b"\0" * 4096)
    assert listing(in_place) == listing(copied)


@pytest.mark.unit
def test_in_place_sparse_member_and_other_sources(tmp_path: Path) -> None:
    """A GNU sparse member is copied into pack 0 (its data is not one range); content an
    earlier layer packed stays there; a later layer's copy of a member maps to the tarball."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse.img", "wb") as f:
        f.truncate(SPARSE_SIZE)
        f.seek(1024 * 1024)
        f.write(b"data in the middle" * 1000)
        f.seek(SPARSE_SIZE - 5)
        f.write(b"tail!")
    early, shared = os.urandom(50_000), os.urandom(100_000)
    (src / "early-copy.bin").write_bytes(early)
    (src / "shared.bin").write_bytes(shared)
    (src / "dup.bin").write_bytes(shared)
    tarball = tmp_path / "sparse.tar"
    run("tar", "--format=pax", "--sparse", "--sort=name", "-C", src, "-cf", tarball, ".")
    with tarfile.open(tarball) as tf:
        member = tf.getmember("./sparse.img")
        assert member.issparse() and member.sparse is not None
        data_map = [(off, num) for off, num in member.sparse if num]
    for layer, name, data in (("before", "early.bin", early), ("after", "later.bin", shared)):
        (tmp_path / layer).mkdir()
        (tmp_path / layer / name).write_bytes(data)
    layers = {k: f"  - dir: {{path: {k}}}\n" for k in ("before", "after")}
    copied = build(tmp_path, tarball, "copied", False, **layers)
    in_place = build(tmp_path, tarball, "in-place", True, **layers)
    same_image(copied, in_place)
    pack0, pack1 = pack_paths(in_place)
    assert pack1.read_bytes() == tarball.read_bytes()
    # pack 0: the earlier layer's file, the sparse file's data runs (holes are not
    # stored, as in the copying build) and device 2's superblock
    stored = sum(end - start for start, end in sector_runs(data_map))
    assert stored < 64 << 10
    assert pack0.stat().st_size == len(early) + stored + 4096
    assert sum(r.length for r in ranges_into(in_place, 1)) == len(shared)  # 3 names, 1 extent
    text = listing(in_place).splitlines()
    for name, data in (
        ("/early.bin", early),
        ("/early-copy.bin", early),
        ("/shared.bin", shared),
        ("/dup.bin", shared),
        ("/later.bin", shared),
    ):
        (line,) = [t for t in text if t.startswith(name + " ")]
        assert f"sha256={hashlib.sha256(data).hexdigest()}" in line


@pytest.mark.unit
def test_in_place_refuses_compressed_tarballs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tarball = tmp_path / "rootfs.tar"
    make_tarball(tarball)
    gz = tmp_path / "rootfs.tar.gz"
    gz.write_bytes(gzip.compress(tarball.read_bytes(), compresslevel=1))
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "version: 1\nname: t\nlayers:\n  - tar: {path: rootfs.tar.gz, in_place: true}\n"
    )
    assert cli(["build", str(spec), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{gz}: in_place needs an uncompressed tarball, this one is gzip-compressed" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rootfs.tar",
        "rootfs.tar.gz",
        "spec.yaml",
    ]


@pytest.mark.unit
def test_in_place_off_keeps_the_image_id(tmp_path: Path) -> None:
    """`in_place: false` is the default: the same bundle, byte for byte."""
    tarball = tmp_path / "rootfs.tar"
    make_tarball(tarball)
    plain = build(tmp_path, tarball, "plain", False)
    spec = tmp_path / "off.yaml"
    spec.write_text("version: 1\nname: inplace\nlayers:\n  - tar: {path: rootfs.tar}\n")
    assert (tmp_path / "plain.yaml").read_bytes() == spec.read_bytes()
    spec.write_text(
        "version: 1\nname: inplace\nlayers:\n  - tar: {path: rootfs.tar, in_place: false}\n"
    )
    off = tmp_path / "off"
    assert cli(["build", str(spec), "-o", str(off)]) == 0
    for name in ("meta.img", "blockmap"):
        assert (off / name).read_bytes() == (plain / name).read_bytes()
    assert manifest(off)["packs"] == manifest(plain)["packs"]


@pytest.mark.root
def test_in_place_kernel_mount_identical(tmp_path: Path) -> None:
    tarball = tmp_path / "rootfs.tar"
    make_tarball(tarball)
    bundle = build(tmp_path, tarball, "bundle", True)
    assert_kernel_mount_matches(bundle, tarball, tmp_path)


@pytest.mark.unit
def test_in_place_prefetch_trace_points_into_the_tarball(tmp_path: Path) -> None:
    tarball = tmp_path / "rootfs.tar"
    make_tarball(tarball)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "version: 1\nname: t\nprefetch: [/big]\n"
        "layers:\n  - tar: {path: rootfs.tar, in_place: true}\n"
    )
    bundle = tmp_path / "bundle"
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    got = trace.read(str(bundle / trace.FILE_NAME))
    trace.check_for_bundle(got, manifest(bundle), got.image_id, "prefetch.trace")
    with tarfile.open(tarball) as tf:
        big = tf.getmember("big")
    first, last = big.offset_data // CHUNK, (big.offset_data + big.size - 1) // CHUNK
    assert list(got.chunks) == [(1, c) for c in range(first, last + 1)]


@pytest.mark.unit
def test_in_place_bundle_pushes(tmp_path: Path) -> None:
    """push uploads the tarball pack like any pack; skopeo copies back the same bytes."""
    tarball = tmp_path / "rootfs.tar"
    make_tarball(tarball)
    bundle = build(tmp_path, tarball, "bundle", True)
    with docker_registry(tmp_path / "registry") as reg:
        ref = f"{reg.address}/images/inplace:v1"
        ok(push("push", bundle, ref))
        layout = tmp_path / "layout"
        c = skopeo("copy", "--src-tls-verify=false", f"docker://{ref}", f"oci:{layout}:v1")
        assert c.returncode == 0, c.stderr
    index = json.loads((layout / "index.json").read_text())
    digest = index["manifests"][0]["digest"].split(":")[1]
    m = json.loads((layout / "blobs" / "sha256" / digest).read_bytes())
    titles = {d["annotations"]["org.opencontainers.image.title"]: d for d in m["layers"]}
    for pack in pack_paths(bundle):
        d = titles[str(pack.relative_to(bundle))]
        blob = layout / "blobs" / "sha256" / d["digest"].split(":")[1]
        assert blob.read_bytes() == pack.read_bytes()
    assert pack.read_bytes() == tarball.read_bytes()  # the last pack: the tarball


@pytest.mark.unit
def test_in_place_truncated_tarball_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tarball = tmp_path / "rootfs.tar"
    make_tarball(tarball)
    data = tarball.read_bytes()
    tarball.write_bytes(data[: len(data) // 2])
    spec = tmp_path / "spec.yaml"
    spec.write_text("version: 1\nname: t\nlayers:\n  - tar: {path: rootfs.tar, in_place: true}\n")
    assert cli(["build", str(spec), "-o", str(tmp_path / "out")]) == 1
    assert f"{tarball}: " in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rootfs.tar", "spec.yaml"]


def _read_all(pack: InPlacePack) -> bytes:
    out = []
    while piece := pack.read(300_000):
        out.append(piece)
    return b"".join(out)


@pytest.mark.root
def test_in_place_copy_methods(tmp_path: Path) -> None:
    """A reflink on btrfs (shared extents), copy_file_range on one ext4/tmpfs, a plain copy
    when the kernel refuses copy_file_range across filesystems: the same bytes each time."""
    data = os.urandom(5 * CHUNK + 123)
    img, btrfs, tmpfs = tmp_path / "btrfs.img", tmp_path / "btrfs", tmp_path / "tmpfs"
    with open(img, "wb") as f:
        f.truncate(512 << 20)
    run("mkfs.btrfs", "-q", "-f", img)
    btrfs.mkdir()
    tmpfs.mkdir()
    run("mount", "-o", "loop", img, btrfs)
    try:
        run("mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", tmpfs)
        try:
            cases = [(btrfs, btrfs, "reflink"), (tmpfs, tmpfs, "copy_file_range")]
            cases.append((tmpfs, tmp_path, "read/write"))  # across filesystems: EXDEV
            for src_dir, out_dir, method in cases:
                src = src_dir / "src.tar"
                src.write_bytes(data)
                packs = out_dir / "packs"
                packs.mkdir()
                writer = PackWriter(str(packs), keep_inline=0)
                pack = writer.open_in_place(str(src))
                assert _read_all(pack) == data
                assert pack.method == method, (src_dir, out_dir)
                pack.complete([], len(data))
                writer.abort()
                copy = packs / f"in-place-{pack.index}.tmp"
                assert copy.read_bytes() == data
                if method == "reflink":
                    assert "shared" in run("filefrag", "-v", copy).stdout
                shutil.rmtree(packs)
        finally:
            run("umount", tmpfs)
    finally:
        run("umount", btrfs)
