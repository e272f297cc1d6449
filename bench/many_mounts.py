"""Many mounts of one bundle (issue 10): cost of the k-th mount, page cache, pack reads.

    .venv/bin/python -m bench.many_mounts [--mounts 16] [--file-mb 256] [--json OUT]
                                          [--workdir DIR]          (as root; bench/many-mounts)

One run, side by side:
* for each ublkd mode (ro, ephemeral, rw): time and extra memory of the k-th concurrent
  mount (k = 1..N): wall time of `ublkd mount`, delta of MemTotal-MemAvailable, of Cached,
  and of the bundle server's RSS;
* page cache held after all N mounts of a mode read the same file (and after mount 1
  alone): delta of Cached minus what the pack files gained in the page cache (the server
  reads packs through the page cache; that copy is the same for every mode);
* bytes the server read from packs while mounts 2..N read the file after mount 1 had;
* the overlayfs way: `tar -x` of the same tarball (time to first mount includes it), N
  overlay mounts over the extracted tree (time per mount), the same page-cache reading.

System-wide memory counters are noisy on a shared machine; the ratios of one run are the
figures to compare. Everything mounted or attached is removed at the end, also on errors.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

from bench.mounts import ublkd_binary

BIG = "data/big.bin"


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0])  # KiB
    return out


def used_kib() -> int:
    m = meminfo()
    return m["MemTotal"] - m["MemAvailable"]


def cached_kib() -> int:
    return meminfo()["Cached"]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fincore_kib(paths: list[Path]) -> int:
    if not paths:
        return 0
    r = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
        capture_output=True,
        text=True,
        check=True,
    )
    return sum(int(x) for x in r.stdout.split()) // 1024


def file_cache_kib(paths: list[Path]) -> int:
    """Page cache held by these files, each distinct inode (st_dev, st_ino) counted once:
    bind mounts of one filesystem and overlay mounts over one lower file share an inode."""
    seen: dict[tuple[int, int], Path] = {}
    for p in paths:
        st = p.stat()
        seen.setdefault((st.st_dev, st.st_ino), p)
    return fincore_kib(list(seen.values()))


def evict(paths: list[Path]) -> None:
    """Drop the clean page-cache pages of these files (no global drop_caches)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass


def make_input(work: Path, file_mb: int) -> tuple[Path, Path]:
    """A tarball: one big random file plus a small tree; its bundle."""
    tarball = work / "rootfs.tar"
    if not tarball.exists():
        with tarfile.open(work / "rootfs.tar.tmp", "w") as tf:
            for d in ("etc", "data", "usr", "usr/bin"):
                ti = tarfile.TarInfo(d)
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(ti)
            for i in range(200):
                data = f"file {i}\n".encode() * 50
                ti = tarfile.TarInfo(f"usr/bin/f{i}")
                ti.size, ti.mode = len(data), 0o755
                tf.addfile(ti, io.BytesIO(data))
            ti = tarfile.TarInfo(BIG)
            ti.size, ti.mode = file_mb << 20, 0o644
            with open("/dev/urandom", "rb") as rnd:
                tf.addfile(ti, rnd)
        (work / "rootfs.tar.tmp").rename(tarball)
    spec = work / "spec.yaml"
    spec.write_text("version: 1\nname: many-mounts\nlayers:\n  - tar: {path: rootfs.tar}\n")
    bundle = work / "bundle"
    if not bundle.exists():
        subprocess.run(
            [
                str(Path(__file__).resolve().parent.parent / ".venv/bin/btrfs-ublk-image"),
                "build",
                str(spec),
                "-o",
                str(bundle),
            ],
            check=True,
            capture_output=True,
        )
    return tarball, bundle


class Ublkd:
    def __init__(self, run_dir: Path) -> None:
        self.exe = ublkd_binary()
        self.env = dict(os.environ, UBLKD_RUN_DIR=str(run_dir))

    def __call__(self, *args: str | Path) -> str:
        r = subprocess.run(
            [self.exe, *map(str, args)], capture_output=True, text=True, env=self.env, timeout=300
        )
        if r.returncode != 0:
            raise RuntimeError(f"ublkd {' '.join(map(str, args))}: {r.stderr}")
        return r.stdout

    def status(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = json.loads(self("status", "--json"))
        return out


def run_dirs_upper(u: Ublkd) -> list[Path]:
    return [Path(str(e["upper"])) for e in u.status() if e.get("upper")]


def bench_mode(
    u: Ublkd, bundle: Path, work: Path, mode: str, n: int, packs: list[Path]
) -> dict[str, Any]:
    mnts = [work / f"{mode}-{k:02d}" for k in range(1, n + 1)]
    for m in mnts:
        m.mkdir(exist_ok=True)
    per_mount = []
    mounted: list[Path] = []
    try:
        evict(packs)
        pid = 0
        for k, m in enumerate(mnts, 1):
            args: list[str | Path] = [
                "mount",
                bundle,
                m,
                "--frontend",
                "fuse",
                "--cache-mb",
                "1024",
            ]
            if mode == "ephemeral":
                args.append("--ephemeral")
            elif mode == "rw":
                args += ["--rw", work / f"{m.name}.rw", "--rw-size", "1G"]
            u0, c0, r0 = used_kib(), cached_kib(), rss_kib(pid) if pid else 0
            t = time.perf_counter()
            u(*args)
            dt = time.perf_counter() - t
            mounted.append(m)
            if not pid:
                pid = int(u.status()[0]["server_pid"])
            per_mount.append(
                {
                    "k": k,
                    "ms": round(dt * 1000, 1),
                    "used_kib": used_kib() - u0,
                    "cached_kib": cached_kib() - c0,
                    "server_rss_kib": rss_kib(pid) - r0,
                }
            )
        time.sleep(0.5)
        # mount 1 reads the file, then mounts 2..n
        c0, p0 = cached_kib(), fincore_kib(packs)
        read_all(mnts[0] / BIG)
        time.sleep(0.3)
        st = u.status()[0]
        one = (cached_kib() - c0) - (fincore_kib(packs) - p0)
        pack_before = int(st["pack_bytes_read"])
        for m in mnts[1:]:
            read_all(m / BIG)
        time.sleep(0.5)  # stats.json is rewritten every 200 ms
        st = u.status()[0]
        all_ = (cached_kib() - c0) - (fincore_kib(packs) - p0)
        files = [m / BIG for m in mnts]
        if mode == "ephemeral":
            # overlay files report a per-overlay st_dev, but their pages are the lower
            # file's (plus copied-up files in the uppers: none, the file is only read)
            files = [Path(str(st["shared"])) / BIG]
            files += [p for d in run_dirs_upper(u) if (p := d / BIG).exists()]
        return {
            "mode": mode,
            "mounts": per_mount,
            "file_cache_one_mib": round(file_cache_kib(files[:1]) / 1024, 1),
            "file_cache_all_mib": round(file_cache_kib(files) / 1024, 1),
            "cache_one_mib": round(one / 1024, 1),
            "cache_all_mib": round(all_ / 1024, 1),
            "cache_ratio": round(all_ / one, 2) if one > 0 else None,
            "pack_bytes_read_by_2_to_n": int(st["pack_bytes_read"]) - pack_before,
            "server_rss_mib": round(rss_kib(pid) / 1024, 1),
        }
    finally:
        for m in reversed(mounted):
            u("umount", m)
        for m in mnts:
            shutil.rmtree(m, ignore_errors=True)
            Path(work / f"{m.name}.rw").unlink(missing_ok=True)


def bench_overlayfs(tarball: Path, work: Path, n: int) -> dict[str, Any]:
    lower = work / "extracted"
    shutil.rmtree(lower, ignore_errors=True)
    lower.mkdir()
    t = time.perf_counter()
    subprocess.run(["tar", "-x", "-f", str(tarball), "-C", str(lower)], check=True)
    subprocess.run(["sync"], check=True)
    extract = time.perf_counter() - t
    evict([lower / BIG])
    mnts = []
    per_mount = []
    try:
        for k in range(1, n + 1):
            d = work / f"ovl-{k:02d}"
            for s in ("upper", "work", "m"):
                (d / s).mkdir(parents=True, exist_ok=True)
            u0 = used_kib()
            t = time.perf_counter()
            subprocess.run(
                [
                    "mount",
                    "-t",
                    "overlay",
                    "overlay",
                    "-o",
                    f"lowerdir={lower},upperdir={d / 'upper'},workdir={d / 'work'}",
                    str(d / "m"),
                ],
                check=True,
            )
            dt = time.perf_counter() - t
            mnts.append(d / "m")
            per_mount.append({"k": k, "ms": round(dt * 1000, 1), "used_kib": used_kib() - u0})
        c0 = cached_kib()
        read_all(mnts[0] / BIG)
        one = cached_kib() - c0
        for m in mnts[1:]:
            read_all(m / BIG)
        all_ = cached_kib() - c0
        files = [lower / BIG]  # overlay pages are the lower file's (nothing copied up)
        files += [
            p for k in range(1, n + 1) if (p := work / f"ovl-{k:02d}" / "upper" / BIG).exists()
        ]
        return {
            "mode": "overlayfs (tar -x + overlay)",
            "file_cache_one_mib": round(file_cache_kib(files[:1]) / 1024, 1),
            "file_cache_all_mib": round(file_cache_kib(files) / 1024, 1),
            "extract_s": round(extract, 2),
            "first_mount_incl_extract_ms": round(extract * 1000 + per_mount[0]["ms"], 1),
            "mounts": per_mount,
            "cache_one_mib": round(one / 1024, 1),
            "cache_all_mib": round(all_ / 1024, 1),
            "cache_ratio": round(all_ / one, 2) if one > 0 else None,
        }
    finally:
        for m in reversed(mnts):
            subprocess.run(["umount", str(m)], check=False)
        for k in range(1, n + 1):
            shutil.rmtree(work / f"ovl-{k:02d}", ignore_errors=True)
        shutil.rmtree(lower, ignore_errors=True)


def report(results: list[dict[str, Any]], n: int) -> str:
    lines = ["k-th concurrent mount: wall ms (extra MemTotal-MemAvailable MiB; server RSS +MiB)"]
    head = "k  " + "".join(f"{r['mode'].split()[0]:>26}" for r in results)
    lines.append(head)
    for k in range(n):
        row = f"{k + 1:<3}"
        for r in results:
            m = r["mounts"][k]
            rss = f"; +{m['server_rss_kib'] / 1024:.1f}" if "server_rss_kib" in m else ""
            row += f"{m['ms']:>10.1f} ms ({m['used_kib'] / 1024:+6.1f}{rss})".rjust(26)
        lines.append(row)
    lines.append("")
    lines.append(
        f"pages of the file in the page cache (fincore; distinct inodes) after 1 / all {n} mounts"
    )
    for r in results:
        lines.append(
            f"  {r['mode']:<28} {r['file_cache_one_mib']:>7} MiB / {r['file_cache_all_mib']:>8} MiB"
        )
    lines.append("")
    lines.append(
        f"Cached (meminfo, noisy) after mount 1 / all {n} mounts read the file; pack bytes read by 2..{n}"
    )
    for r in results:
        extra = ""
        if "pack_bytes_read_by_2_to_n" in r:
            extra = f", pack bytes read by mounts 2..{n}: {r['pack_bytes_read_by_2_to_n']}"
            extra += f", server RSS {r['server_rss_mib']} MiB"
        if "extract_s" in r:
            extra = f", tar -x {r['extract_s']} s, first mount incl. extraction {r['first_mount_incl_extract_ms']} ms"
        lines.append(
            f"  {r['mode']:<28} {r['cache_one_mib']:>8} MiB / {r['cache_all_mib']:>8} MiB = {r['cache_ratio']}x{extra}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mounts", type=int, default=16)
    ap.add_argument("--file-mb", type=int, default=256)
    ap.add_argument(
        "--workdir", type=Path, default=Path("/var/tmp/btrfs-ublk-image-bench/many-mounts")
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--modes", default="ro,ephemeral,rw,overlayfs")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        ap.error("run as root")
    a.workdir.mkdir(parents=True, exist_ok=True)
    tarball, bundle = make_input(a.workdir, a.file_mb)
    packs = sorted((bundle / "packs").iterdir())
    run_dir = Path(f"/run/ublkd-bench-{os.getpid()}")
    u = Ublkd(run_dir)
    results = []
    try:
        for mode in a.modes.split(","):
            print(f"many-mounts: {mode} x {a.mounts}", flush=True)
            if mode == "overlayfs":
                results.append(bench_overlayfs(tarball, a.workdir, a.mounts))
            else:
                results.append(bench_mode(u, bundle, a.workdir, mode, a.mounts, packs))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    text = report(results, a.mounts)
    print(text)
    if a.json:
        a.json.write_text(
            json.dumps({"mounts": a.mounts, "file_mb": a.file_mb, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
