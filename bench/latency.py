"""Latency section: cold random reads of a remote bundle behind injected latency (issue 21).

A bundle of one 16 MiB file in 64 KiB chunks is served by tests/slowhttp.py, which answers
every request 0 or 20 ms late. Each run mounts it cold (empty chunk cache, readahead and
prefetch off) through the fuse frontend and reads 4 KiB with O_DIRECT at one offset in
each of 256 chunks, from 1 thread (qd1) or 16 threads (qd16); IOPS = reads / wall time.
`ours` is the ublkd this checkout built; `baseline` another ublkd binary (`--baseline-ublkd`,
e.g. one built from the previous commit), measured in the same run, alternating.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench.measure import drop_caches, remove
from bench.mounts import ublkd_binary
from tests.servers import slow_http

CHUNK = 64 << 10
CHUNKS = 256
READ = 4096
DELAYS_MS = (0.0, 20.0)
DEPTHS = (1, 16)


def _read(path: Path, offsets: list[int]) -> None:
    buf = mmap.mmap(-1, READ)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for off in offsets:
            os.preadv(fd, [buf], off)
    finally:
        os.close(fd)
        buf.close()


def _one(ublkd: str, url: str, work: Path, depth: int) -> float:
    """IOPS of one cold run."""
    mnt, cache = work / "mnt", work / "cache"
    remove(cache)
    mnt.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, UBLKD_RUN_DIR=str(work / "run"))
    subprocess.run([ublkd, "mount", url, str(mnt), "--frontend", "fuse", "--readahead", "0",
                    "--no-prefetch", "--cache-dir", str(cache)],
                   check=True, capture_output=True, env=env)  # fmt: skip
    try:
        drop_caches()
        offs = [i * CHUNK + (i * 7919 % (CHUNK // READ)) * READ for i in range(CHUNKS)]
        parts = [offs[i::depth] for i in range(depth)]
        threads = [threading.Thread(target=_read, args=(mnt / "data", p)) for p in parts]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return CHUNKS / (time.monotonic() - t0)
    finally:
        subprocess.run([ublkd, "umount", str(mnt)], check=True, capture_output=True, env=env)


def measure_latency(work: Path, repeats: int, baseline: str | None) -> dict[str, Any]:
    remove(work)
    (work / "tree").mkdir(parents=True)
    (work / "tree" / "data").write_bytes(os.urandom(CHUNK * CHUNKS))
    (work / "spec.yaml").write_text(
        f"version: 1\nname: latency\npack_chunk_size: {CHUNK}\nlayers:\n"
        f"  - dir: {{path: {work / 'tree'}}}\n"
    )
    site = work / "site"
    site.mkdir()
    subprocess.run(["btrfs-ublk-image", "build", str(work / "spec.yaml"), "-o",
                    str(site / "bundle")], check=True, capture_output=True)  # fmt: skip
    binaries = {"ours": ublkd_binary()} | ({"baseline": baseline} if baseline else {})
    runs: dict[str, dict[str, list[float]]] = {}
    for delay in DELAYS_MS:
        with slow_http(site, work / f"http-{delay:g}", delay) as server:
            url = f"{server.url}/bundle/manifest.json"
            for _ in range(max(1, repeats)):
                for name, binary in binaries.items():
                    for depth in DEPTHS:
                        key = f"{delay:g}ms qd{depth}"
                        runs.setdefault(name, {}).setdefault(key, []).append(
                            _one(binary, url, work, depth)
                        )
    shutil.rmtree(work, ignore_errors=True)
    return {"chunks": CHUNKS, "chunk_size": CHUNK, "binaries": binaries, "runs": runs}


def latency_table(lt: dict[str, Any]) -> str:
    keys = [f"{d:g}ms qd{q}" for d in DELAYS_MS for q in DEPTHS]
    rows = [
        "| ublkd | " + " | ".join(f"{k} (IOPS)" for k in keys) + " | qd16/qd1 at 20 ms |",
        "|---|" + "---:|" * (len(keys) + 1),
    ]
    for name, per in lt["runs"].items():
        med = {k: statistics.median(v) for k, v in per.items()}
        ratio = med["20ms qd16"] / med["20ms qd1"]
        rows.append(
            f"| {name} | " + " | ".join(f"{med[k]:,.0f}" for k in keys) + f" | {ratio:.1f}x |"
        )
    return "\n".join(rows) + "\n"
