"""Misses of a remote bundle overlap (issue 21): with a fixed delay per HTTP request
(tests/slowhttp.py), 16 concurrent cold readers finish far sooner than one reader doing
the same reads, and a read of a cached chunk does not wait behind a miss.

The bundle holds one file of 64 chunks (64 KiB chunks); every read is 4 KiB, O_DIRECT,
in a different chunk: through the fuse frontend on the host with 50 ms per request,
through ublk inside the VM (tests/vm) with 400 ms (see DELAY_MS). Readahead and prefetch are off so
that one read is one fetch.
"""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from servers import SlowHttp, slow_http

CHUNK = 64 << 10
CHUNKS = 64
READ = 4096
IN_VM = os.environ.get("BUI_IN_VM") == "1"
# per request. In the VM 400 ms: under TCG each read's own CPU (kernel, ublkd, this
# test's threads, the Python HTTP server: ~23 ms) runs serially on the guest's one
# emulating host thread, so with 200 ms 16 readers reach 7.6-10x one reader depending on
# the host's load (bench/run --sections latency_vm reports the 200 ms figures); the bound
# is about waits overlapping, which 400 ms shows without the host's load deciding it. On
# the host 50 ms: with 20 ms, 16 readers reached 7.6x one reader in a clean-clone CI run
# beside two other builds (0.19 s, where 4 rounds of waits take 0.08 s); 13.5-14.7x at 50 ms.
DELAY_MS = float(os.environ.get("BUI_LATENCY_MS", "400" if IN_VM else "50"))
# a timed run again (fresh chunks, a fresh cold mount) up to this many times before the
# bound fails: under TCG the guest's CPU, and so a run's non-waiting part, varies with the
# host's load (16 readers 7.5x one reader at 400 ms, a cached read 5.47 ms once, in a
# clean-clone CI run that passed both before); serialised misses fail every attempt (~1x
# and ~DELAY_MS)
ATTEMPTS = 3
# the bounds (issue 21): 16 cold readers at least this many times faster than one, and a
# read of a cached chunk while a miss is in flight within this many seconds
OVERLAP = 8
CACHED_READ_S = 0.005
# fuse on the host (root), ublk inside the VM (tests/test_vm.py runs `-m vm` there)
FRONTENDS = [
    pytest.param("fuse", marks=pytest.mark.root),
    pytest.param("ublk", marks=pytest.mark.vm),
]


@dataclass
class Remote:
    url: str
    server: SlowHttp
    work: Path


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    work = tmp_path_factory.mktemp("latency")
    site = work / "site"
    (work / "tree").mkdir()
    (work / "tree" / "data").write_bytes(os.urandom(CHUNK * CHUNKS))
    (work / "spec.yaml").write_text(
        f"version: 1\nname: latency\npack_chunk_size: {CHUNK}\nlayers:\n"
        f"  - dir: {{path: {work / 'tree'}}}\n"
    )
    site.mkdir()
    subprocess.run(["btrfs-ublk-image", "build", str(work / "spec.yaml"), "-o",
                    str(site / "bundle")], check=True, capture_output=True)  # fmt: skip
    with slow_http(site, work / "http", DELAY_MS) as server:
        yield Remote(f"{server.url}/bundle/manifest.json", server, work)


@pytest.fixture
def mounted(remote: Remote, frontend: str, tmp_path: Path) -> Iterator[Path]:
    """A cold mount (empty chunk cache) of the remote bundle."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cache = tmp_path / "cache"
    subprocess.run(
        ["ublkd", "mount", remote.url, str(mnt), "--frontend", frontend, "--readahead", "0",
         "--no-prefetch", "--cache-dir", str(cache)],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        yield mnt / "data"
    finally:
        subprocess.run(["ublkd", "umount", str(mnt)], check=True, capture_output=True)
        shutil.rmtree(cache, ignore_errors=True)


def read_direct(path: Path, offsets: list[int], latencies: list[float] | None = None) -> None:
    buf = mmap.mmap(-1, READ)  # page-aligned, as O_DIRECT wants
    buf.write(bytes(READ))  # faulted in now, not inside the first timed read
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for off in offsets:
            t0 = time.monotonic()
            assert os.preadv(fd, [buf], off) == READ
            if latencies is not None:
                latencies.append(time.monotonic() - t0)
    finally:
        os.close(fd)
        buf.close()


def offsets() -> list[int]:
    """One 4 KiB read in the middle of each chunk of the file."""
    return [i * CHUNK + CHUNK // 2 for i in range(CHUNKS)]


def timed_readers(path: Path, readers: int) -> float:
    offs = offsets()
    parts = [offs[i::readers] for i in range(readers)]
    threads = [threading.Thread(target=read_direct, args=(path, p)) for p in parts]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_sixteen_readers_overlap(remote: Remote, frontend: str, tmp_path: Path) -> None:
    def cold(readers: int, attempt: int = 0) -> float:
        mnt = tmp_path / f"mnt{readers}-{attempt}"
        mnt.mkdir()
        cache = tmp_path / f"cache{readers}-{attempt}"
        subprocess.run(
            ["ublkd", "mount", remote.url, str(mnt), "--frontend", frontend,
             "--readahead", "0", "--no-prefetch", "--cache-dir", str(cache)],
            check=True, capture_output=True,
        )  # fmt: skip
        try:
            return timed_readers(mnt / "data", readers)
        finally:
            subprocess.run(["ublkd", "umount", str(mnt)], check=True, capture_output=True)

    one = cold(1)
    sixteen = cold(16)
    for attempt in range(1, ATTEMPTS):
        if one / sixteen >= OVERLAP:
            break
        sixteen = min(sixteen, cold(16, attempt))
    assert one >= CHUNKS * DELAY_MS / 1000  # one fetch at a time, each DELAY_MS late
    print(f"1 reader {one:.2f} s, 16 readers {sixteen:.2f} s: {one / sixteen:.1f}x")
    assert one / sixteen >= OVERLAP, f"1 reader {one:.2f} s, 16 readers {sixteen:.2f} s"


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_cached_read_does_not_wait_behind_a_miss(mounted: Path, frontend: str) -> None:
    offs = offsets()
    read_direct(mounted, offs[:1])  # chunk 0 is cached now
    for attempt in range(ATTEMPTS):
        # a miss in flight (DELAY_MS late, a chunk not read before), then reads of the
        # cached chunk
        miss = threading.Thread(target=read_direct, args=(mounted, [offs[1 + attempt]]))
        miss.start()
        # until the miss waits in preadv (GIL released: its Python start-up would otherwise
        # hold the GIL across a timed read, under TCG for milliseconds); a quarter of its delay
        time.sleep(DELAY_MS / 4000)
        latencies: list[float] = []
        read_direct(mounted, offs[:1] * 5, latencies)
        miss.join()
        if max(latencies) < CACHED_READ_S:
            break
    assert max(latencies) < CACHED_READ_S, latencies
