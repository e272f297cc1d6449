"""Soak section (issue 22): tests/soak.py once, 2 minutes: 8 mounts of one remote bundle
behind tests/faultproxy.py (2% of range responses dropped mid-body, 2% stalled 1.5 s, 2%
with a flipped byte), a reader per mount checking every byte, the server killed with
SIGKILL 20 times at random moments (its supervisor restarts it): fuse on the host
(`soak`), ublk inside the VM harness (`soak_vm`; `python -m bench.soak` runs there)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from bench.measure import in_vm_json
from bench.mounts import ublkd_binary
from tests.soak import run_soak


def measure_soak(
    workdir: Path,
    seconds: float = 120,
    kills: int = 20,
    frontend: str = "fuse",
    run_dir: Path | None = None,
) -> dict[str, Any]:
    """`run_dir`: ublkd's state (default workdir/run); the overlay upper directories of the
    ephemeral mounts live there, and overlayfs refuses an upper dir on overlayfs (the VM
    guest's /tmp)."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    old = os.environ.get("UBLKD_RUN_DIR")
    os.environ["UBLKD_RUN_DIR"] = str(run_dir or workdir / "run")
    try:
        out = run_soak(
            ublkd_binary(),
            workdir,
            seconds=seconds,
            kills=kills,
            frontend=frontend,
            log=lambda _: None,
        )
    finally:
        if old is None:
            os.environ.pop("UBLKD_RUN_DIR", None)
        else:
            os.environ["UBLKD_RUN_DIR"] = old
    out.pop("status_text", None)
    return out


def measure_soak_vm() -> dict[str, Any]:
    """The same through ublk inside the VM harness (tests/vm): this module runs there."""
    return in_vm_json(["-m", "bench.soak", "--json", "/vmout/soak.json"], "soak.json", "soak")


def main() -> None:
    """Inside the VM: the soak through ublk, written as JSON."""
    ap = argparse.ArgumentParser(description="bench/soak.py inside the VM (ublk)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    doc = measure_soak(Path("/tmp/bench-soak"), frontend="ublk", run_dir=Path("/run/bench-soak"))
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


def soak_table(d: dict[str, Any]) -> str:
    f, s, r = d["proxy_faults"], d["status"], d["restarts"]
    lat, acr = d["latency_ms"], d["across_restart_ms"]
    rows = [
        ("frontend, mounts, seconds, SIGKILLs",
         f"{d.get('frontend', 'fuse')}, {d['mounts']}, {d['seconds']:.0f}, {d['kills']}"),
        ("reads (bytes)", f"{d['reads']:,} ({d['bytes_read'] / 2**20:,.0f} MiB)"),
        ("failed reads / wrong bytes / hung readers",
         f"{d['failed_reads']} / {d['wrong_bytes']} / {d['hung_readers']}"),
        ("read latency p50 / p99 / max (ms)", f"{lat['p50']:.0f} / {lat['p99']:.0f} / {lat['max']:.0f}"),
        (f"reads across a restart ({acr['reads']}): p50 / p99 / max (ms)",
         f"{acr['p50']:.0f} / {acr['p99']:.0f} / {acr['max']:.0f}"),
        ("restarts in status (cause; downtime last / max ms)",
         f"{r['count']} ({r['last_cause']}; {r['last_downtime_ms']} / {r['max_downtime_ms']})"),
        ("dropped responses: proxy / status fetch_errors", f"{f['drop']} / {s['fetch_errors']}"),
        ("corrupted responses: proxy / status verify_failures", f"{f['corrupt']} / {s['verify_failures']}"),
        ("stalled responses (1.5 s): proxy / status fetch latency max (ms)",
         f"{f['stall']} / {s['fetch_latency_us_max'] / 1000:.0f}"),
    ]  # fmt: skip
    lines = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
