"""Machine description, the results table (Markdown, also printed on stdout), docs update."""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.measure import Result

DOC_BEGIN = "<!-- bench:{section}:begin -->"
DOC_END = "<!-- bench:{section}:end -->"


def _first_line(cmd: Sequence[str]) -> str | None:
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (p.stdout or p.stderr).strip().splitlines()
    return lines[0].strip() if lines else None


def machine_info() -> dict[str, Any]:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = None
    try:
        m = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
        mem_kib = int(m.group(1)) if m else None
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_gib": round(mem_kib / 2**20, 1) if mem_kib else None,
        "kernel": platform.release(),
        "os": _os_name(),
        "python": platform.python_version(),
        "tools": {
            "tar": _first_line(["tar", "--version"]),
            "mkfs.btrfs": _first_line(["mkfs.btrfs", "--version"]),
            "mksquashfs": _first_line(["mksquashfs", "-version"]),
            "mkfs.erofs": _first_line(
                ["dpkg-query", "-W", "-f=erofs-utils ${Version}", "erofs-utils"]
            ),
        },
    }


def _os_name() -> str | None:
    try:
        m = re.search(r'^PRETTY_NAME="?([^"\n]*)', Path("/etc/os-release").read_text(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _rate(n: float) -> str:
    return f"{n:,.0f}" if n >= 100 else f"{n:.1f}"


def build_table(results: Sequence[Result], content_bytes: int, entries: int, ours: str) -> str:
    """The Build table in Markdown; the last column is that row's median wall / ours'.

    Above 1.00x ours is faster than that row, below 1.00x slower.
    """
    ref = next((r for r in results if r.name == ours and r.ok), None)
    rows = [
        "| build | wall min (s) | wall median (s) | + sync (s) | MB/s | files/s | peak RSS"
        " | RSS/file | output | its time / ours |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if not r.ok:
            rows.append(f"| {r.label} | {r.error or 'not run'} | | | | | | | | |")
            continue
        med = r.wall_median
        out = "" if r.output_bytes is None else human(r.output_bytes)
        alloc, size = r.output_alloc_bytes, r.output_bytes
        if alloc is not None and size is not None and abs(alloc - size) > size * 0.05:
            out += f" ({human(alloc)} alloc.)"
        if ref is None or r is ref:
            ratio = "" if ref is None else "1.00x"
        else:
            ratio = f"{med / ref.wall_median:.2f}x"
        rows.append(
            f"| {r.label} | {r.wall_min:.2f} | {med:.2f} | {r.synced_median:.2f}"
            f" | {_rate(content_bytes / 1e6 / med)}"
            f" | {_rate(entries / med)} | {human(r.peak_rss_kib * 1024)}"
            f" | {r.peak_rss_kib * 1024 / max(1, entries):,.0f} B | {out} | {ratio} |"
        )
    return "\n".join(rows) + "\n"


def machine_line(m: dict[str, Any]) -> str:
    return (
        f"{m.get('date')}; {m.get('nproc')} cores ({m.get('cpu')}), {m.get('mem_gib')} GiB,"
        f" kernel {m.get('kernel')}, {m.get('os')}, Python {m.get('python')}"
    )


def build_section(doc: dict[str, Any], table: str) -> str:
    """The Markdown body of the Build section of docs/benchmarks.md (between the markers)."""
    m = doc["machine"]
    b = doc["build"]
    s = b["input"]["stats"]
    tools = "; ".join(f"{v}" for v in m.get("tools", {}).values() if v)
    lines = [
        f"Run `{b['command']}` on {machine_line(m)}.",
        f"Tools: {tools}. Builder at commit {b.get('builder_commit')}.",
        "",
        f"Input: one uncompressed pax tarball ({human(s['tar_bytes'])}) holding"
        f" {s['entries']:,} entries: {s['regular_names']:,} regular file names"
        f" ({s['hardlinks']:,} of them hardlinks, {s['duplicate_files']:,} duplicates),"
        f" {s['symlinks']:,} symlinks, {s['directories']:,} directories;"
        f" {human(s['small_bytes'])} in small files (0..16 KiB) plus {s['large_files']} large"
        f" incompressible files totalling {human(s['large_bytes'])}"
        f" ({human(s['content_bytes'])} content, {human(s['unique_bytes'])} unique).",
        "",
        f"{b['repeats']} repeats each. {b['cache_policy']}",
        "",
        table.rstrip("\n"),
        "",
        "MB/s is content bytes (10^6) per second and files/s is entries per second, both from"
        ' the median wall time. "+ sync" is the median of wall time plus the untimed `sync`'
        " after the command (until its output is on disk; ours and mkfs.btrfs fsync their"
        ' output themselves). "its time / ours" is that row\'s median wall time divided by'
        " ours' (above 1.00x ours is faster, below 1.00x ours is slower). Peak RSS is the"
        " largest process of the command's tree (GNU time `%M`); RSS/file divides it by the"
        " entry count. Output is the bundle (meta.img + blockmap + packs) for ours, the image"
        " file for the others (allocated size when it differs, e.g. sparse).",
    ]
    prof = b.get("profile")
    if prof:
        lines += [
            "",
            f"One more build under cProfile ({prof['total_s']:.1f} s profiled; cProfile"
            " inflates call-heavy Python code), functions with the most own time:",
            "",
            "| own s | cumulative s | calls | function |",
            "|---:|---:|---:|---|",
        ]
        for r in prof["top_by_tottime"][:12]:
            fn = r["function"].replace("|", "\\|")
            lines.append(
                f"| {r['tottime_s']:.2f} | {r['cumtime_s']:.2f} | {r['calls']:,} | `{fn}` |"
            )
    return "\n".join(lines) + "\n"


def update_doc(path: Path, section: str, body: str) -> None:
    """Replace the text between the section's markers in ``path`` (appended if absent)."""
    begin, end = DOC_BEGIN.format(section=section), DOC_END.format(section=section)
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{body}{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)
