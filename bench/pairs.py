"""Alternating pairs of whole builds: this checkout's command against another checkout's
(each in its own venv), warm page cache, ``rm -rf OUT; sync; sleep 1`` before each run
(``--cold``: the page cache dropped after that, ``echo 3 > /proc/sys/vm/drop_caches``; root).

    .venv/bin/python -m bench.pairs SPEC --baseline DIR [--pairs 10] [--cold] [--json OUT.json]

Each run is ``DIR/.venv/bin/btrfs-ublk-image build SPEC -o OUT`` in a child process, or,
for a DIR without a venv (``git archive COMMIT btrfs_ublk_image | tar -x -C DIR`` plus that
commit's ``btrfs_ublk_native`` package, as ``bench/run --baseline-builder`` takes),
``python -P -m btrfs_ublk_image build ...`` with this venv's Python and ``PYTHONPATH=DIR``;
both sides' modules are compiled first (``PYTHONDONTWRITEBYTECODE`` would otherwise make
every run compile them). Its wall time, user and sys CPU and peak RSS come from ``os.wait4``. The side that runs first
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


def run_build(checkout: Path, spec: Path, out: Path, cold: bool = False) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    time.sleep(1)
    if cold:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    cmd, env = build_command(checkout, spec, out)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    assert proc.stdout is not None and proc.stderr is not None
    stdout, stderr = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}\n{stderr}")
    return {
        "wall_s": round(wall, 4),
        "user_s": round(ru.ru_utime, 3),
        "sys_s": round(ru.ru_stime, 3),
        "maxrss_kib": ru.ru_maxrss,
        "image_id": stdout.split(": ")[1],
    }


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
                f"pair {i + 1}: ours {pair['ours']['wall_s']:.3f} s,"
                f" base {pair['base']['wall_s']:.3f} s, load {pair['load_1min_after']:.2f}",
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
