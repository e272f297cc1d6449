"""Remote section: cold start over nginx on loopback (issue 11).

The Debian minbase image is served by nginx (tests/servers.py) from one directory that
holds the bundle and, for the baseline, the same image as a tarball (plain and zstd).
Each run starts cold: an empty ublkd cache, the page cache dropped, no server. Measured
from the start of `ublkd mount` (or of the download) until `chroot MNT /bin/true` exits:

* ours, no prefetch: `ublkd mount http://.../manifest.json`, then the chroot;
* ours, with a trace recorded on an earlier mount (`ublkd record`) and applied with
  `--prefetch`: the same, plus the time until the prefetch has finished;
* baseline: `curl URL | tar -x` (and `| zstd -d | tar -x`), then the chroot.

Bytes and requests come from nginx's access log (body bytes sent), so both sides are
counted the same way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.measure import drop_caches, remove
from bench.mounts import Ublkd
from tests.servers import Nginx, nginx_serving

CHROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}
COMMAND = ["/bin/true"]


def _served(web: Nginx) -> tuple[int, int]:
    """(requests, body bytes) in nginx's access log so far."""
    reqs = web.requests()
    return len(reqs), sum(r.bytes_sent for r in reqs)


def _chroot(root: Path) -> None:
    subprocess.run(["chroot", str(root), *COMMAND], check=True, env=CHROOT_ENV, timeout=600)


def _cold(web: Nginx, cache: Path) -> None:
    remove(cache)
    cache.mkdir(parents=True)
    web.clear_log()
    drop_caches()


def _ours(
    ublkd: Ublkd,
    web: Nginx,
    url: str,
    mnt: Path,
    cache: Path,
    extra: list[str],
    wait_prefetch: bool,
) -> dict[str, Any]:
    _cold(web, cache)
    t0 = time.monotonic()
    ublkd.run(["mount", url, str(mnt), "--frontend", "fuse", "--cache-dir", str(cache), *extra])
    try:
        t_mounted = time.monotonic()
        _chroot(mnt)
        t_done = time.monotonic()
        st = ublkd.settled_status(mnt)
        if wait_prefetch:
            st = ublkd.wait_prefetch(mnt)
        t_prefetched = time.monotonic()
        requests, sent = _served(web)
    finally:
        ublkd.umount(mnt)
    return {
        "mount_s": t_mounted - t0,
        "to_command_done_s": t_done - t0,
        "to_prefetch_done_s": (t_prefetched - t0) if wait_prefetch else None,
        "requests": requests,
        "bytes": sent,
        "status": {k: v for k, v in st.items() if isinstance(v, int | float)},
    }


def _download(web: Nginx, url: str, dest: Path, unpack: list[str] | None) -> dict[str, Any]:
    remove(dest)
    dest.mkdir(parents=True)
    web.clear_log()
    drop_caches()
    t0 = time.monotonic()
    pipeline = f"curl -sf {url}"
    if unpack:
        pipeline += " | " + " ".join(unpack)
    pipeline += f" | tar -x --numeric-owner -C {dest}"
    subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], check=True, timeout=1200)
    t_unpacked = time.monotonic()
    _chroot(dest)
    t_done = time.monotonic()
    requests, sent = _served(web)
    remove(dest)
    return {
        "mount_s": t_unpacked - t0,
        "to_command_done_s": t_done - t0,
        "to_prefetch_done_s": None,
        "requests": requests,
        "bytes": sent,
    }


def measure_remote(
    bundle: Path, tar: Path, work: Path, ublkd: Ublkd, repeats: int
) -> dict[str, Any]:
    """Cold starts over nginx on loopback; medians over `repeats` runs of each way."""
    site = work / "site"
    remove(site)
    site.mkdir(parents=True)
    shutil.copytree(bundle, site / "bundle", ignore=shutil.ignore_patterns("prefetch.trace"))
    os.link(tar, site / "rootfs.tar") if tar.stat().st_dev == site.stat().st_dev else shutil.copy(
        tar, site / "rootfs.tar"
    )
    subprocess.run(
        ["zstd", "-q", "-3", "-T0", str(site / "rootfs.tar"), "-o", str(site / "rootfs.tar.zst")],
        check=True,
    )
    mnt, cache, trace = work / "mnt", work / "cache", work / "chroot-true.trace"
    mnt.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    with nginx_serving(site, work / "nginx") as web:
        url = f"{web.url}/bundle/manifest.json"
        # a trace of the command, recorded on one mount (not timed)
        _cold(web, cache)
        ublkd.run(
            [
                "mount",
                url,
                str(mnt),
                "--frontend",
                "fuse",
                "--cache-dir",
                str(cache),
                "--no-prefetch",
            ]
        )
        try:
            _chroot(mnt)
            ublkd.run(["record", str(mnt), "-o", str(trace)])
        finally:
            ublkd.umount(mnt)
        ways: dict[str, Callable[[], dict[str, Any]]] = {
            "ours (no prefetch)": lambda: _ours(
                ublkd, web, url, mnt, cache, ["--no-prefetch"], False
            ),
            "ours (recorded trace)": lambda: _ours(
                ublkd, web, url, mnt, cache, ["--prefetch", str(trace)], True
            ),
            "curl | tar -x": lambda: _download(web, f"{web.url}/rootfs.tar", work / "x", None),
            "curl | zstd -d | tar -x": lambda: _download(
                web, f"{web.url}/rootfs.tar.zst", work / "x", ["zstd", "-d", "-q"]
            ),
        }
        for _ in range(max(1, repeats)):
            for name, fn in ways.items():
                runs.setdefault(name, []).append(fn())
    remove(site)
    remove(cache)
    return {
        "command": " ".join(["chroot", "MNT", *COMMAND]),
        "bundle_bytes": sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()),
        "tar_bytes": tar.stat().st_size,
        "runs": runs,
    }
