"""Root integration tests for remote bundles (docs/remote.md): `ublkd mount` of a bundle
served by nginx over HTTP and of an artifact in docker-registry (both real servers on
loopback, tests/servers.py), the persistent chunk cache, timeouts and corrupt responses.

Helpers and the `no_leftovers` fixture come from tests/test_ublkd.py; the chunk cache
goes to tmp_path (UBLKD_CACHE_DIR), so a test leaves nothing behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import zstandard
from servers import (
    AccessRecord,
    Registry,
    TokenService,
    docker_registry,
    htpasswd_auth,
    nginx_serving,
)
from test_push import ok, push, write_trace
from test_ublkd import (
    CHUNK,
    dev2_dio,
    kill_server,
    no_leftovers,
    read_file,
    status,
    status_of,
    ublkd,
)

from btrfs_ublk_image import blockmap as bmap
from btrfs_ublk_image.cli import main as cli

from bundletools import list_dir, list_tar, write_pax_tar

pytestmark = pytest.mark.root
__all__ = ["no_leftovers"]  # the fixture, used by name

FRONTEND = ("--frontend", "fuse")


def make_tree(path: Path) -> dict[str, bytes]:
    """A tarball whose pack has neighbours around a 1 MiB file; returns name -> content."""
    rnd = __import__("random").Random(11)
    files = {
        "etc/hostname": b"remote\n",
        # unique per call: two runs at once must not mount one image (one kernel btrfs
        # instance per fsid)
        "etc/run-id": os.urandom(16).hex().encode(),
        "data/before.bin": rnd.randbytes(3 * CHUNK + 5000),
        "data/one.bin": rnd.randbytes(CHUNK),
        "data/after.bin": rnd.randbytes(3 * CHUNK + 777),
        "data/long.bin": rnd.randbytes(24 * CHUNK),
        "data/small.bin": rnd.randbytes(70_000),
        "data/victim.bin": rnd.randbytes(2 * CHUNK),
    }
    write_pax_tar(path, files, ("etc", "data"))
    return files


def build_served_bundle(tmp: Path) -> tuple[Path, Path, dict[str, bytes]]:
    """-> (bundle dir under tmp/www, tarball, files)."""
    work = tmp / "src"
    work.mkdir()
    tarball = work / "rootfs.tar"
    files = make_tree(tarball)
    spec = work / "spec.yaml"
    spec.write_text("version: 1\nname: remote\nlayers:\n  - tar: {path: rootfs.tar}\n")
    bundle = tmp / "www" / "img.bundle"
    bundle.parent.mkdir()
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    return bundle, tarball, files


def pack_bytes(reqs: list[AccessRecord]) -> int:
    return sum(r.bytes_sent for r in reqs if "/packs/" in r.path)


def image_hex(bundle: Path) -> str:
    return hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()


def settled_status(mnt: Path) -> dict[str, object]:
    """The mount's status once the server's counters stopped changing (stats.json is
    rewritten every 200 ms; readahead may still be finishing)."""
    last = status_of(mnt)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = status_of(mnt)
        if now == last:
            break
        last = now
    return last


@pytest.fixture
def cache_dir(no_leftovers: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = no_leftovers / "cache"
    monkeypatch.setenv("UBLKD_CACHE_DIR", str(d))
    return d


def test_http_mount_tree_one_file_fetch_and_persistent_cache(
    no_leftovers: Path, cache_dir: Path
) -> None:
    tmp = no_leftovers
    bundle, tarball, files = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    with nginx_serving(bundle.parent, tmp / "nginx") as web:
        url = f"{web.url}/{bundle.name}/manifest.json"
        r = ublkd("mount", url, mnt, *FRONTEND)
        assert url in r.stdout
        try:
            # a miss is a fetch: device 2 stays direct I/O, misses in parallel
            assert "--dev2-cache direct (default for a remote bundle)" in r.stderr, r.stderr
            assert dev2_dio(mnt) == "1"
            # manifest.json, the optional trace (none: 404), meta.img and blockmap; of
            # the packs only what mount(2) reads: device 2's superblock (one chunk)
            reqs = web.requests()
            assert [(r.path.rsplit("/", 1)[1], r.status) for r in reqs[:4]] == [
                ("manifest.json", 200),
                ("prefetch.trace", 404),
                ("meta.img", 200),
                ("blockmap", 200),
            ]
            assert pack_bytes(reqs) <= CHUNK and len(reqs) <= 5, reqs
            boot = [r for r in reqs if "/packs/" in r.path]
            img = cache_dir / image_hex(bundle)
            assert (img / "meta.img").read_bytes() == (bundle / "meta.img").read_bytes()
            web.clear_log()
            assert read_file(mnt / "data" / "one.bin") == files["data/one.bin"]
            reqs = web.requests()
            fetched = pack_bytes(reqs)
            assert 0 < fetched <= 2 * CHUNK, reqs
            assert all(r.status == 206 and r.range.startswith("bytes=") for r in reqs), reqs
            assert list_dir(mnt) == list_tar(tarball)
            st = settled_status(mnt)
            assert st["bundle"] == url
            # the server's counters: its requests are exactly the pack requests nginx saw
            reqs = boot + web.requests()
            assert st["fetch_requests"] == len(reqs) and st["fetch_bytes"] == pack_bytes(reqs)
            assert st["fetch_errors"] == 0 and st["verify_failures"] == 0
            assert isinstance(st["fetch_latency_us_max"], int) and st["fetch_latency_us_max"] > 0
            assert st["disk_cache_bytes"] == st["fetch_bytes"]
        finally:
            ublkd("umount", mnt)
        assert status() == []
        # a cold start: a new server, nothing in memory; the chunk cache has every chunk.
        # (Its meta.img check writes a verified record only for a file whose ctime is
        # over 2 s old: wait until the cached copies are.)
        for name in ("meta.img", "blockmap"):
            time.sleep(max(0.0, 2.2 - (time.time() - (img / name).stat().st_ctime)))
        web.clear_log()
        ublkd("mount", url, mnt, *FRONTEND)
        try:
            assert list_dir(mnt) == list_tar(tarball)
            reqs = web.requests()
            assert pack_bytes(reqs) == 0, reqs
            assert [r.path.rsplit("/", 1)[1] for r in reqs] == ["manifest.json", "prefetch.trace"]
            st = settled_status(mnt)
            assert isinstance(st["disk_cache_hits"], int) and st["disk_cache_hits"] >= 30
            assert st["fetch_bytes"] == 0 and st["disk_cache_corrupt"] == 0
            text = ublkd("status").stdout
            assert "chunk cache 0 hits" not in text and "fetched  0 bytes" in text, text
        finally:
            ublkd("umount", mnt)
        assert status() == []
        # meta.img's sha256 has a verified record, the blockmap's has none (Bundle::open
        # hashes it on every start); the image id has its structural check record
        manifest = json.loads((bundle / "manifest.json").read_bytes())
        verified = sorted(p.name for p in Path(os.environ["UBLKD_RUN_DIR"], "verified").iterdir())
        assert verified == [
            manifest["files"]["meta.img"]["sha256"].removeprefix("sha256:") + ".json",
            f"image-{image_hex(bundle)}.json",
        ]
        # a cached blockmap that no longer matches (same size) is fetched again
        bm = img / "blockmap"
        data = bytearray(bm.read_bytes())
        data[-1] ^= 0xFF
        bm.write_bytes(bytes(data))
        web.clear_log()
        r = ublkd("mount", url, mnt, *FRONTEND)
        try:
            assert "blockmap: cached copy does not match the manifest" in r.stderr, r.stderr
            assert [r.path.rsplit("/", 1)[1] for r in web.requests()][:3] == [
                "manifest.json",
                "prefetch.trace",
                "blockmap",
            ]
            assert bm.read_bytes() == (bundle / "blockmap").read_bytes()
            assert read_file(mnt / "data" / "one.bin") == files["data/one.bin"]
        finally:
            ublkd("umount", mnt)
    assert status() == []


def test_http_passthrough_from_a_full_chunk_cache(no_leftovers: Path, cache_dir: Path) -> None:
    """--dev2-cache passthrough of a remote bundle whose chunks are all in the persistent
    cache: the server's copy of device 2 fetches no pack byte, the mount lists what a
    default mount does, and no read reaches the server."""
    tmp = no_leftovers
    bundle, tarball, _files = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    with nginx_serving(bundle.parent, tmp / "nginx") as web:
        url = f"{web.url}/{bundle.name}/manifest.json"
        ublkd("mount", url, mnt, *FRONTEND)
        try:
            # every file read: every pack chunk (file content or device 2's superblock)
            # is now in the persistent cache
            listing = list_dir(mnt)
        finally:
            ublkd("umount", mnt)
        assert listing == list_tar(tarball)
        web.clear_log()
        r = ublkd("mount", url, mnt, *FRONTEND, "--dev2-cache", "passthrough")
        try:
            assert "--dev2-cache passthrough (requested)" in r.stderr, r.stderr
            assert pack_bytes(web.requests()) == 0, web.requests()
            assert list_dir(mnt) == listing
            st = settled_status(mnt)
            assert (st["reads"], st["fetch_bytes"]) == (0, 0), st
            assert st["disk_cache_hits"] == st["prefetch_chunks"] > 0, st
        finally:
            ublkd("umount", mnt)
    assert status() == []


def test_http_redirects_are_followed_keeping_the_range(no_leftovers: Path, cache_dir: Path) -> None:
    """Every file of the bundle behind a 302 (as registries and CDNs redirect blob GETs):
    the range request reaches the new location with its Range header."""
    tmp = no_leftovers
    bundle, _, files = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    moves = {"/moved/": f"/{bundle.name}/"}
    with nginx_serving(bundle.parent, tmp / "nginx", redirects=moves) as web:
        ublkd("mount", f"{web.url}/moved/manifest.json", mnt, *FRONTEND)
        try:
            web.clear_log()
            assert read_file(mnt / "data" / "one.bin") == files["data/one.bin"]
            reqs = web.requests()
            moved = [r for r in reqs if r.path.startswith("/moved/packs/")]
            served = [r for r in reqs if r.path.startswith(f"/{bundle.name}/packs/")]
            assert moved and all(r.status == 302 for r in moved), reqs
            # (concurrent fetches: the log's order may differ)
            assert sorted(r.range for r in served) == sorted(r.range for r in moved), reqs
            assert all(r.status == 206 for r in served), reqs
        finally:
            ublkd("umount", mnt)
    assert status() == []


def test_https_checks_the_certificate(
    no_leftovers: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTPS (nginx with a certificate of a test CA): refused while the CA is unknown;
    trusted through SSL_CERT_FILE (the system store otherwise), the bundle mounts."""
    tmp = no_leftovers
    bundle, _, files = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    with nginx_serving(bundle.parent, tmp / "nginx", tls=True) as web:
        assert web.ca is not None and web.url.startswith("https://")
        url = f"{web.url}/{bundle.name}/manifest.json"
        r = ublkd("mount", url, mnt, *FRONTEND, "--fetch-timeout", "2", check=False)
        assert r.returncode != 0 and url in r.stderr and "UnknownIssuer" in r.stderr, r.stderr
        monkeypatch.setenv("SSL_CERT_FILE", str(web.ca))
        ublkd("mount", url, mnt, *FRONTEND)
        try:
            assert read_file(mnt / "data" / "one.bin") == files["data/one.bin"]
            # (prefetch.trace: 404, there is none)
            assert all(r.status in (200, 206, 404) for r in web.requests())
            assert [r.path for r in web.requests() if r.status == 404] == [
                f"/{bundle.name}/prefetch.trace"
            ]
        finally:
            ublkd("umount", mnt)
    assert status() == []


def test_http_server_gone_mid_read_eio_then_back_and_recover(
    no_leftovers: Path, cache_dir: Path
) -> None:
    """nginx stopped while a file is read: the read fails with EIO after the fetch timeout
    (it never hangs); once nginx is back the same read succeeds. Then kill -9 of the
    server and `ublkd recover`: the new server starts from the cached image (no network
    needed for that) and serves the rest."""
    tmp = no_leftovers
    bundle, _, files = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    timeout = 2.0
    with nginx_serving(bundle.parent, tmp / "nginx") as web:
        url = f"{web.url}/{bundle.name}/manifest.json"
        ublkd("mount", url, mnt, *FRONTEND, "--fetch-timeout", str(timeout))
        try:
            want = files["data/long.bin"]
            with open(mnt / "data" / "long.bin", "rb") as f:
                assert f.read(CHUNK) == want[:CHUNK]
                web.stop()
                t0 = time.monotonic()
                with pytest.raises(OSError) as e:
                    f.read()
                elapsed = time.monotonic() - t0
            assert e.value.errno == errno.EIO
            print(f"EIO after {elapsed:.2f} s with --fetch-timeout {timeout}")
            # once one fetch gave up (maybe a readahead that began before), the others
            # fail fast: about one fetch timeout, not one per fetch the read needs
            assert elapsed < 1.5 * timeout + 1, elapsed
            st = settled_status(mnt)
            assert isinstance(st["fetch_errors"], int) and st["fetch_errors"] > 0
            assert isinstance(st["read_errors"], int) and st["read_errors"] > 0
            web.start()
            assert read_file(mnt / "data" / "long.bin") == want
            # the server dies; recover restarts it (it opens the cached image)
            kill_server(mnt)
            web.stop()
            ublkd("recover", mnt)
            assert status_of(mnt)["server_alive"] is True
            assert dev2_dio(mnt) == "1"  # the new server is direct I/O too
            web.start()
            assert read_file(mnt / "data" / "after.bin") == files["data/after.bin"]
        finally:
            ublkd("umount", mnt)
    assert status() == []


def test_corrupt_response_rejected_counted_never_cached(
    no_leftovers: Path, cache_dir: Path
) -> None:
    tmp = no_leftovers
    bundle, _, files = build_served_bundle(tmp)
    (pack,) = list((bundle / "packs").iterdir())
    data = bytearray(pack.read_bytes())
    want = files["data/victim.bin"]
    at = data.find(want)
    assert at >= 0
    victim = at + len(want) // 2
    bad_chunk = victim // CHUNK
    bm = bmap.decode((bundle / "blockmap").read_bytes())
    digest = bm.packs[0].chunk_digests[bad_chunk].hex()
    cached = cache_dir / image_hex(bundle) / "chunks" / digest[:2] / digest
    mnt = tmp / "mnt"
    mnt.mkdir()
    with nginx_serving(bundle.parent, tmp / "nginx") as web:
        url = f"{web.url}/{bundle.name}/manifest.json"
        ublkd("mount", url, mnt, *FRONTEND, "--fetch-timeout", "5")
        try:
            data[victim] ^= 0xFF
            pack.write_bytes(bytes(data))  # the server now sends one wrong byte
            assert read_file(mnt / "data" / "victim.bin") == errno.EIO
            st = settled_status(mnt)
            assert isinstance(st["verify_failures"], int) and st["verify_failures"] >= 1
            assert not cached.exists()
            assert not list((cache_dir / image_hex(bundle) / "chunks" / "tmp").iterdir())
            data[victim] ^= 0xFF
            pack.write_bytes(bytes(data))  # fixed
            assert read_file(mnt / "data" / "victim.bin") == want
            assert hashlib.sha256(cached.read_bytes()).hexdigest() == digest
        finally:
            ublkd("umount", mnt)
    assert status() == []


# --- OCI -------------------------------------------------------------------------------
def test_oci_mount_by_tag_and_digest(no_leftovers: Path, cache_dir: Path) -> None:
    tmp = no_leftovers
    bundle, tarball, files = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    with docker_registry(tmp / "registry") as reg:
        pushed = ok(push("push", bundle, f"{reg.address}/images/remote:v1")).stdout
        digest = re.search(r": manifest (sha256:[0-9a-f]{64})", pushed)
        assert digest is not None, pushed
        loc = f"oci://{reg.address}/images/remote:v1"
        image_id = "sha256:" + image_hex(bundle)
        r = ublkd("mount", loc, mnt, *FRONTEND, "--expect-id", image_id)
        assert image_id in r.stdout
        try:
            before = settled_status(mnt)["fetch_bytes"]  # mount(2) read dev 2's superblock
            assert isinstance(before, int)
            assert read_file(mnt / "data" / "one.bin") == files["data/one.bin"]
            st = settled_status(mnt)
            assert st["bundle"] == loc and st["image_id"] == image_id
            assert (
                isinstance(st["fetch_bytes"], int) and 0 < st["fetch_bytes"] - before <= 2 * CHUNK
            )
            assert list_dir(mnt) == list_tar(tarball)
        finally:
            ublkd("umount", mnt)
        # by digest: the same image, its chunks already cached
        ublkd("mount", f"oci://{reg.address}/images/remote@{digest[1]}", mnt, *FRONTEND)
        try:
            assert list_dir(mnt) == list_tar(tarball)
            assert settled_status(mnt)["fetch_bytes"] == 0
        finally:
            ublkd("umount", mnt)
        # errors name the location and the problem; nothing is left mounted
        r = ublkd("mount", f"oci://{reg.address}/images/remote:nope", mnt, *FRONTEND, check=False)
        assert r.returncode != 0 and "images/remote/manifests/nope: HTTP 404" in r.stderr, r.stderr
        r = ublkd("mount", loc, mnt, *FRONTEND, "--expect-id", "sha256:" + "0" * 64, check=False)
        assert r.returncode != 0 and f"{loc}: image id is {image_id}" in r.stderr, r.stderr
    assert status() == []


def registry_blob(reg: Registry, digest: str) -> Path:
    """Where docker-registry's filesystem storage keeps a blob's bytes."""
    hex_ = digest.removeprefix("sha256:")
    return reg.workdir / "storage/docker/registry/v2/blobs/sha256" / hex_[:2] / hex_ / "data"


def test_oci_meta_img_travels_zstd_compressed(no_leftovers: Path, cache_dir: Path) -> None:
    """push uploads meta.img as one zstd frame: the mount GETs fewer bytes than the file
    and caches the decompressed, verified meta.img. A wrong blob in the registry's storage
    (a flipped byte, another valid frame, a frame that inflates past the manifest's size,
    a blob longer than its descriptor) fails the mount naming meta.img, leaving nothing
    mounted and no meta.img in the cache. An artifact with an uncompressed meta.img layer
    (pushed before) still mounts."""
    tmp = no_leftovers
    bundle, tarball, files = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    meta = (bundle / "meta.img").read_bytes()
    img = cache_dir / image_hex(bundle)
    with docker_registry(tmp / "registry") as reg:
        ok(push("push", bundle, f"{reg.address}/images/zst:v1"))
        layer = json.loads(raw_oci_manifest(reg, "images/zst", "v1"))["layers"][0]
        assert layer["mediaType"] == "application/vnd.btrfs-ublk-image.meta.v1+zstd"
        assert layer["annotations"]["org.opencontainers.image.title"] == "meta.img"
        loc = f"oci://{reg.address}/images/zst:v1"
        before = len(reg.requests())
        ublkd("mount", loc, mnt, *FRONTEND)
        try:
            sent = [
                r.bytes_sent
                for r in reg.requests()[before:]
                if r.method == "GET" and r.path.endswith(f"/blobs/{layer['digest']}")
            ]
            assert sent == [layer["size"]], sent
            assert layer["size"] < len(meta) // 2, (layer["size"], len(meta))
            assert (img / "meta.img").read_bytes() == meta
            assert read_file(mnt / "data" / "one.bin") == files["data/one.bin"]
            assert list_dir(mnt) == list_tar(tarball)
        finally:
            ublkd("umount", mnt)
        assert status() == []

        blob = registry_blob(reg, layer["digest"])
        good = blob.read_bytes()
        flipped = bytearray(good)
        flipped[len(flipped) // 2] ^= 0x55
        other = bytearray(meta)
        nonzero = next(i for i in range(65536, len(meta), 4096) if any(meta[i : i + 4096]))
        other[nonzero : nonzero + 4096] = bytes(4096)  # another meta.img, no larger a frame
        cctx = zstandard.ZstdCompressor(level=3, write_content_size=True)
        another = cctx.compress(bytes(other))
        bomb = cctx.compress(bytes(len(meta) + (1 << 20)))  # zeros: far smaller than good
        assert len(another) <= len(good) and len(bomb) < len(good)
        for name, bad, expect in [
            ("flipped byte", bytes(flipped), ("sha256", "does not decompress")),
            ("another frame", another, (f"the manifest says {len(meta)} bytes with",)),
            ("too large", bomb, (f"more than the {len(meta)} bytes the manifest says",)),
            ("longer blob", good + bytes(10), (f"more than the {len(good)} bytes of the layer",)),
        ]:
            shutil.rmtree(img)  # a cold cache: the mount must fetch meta.img
            blob.write_bytes(bad)
            try:
                r = ublkd("mount", loc, mnt, *FRONTEND, check=False)
            finally:
                blob.write_bytes(good)
            assert r.returncode != 0, (name, r.stdout)
            assert f"{loc}: fetching meta.img: " in r.stderr, (name, r.stderr)
            assert any(e in r.stderr for e in expect), (name, r.stderr)
            assert status() == [] and not os.path.ismount(mnt), name
            assert sorted(p.name for p in img.iterdir() if "meta.img" in p.name) == [], name
        # the good blob back: the same mount works
        shutil.rmtree(img)
        ublkd("mount", loc, mnt, *FRONTEND)
        try:
            assert read_file(mnt / "data" / "small.bin") == files["data/small.bin"]
        finally:
            ublkd("umount", mnt)
        assert status() == []

        # an artifact pushed before meta.img was compressed (layer 0 = the file itself)
        # still mounts
        raw_loc = push_uncompressed_meta(bundle, reg, "images/zst", "raw")
        shutil.rmtree(img)
        before = len(reg.requests())
        ublkd("mount", raw_loc, mnt, *FRONTEND)
        try:
            meta_digest = "sha256:" + hashlib.sha256(meta).hexdigest()
            sent = [
                r.bytes_sent
                for r in reg.requests()[before:]
                if r.method == "GET" and r.path.endswith(f"/blobs/{meta_digest}")
            ]
            assert sent == [len(meta)], sent
            assert (img / "meta.img").read_bytes() == meta
            assert read_file(mnt / "data" / "one.bin") == files["data/one.bin"]
        finally:
            ublkd("umount", mnt)
    assert status() == []


def push_uncompressed_meta(bundle: Path, reg: Registry, repo: str, tag: str) -> str:
    """The artifact as push made it before meta.img travelled compressed -> its oci://."""
    from btrfs_ublk_image.push import MT_META, MT_OCI_MANIFEST, bundle_manifest, verify_bundle
    from btrfs_ublk_image.registry import Reference
    from btrfs_ublk_image.registry import Registry as Client

    b = verify_bundle(str(bundle))  # no workdir: layer 0 is meta.img itself
    assert b.layers[0].media_type == MT_META
    client = Client(Reference(reg.address, repo, tag))
    try:
        for blob in [b.config, *b.layers]:
            client.put_blob(blob)
        client.put_manifest(tag, bundle_manifest(b), MT_OCI_MANIFEST)
    finally:
        client.close()
    return f"oci://{reg.address}/{repo}:{tag}"


def raw_oci_manifest(reg: Registry, repo: str, tag: str) -> bytes:
    """The manifest as the registry stores it (through its link files)."""
    store = reg.workdir / "storage/docker/registry/v2/repositories" / repo / "_manifests"
    digest = (store / "tags" / tag / "current" / "link").read_text().strip()
    return registry_blob(reg, digest).read_bytes()


def test_oci_registry_basic_auth(no_leftovers: Path, cache_dir: Path) -> None:
    """docker-registry with htpasswd auth: anonymous requests get a `Basic` challenge;
    without credentials the mount fails saying so; with --registry-auth it mounts (the
    server, which fetches the packs, gets the credentials through its environment)."""
    tmp = no_leftovers
    bundle, tarball, _ = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    with docker_registry(tmp / "registry", auth=htpasswd_auth(tmp, "builder", "s3cret")) as reg:
        ok(push("push", bundle, f"{reg.address}/images/private:v1", "--auth", "builder:s3cret"))
        loc = f"oci://{reg.address}/images/private:v1"
        r = ublkd("mount", loc, mnt, *FRONTEND, check=False)
        assert r.returncode != 0 and "asks for credentials" in r.stderr, r.stderr
        r = ublkd("mount", loc, mnt, *FRONTEND, "--registry-auth", "builder:wrong", check=False)
        assert r.returncode != 0 and "HTTP 401" in r.stderr, r.stderr
        ublkd("mount", loc, mnt, *FRONTEND, "--registry-auth", "builder:s3cret")
        try:
            assert list_dir(mnt) == list_tar(tarball)
            pid = status_of(mnt)["server_pid"]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert b"s3cret" not in cmdline
        finally:
            ublkd("umount", mnt)
    assert status() == []


def test_oci_registry_bearer_token_auth(no_leftovers: Path, cache_dir: Path) -> None:
    """docker-registry with token auth: a `Bearer realm=..,service=..,scope=..` challenge;
    ublkd gets a token from the realm (with the basic credentials) and retries."""
    tmp = no_leftovers
    bundle, tarball, files = build_served_bundle(tmp)
    mnt = tmp / "mnt"
    mnt.mkdir()
    tokens = TokenService(tmp, "reader", "pw")
    auth = (
        f"{{token: {{realm: '{tokens.realm}', service: bui-registry, issuer: bui-test-issuer,"
        f" rootcertbundle: {tokens.cert}}}}}"
    )
    with tokens.running(), docker_registry(tmp / "registry", auth=auth) as reg:
        ok(push("push", bundle, f"{reg.address}/images/tok:v1", "--auth", "reader:pw"))
        loc = f"oci://{reg.address}/images/tok:v1"
        r = ublkd("mount", loc, mnt, *FRONTEND, check=False)
        assert r.returncode != 0 and "refused anonymous access" in r.stderr, r.stderr
        ublkd("mount", loc, mnt, *FRONTEND, "--registry-auth", "reader:pw")
        try:
            assert read_file(mnt / "data" / "one.bin") == files["data/one.bin"]
            assert list_dir(mnt) == list_tar(tarball)
        finally:
            ublkd("umount", mnt)
        assert ["repository:images/tok:pull"] in tokens.scopes, tokens.scopes
    assert status() == []


def test_chunk_cache_is_bounded_and_rechecked_on_load(no_leftovers: Path, cache_dir: Path) -> None:
    """--cache-size bounds the chunk files (least recently used go); an entry damaged on
    disk is detected when loaded, counted, and fetched again; leftover temp files of a
    torn write are removed when a server starts."""
    tmp = no_leftovers
    bundle, tarball, files = build_served_bundle(tmp)
    data = (next((bundle / "packs").iterdir())).read_bytes()
    bm = bmap.decode((bundle / "blockmap").read_bytes())
    index = {d.hex(): i for i, d in enumerate(bm.packs[0].chunk_digests)}
    where = {name: data.find(content) for name, content in files.items() if len(content) > 4096}
    chunks = cache_dir / image_hex(bundle) / "chunks"
    mnt = tmp / "mnt"
    mnt.mkdir()
    limit = 6 * CHUNK
    with nginx_serving(bundle.parent, tmp / "nginx") as web:
        url = f"{web.url}/{bundle.name}/manifest.json"
        ublkd("mount", url, mnt, *FRONTEND, "--cache-size", str(limit))
        try:
            assert list_dir(mnt) == list_tar(tarball)  # 33 MiB through a 6 MiB cache
            st = settled_status(mnt)
            cached = sum(p.stat().st_size for p in chunks.glob("??/*"))
            assert cached == st["disk_cache_bytes"] and 0 < cached <= limit, (cached, st)
        finally:
            ublkd("umount", mnt)
        # damage a cached chunk of some file (which chunks stay cached depends on
        # readahead timing)
        holder = {
            c: name
            for name, at in where.items()
            for c in range(at // CHUNK, (at + len(files[name]) - 1) // CHUNK + 1)
        }
        entry, chunk, name = next(
            (p, index[p.name], holder[index[p.name]])
            for p in sorted(chunks.glob("??/*"))
            if index[p.name] in holder
        )
        raw = bytearray(entry.read_bytes())
        raw[100] ^= 1
        entry.write_bytes(bytes(raw))
        (chunks / "tmp" / f"{entry.name}.1.0").write_bytes(b"torn")
        web.clear_log()
        ublkd("mount", url, mnt, *FRONTEND, "--cache-size", str(limit))
        try:
            assert not list((chunks / "tmp").iterdir())
            # read just inside that chunk (a whole file could evict it before reaching it)
            off = max(chunk * CHUNK - where[name], 0)
            with open(mnt / name, "rb") as f:
                f.seek(off)
                assert f.read(4096) == files[name][off : off + 4096]
            st = settled_status(mnt)
            assert st["disk_cache_corrupt"] == 1 and st["verify_failures"] == 0, st
            spans = [r.range[6:].split("-") for r in web.requests() if r.range != "-"]
            assert any(int(a) <= chunk * CHUNK <= int(b) for a, b in spans), spans
            assert hashlib.sha256(entry.read_bytes()).hexdigest() == entry.name
        finally:
            ublkd("umount", mnt)
    assert status() == []


def wait_prefetch(mnt: Path) -> dict[str, object]:
    """The mount's status once its server's prefetch is done."""
    deadline = time.monotonic() + 60
    while True:
        st = status_of(mnt)
        total, done = st["prefetch_total"], st["prefetch_done"]
        assert isinstance(total, int) and isinstance(done, int)
        if (total and done >= total) or time.monotonic() > deadline:
            return settled_status(mnt)
        time.sleep(0.1)


def test_prefetch_trace_beside_the_manifest_and_as_a_referrer(
    no_leftovers: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote bundle's trace is found where docs/remote.md says (`prefetch.trace` beside
    the manifest's URL; for oci://, the last trace referrer of the bundle manifest) and
    applied: the traced file is then read without any fetch."""
    tmp = no_leftovers
    bundle, _, files = build_served_bundle(tmp)
    pack = next((bundle / "packs").iterdir()).read_bytes()
    at, want = pack.find(files["data/one.bin"]), files["data/one.bin"]
    chunks = [[0, c] for c in range(at // CHUNK, (at + len(want) - 1) // CHUNK + 1)]
    image_id = "sha256:" + image_hex(bundle)
    write_trace(bundle / "prefetch.trace", image_id, chunks)
    mnt = tmp / "mnt"
    mnt.mkdir()
    with nginx_serving(bundle.parent, tmp / "nginx") as web:
        r = ublkd("mount", f"{web.url}/{bundle.name}/manifest.json", mnt, *FRONTEND)
        assert f"prefetching {len(chunks)} chunks" in r.stdout, r.stdout
        try:
            before = wait_prefetch(mnt)
            assert before["prefetch_done"] == len(chunks) and before["prefetch_errors"] == 0
            web.clear_log()
            assert read_file(mnt / "data" / "one.bin") == want
            assert pack_bytes(web.requests()) == 0, web.requests()
        finally:
            ublkd("umount", mnt)
    # the same through a registry (push attaches the bundle's prefetch.trace), cold cache
    monkeypatch.setenv("UBLKD_CACHE_DIR", str(tmp / "cache2"))
    with docker_registry(tmp / "registry") as reg:
        ok(push("push", bundle, f"{reg.address}/images/traced:v1"))
        r = ublkd("mount", f"oci://{reg.address}/images/traced:v1", mnt, *FRONTEND)
        assert f"prefetching {len(chunks)} chunks" in r.stdout, r.stdout
        try:
            before = wait_prefetch(mnt)
            assert read_file(mnt / "data" / "one.bin") == want
            after = settled_status(mnt)
            keys = ("fetch_requests", "prefetch_total", "prefetch_done", "prefetch_errors")
            assert after["fetch_requests"] == before["fetch_requests"], [
                (k, before[k], after[k]) for k in keys
            ]
        finally:
            ublkd("umount", mnt)
    assert status() == []
