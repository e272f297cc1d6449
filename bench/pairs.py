"""Alternating pairs of whole builds: this checkout's command against another checkout's
(each in its own venv), warm page cache, ``rm -rf OUT; sync; sleep 1`` before each run
(``--cold``: the page cache dropped after that, ``echo 3 > /proc/sys/vm/drop_caches``; root).

    .venv/bin/python -m bench.pairs SPEC --baseline DIR [--pairs 10] [--cold] [--json OUT.json]

Each run is ``DIR/.venv/bin/btrfs-ublk-image build SPEC -o OUT`` in a child process, or,
for a DIR without a venv (``git archive COMMIT btrfs_ublk_image | tar -x -C DIR`` plus that
commit's ``btrfs_ublk_native`` package, as ``bench/run --baseline-builder`` takes),
``python -P -m btrfs_ublk_image build ...`` with this venv's Python and ``PYTHONPATH=DIR``;
both sides' modules are compiled first (``PYTHONDONTWRITEBYTECODE`` would otherwise make
every run compile them). Its wall time, user and sys CPU and peak RSS come from ``os.wait4``;
the bytes the output's disk read and wrote meanwhile from ``/proc/diskstats`` (a cold
synthetic build reads its ~2.8 GB input and writes its ~2.6 GB bundle: more is another
process's I/O on the same disk, which makes that sample slower). The side that runs first
alternates from pair to pair, after one untimed build (``--warmup``); the 1-minute load
average is read after each pair. Both sides must print the same image id (same bytes out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def build_command(checkout: Path, spec: Path, out: Path) -> tuple[list[str], dict[str, str]]:
    """The command that builds ``spec`` with ``checkout``'s code, and its environment."""
    env = dict(os.environ)
    script = checkout / ".venv/bin/btrfs-ublk-image"
    if script.exists():
        return [str(script), "build", str(spec), "-o", str(out)], env
    env["PYTHONPATH"] = str(checkout)
    # -P: the working directory first on sys.path would import this checkout's package
    return [sys.executable, "-P", "-m", "btrfs_ublk_image", "build", str(spec), "-o", str(out)], env


def disk_bytes(diskstats: str, dev: int) -> tuple[int, int] | None:
    """Bytes read and written so far by the block device ``dev`` (``st_dev``), from the text
    of ``/proc/diskstats`` (sectors of 512 bytes); None when it is not listed (tmpfs, ...)."""
    for line in diskstats.splitlines():
        f = line.split()
        if len(f) >= 10 and (int(f[0]), int(f[1])) == (os.major(dev), os.minor(dev)):
            return int(f[5]) * 512, int(f[9]) * 512
    return None


def _disk_now(dev: int) -> tuple[int, int] | None:
    try:
        return disk_bytes(Path("/proc/diskstats").read_text(), dev)
    except OSError:
        return None


def run_build(checkout: Path, spec: Path, out: Path, cold: bool = False) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    time.sleep(1)
    if cold:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    cmd, env = build_command(checkout, spec, out)
    dev = os.stat(out.parent).st_dev
    disk0 = _disk_now(dev)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    disk1 = _disk_now(dev)
    assert proc.stdout is not None and proc.stderr is not None
    stdout, stderr = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}\n{stderr}")
    sample: dict[str, Any] = {
        "wall_s": round(wall, 4),
        "user_s": round(ru.ru_utime, 3),
        "sys_s": round(ru.ru_stime, 3),
        "maxrss_kib": ru.ru_maxrss,
        "image_id": stdout.split(": ")[1],
    }
    if disk0 is not None and disk1 is not None:
        sample["disk_read_mb"] = round((disk1[0] - disk0[0]) / 1e6)
        sample["disk_write_mb"] = round((disk1[1] - disk0[1]) / 1e6)
    return sample


def _brief(sample: dict[str, Any]) -> str:
    disk = ""
    if "disk_read_mb" in sample:
        disk = f" (disk: {sample['disk_read_mb']} MB read, {sample['disk_write_mb']} MB written)"
    return f"{sample['wall_s']:.3f} s{disk}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--baseline", type=Path, required=True, help="the other checkout")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1, help="untimed builds first (baseline)")
    ap.add_argument("--out", type=Path, default=Path("/var/tmp/bench-pairs.bundle"))
    ap.add_argument("--json", type=Path, help="write the samples here")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run")
    args = ap.parse_args()
    sides = {"ours": ROOT, "base": args.baseline.resolve()}
    for checkout in sides.values():
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", str(checkout / "btrfs_ublk_image")],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    pairs: list[dict[str, Any]] = []
    try:
        for _ in range(args.warmup):  # the first build after other work runs slow: not a pair's
            run_build(sides["base"], args.spec, args.out)
        for i in range(args.pairs):
            order = ["ours", "base"] if i % 2 == 0 else ["base", "ours"]
            pair: dict[str, Any] = {"first": order[0]}
            for side in order:
                pair[side] = run_build(sides[side], args.spec, args.out, args.cold)
            pair["load_1min_after"] = os.getloadavg()[0]
            if pair["ours"]["image_id"] != pair["base"]["image_id"]:
                raise SystemExit(f"image ids differ: {pair}")
            pairs.append(pair)
            print(
                f"pair {i + 1}: ours {_brief(pair['ours'])}, base {_brief(pair['base'])},"
                f" load {pair['load_1min_after']:.2f}",
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(args.out, ignore_errors=True)
    summary: dict[str, Any] = {
        side: {
            k: statistics.median(p[side][k] for p in pairs)
            for k in ("wall_s", "user_s", "sys_s", "maxrss_kib")
        }
        for side in sides
    }
    summary["ours_faster_in"] = sum(p["ours"]["wall_s"] < p["base"]["wall_s"] for p in pairs)
    summary["load_1min"] = [
        min(p["load_1min_after"] for p in pairs),
        max(p["load_1min_after"] for p in pairs),
    ]
    doc = {
        "spec": str(args.spec),
        "baseline": str(sides["base"]),
        "page_cache": "cold" if args.cold else "warm",
        "pairs": pairs,
        "medians": summary,
    }
    print(json.dumps(summary, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
