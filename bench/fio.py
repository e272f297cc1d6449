"""fio 4 KiB random reads: the job matrix, the command line and parsing fio's JSON output."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FioJob:
    """One point of the matrix: engine, queue depth, number of jobs (threads)."""

    engine: str  # io_uring | psync
    iodepth: int
    numjobs: int

    @property
    def name(self) -> str:
        qd = f"-qd{self.iodepth}" if self.engine != "psync" else ""
        return f"{self.engine}{qd}-j{self.numjobs}"

    @property
    def label(self) -> str:
        qd = f" qd {self.iodepth}" if self.engine != "psync" else ""
        return f"{self.engine}{qd}, {self.numjobs} job{'s' if self.numjobs > 1 else ''}"


MATRIX: tuple[FioJob, ...] = tuple(
    FioJob(engine, qd, jobs)
    for engine, qd in (("io_uring", 1), ("io_uring", 16), ("psync", 1))
    for jobs in (1, 2)
)


def fio_args(job: FioJob, path: str, runtime_s: float, ramp_s: float = 1.0) -> list[str]:
    """fio arguments (without the ``fio`` itself): 4 KiB O_DIRECT random reads of ``path``."""
    return [
        "--name=randread",
        f"--filename={path}",
        "--readonly",
        "--rw=randread",
        "--bs=4k",
        "--direct=1",
        f"--ioengine={job.engine}",
        f"--iodepth={job.iodepth}",
        f"--numjobs={job.numjobs}",
        "--thread",
        "--group_reporting",
        "--time_based",
        f"--runtime={runtime_s:g}",
        f"--ramp_time={ramp_s:g}",
        "--randrepeat=0",
        "--norandommap",
        "--invalidate=0",
        "--output-format=json",
    ]


@dataclass
class FioResult:
    iops: float
    mib_s: float
    lat_p50_us: float | None
    lat_p99_us: float | None
    errors: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_fio_json(text: str) -> FioResult:
    """The read side of fio's ``--output-format=json`` (one group-reported job).

    fio may print warnings before the JSON object; everything before the first ``{`` at
    the start of a line is skipped.
    """
    start = 0 if text.startswith("{") else text.find("\n{") + 1
    if start == 0 and not text.startswith("{"):
        raise ValueError("no JSON object in fio output")
    doc = json.loads(text[start:])
    jobs = doc.get("jobs") or []
    if not jobs:
        raise ValueError("fio output has no jobs")
    rd = jobs[0]["read"]
    pct = (rd.get("clat_ns") or {}).get("percentile") or {}

    def us(key: str) -> float | None:
        v = pct.get(key)
        return None if v is None else float(v) / 1000.0

    return FioResult(
        iops=float(rd["iops"]),
        mib_s=float(rd["bw_bytes"]) / 2**20,
        lat_p50_us=us("50.000000"),
        lat_p99_us=us("99.000000"),
        errors=int(jobs[0].get("error", 0)),
    )


def run_fio(job: FioJob, path: Path, runtime_s: float, log: Path, ramp_s: float = 1.0) -> FioResult:
    cmd = ["fio", *fio_args(job, str(path), runtime_s, ramp_s)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=runtime_s + 120)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{p.stderr}")
    if p.returncode != 0:
        raise RuntimeError(f"fio exited {p.returncode}: {p.stderr.strip()[-400:]}")
    return parse_fio_json(p.stdout)


def matrix_from_names(names: Sequence[str]) -> list[FioJob]:
    by = {j.name: j for j in MATRIX}
    return [by[n] for n in names]
