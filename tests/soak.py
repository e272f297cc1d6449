"""The soak of issue 22: a remote bundle behind a fault-injecting proxy
(tests/faultproxy.py: dropped connections, stalls, corrupted bytes), mounted 8 times
(read-only, ephemeral, --rw), one reader per mount checking every byte it reads against
the source, while the bundle's server is killed with SIGKILL at random moments (its
supervisor starts a new one). Used by tests/test_soak.py (slow) and `bench/run --sections
soak`; `run_soak` returns what was counted.

Readers use O_DIRECT (every read reaches the server: the remote default
`--dev2-cache direct`), random 4 KiB-aligned ranges of 4-256 KiB in files of random bytes;
the chunk caches are kept small (`--cache-mb`, `--cache-size`) so that reads keep going to
the network, through the proxy, for the whole run.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from btrfs_ublk_image.cli import main as cli

from tests.servers import fault_proxy, slow_http

CHUNK = 256 << 10
MODES = ("ro", "ro", "ro", "ephemeral", "ephemeral", "rw", "rw", "rw")


@dataclass
class Reads:
    """What the readers saw: (start, seconds) per read, failures, wrong bytes."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    times: list[tuple[float, float]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    wrong_bytes: int = 0
    bytes: int = 0


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def _reader(
    path_files: list[tuple[Path, bytes]], seed: int, stop: threading.Event, out: Reads
) -> None:
    rnd = random.Random(seed)
    buf = mmap.mmap(-1, 256 << 10)
    try:
        while not stop.is_set():
            path, want = path_files[rnd.randrange(len(path_files))]
            off = rnd.randrange(len(want) // 4096) * 4096
            n = rnd.randrange(1, 65) * 4096
            view = memoryview(buf)[:n]
            t0 = time.monotonic()
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                try:
                    got = os.preadv(fd, [view], off)
                finally:
                    os.close(fd)
            except OSError as e:
                with out.lock:
                    out.failed.append(f"{path} [{off}, +{n}): {e}")
                continue
            dt = time.monotonic() - t0
            exp = want[off : off + n]
            wrong = abs(got - len(exp))
            if got and view[: min(got, len(exp))] != exp[: min(got, len(exp))]:
                a, b = bytes(view[: min(got, len(exp))]), exp[: min(got, len(exp))]
                wrong += sum(1 for x, y in zip(a, b, strict=True) if x != y)
            with out.lock:
                out.times.append((t0, dt))
                out.wrong_bytes += wrong
                out.bytes += got
            view.release()
    finally:
        buf.close()


def build_site(
    work: Path, seed: int, files: int = 24, size: int = 2 << 20
) -> tuple[Path, dict[str, bytes]]:
    """A bundle of `files` files of random bytes (256 KiB chunks) under work/site/bundle."""
    rnd = random.Random(seed)
    tree = work / "tree"
    tree.mkdir(parents=True)
    content = {}
    for i in range(files):
        data = rnd.randbytes(size + 4096 * rnd.randrange(64))
        (tree / f"f{i:02}.bin").write_bytes(data)
        content[f"f{i:02}.bin"] = data
    spec = work / "spec.yaml"
    spec.write_text(
        f"version: 1\nname: soak\npack_chunk_size: {CHUNK}\nlayers:\n  - dir: {{path: {tree}}}\n"
    )
    site = work / "site"
    site.mkdir()
    assert cli(["build", str(spec), "-o", str(site / "bundle")]) == 0
    return site, content


def run_soak(
    ublkd: str,
    work: Path,
    *,
    seconds: float = 120,
    kills: int = 20,
    seed: int | None = None,
    drop: float = 0.02,
    stall: float = 0.02,
    stall_ms: float = 1500,
    corrupt: float = 0.02,
    frontend: str = "fuse",
    log: Any = print,
) -> dict[str, Any]:
    """Run the soak in `work` (UBLKD_RUN_DIR must be set by the caller); -> the counts."""
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    rnd = random.Random(seed)
    site, content = build_site(work, seed)

    def ublkd_(*a: str | Path, timeout: float = 120) -> str:
        r = subprocess.run([ublkd, *map(str, a)], capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise AssertionError(f"ublkd {' '.join(map(str, a))}: {r.stderr}")
        return r.stdout

    mounts: list[Path] = []
    with (
        slow_http(site, work / "http", 2) as web,
        fault_proxy(web.url, work / "proxy", drop=drop, stall=stall, stall_ms=stall_ms,
                    corrupt=corrupt, seed=seed) as proxy,
    ):  # fmt: skip
        url = f"{proxy.url}/bundle/manifest.json"
        try:
            for i, mode in enumerate(MODES):
                mnt = work / f"mnt{i}"
                mnt.mkdir()
                extra: list[str | Path] = []
                if mode == "ephemeral":
                    extra = ["--ephemeral"]
                elif mode == "rw":
                    extra = ["--rw", work / f"rw{i}.img", "--rw-size", "1G"]
                ublkd_("mount", url, mnt, "--frontend", frontend, "--cache-mb", "4", "--cache-size", "4M",
                       "--readahead", "0", "--no-prefetch", "--cache-dir", work / "cache", *extra)  # fmt: skip
                mounts.append(mnt)
            st = json.loads(ublkd_("status", "--json"))
            restarts_file = (
                Path(os.environ["UBLKD_RUN_DIR"])
                / "bundles"
                / st[0]["bundle_key"]
                / "restarts.json"
            )
            reads = Reads()
            stop = threading.Event()
            readers = [
                threading.Thread(
                    target=_reader,
                    args=([(m / n, c) for n, c in content.items()], seed + i, stop, reads),
                    daemon=True,
                )
                for i, m in enumerate(mounts)
            ]
            t0 = time.monotonic()
            for t in readers:
                t.start()
            plan = sorted(rnd.uniform(1, seconds - 2) for _ in range(kills))
            killed: list[float] = []
            for at in plan:
                time.sleep(max(0.0, t0 + at - time.monotonic()))
                before = json.loads(restarts_file.read_text())
                os.kill(before["server_pid"], signal.SIGKILL)
                killed.append(time.monotonic())
                # the next kill must meet the new server
                deadline = time.monotonic() + 60
                while json.loads(restarts_file.read_text())["count"] == before["count"]:
                    assert time.monotonic() < deadline, "no new server within 60 s"
                    time.sleep(0.01)
            time.sleep(max(0.0, t0 + seconds - time.monotonic()))
            stop.set()
            for t in readers:
                t.join(120)
            hung = sum(t.is_alive() for t in readers)
            status = json.loads(ublkd_("status", "--json"))[0]
            text = ublkd_("status")
        finally:
            for m in reversed(mounts):
                subprocess.run([ublkd, "umount", str(m)], capture_output=True, timeout=120)
        faults = proxy.counts()
    lat = [d for _, d in reads.times]
    # reads in flight when a server was killed, or started within 1 s after it
    across = [d for s, d in reads.times if any(s <= k < s + d or k <= s < k + 1 for k in killed)]
    out = {
        "seed": seed,
        "frontend": frontend,
        "seconds": seconds,
        "mounts": len(mounts),
        "kills": len(killed),
        "reads": len(lat),
        "bytes_read": reads.bytes,
        "failed_reads": len(reads.failed),
        "failed_examples": reads.failed[:5],
        "wrong_bytes": reads.wrong_bytes,
        "hung_readers": hung,
        "latency_ms": {
            "p50": _pct(lat, 50) * 1e3,
            "p99": _pct(lat, 99) * 1e3,
            "max": max(lat, default=0) * 1e3,
        },
        "across_restart_ms": {
            "reads": len(across),
            "p50": _pct(across, 50) * 1e3,
            "p99": _pct(across, 99) * 1e3,
            "max": max(across, default=0) * 1e3,
        },
        "restarts": status["restarts"],
        "proxy_faults": faults,
        "status": {
            k: status[k]
            for k in (
                "fetch_errors",
                "verify_failures",
                "fetch_latency_us_max",
                "fetch_requests",
                "read_errors",
            )
        },  # fmt: skip
        "status_text": text,
    }
    log(json.dumps({k: v for k, v in out.items() if k != "status_text"}, indent=1))
    return out
