"""Delta images under ublkd (fuse frontend, root): a bundle built with ``--base`` whose
reused base pack is corrupt serves EIO for the files in the bad chunk only; every other
file, reused or new, reads right. Over HTTP, a host that read all of v1 fetches only v2's
new chunks: the rest is found, by digest, in v1's chunk cache. Oracles: the source trees'
bytes, where each file's bytes lie in the base pack (found by content, not through the
blockmap), nginx's access log. In the VM's 6.12 guest (marker vm), the same v2 through the
ublk frontend: new data at 1 PiB + its device-2 offset (FIEMAP, /dev/ublkbN's bytes)."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from servers import docker_registry, nginx_serving
from test_delta import build, delta, layout_of, make_shrunk, make_v1, make_v2, write_spec
from test_remote import cache_dir, image_hex, pack_bytes, settled_status
from test_ublkd import CHUNK, fresh_seed, no_leftovers, read_file, status, status_of, ublkd

from bundletools import dmesg_btrfs_problems, dmesg_len, list_dir, mounted_bundle, run

__all__ = ["cache_dir", "no_leftovers"]  # the fixture, used by name

pytestmark = pytest.mark.root


def tree_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_corrupt_base_pack_fails_only_its_files(no_leftovers: Path) -> None:
    tmp = no_leftovers
    v1, v2 = tmp / "v1", tmp / "v2"
    make_v1(v1, seed=fresh_seed())
    make_v2(v1, v2)
    b1, b2 = tmp / "v1.bundle", tmp / "v2.bundle"
    build(write_spec(tmp / "v1.yaml", v1), b1)
    m2 = build(write_spec(tmp / "v2.yaml", v2), b2, "--base", b1)
    packs = m2["packs"]
    assert isinstance(packs, list) and len(packs) == 2
    base_pack = b2 / packs[1]["path"]
    data = bytearray(base_pack.read_bytes())
    files = tree_files(v2)
    in_base: dict[str, set[int]] = {}
    for name, content in files.items():
        if len(content) > 4096 and (at := data.find(content)) >= 0:
            in_base[name] = set(range(at // CHUNK, (at + len(content) - 1) // CHUNK + 1))
    new = [n for n, c in files.items() if len(c) > 4096 and n not in in_base]
    assert sorted(new) == ["d0/added", "d3/f3", "d7/f107"]
    bad = 4
    data[bad * CHUNK + 12345] ^= 0xFF
    base_pack.unlink()  # a hard link of v1's pack: v2 gets its own, corrupt, copy
    base_pack.write_bytes(bytes(data))
    affected = sorted(n for n, c in in_base.items() if bad in c)
    assert affected and len(affected) < len(in_base) // 5
    mnt = tmp / "mnt"
    mnt.mkdir()
    ublkd("mount", b2, mnt, "--frontend", "fuse")
    try:
        for name in affected * 2:  # again: a failed read leaves nothing in the page cache
            assert read_file(mnt / name) == errno.EIO, name
        for name, content in files.items():
            if name not in affected:
                assert read_file(mnt / name) == content, name
        st = status_of(mnt)
        assert isinstance(st["verify_failures"], int) and st["verify_failures"] >= 1
    finally:
        ublkd("umount", mnt)


def read_all(mnt: Path, files: dict[str, bytes]) -> None:
    """Every file through one child (a hung read fails the test by its timeout)."""
    r = subprocess.run(
        ["python3", "-c", READ_ALL, str(mnt), *files], capture_output=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    got = dict(zip(files, r.stdout.decode().split(), strict=True))
    for name, content in files.items():
        assert got[name] == hashlib.sha256(content).hexdigest(), name


READ_ALL = """
import hashlib, sys
for name in sys.argv[2:]:
    print(hashlib.sha256(open(sys.argv[1] + '/' + name, 'rb').read()).hexdigest())
"""


def test_v2_after_v1_over_http_fetches_only_new_chunks(no_leftovers: Path, cache_dir: Path) -> None:
    tmp = no_leftovers
    v1, v2 = tmp / "v1", tmp / "v2"
    make_v1(v1, seed=fresh_seed())
    new_bytes = make_v2(v1, v2)
    www = tmp / "www"
    www.mkdir()
    b1, b2 = www / "v1.bundle", www / "v2.bundle"
    build(write_spec(tmp / "v1.yaml", v1), b1)
    build(write_spec(tmp / "v2.yaml", v2), b2, "--base", b1)
    mnt = tmp / "mnt"
    mnt.mkdir()
    with nginx_serving(www, tmp / "nginx") as web:
        ublkd("mount", f"{web.url}/v1.bundle/manifest.json", mnt, "--frontend", "fuse")
        try:
            read_all(mnt, tree_files(v1))
            v1_fetched = pack_bytes(web.requests())
        finally:
            ublkd("umount", mnt)
        web.clear_log()
        ublkd("mount", f"{web.url}/v2.bundle/manifest.json", mnt, "--frontend", "fuse")
        try:
            read_all(mnt, tree_files(v2))
            st = settled_status(mnt)
        finally:
            ublkd("umount", mnt)
        reqs = web.requests()
        fetched = pack_bytes(reqs)
    # v2's new pack is one chunk: its new content and device 2's superblock
    assert new_bytes < fetched <= new_bytes * 1.1, (fetched, new_bytes)
    # v1's reads fetched all of its content (its files' sizes are random: a fixed ratio to
    # v2's fetch failed for the ~2% of seeds whose v1 holds under 9.7 MB); only hostname,
    # 3 bytes, is inline in meta.img
    v1_bytes = sum(len(data) for data in tree_files(v1).values())
    assert v1_fetched >= v1_bytes - 4096, (v1_fetched, v1_bytes)
    shared = st["disk_cache_shared_bytes"]
    assert isinstance(shared, int) and shared > v1_fetched * 0.9, (shared, v1_fetched)
    # metadata: the manifest and the two patches; the patch base is v1's meta.img and
    # blockmap, found in v1's image directory. Everything together within the bound.
    paths = sorted(r.path.removeprefix("/v2.bundle/") for r in reqs if "/packs/" not in r.path)
    assert paths == ["blockmap.patch", "manifest.json", "meta.img.patch", "prefetch.trace"], paths
    total = sum(r.bytes_sent for r in reqs if r.status in (200, 206))
    assert total <= new_bytes * 1.1, (total, fetched, new_bytes)
    assert st["fetch_bytes"] == fetched  # the server's; the mount fetched the metadata


def test_base_pack_missing_on_the_server_fails_only_reused_files(
    no_leftovers: Path, cache_dir: Path
) -> None:
    """v2 served without its base pack (a 404), on a host that never read v1: every read
    of reused content fails with EIO, v2's new files read right."""
    tmp = no_leftovers
    v1, v2 = tmp / "v1", tmp / "v2"
    make_v1(v1, seed=fresh_seed())
    make_v2(v1, v2)
    www = tmp / "www"
    www.mkdir()
    b1, b2 = tmp / "v1.bundle", www / "v2.bundle"
    build(write_spec(tmp / "v1.yaml", v1), b1)
    m2 = build(write_spec(tmp / "v2.yaml", v2), b2, "--base", b1)
    packs = m2["packs"]
    assert isinstance(packs, list)
    (b2 / packs[1]["path"]).unlink()
    files = tree_files(v2)
    new = {"d0/added", "d3/f3", "d7/f107"}
    reused = [n for n, c in sorted(files.items()) if len(c) > 4096 and n not in new]
    mnt = tmp / "mnt"
    mnt.mkdir()
    with nginx_serving(www, tmp / "nginx") as web:
        ublkd("mount", f"{web.url}/v2.bundle/manifest.json", mnt, "--frontend", "fuse")
        try:
            for name in reused[:5]:
                assert read_file(mnt / name) == errno.EIO, name
            read_all(mnt, {n: files[n] for n in sorted(new)})
            assert read_file(mnt / "etc/hostname") == b"v1\n"  # inline in meta.img
        finally:
            ublkd("umount", mnt)
        # a host without v1: meta.img and blockmap made from the patch base and patches
        meta = sorted(r.path for r in web.requests() if "/packs/" not in r.path)
        assert [p.removeprefix("/v2.bundle/") for p in meta if "manifest" not in p] == [
            "base/blockmap", "base/meta.img", "blockmap.patch", "meta.img.patch",
            "prefetch.trace"]  # fmt: skip
        # a damaged patch (the server's copy) is refused, naming it; nothing is mounted
        shutil.rmtree(cache_dir)
        patch = b2 / "meta.img.patch"
        data = bytearray(patch.read_bytes())
        data[-1] ^= 1
        patch.write_bytes(data)
        r = ublkd("mount", f"{web.url}/v2.bundle/manifest.json", mnt, "--frontend", "fuse",
                  check=False)  # fmt: skip
        assert r.returncode != 0 and "meta.img.patch" in r.stderr, r.stderr
        assert not os.path.ismount(mnt)


def test_v2_after_v1_from_a_registry_moves_only_patches_and_new_chunks(
    no_leftovers: Path, cache_dir: Path
) -> None:
    """oci://: v1 and v2 pushed; a host that read v1 mounts v2 with GETs of v2's manifests,
    its two patches and its new chunk (within changed bytes + 10 %); a host that holds
    nothing gets the patch base (v1's meta.img blob, zstd) and the patches, and reads v2
    right. The registry's access log is the oracle."""
    tmp = no_leftovers
    v1, v2 = tmp / "v1", tmp / "v2"
    make_v1(v1, seed=fresh_seed())
    new_bytes = make_v2(v1, v2)
    b1, b2 = tmp / "v1.bundle", tmp / "v2.bundle"
    build(write_spec(tmp / "v1.yaml", v1), b1)
    m2 = build(write_spec(tmp / "v2.yaml", v2), b2, "--base", b1)
    mnt = tmp / "mnt"
    mnt.mkdir()
    with docker_registry(tmp / "registry") as reg:
        for name, b in (("v1", b1), ("v2", b2)):
            subprocess.run([sys.executable, "-m", "btrfs_ublk_image", "push", b,
                            f"{reg.address}/img:{name}"], check=True, capture_output=True)  # fmt: skip
        blobs = {}
        for path in (*b1.rglob("*"), *b2.rglob("*")):
            if path.is_file():
                blobs["sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()] = path.name

        def moved(name: str, cache: Path) -> list[tuple[str, int]]:
            before = len(reg.requests())
            ublkd("mount", f"oci://{reg.address}/img:{name}", mnt, "--frontend", "fuse",
                  "--cache-dir", cache)  # fmt: skip
            try:
                read_all(mnt, tree_files(v1 if name == "v1" else v2))
            finally:
                ublkd("umount", mnt)
            return [
                (blobs.get(r.path.rsplit("/", 1)[1], r.path.rsplit("/", 1)[1]), r.bytes_sent)
                for r in reg.requests()[before:]
                if r.method == "GET" and "/blobs/" in r.path
            ]

        moved("v1", cache_dir)
        warm = moved("v2", cache_dir)
        cold = moved("v2", tmp / "cache-cold")
    new_pack = m2["packs"][0]["path"].rsplit("/", 1)[1]  # type: ignore[index]
    assert {n for n, _ in warm} == {"blockmap.patch", "manifest.json", "meta.img.patch", new_pack}
    assert sum(n for _, n in warm) <= new_bytes * 1.1, warm
    # cold: v1's meta.img as its zstd blob (named by no bundle file) and blockmap, too
    cold_names = {n for n, _ in cold}
    assert {"blockmap", "blockmap.patch", "meta.img.patch", new_pack} <= cold_names, cold
    assert (tmp / "cache-cold" / image_hex(b2) / "base" / "meta.img").read_bytes() == (
        b1 / "meta.img"
    ).read_bytes()


def test_one_cache_bound_for_every_image_least_recently_used_first(
    no_leftovers: Path, cache_dir: Path
) -> None:
    """--cache-size bounds the chunk files of every image in the cache dir together: two
    unrelated images read whole through a 6 MiB bound leave at most 6 MiB (+5 % per
    server) of chunk files, the second image's reads having evicted the first's oldest
    chunks; the files on disk (each inode once) are the oracle."""
    tmp = no_leftovers
    www = tmp / "www"
    www.mkdir()
    trees = {}
    for name in ("a", "b"):
        trees[name] = tmp / name
        make_v1(trees[name], seed=fresh_seed())
        build(write_spec(tmp / f"{name}.yaml", trees[name]), www / f"{name}.bundle")
    limit = 6 << 20
    mnt = tmp / "mnt"
    mnt.mkdir()

    def chunk_bytes(image: str | None = None) -> int:
        seen = {}
        for p in cache_dir.glob(f"{image or '*'}/chunks/??/*"):
            st = p.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
        return sum(seen.values())

    with nginx_serving(www, tmp / "nginx") as web:
        for name in ("a", "b"):
            ublkd("mount", f"{web.url}/{name}.bundle/manifest.json", mnt, "--frontend", "fuse",
                  "--cache-size", str(limit))  # fmt: skip
            try:
                read_all(mnt, tree_files(trees[name]))
            finally:
                ublkd("umount", mnt)
            assert chunk_bytes() <= limit * 1.05, (name, chunk_bytes())
    # both images' packs are larger than the bound: b's reads evicted a's chunks
    a, b = image_hex(www / "a.bundle"), image_hex(www / "b.bundle")
    assert chunk_bytes(b) > limit / 2 and chunk_bytes(a) < limit / 2, (
        chunk_bytes(a),
        chunk_bytes(b),
    )


def test_kernel_sees_v1_inode_numbers_and_extents_in_v2(tmp_path: Path) -> None:
    """The kernel mounts v2 built on v1 (sizes changed, a file added and one removed)
    with no btrfs complaint: every path of both has the inode number (stat) and, content
    unchanged, the physical extents (FIEMAP) it had in v1; a new name in the directory
    that lost one has the lost one's number; every file reads right; sprouted onto a
    writable device, v2 takes new writes (chunks allocated above the new data)."""
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    make_v1(v1, seed=fresh_seed())
    make_v2(v1, v2)
    (v2 / "d5" / "g5").write_bytes(os.urandom(7_000))  # d5/f5 is gone
    b1, b2 = tmp_path / "v1.bundle", tmp_path / "v2.bundle"
    build(write_spec(tmp_path / "v1.yaml", v1), b1)
    build(write_spec(tmp_path / "v2.yaml", v2), b2, "--base", b1)

    def seen(bundle: Path, work: Path, rw: Path | None = None) -> dict[str, tuple[int, str]]:
        work.mkdir()
        before = dmesg_len()
        with mounted_bundle(bundle, work, rw) as m:
            out = {}
            for p in sorted(m.mountpoint.rglob("*")):
                rel = str(p.relative_to(m.mountpoint))
                fiemap = run("filefrag", "-v", "-b4096", p).stdout if p.is_file() else ""
                extents = [x for x in fiemap.splitlines() if x.split(":")[0].strip().isdigit()]
                out[rel] = (p.stat().st_ino, "\n".join(extents))
            if rw is not None:
                assert tree_files(m.mountpoint) == tree_files(v2)
                (m.mountpoint / "written").write_bytes(b"w" * 100_000)
                os.sync()
                assert (m.mountpoint / "written").read_bytes() == b"w" * 100_000
        assert dmesg_btrfs_problems(before, m.loops) == []
        return out

    old = seen(b1, tmp_path / "m1")
    rw = tmp_path / "rw.img"
    with open(rw, "wb") as f:
        f.truncate(1 << 30)
    new = seen(b2, tmp_path / "m2", rw)
    changed = {"d3/f3", "d7/f107"}
    common = set(old) & set(new)
    assert len(common) > 200 and set(old) - set(new) == {"d5/f5"}
    for rel in common:
        assert new[rel][0] == old[rel][0], rel
        if rel not in changed:
            assert new[rel][1] == old[rel][1], rel
    assert new["d0/added"][0] > max(ino for ino, _ in old.values())
    assert new["d5/g5"][0] == old["d5/f5"][0]


@pytest.mark.slow
def test_debian_with_packages_replaced_moves_within_the_bound(tmp_path: Path) -> None:
    """Debian minbase v1, v2 with five packages replaced (bench/delta.py's maker: their
    files rewritten with other sizes, one removed and one added each): built on v1, v2
    keeps every path's inode number, `btrfs check` finds no error, and what a registry
    or host holding v1 gets for v2 (new chunks, manifest, patches: `diff --delta`) is
    within the changed bytes + 10 %."""
    from bench.delta import make_v2_packages_tar
    from bundletools import prepare_debian_inputs

    if shutil.which("mmdebstrap") is None:
        pytest.skip("needs mmdebstrap (scripts/setup.sh installs it)")
    v1 = prepare_debian_inputs() / "rootfs.tar"
    v2 = tmp_path / "v2.tar"
    _, _, changed = make_v2_packages_tar(v1, v2)
    b1, b2 = tmp_path / "v1.bundle", tmp_path / "v2.bundle"
    spec = "version: 1\nname: d\nsource_date_epoch: 1700000000\nlayers:\n  - tar: {path: %s}\n"
    (tmp_path / "v1.yaml").write_text(spec % v1)
    (tmp_path / "v2.yaml").write_text(spec % v2)
    build(tmp_path / "v1.yaml", b1)
    build(tmp_path / "v2.yaml", b2, "--base", b1)
    d = delta(b1, b2)
    assert (d["added"], d["removed"]) == (5, 5), d
    assert d["push_bytes"] + d["meta_bytes"] <= changed * 1.1, (d, changed)
    assert d["fetch_bytes"] + d["meta_bytes"] <= changed * 1.1, (d, changed)
    old, _ = layout_of(b1)
    new, _ = layout_of(b2)
    assert all(new[p][0] == old[p][0] for p in new.keys() & old.keys())
    check = subprocess.run(
        ["btrfs", "check", "--readonly", b2 / "meta.img"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_kernel_mounts_and_sprouts_a_delta_build_with_gaps(tmp_path: Path) -> None:
    """The v2 of test_delta's smaller tree (blocks at v1's addresses, gaps in its metadata
    chunk): the kernel mounts it with v2's tree and no btrfs complaint, and a sprouted
    writable mount takes new files."""
    v2, _b1, b2 = make_shrunk(tmp_path)
    rw = tmp_path / "rw.img"
    with open(rw, "wb") as f:
        f.truncate(512 << 20)
    before = dmesg_len()
    with mounted_bundle(b2, tmp_path, rw=rw) as m:
        got = list_dir(m.mountpoint)
        (m.mountpoint / "new").write_bytes(b"x" * 100_000)
        os.sync()
        assert (m.mountpoint / "new").read_bytes() == b"x" * 100_000

    def unclamped(listing: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
        # the spec's source_date_epoch clamps every mtime
        return {p: {k: v for k, v in e.items() if k != "mtime_ns"} for p, e in listing.items()}

    assert unclamped(got) == unclamped(list_dir(v2))
    assert dmesg_btrfs_problems(before, m.loops) == []


def extents_of(*paths: Path) -> dict[Path, list[tuple[int, int, int]]]:
    """Per file, (file offset, physical address, length) in bytes of each extent, as
    FIEMAP gives them (filefrag; on btrfs the physical address is the filesystem's
    logical one). One filefrag for all: under TCG each process start costs."""
    out: dict[Path, list[tuple[int, int, int]]] = {}
    rows: list[tuple[int, int, int]] = []
    for line in run("filefrag", "-v", "-b4096", *paths).stdout.splitlines():
        if line.startswith("File size of "):
            rows = out.setdefault(Path(line.removeprefix("File size of ").rsplit(" is ")[0]), [])
        elif line.split(":")[0].strip().isdigit():
            r = line.split(":")
            rows.append(
                (int(r[1].split("..")[0]) << 12, int(r[2].split("..")[0]) << 12, int(r[3]) << 12)
            )
    assert sorted(out) == sorted(paths), out.keys()
    return out


PIB = 1 << 50  # where a build with a base puts new data (layout.DELTA_DATA_LOGICAL)

# in the guest nothing else runs beside the test: every such line is the test's
GUEST_KERNEL_PROBLEM = re.compile(
    r"BTRFS (warning|error|critical)|ublk.*(error|fail)|I/O error|WARNING:|BUG:", re.I
)


@pytest.mark.vm
def test_ublk_guest_kernel_serves_v2_new_data_above_1_pib(no_leftovers: Path) -> None:
    """The 6.12 guest's kernel mounts a v2 built on v1 (files resized, added and removed,
    a new directory) through `ublkd mount --frontend ublk`: every file reads back equal to
    its source; FIEMAP puts each new file's extents at 1 PiB + an offset of device 2 whose
    bytes, read from /dev/ublkbN there, are the file's, and each reused file's below 1 PiB;
    `btrfs check` of the mounted seed (meta.img's loop device: it reads no file data) is clean;
    sprouted, v2 takes writes (in chunks the kernel puts above the new data) that survive
    a remount; dmesg has no btrfs or ublk complaint."""
    tmp = no_leftovers
    subprocess.run(["modprobe", "ublk_drv"], check=True)
    before = dmesg_len()
    v1, v2 = tmp / "v1", tmp / "v2"
    make_v1(v1, seed=fresh_seed())
    make_v2(v1, v2)
    (v2 / "new" / "dir").mkdir(parents=True)
    (v2 / "new" / "dir" / "file").write_bytes(os.urandom(300_000))
    b1, b2 = tmp / "v1.bundle", tmp / "v2.bundle"
    build(write_spec(tmp / "v1.yaml", v1), b1)
    build(write_spec(tmp / "v2.yaml", v2), b2, "--base", b1)
    files = tree_files(v2)
    new = {"d3/f3", "d7/f107", "d0/added", "new/dir/file"}
    assert new <= files.keys() and "d5/f5" not in files
    mnt = tmp / "mnt"
    mnt.mkdir()
    ublkd("mount", b2, mnt, "--frontend", "ublk")
    try:
        st = status_of(mnt)
        assert st["frontend"] == "ublk"
        devices = [str(d) for d in st["devices"]]  # type: ignore[attr-defined]
        (dev2,) = [d.removeprefix("dev2=").split()[0] for d in devices if "=/dev/ublkb" in d]
        (meta,) = [d.removeprefix("meta=").split()[0] for d in devices if d.startswith("meta=")]
        assert sorted(str(p.relative_to(mnt)) for p in mnt.rglob("*")) == sorted(
            str(p.relative_to(v2)) for p in v2.rglob("*")
        )
        read_all(mnt, files)
        new_end = 0
        fiemap = extents_of(*(mnt / name for name in files))
        with open(dev2, "rb") as dev:
            dev2_size = dev.seek(0, os.SEEK_END)
            for name, content in files.items():
                extents = fiemap[mnt / name]
                if name in new:
                    assert extents, name
                    for offset, physical, length in extents:
                        assert PIB <= physical <= PIB + dev2_size - length, (name, extents)
                        dev.seek(physical - PIB)
                        want = content[offset : offset + length]
                        assert dev.read(len(want)) == want, (name, offset)
                        new_end = max(new_end, physical + length)
                elif len(content) > 4096:  # (smaller ones are inline in meta.img)
                    assert extents and all(p < PIB for _, p, _ in extents), name
        check = subprocess.run(
            ["btrfs", "check", "--readonly", "--force", meta],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        ublkd("umount", mnt, timeout=120)
    rw = tmp / "rw.img"
    ublkd("mount", b2, mnt, "--frontend", "ublk", "--rw", rw, "--rw-size", "1G")
    written = os.urandom(3 * CHUNK)
    try:
        (mnt / "new" / "dir" / "written").write_bytes(written)
        (mnt / "d3" / "f3").write_bytes(b"rewritten\n" * 1000)
        (mnt / "d0" / "added").unlink()
        os.sync()
        (extents,) = extents_of(mnt / "new" / "dir" / "written").values()
        assert extents and all(p >= new_end for _, p, _ in extents), (new_end, extents)
    finally:
        ublkd("umount", mnt, timeout=120)
    ublkd("mount", b2, mnt, "--frontend", "ublk", "--rw", rw)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        assert (mnt / "new" / "dir" / "written").read_bytes() == written
        assert (mnt / "d3" / "f3").read_bytes() == b"rewritten\n" * 1000
        assert not (mnt / "d0" / "added").exists()
        kept = {n: c for n, c in files.items() if n not in ("d3/f3", "d0/added")}
        read_all(mnt, kept)
    finally:
        ublkd("umount", mnt, timeout=120)
    assert status() == []
    assert not list(Path("/dev").glob("ublkb*"))
    # 6.12 logs "device /dev/loopN maj:min changed from 0:0" for the seed's devices when
    # an existing sprout is mounted again, delta or not (test_sprout_write_umount_mount_again
    # [ublk] too): the kernel noting the seed devices it found, not a fault
    problems = [
        ln
        for ln in run("dmesg").stdout.splitlines()[before:]
        if GUEST_KERNEL_PROBLEM.search(ln) and "maj:min changed from 0:0" not in ln
    ]
    assert problems == []
