"""btrfs compressed extents vs pack compression vs none (issue 25), on the Debian golden rootfs.

    python -m bench.btrfs_zstd WORKDIR      # root; ublkd from the checkout; JSON on stdout

For each variant (pack_compression x pack_chunk_size) the same spec (the golden Debian
rootfs.tar + overlay, as specs/golden/debian/prepare.sh caches them) is built once:
build seconds, pack / meta.img / blockmap bytes, and whether our reader lists it exactly
like the uncompressed build. Then, served by nginx on loopback (tests/servers.py) and
mounted through ublkd's FUSE frontend with an empty cache:

* cold random reads: 40 regular files over 8 KiB picked at random (fixed seed), one
  4 KiB read each at a random sector (readahead off: POSIX_FADV_RANDOM), one mount for
  all; body bytes nginx sent for each read, and each read's latency;
* cold start: a fresh mount, page cache dropped, `chroot MNT /bin/true`: bytes, requests
  and seconds from the mount's start.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from btrfs_ublk_image import listing
from btrfs_ublk_image.reader import BundleReader

from bench.measure import drop_caches, remove
from bench.mounts import Ublkd
from tests.bundletools import prepare_debian_inputs
from tests.servers import Nginx, nginx_serving

VARIANTS = {
    "none-1M": "",
    "none-64K": "pack_chunk_size: 65536\n",
    "zstd-1M": "pack_compression: zstd\n",
    "zstd-64K": "pack_compression: zstd\npack_chunk_size: 65536\n",
    "btrfs-zstd-64K": "pack_compression: btrfs-zstd\npack_chunk_size: 65536\n",
    "btrfs-zstd-128K": "pack_compression: btrfs-zstd\npack_chunk_size: 131072\n",
}
SPEC = (
    "version: 1\nname: {name}\nsource_date_epoch: 1700000000\n{extra}layers:\n"
    "  - tar: {{path: rootfs.tar}}\n  - dir: {{path: overlay, uid: 0, gid: 0}}\n"
)
READS = 40
CHROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}


def build(work: Path, name: str, extra: str) -> dict[str, Any]:
    spec = work / f"{name}.yaml"
    spec.write_text(SPEC.format(name=name, extra=extra))
    out = work / "www" / f"{name}.bundle"
    remove(out)
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "btrfs_ublk_image", "build", str(spec), "-o", str(out)],
        check=True,
        capture_output=True,
    )
    return {
        "build_s": round(time.monotonic() - started, 2),
        "pack_bytes": sum(p.stat().st_size for p in (out / "packs").iterdir()),
        "meta_img_bytes": (out / "meta.img").stat().st_size,
        "blockmap_bytes": (out / "blockmap").stat().st_size,
    }


def pick_reads(bundle: Path) -> list[tuple[str, int]]:
    rnd = random.Random(11)
    with BundleReader(str(bundle)) as r:
        sizes = {
            p.decode(): n.item.size
            for p, n in r.walk()
            if n.item.mode & 0o170000 == 0o100000 and n.item.size > 8192
        }
    files = rnd.sample(sorted(sizes), READS)
    return [(p, rnd.randrange(0, sizes[p] - 4096) // 4096 * 4096) for p in files]


def _pack_bytes(web: Nginx) -> int:
    return sum(q.bytes_sent for q in web.requests() if "/packs/" in q.path)


def cold_reads(
    web: Nginx, ublkd: Ublkd, url: str, mnt: Path, cache: Path, reads: list[tuple[str, int]]
) -> dict[str, Any]:
    remove(cache)
    ublkd.env["UBLKD_CACHE_DIR"] = str(cache)
    drop_caches()
    ublkd.run(["mount", url, str(mnt), "--frontend", "fuse"])
    time.sleep(3)  # device 2 is read right after a mount (its superblock...): not counted
    moved, latency = [], []
    try:
        for path, at in reads:
            web.clear_log()
            fd = os.open(mnt / path.lstrip("/"), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                started = time.monotonic()
                os.pread(fd, 4096, at)
                latency.append(time.monotonic() - started)
            finally:
                os.close(fd)
            time.sleep(0.3)  # nginx logs a response when it ends; readahead settles
            moved.append(_pack_bytes(web))
    finally:
        ublkd.umount(mnt)
    moved.sort()
    latency.sort()
    return {
        "reads": len(moved),
        "bytes_mean": sum(moved) // len(moved),
        "bytes_median": moved[len(moved) // 2],
        "bytes_max": moved[-1],
        "reads_that_fetched": sum(1 for m in moved if m),
        "latency_ms_median": round(latency[len(latency) // 2] * 1000, 2),
    }


def cold_start(web: Nginx, ublkd: Ublkd, url: str, mnt: Path, cache: Path) -> dict[str, Any]:
    remove(cache)
    ublkd.env["UBLKD_CACHE_DIR"] = str(cache)
    drop_caches()
    web.clear_log()
    started = time.monotonic()
    ublkd.run(["mount", url, str(mnt), "--frontend", "fuse"])
    try:
        subprocess.run(["chroot", str(mnt), "/bin/true"], check=True, env=CHROOT_ENV)
        seconds = time.monotonic() - started
    finally:
        ublkd.umount(mnt)
    reqs = [q for q in web.requests() if "/packs/" in q.path]
    return {
        "seconds": round(seconds, 3),
        "pack_requests": len(reqs),
        "pack_bytes": sum(q.bytes_sent for q in reqs),
    }


def main(work: Path) -> dict[str, Any]:
    inputs = prepare_debian_inputs()
    work.mkdir(parents=True, exist_ok=True)
    (work / "www").mkdir(exist_ok=True)
    for name in ("rootfs.tar", "overlay"):
        remove(work / name)
        os.symlink(inputs / name, work / name)
    res: dict[str, Any] = {name: build(work, name, extra) for name, extra in VARIANTS.items()}
    www = work / "www"
    want = listing.format_listing(listing.from_bundle(str(www / "none-1M.bundle")))
    for name in VARIANTS:
        got = listing.format_listing(listing.from_bundle(str(www / f"{name}.bundle")))
        res[name]["listing_equal"] = got == want
    reads = pick_reads(www / "none-1M.bundle")
    mnt = work / "mnt"
    mnt.mkdir(exist_ok=True)
    ublkd = Ublkd(work / "run")
    with nginx_serving(work, work / "nginx") as web:
        for name in VARIANTS:
            url = f"{web.url}/www/{name}.bundle/manifest.json"
            cache = work / f"cache-{name}"
            res[name]["cold_random_4k"] = cold_reads(web, ublkd, url, mnt, cache, reads)
            res[name]["cold_chroot_true"] = cold_start(web, ublkd, url, mnt, cache)
            print(name, json.dumps(res[name]), file=sys.stderr, flush=True)
    return res


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m bench.btrfs_zstd WORKDIR")
    print(json.dumps(main(Path(sys.argv[1])), indent=1))
