"""Running one command and measuring it: wall time, peak RSS, output size."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Sample:
    """One run of one command.

    ``maxrss_kib`` is the largest resident set of the command or of any descendant it
    waited for (the peak of the biggest process of the tree, not a sum), from GNU
    time's ``%M`` or else ``wait4``'s rusage. ``sync_s`` is the untimed ``sync`` that follows the command
    (writeback of what it left dirty), recorded so it is visible, not added.
    """

    wall_s: float
    maxrss_kib: int
    returncode: int
    sync_s: float = 0.0
    cpu_s: float = 0.0  # user + system CPU of the command and its descendants (rusage)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


GNU_TIME = "/usr/bin/time"


def run_measured(cmd: Sequence[str], log: Path, stdin: Path | None = None) -> Sample:
    """Run ``cmd`` (stdin from a file if given; stdout+stderr appended to ``log``), then ``sync``.

    The peak RSS comes from GNU time (``%M``) when installed: a child of this Python
    process would otherwise count the parent's resident set it had before ``exec``.
    The ``sync`` is not part of the wall time: it is recorded separately.
    """
    rss_file = None
    full = list(cmd)
    if os.access(GNU_TIME, os.X_OK):
        fd, name = tempfile.mkstemp(prefix="bench-rss-")
        os.close(fd)
        rss_file = Path(name)
        full = [GNU_TIME, "-f", "%M", "-o", name, *full]
    try:
        with open(log, "ab") as out, open(stdin or os.devnull, "rb") as inp:
            out.write(f"$ {' '.join(cmd)}{' < ' + str(stdin) if stdin else ''}\n".encode())
            out.flush()
            t0 = time.perf_counter()
            proc = subprocess.Popen(full, stdin=inp, stdout=out, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        maxrss = int(usage.ru_maxrss)
        if rss_file is not None:
            lines = rss_file.read_text().split()
            if lines and lines[-1].isdigit():
                maxrss = int(lines[-1])
    finally:
        if rss_file is not None:
            rss_file.unlink(missing_ok=True)
    t1 = time.perf_counter()
    os.sync()
    cpu = usage.ru_utime + usage.ru_stime
    return Sample(wall, maxrss, proc.returncode, time.perf_counter() - t1, cpu)


def in_vm_json(module_argv: Sequence[str], out: str, what: str) -> dict[str, Any]:
    """Run `python MODULE_ARGV` inside the VM harness (tests/vm), where it writes the JSON
    file /vmout/OUT; -> that JSON. `what` names the run in the error."""
    import json

    from tests.vm import harness

    script = f"{harness.guest_python()} {' '.join(module_argv)}\n"
    res = harness.run_in_vm(
        harness.SCRIPT_BODY.format(script="/vmout/script.sh"),
        files={"script.sh": script.encode()},
        timeout=float(os.environ.get("BUI_VM_TIMEOUT", 1800)),
    )
    path = res.share / out
    if res.rc != 0 or not path.exists():
        raise RuntimeError(f"VM {what} failed (rc {res.rc}): {res.read('pytest.log')[-800:]}")
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def drop_caches() -> bool:
    """sync + drop the page cache, dentries and inodes; False when not permitted (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def tree_size(path: Path) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of a file or of every file under a directory."""
    if path.is_file():
        st = path.stat()
        return st.st_size, st.st_blocks * 512
    apparent = allocated = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return apparent, allocated


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@dataclass
class Result:
    """All samples of one tool (or one pipeline of steps) plus its output size."""

    name: str
    label: str
    cmd: list[str]
    samples: list[Sample] = field(default_factory=list)
    output_bytes: int | None = None
    output_alloc_bytes: int | None = None
    steps: list[str] = field(default_factory=list)  # for a pipeline: the step results' names
    error: str | None = None
    note: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.samples)

    @property
    def walls(self) -> list[float]:
        return [s.wall_s for s in self.samples]

    @property
    def wall_min(self) -> float:
        return min(self.walls)

    @property
    def wall_median(self) -> float:
        return statistics.median(self.walls)

    @property
    def synced_median(self) -> float:
        """Median of wall + the untimed sync after it: the time until the output is on disk."""
        return statistics.median(s.wall_s + s.sync_s for s in self.samples)

    @property
    def peak_rss_kib(self) -> int:
        return max(s.maxrss_kib for s in self.samples)

    @classmethod
    def from_json(cls, name: str, d: dict[str, Any]) -> Result:
        """The inverse of ``to_json`` (derived figures are recomputed, not read)."""
        return cls(
            name,
            d["label"],
            list(d["cmd"]),
            [Sample(**s) for s in d["samples"]],
            d.get("output_bytes"),
            d.get("output_alloc_bytes"),
            list(d.get("steps", [])),
            d.get("error"),
            d.get("note"),
        )

    def to_json(self, content_bytes: int, entries: int) -> dict[str, Any]:
        d: dict[str, Any] = {
            "label": self.label,
            "cmd": self.cmd,
            "steps": self.steps,
            "samples": [s.to_json() for s in self.samples],
            "output_bytes": self.output_bytes,
            "output_alloc_bytes": self.output_alloc_bytes,
            "error": self.error,
            "note": self.note,
        }
        if self.ok:
            med = self.wall_median
            d.update(
                wall_min_s=self.wall_min,
                wall_median_s=med,
                wall_plus_sync_median_s=self.synced_median,
                mb_per_s=content_bytes / 1e6 / med,
                files_per_s=entries / med,
                peak_rss_kib=self.peak_rss_kib,
                rss_bytes_per_file=self.peak_rss_kib * 1024 / max(1, entries),
            )
        return d


def pipeline(name: str, label: str, parts: Sequence[Result]) -> Result:
    """The sum of several steps run one after another in the same repeat."""
    res = Result(name, label, [], steps=[p.name for p in parts])
    bad = [p for p in parts if not p.ok]
    if bad:
        res.error = f"step {bad[0].name} failed"
        return res
    n = min(len(p.samples) for p in parts)
    for i in range(n):
        ss = [p.samples[i] for p in parts]
        res.samples.append(
            Sample(
                sum(s.wall_s for s in ss),
                max(s.maxrss_kib for s in ss),
                max((s.returncode for s in ss), key=abs),
                sum(s.sync_s for s in ss),
            )
        )
    res.output_bytes = parts[-1].output_bytes
    res.output_alloc_bytes = parts[-1].output_alloc_bytes
    return res
