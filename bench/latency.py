"""Latency section: cold random reads of a remote bundle behind injected latency (issue 21).

A bundle of one file in 64 KiB chunks is served by tests/slowhttp.py, which answers every
request DELAY ms late. Each run mounts it cold (empty chunk cache, readahead and prefetch
off) and reads 4 KiB with O_DIRECT at one offset in each chunk, from 1 thread (qd1) or 16
threads (qd16); IOPS = reads / wall time. On the host: the fuse frontend, 256 chunks,
0 and 20 ms. In the VM (ublk; `python -m bench.latency` runs there): 64 chunks, 0 and
200 ms (TCG makes every CPU step ~10x slower). `ours` is the ublkd this checkout built;
`baseline` another ublkd binary (`--baseline-ublkd`, e.g. one built from the previous
commit), measured in the same run, alternating.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench.measure import drop_caches, in_vm_json, remove
from bench.mounts import ublkd_binary
from tests.servers import slow_http

CHUNK = 64 << 10
READ = 4096
DEPTHS = (1, 16)
HOST = {"frontend": "fuse", "chunks": 256, "delays_ms": (0.0, 20.0)}
VM = {"frontend": "ublk", "chunks": 64, "delays_ms": (0.0, 200.0)}


def _read(path: Path, offsets: list[int]) -> None:
    buf = mmap.mmap(-1, READ)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for off in offsets:
            os.preadv(fd, [buf], off)
    finally:
        os.close(fd)
        buf.close()


def _one(ublkd: str, url: str, work: Path, depth: int, frontend: str, chunks: int) -> float:
    """IOPS of one cold run."""
    mnt, cache = work / "mnt", work / "cache"
    remove(cache)
    mnt.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, UBLKD_RUN_DIR=str(work / "run"))
    subprocess.run([ublkd, "mount", url, str(mnt), "--frontend", frontend, "--readahead", "0",
                    "--no-prefetch", "--cache-dir", str(cache)],
                   check=True, capture_output=True, env=env)  # fmt: skip
    try:
        drop_caches()
        offs = [i * CHUNK + (i * 7919 % (CHUNK // READ)) * READ for i in range(chunks)]
        parts = [offs[i::depth] for i in range(depth)]
        threads = [threading.Thread(target=_read, args=(mnt / "data", p)) for p in parts]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return chunks / (time.monotonic() - t0)
    finally:
        subprocess.run([ublkd, "umount", str(mnt)], check=True, capture_output=True, env=env)


def measure_latency(
    work: Path, repeats: int, baseline: str | None, where: dict[str, Any] = HOST
) -> dict[str, Any]:
    frontend, chunks, delays = where["frontend"], where["chunks"], where["delays_ms"]
    remove(work)
    (work / "tree").mkdir(parents=True)
    (work / "tree" / "data").write_bytes(os.urandom(CHUNK * chunks))
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
    for delay in delays:
        with slow_http(site, work / f"http-{delay:g}", delay) as server:
            url = f"{server.url}/bundle/manifest.json"
            for _ in range(max(1, repeats)):
                for name, binary in binaries.items():
                    for depth in DEPTHS:
                        key = f"{delay:g}ms qd{depth}"
                        runs.setdefault(name, {}).setdefault(key, []).append(
                            _one(binary, url, work, depth, frontend, chunks)
                        )
    shutil.rmtree(work, ignore_errors=True)
    return {"frontend": frontend, "chunks": chunks, "chunk_size": CHUNK, "delays_ms": delays,
            "binaries": binaries, "runs": runs}  # fmt: skip


def measure_latency_vm(work: Path, repeats: int, baseline: str | None) -> dict[str, Any]:
    """The same through ublk inside the VM harness (tests/vm): this module runs there."""
    argv = ["-m", "bench.latency", "--json", "/vmout/latency.json", "--repeat", str(repeats)]
    argv += ["--baseline-ublkd", baseline] if baseline else []
    return in_vm_json(argv, "latency.json", "latency run")


def main() -> None:
    """Inside the VM: the ublk measurement, written as JSON."""
    ap = argparse.ArgumentParser(description="bench/latency.py inside the VM (ublk)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline-ublkd")
    args = ap.parse_args()
    doc = measure_latency(Path("/tmp/bench-latency"), args.repeat, args.baseline_ublkd, VM)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()


def latency_table(lt: dict[str, Any]) -> str:
    delays = lt.get("delays_ms", HOST["delays_ms"])
    slow = f"{max(delays):g}ms"
    keys = [f"{d:g}ms qd{q}" for d in delays for q in DEPTHS]
    rows = [
        f"| ublkd ({lt.get('frontend', 'fuse')}) | "
        + " | ".join(f"{k} (IOPS)" for k in keys)
        + f" | qd16/qd1 at {slow} |",
        "|---|" + "---:|" * (len(keys) + 1),
    ]
    for name, per in lt["runs"].items():
        med = {k: statistics.median(v) for k, v in per.items()}
        ratio = med[f"{slow} qd16"] / med[f"{slow} qd1"]
        cells = " | ".join(f"{med[k]:,.1f}" if med[k] < 100 else f"{med[k]:,.0f}" for k in keys)
        rows.append(f"| {name} | {cells} | {ratio:.1f}x |")
    return "\n".join(rows) + "\n"
