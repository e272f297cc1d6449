"""FUSE passthrough (``--dev2-cache passthrough``) vs the page-cached FUSE file vs btrfs on a
local loop device: warm 4 KiB random reads (every job shape of the randread section), with
the CPU each I/O costs, and what a SIGKILL of the server does to reads. docs/benchmarks.md.

CPU per I/O is what can be attributed on a shared host: fio's own user + system time
(``getrusage`` of the child: the read path that runs in its threads, btrfs O_DIRECT
included), the server's (``/proc/PID/stat`` of the real server, the supervisor's child)
and the unbound kworkers' (every ``kworker/u*`` thread's utime + stime: the loop devices'
workers run there, as does any other unbound kernel work on the host at that moment).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench import inputs as inp
from bench.fio import MATRIX, FioJob, run_fio
from bench.measure import drop_caches, remove
from bench.mounts import Ublkd, btrfs_loop_mounted, read_direct
from bench.runtime import randread_schedule

INPUT = inp.InputParams(files=200, large_bytes=256 << 20, large_count=1, seed=7)
FILE = "large/blob-0.bin"
TARGETS = ("fuse_page", "fuse_passthrough", "btrfs_loop")
LABELS = {
    "fuse_page": "fuse, --dev2-cache page",
    "fuse_passthrough": "fuse, --dev2-cache passthrough",
    "btrfs_loop": "btrfs on a local loop device",
}
CLK_TCK = os.sysconf("SC_CLK_TCK")
KILL_AFTER_S = 1.5
CRASH_READ_S = 4.0


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _ticks(pid: int | str) -> int:
    """utime + stime of a task (``/proc/PID/stat`` or ``PID/task/TID``), 0 once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    f = text[text.rindex(")") + 2 :].split()
    return int(f[11]) + int(f[12])


def _kworker_ticks() -> int:
    """utime + stime of every unbound kworker thread (where loop devices' work runs)."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm = (d / "comm").read_text()
        except OSError:
            continue
        if comm.startswith("kworker/u"):
            total += _ticks(d.name)
    return total


def _server_pid(ublkd: Ublkd, mnt: Path) -> int:
    return int(ublkd.status(mnt)["restarts"]["server_pid"])


def _job(
    ublkd: Ublkd, mnt: Path, target: str, j: FioJob, runtime_s: float, log: Path
) -> dict[str, Any]:
    """One fio job on ``mnt`` (warm), with its CPU split and the reads that reached the server."""
    pid = _server_pid(ublkd, mnt) if target != "btrfs_loop" else None
    before = ublkd.settled_status(mnt) if pid else None
    child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    srv0, kw0 = (_ticks(pid) if pid else 0), _kworker_ticks()
    r = run_fio(j, mnt / FILE, runtime_s, log, ramp_s=0)
    srv1, kw1 = (_ticks(pid) if pid else 0), _kworker_ticks()
    child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    ios = r.iops * runtime_s
    res: dict[str, Any] = r.to_json()
    res["cpu_us_per_io"] = {
        "fio": round((child1.ru_utime + child1.ru_stime - child0.ru_utime - child0.ru_stime) / ios * 1e6, 2),
        "server": round((srv1 - srv0) / CLK_TCK / ios * 1e6, 2),
        "kworkers": round((kw1 - kw0) / CLK_TCK / ios * 1e6, 2),
    }  # fmt: skip
    if before is not None:
        res["server_reads"] = int(ublkd.settled_status(mnt)["reads"]) - int(before["reads"])
    return res


@contextlib.contextmanager
def _mounted(ublkd: Ublkd, bundle: Path, data_img: Path, mnt: Path, target: str) -> Iterator[Path]:
    if target == "btrfs_loop":
        with btrfs_loop_mounted(bundle / "meta.img", data_img, mnt) as m:
            yield m
        return
    with ublkd.mounted(bundle, mnt, "fuse", 512, dev2_cache=target.removeprefix("fuse_")) as m:
        yield m


def _reader(path: Path, stop: threading.Event, out: dict[str, Any]) -> None:
    """O_DIRECT 4 KiB reads at random offsets of ``path`` until ``stop``: latencies, errors."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 4096)
    blocks = os.fstat(fd).st_size // 4096
    lat: list[tuple[float, float]] = []
    errors = 0
    x = 0x9E3779B97F4A7C15
    try:
        while not stop.is_set():
            x = (x * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
            t0 = time.perf_counter()
            try:
                os.preadv(fd, [buf], (x >> 20) % blocks * 4096)
            except OSError:
                errors += 1
            lat.append((t0, time.perf_counter() - t0))
    finally:
        os.close(fd)
    out.update(lat=lat, errors=errors)


def _crash(ublkd: Ublkd, bundle: Path, mnt: Path, mode: str, victim: str) -> dict[str, Any]:
    """Cold O_DIRECT random reads of the file (caches dropped) while ``victim`` (the server,
    which the supervisor restarts, or the supervisor itself, which ends the FUSE connection)
    is killed with SIGKILL: reads done, failed, the slowest, those after the kill."""
    with ublkd.mounted(bundle, mnt, "fuse", 512, dev2_cache=mode) as m:
        st = ublkd.status(m)
        pid = int(st["restarts"]["server_pid"] if victim == "server" else st["server_pid"])
        drop_caches()
        stop, out = threading.Event(), {}  # type: ignore[var-annotated]
        t = threading.Thread(target=_reader, args=(m / FILE, stop, out))
        t.start()
        time.sleep(KILL_AFTER_S)
        killed_at = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        time.sleep(CRASH_READ_S - KILL_AFTER_S)
        stop.set()
        t.join()
        after = [d for t0, d in out["lat"] if t0 + d >= killed_at]
        res = {
            "reads": len(out["lat"]),
            "failed": out["errors"],
            "max_ms": round(max(d for _, d in out["lat"]) * 1000, 1),
            "after_kill": len(after),
            "after_kill_max_ms": round(max(after, default=0) * 1000, 1),
            "restarts": ublkd.status(m)["restarts"]["count"] if victim == "server" else None,
        }
    _log(f"  crash {mode} ({victim} killed): {res}")
    return res


def measure_passthrough(
    workdir: Path, runtime_s: float, jobs: Sequence[FioJob] = MATRIX
) -> dict[str, Any]:
    """Every job shape on each target in turn (:func:`randread_schedule`), each mounted afresh
    and its file read once before fio (warm: for passthrough that is the backing file's page
    cache, for page the FUSE file's); then the crash runs."""
    from tests.bundletools import materialize_data_device

    log = workdir / "bench.log"
    data = inp.ensure_inputs(workdir, INPUT, log=_log)
    work = workdir / "passthrough"
    remove(work)
    work.mkdir(parents=True)
    bundle, data_img, mnt = work / "bundle", work / "dev2.img", work / "m"
    subprocess.run([sys.executable, "-m", "btrfs_ublk_image", "build", str(data.spec), "-o",
                    str(bundle)], check=True, capture_output=True)  # fmt: skip
    materialize_data_device(bundle, data_img)
    ublkd = Ublkd(workdir / "ublkd-run")
    targets: dict[str, dict[str, Any]] = {}
    mount_ms: dict[str, list[float]] = {}
    try:
        for j, target in randread_schedule(jobs, TARGETS):
            try:
                t0 = time.perf_counter()
                with _mounted(ublkd, bundle, data_img, mnt, target) as m:
                    mount_ms.setdefault(target, []).append(round((time.perf_counter() - t0) * 1000))
                    read_direct(m / FILE)
                    res = _job(ublkd, m, target, j, runtime_s, log)
            except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
                res = {"error": str(e)[:300]}
            targets.setdefault(target, {})[j.name] = res
            _log(f"  {target} {j.name}: {res}")
        crash = {
            f"{mode}/{victim}": _crash(ublkd, bundle, mnt, mode, victim)
            for mode in ("page", "passthrough")
            for victim in ("server", "supervisor")
        }
    finally:
        remove(work)
    return {"file_bytes": INPUT.large_bytes, "runtime_s": runtime_s, "targets": targets,
            "mount_ms": mount_ms, "crash": crash, "kernel": os.uname().release}  # fmt: skip


def passthrough_table(d: dict[str, Any]) -> str:
    """IOPS and CPU µs per I/O (fio + server + kworkers) per job shape and target; the mount
    times; then the crash runs."""
    jobs = list(next(iter(d["targets"].values())))
    head = (
        "| fio job: IOPS; CPU µs per I/O: fio + kworkers (+ server) | "
        + " | ".join(LABELS[t] for t in TARGETS)
        + " |"
    )
    lines = [head, "|---" * (len(TARGETS) + 1) + "|"]
    for name in jobs:
        cells = []
        for t in TARGETS:
            r = d["targets"].get(t, {}).get(name, {})
            if "iops" not in r:
                cells.append(f"error: {r.get('error', 'not run')[:60]}")
                continue
            c = r["cpu_us_per_io"]
            srv = f" + {c['server']:.1f}" if t != "btrfs_loop" else ""
            reached = f"; {r['server_reads']:,} reached the server" if "server_reads" in r else ""
            cells.append(
                f"{r['iops']:,.0f} IOPS; {c['fio']:.1f} + {c['kworkers']:.1f}{srv} µs{reached}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    mounts = ", ".join(
        f"{LABELS[t]} {min(v):,.0f}-{max(v):,.0f} ms" for t, v in d["mount_ms"].items()
    )
    lines += [
        "",
        f"Mount, wall (kernel {d['kernel']}; passthrough writes device 2's copy): {mounts}.",
        "",
    ]
    lines += ["| SIGKILL of | reads in 4 s | failed | slowest (ms) | after the kill: reads, slowest (ms) |",
              "|---|---|---|---|---|"]  # fmt: skip
    for key, c in d["crash"].items():
        mode, victim = key.split("/")
        who = "the server (restarted)" if victim == "server" else "the supervisor (connection ends)"
        lines.append(f"| {mode}: {who} | {c['reads']:,} | {c['failed']:,} | {c['max_ms']} |"
                     f" {c['after_kill']:,}, {c['after_kill_max_ms']} |")  # fmt: skip
    return "\n".join(lines) + "\n"
