"""Machine description, the results table (Markdown, also printed on stdout), docs update."""

from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
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
            "umoci": _first_line(["umoci", "--version"]),
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


UMOCI_BASELINE = "umoci_unpack+mkfs_btrfs_umoci"
TAR_BASELINE = "tar_x+mkfs_btrfs"
BASELINES = (  # the rows the build ratios divide: (result name, short label)
    (UMOCI_BASELINE, "umoci + mkfs.btrfs"),
    (TAR_BASELINE, "tar -x + mkfs.btrfs"),
)
OURS_ROWS = {  # our rows, with the baseline each is compared with first (same input form)
    "ours": TAR_BASELINE,
    "ours_oci": UMOCI_BASELINE,
    "ours_in_place": TAR_BASELINE,
    "ours_in_place_reflink": TAR_BASELINE,
}
BUILD_TARGET = 3.0  # issue 7: at least 3x faster than the baseline


def build_table(results: Sequence[Result], content_bytes: int, entries: int) -> str:
    """The Build table of one input in Markdown; one "BASELINE / this" column per baseline
    present: the baseline's median wall divided by the row's (above 1.00x the row is
    faster than that baseline, below 1.00x slower)."""
    by = {r.name: r for r in results}
    bases = [(n, short, by[n]) for n, short in BASELINES if n in by and by[n].ok]
    rows = [
        "| build | wall min (s) | wall median (s) | + sync (s) | MB/s | files/s | peak RSS"
        " | RSS/file | output |" + "".join(f" {short} / this |" for _, short, _ in bases),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(bases),
    ]
    for r in results:
        if not r.ok:
            rows.append(f"| {r.label} | {r.error or 'not run'} |" + " |" * (7 + len(bases)))
            continue
        med = r.wall_median
        out = "" if r.output_bytes is None else human(r.output_bytes)
        alloc, size = r.output_alloc_bytes, r.output_bytes
        if alloc is not None and size is not None and abs(alloc - size) > size * 0.05:
            out += f" ({human(alloc)} alloc.)"
        ratios = "".join(f" {b.wall_median / med:.2f}x |" for _, _, b in bases)
        rows.append(
            f"| {r.label} | {r.wall_min:.2f} | {med:.2f} | {r.synced_median:.2f}"
            f" | {_rate(content_bytes / 1e6 / med)}"
            f" | {_rate(entries / med)} | {human(r.peak_rss_kib * 1024)}"
            f" | {r.peak_rss_kib * 1024 / max(1, entries):,.0f} B | {out} |{ratios}"
        )
    return "\n".join(rows) + "\n"


def build_summary(results: Sequence[Result], entries: int) -> list[str]:
    """One line per row of ours: how many times faster than each baseline (median wall;
    with the baseline's writeback), against issue 7's 3x, and its peak RSS per entry."""
    by = {r.name: r for r in results if r.ok}
    lines = []
    for name, first in OURS_ROWS.items():
        ours = by.get(name)
        if ours is None:
            continue
        parts = []
        for base_name, short in sorted(BASELINES, key=lambda b: b[0] != first):
            base = by.get(base_name)
            if base is None:
                continue
            x = base.wall_median / ours.wall_median
            xs = base.synced_median / ours.synced_median
            mark = "" if x >= BUILD_TARGET else f", target {BUILD_TARGET:g}x missed"
            parts.append(f"{x:.2f}x vs {short} ({xs:.2f}x with writeback{mark})")
        rss = ours.peak_rss_kib * 1024 / max(1, entries)
        parts.append(f"{rss:,.0f} B peak RSS per entry")
        label = ours.label.replace("*", "")
        lines.append(f"{label}: " + "; ".join(parts))
    for what, num, den in FLOOR_ROWS:
        if num in by and den in by:
            lines.append(f"{what}: {_in_turn_ratios(by[num], by[den])}")
    return lines


FLOOR_ROWS = (  # issue 23's ratios: (what, numerator row, denominator row)
    ("ours cold / the floor cold (`openssl dgst -sha256`)", "ours", "sha256_floor"),
    ("ours warm / the floor warm", "ours_warm", "sha256_floor_warm"),
    ("ours cold / the floor beside the pack's write (io_floor)", "ours", "io_floor"),
    ("tar -x + mkfs.btrfs / ours warm", TAR_BASELINE, "ours_warm"),
)


def _in_turn_ratios(num: Result, den: Result) -> str:
    """The ratio of the median walls, then the median (and range) of each repeat's own
    ratio: a repeat's two runs are minutes apart at most, so a host that slows down for a
    part of the run moves both (the cold floor's own medians here differ by up to 1.5x)."""
    each = sorted(x.wall_s / y.wall_s for x, y in zip(num.samples, den.samples, strict=False))
    return (
        f"{num.wall_median / den.wall_median:.2f}x of the medians, per repeat"
        f" {statistics.median(each):.2f}x ({each[0]:.2f}-{each[-1]:.2f}x, {len(each)} repeats)"
    )


def build_inputs(b: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-input results of a Build section's JSON; a JSON from before the Debian
    input and the OCI rows (one input: ``input``, ``results`` at the top) as one input."""
    if "inputs" in b:
        return dict(b["inputs"])
    return {
        "synthetic": {
            "label": "synthetic set",
            "repeats": b.get("repeats"),
            "input": b["input"],
            "results": b["results"],
            "skipped": b.get("skipped", {}),
        }
    }


def input_results(one: dict[str, Any]) -> list[Result]:
    return [Result.from_json(k, v) for k, v in one["results"].items()]


def machine_line(m: dict[str, Any]) -> str:
    return (
        f"{m.get('date')}; {m.get('nproc')} cores ({m.get('cpu')}), {m.get('mem_gib')} GiB,"
        f" kernel {m.get('kernel')}, {m.get('os')}, Python {m.get('python')}"
    )


def _synthetic_text(s: dict[str, Any]) -> str:
    return (
        f"one uncompressed pax tarball ({human(s['tar_bytes'])}) holding"
        f" {s['entries']:,} entries: {s['regular_names']:,} regular file names"
        f" ({s['hardlinks']:,} of them hardlinks, {s['duplicate_files']:,} duplicates),"
        f" {s['symlinks']:,} symlinks, {s['directories']:,} directories;"
        f" {human(s['small_bytes'])} in small files (0..16 KiB) plus {s['large_files']} large"
        f" incompressible files totalling {human(s['large_bytes'])}"
        f" ({human(s['content_bytes'])} content, {human(s['unique_bytes'])} unique)."
    )


def _tar_text(s: dict[str, Any], tar: str) -> str:
    return (
        f"`{tar}` ({human(s['tar_bytes'])}) holding"
        f" {s['entries']:,} entries: {s['regular_names']:,} regular file names"
        f" ({s['hardlinks']:,} of them hardlinks), {s['symlinks']:,} symlinks,"
        f" {s['directories']:,} directories; {human(s['content_bytes'])} content."
    )


def _oci_text(oci: dict[str, Any] | None) -> str:
    if not oci:
        return " No OCI layout: no umoci rows."
    layers = oci["layers"]
    kinds = ", ".join(
        f"{human(x['size'])} {x['media_type'].rsplit('.', 1)[-1].replace('v1.', '')}"
        for x in layers
    )
    return (
        f" OCI layout `{oci['layout']}`, ref `{oci['ref']}`: {len(layers)}"
        f" layer{'s' if len(layers) != 1 else ''} ({kinds})."
    )


BUILD_NOTE = (
    "MB/s is content bytes (10^6) per second and files/s is entries per second, both from"
    ' the median wall time. "+ sync" is the median of wall time plus the untimed `sync`'
    " after the command (until its output is on disk; ours and mkfs.btrfs fsync their"
    ' output themselves). "umoci + mkfs.btrfs / this" and "tar -x + mkfs.btrfs / this" are'
    " that baseline's median wall time divided by the row's (above 1.00x the row is faster"
    " than the baseline; issue 7's target for ours is 3x). Peak RSS is the largest process"
    " of the command's tree (GNU time `%M`); RSS/file divides it by the entry count."
    " Output is the bundle (meta.img + blockmap + packs) for ours, the image file for the"
    " others (allocated size when it differs, e.g. sparse)."
)


def repeats_text(n: object) -> str:
    return f"{n} repeat{'' if n == 1 else 's'}"


def build_section(doc: dict[str, Any]) -> str:
    """The Markdown body of the Build section of docs/benchmarks.md (between the markers)."""
    m = doc["machine"]
    b = doc["build"]
    tools = "; ".join(f"{v}" for v in m.get("tools", {}).values() if v)
    lines = [
        f"Run `{b['command']}` on {machine_line(m)}.",
        f"Tools: {tools}. Builder at commit {b.get('builder_commit')}.",
    ]
    if b.get("note"):
        lines += ["", b["note"]]
    lines += ["", b["cache_policy"]]
    for name, one in build_inputs(b).items():
        s = one["input"]["stats"]
        tar = Path(one["input"].get("tar", "input.tar")).name
        about = _synthetic_text(s) if name == "synthetic" else _tar_text(s, tar)
        results = input_results(one)
        lines += [
            "",
            f"**{one.get('label', name)}** ({repeats_text(one.get('repeats'))} each):"
            f" {one['input'].get('description', '')}{about}{_oci_text(one['input'].get('oci'))}",
            "",
            build_table(results, s["content_bytes"], s["entries"]).rstrip("\n"),
            "",
        ]
        lines += [f"* {x}" for x in build_summary(results, s["entries"])]
        lines += [f"* skipped {k}: {why}" for k, why in one.get("skipped", {}).items()]
    for k, why in b.get("skipped_inputs", {}).items():
        lines += ["", f"Input {k} skipped: {why}"]
    lines += ["", BUILD_NOTE]
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


# ------------------------------------------------------------------- runtime sections

MOUNT_NOTE = (
    'Wall time from the start of the command until the "first file" has been read whole'
    " (page cache dropped before every run; mounts are torn down untimed): `ublkd mount`"
    " (verifies the bundle; hashes meta.img unless its verified record from an earlier"
    " mount still matches, docs/ublkd.md, so the first run of an image pays the hash;"
    " starts the server, loop devices, mount) then"
    " the read; `squashfuse IMG MNT` then the read; `mount(2)` of the erofs file"
    " (file-backed, no loop device) then the read; `tar -x` of the whole image tarball"
    ' (the tree is only usable when it ends). "+ writeback" adds the untimed `sync` after'
    ' the command (what `tar -x` left dirty). "its time / ours" is that row\'s median'
    " divided by ours' (above 1.00x ours is faster)."
)


def _ms(s: float) -> str:
    return f"{s * 1000:,.1f}" if s < 10 else f"{s * 1000:,.0f}"


def mount_table(images: dict[str, Any]) -> str:
    rows = [
        "| image | how | min (ms) | median (ms) | median + writeback (ms) | its time / ours |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for img in images.values():
        res = img["results"]
        ours = res.get("ours", {})
        ref = ours.get("wall_median_s")
        for r in res.values():
            label = f"{img['label']}"
            if r.get("wall_median_s") is None:
                rows.append(f"| {label} | {r['label']} | {r.get('error') or 'not run'} | | | |")
                continue
            med = r["wall_median_s"]
            ratio = "" if not ref else f"{med / ref:.2f}x"
            rows.append(
                f"| {label} | {r['label']} | {_ms(r['wall_min_s'])} | {_ms(med)}"
                f" | {_ms(r['wall_plus_sync_median_s'])} | {ratio} |"
            )
    return "\n".join(rows) + "\n"


RANDREAD_TARGETS = {
    "null_ublk": "null ublk target `--ublk-poll=off`, raw device",
    "ours_ublk_raw": "**ours** /dev/ublkbN (device 2), raw",
    "ours_ublk_off_raw": "**ours** /dev/ublkbN `--ublk-poll=off`, raw",
    "loop_raw": "loop over device 2 in RAM, raw",
    "ours_ublk": "**ours** (ublk frontend)",
    "ours_ublk_off": "**ours** (ublk frontend, `--ublk-poll=off`)",
    "null_ublk_poll": "null ublk target `--ublk-poll`, raw device",
    "ours_ublk_poll_raw": "**ours** /dev/ublkbN `--ublk-poll`, raw",
    "ours_ublk_poll": "**ours** (ublk frontend, `--ublk-poll`)",
    "ours_fuse": "**ours** (fuse frontend)",
    "btrfs_loop": "btrfs, device 2 on a local loop",
    "btrfs_loop_off": "btrfs on loop, beside `--ublk-poll=off`",
    "btrfs_loop_poll": "btrfs on loop, beside `--ublk-poll`",
    "btrfs_loop_fuse": "btrfs on loop, beside fuse",
    "erofs_loop": "erofs on a loop device",
    "squashfuse": "squashfuse",
}
SHORT = {"null_ublk": "null ublk", "ours_ublk_raw": "ours ublkb raw", "loop_raw": "loop raw",
         "ours_ublk": "ours ublk", "ours_fuse": "ours fuse", "btrfs_loop": "btrfs loop",
         "null_ublk_poll": "null ublk poll", "ours_ublk_poll_raw": "ours ublkb raw poll",
         "ours_ublk_poll": "ours ublk poll", "ours_ublk_off": "ours ublk off",
         "ours_ublk_off_raw": "ours ublkb raw off", "btrfs_loop_off": "btrfs loop",
         "btrfs_loop_poll": "btrfs loop", "btrfs_loop_fuse": "btrfs loop",
         "erofs_loop": "erofs", "squashfuse": "squashfuse"}  # fmt: skip


def _iops(d: dict[str, Any] | None) -> float | None:
    if not d or d.get("iops") is None:
        return None
    return float(d["iops"])


def randread_table(rr: dict[str, Any], ratios: Sequence[tuple[str, str]]) -> str:
    """IOPS per fio job (rows) and target (columns), then ``num/den`` ratio columns."""
    targets = [t for t in RANDREAD_TARGETS if t in rr["targets"]]
    jobs: list[str] = []
    for t in targets:
        for j in rr["targets"][t]:
            if j not in jobs:
                jobs.append(j)
    head = ["fio job"] + [f"{RANDREAD_TARGETS[t]} IOPS" for t in targets]
    head += [f"{SHORT[a]} / {SHORT[b]}" for a, b in ratios if a in targets and b in targets]
    rows = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for j in jobs:
        cells = [j]
        for t in targets:
            v = _iops(rr["targets"][t].get(j))
            cells.append("failed" if v is None else f"{v:,.0f}")
        for a, b in ratios:
            if a in targets and b in targets:
                va, vb = _iops(rr["targets"][a].get(j)), _iops(rr["targets"][b].get(j))
                cells.append(f"{va / vb:.2f}x" if va is not None and vb else "")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def laziness_table(lz: dict[str, Any]) -> str:
    rows = [
        "| step | device reads | bytes served to the kernel | chunks verified"
        " | bytes read from packs | packs read / served |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in lz["steps"]:
        served = s["bytes_served"]
        amp = f"{s['pack_bytes_read'] / served:.2f}x" if served else ""
        rows.append(
            f"| {s['what']} | {s['reads']:,} | {human(served)} | {s['chunks_verified']:,}"
            f" | {human(s['pack_bytes_read'])} | {amp} |"
        )
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    """Text for a markdown table cell (a shell pipeline's `|` would end the cell)."""
    return text.replace("|", "\\|")


def _median_status(runs: list[dict[str, Any]], key: str) -> str:
    """Median of one ublkd counter over the runs that have a status (ours), else ''."""
    vals = [r["status"][key] for r in runs if key in r.get("status", {})]
    return f"{int(statistics.median(vals)):,}" if vals else ""


def remote_table(rm: dict[str, Any]) -> str:
    """Medians of the cold starts over nginx; ratios to the zstd tarball download."""
    base_name = "curl | zstd -d | tar -x"

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(r[key] for r in runs))

    base = med(rm["runs"][base_name], "to_command_done_s") if base_name in rm["runs"] else 0.0
    rows = [
        f"| how | ready (s) | `{rm['command']}` done (s) | prefetch done (s) | requests"
        f" | bytes moved | chunks loaded on demand | speed-up vs `{_cell(base_name)}` |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in rm["runs"].items():
        done = med(runs, "to_command_done_s")
        pre = [r["to_prefetch_done_s"] for r in runs if r.get("to_prefetch_done_s") is not None]
        rows.append(
            f"| {_cell(name)} | {med(runs, 'mount_s'):.2f} | {done:.2f}"
            f" | {f'{statistics.median(pre):.2f}' if pre else ''}"
            f" | {int(med(runs, 'requests')):,} | {human(med(runs, 'bytes'))}"
            f" | {_median_status(runs, 'demand_chunk_loads')}"
            f" | {f'{base / done:.1f}x' if base and done else ''} |"
        )
    return "\n".join(rows) + "\n"


def containerd_table(cd: dict[str, Any]) -> str:
    """Medians of the cold container starts; ours against containerd's overlayfs."""
    from bench.containerd import medians

    rows = [
        "| containerd | snapshotter | pull (s) | first line (s) | requests | bytes moved"
        " | speed-up | fewer bytes |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for flavour, ways in cd["runs"].items():
        base = medians(ways["overlayfs"])
        for name, runs in ways.items():
            m = medians(runs)
            rows.append(
                f"| {flavour} | {name} | {m['pull_s']:.2f} | {m['to_first_line_s']:.2f}"
                f" | {int(m['requests']):,} | {human(m['bytes'])}"
                f" | {base['to_first_line_s'] / m['to_first_line_s']:.1f}x"
                f" | {base['bytes'] / max(1.0, m['bytes']):.1f}x |"
            )
    return "\n".join(rows) + "\n"


def containerd_section(doc: dict[str, Any]) -> str:
    cd = doc["containerd"]
    return (
        f"Run `{doc.get('command', 'bench/run')}` on {machine_line(doc['machine'])}.\n\n"
        "The Debian minbase image in docker-registry on loopback, as it is and as a bundle"
        " (`push --image`); every run cold (new containerd and snapshotter, empty ublkd"
        " cache, page cache dropped); timed from the start of the pull to the first line"
        f" of `ctr run ... {cd['command']}`; medians of {cd['repeats']} runs. Bytes and"
        " requests from the registry's access log. Ratios against containerd's overlayfs"
        " snapshotter on the same containerd.\n\n" + containerd_table(cd)
    )


def remote_section(doc: dict[str, Any]) -> str:
    rm = doc["remote"]
    return (
        f"Run `{doc.get('command', 'bench/run')}` on {machine_line(doc['machine'])}.\n\n"
        f"The Debian image (bundle {human(rm['bundle_bytes'])}, tarball {human(rm['tar_bytes'])})"
        " served by nginx on loopback; every run cold (empty ublkd cache, page cache dropped);"
        f" medians of {len(next(iter(rm['runs'].values())))} runs. Bytes and requests from"
        " nginx's access log. *ready*: the mount is up / the tarball is extracted.\n\n"
        + remote_table(rm)
    )


def mount_section(doc: dict[str, Any]) -> str:
    m = doc["mount"]
    lines = [f"Run `{doc.get('command', 'bench/run')}` on {machine_line(doc['machine'])}."]
    lines += [f"{m['repeats']} repeats each, interleaved.", ""]
    for img in m["images"].values():
        lines.append(
            f"* {img['label']}: {img['entries']:,} entries, {human(img['content_bytes'])};"
            f" first file read: `/{img['probe']}`."
        )
    lines += ["", mount_table(m["images"]).rstrip("\n"), "", MOUNT_NOTE]
    return "\n".join(lines) + "\n"


VM_FS_TARGETS = ("ours_ublk", "ours_ublk_off", "ours_ublk_poll", "ours_fuse", "btrfs_loop",
                 "btrfs_loop_off", "btrfs_loop_poll", "btrfs_loop_fuse")  # fmt: skip
# each through-btrfs target against the baseline runs of its own block (bench/runtime.py)
VM_FS_RATIOS = [("ours_ublk", "btrfs_loop"), ("ours_ublk_off", "btrfs_loop_off"),
                ("ours_ublk_poll", "btrfs_loop_poll"), ("ours_fuse", "btrfs_loop_fuse")]  # fmt: skip
VM_RAW_RATIOS = [("null_ublk", "loop_raw"), ("null_ublk_poll", "loop_raw"),
                 ("ours_ublk_raw", "loop_raw"), ("ours_ublk_off_raw", "loop_raw"),
                 ("ours_ublk_poll_raw", "loop_raw"), ("ours_ublk_off_raw", "null_ublk")]  # fmt: skip


def cpu_note(server_cpu: dict[str, dict[str, float]]) -> str:
    """The ublk servers' CPU use during each fio job (CPUs busy: CPU time / wall time)."""
    if not server_cpu:
        return ""
    parts = [
        f"{SHORT.get(t, t)} " + ", ".join(f"{j} {c:.2f}" for j, c in sorted(js.items()))
        for t, js in server_cpu.items()
    ]
    return " Server CPU during each job (CPUs busy, mean of rounds): " + "; ".join(parts) + "."


def queue_note(queues: dict[str, dict[str, str]]) -> str:
    """One sentence on the block queue settings fio ran against, per device."""
    if not queues:
        return ""
    parts = [
        f"{SHORT.get(t, t)}: hw queues {q.get('nr_hw_queues', '?')}, scheduler"
        f" {q.get('scheduler', '?')}, nr_requests {q.get('nr_requests', '?')}"
        for t, q in queues.items()
    ]
    return " Block queues: " + "; ".join(parts) + "."


def randread_section(doc: dict[str, Any]) -> str:
    rr = doc["randread"]
    lines = [
        f"Run `{doc.get('command', 'bench/run')}` on {machine_line(doc['machine'])}.",
        "",
        f"fio 4 KiB random reads, `direct=1`, {rr['runtime_s']:g} s per job after a 1 s ramp,"
        f" on `/{rr['file']}` ({human(rr['file_bytes'])}) of the synthetic image. Before fio,"
        " each target's file is read once whole with O_DIRECT, so every layer below the"
        " page cache is warm: ours has verified and cached every chunk (`--cache-mb"
        f" {rr['ours_cache_mb']}`), the loop devices' backing files are in the page cache.",
        "",
        randread_table(rr, [("ours_fuse", "btrfs_loop"), ("ours_fuse", "squashfuse")]).rstrip("\n"),
    ]
    if rr.get("interleaved"):
        lines += ["", f"{' and '.join(SHORT[t] for t in rr['interleaved'])} took turns per fio"
                  " job (order alternating), each mounted afresh and warmed right before it."]  # fmt: skip
    served = {j: r["server_reads"] for j, r in rr["targets"].get("ours_fuse", {}).items()
              if isinstance(r, dict) and "server_reads" in r}  # fmt: skip
    if served:
        lines += ["", "Reads that reached ours' server during each job (device 2's page cache"
                  " missed, e.g. pages reclaimed since the warm-up): "
                  + ", ".join(f"{j} {n:,}" for j, n in served.items()) + "."]  # fmt: skip
    for t, e in rr.get("errors", {}).items():
        lines.append(f"\n{t}: {e}")
    vm = doc.get("randread_vm")
    if vm:
        lines += [
            "",
            f"Inside the VM harness (guest kernel {vm['kernel']}, QEMU"
            f" `-accel {vm.get('accel', 'tcg,thread=single')}`"
            + (
                f" `-icount {vm['icount']}`, the guest's clock counting its instructions"
                " (rates per guest instruction, not per host second)"
                if vm.get("icount")
                else ""
            )
            + ": absolute figures are meaningless, only the ratios within this one VM run count):"
            f" `/{vm['file']}` ({human(vm['file_bytes'])}) of a small synthetic image,"
            f" {vm['runtime_s']:g} s per job, best of {vm.get('rounds', 1)} rounds;"
            " ours through the ublk and the fuse frontend"
            " vs the same btrfs image with device 2 materialized into the guest's RAM on a"
            " loop device, mounted beside ours under a fsid of its own and run before or"
            " after ours for each fio job (one column per block, each ratio against its"
            " own block's).",
            "",
            randread_table(
                {"targets": {t: v for t, v in vm["targets"].items() if t in VM_FS_TARGETS}},
                VM_FS_RATIOS,
            ).rstrip("\n"),
        ]
        raw = {t: v for t, v in vm["targets"].items() if t not in VM_FS_TARGETS}
        if raw:
            lines += [
                "",
                "The same VM run, raw block devices (no btrfs): the ceiling of the ublk"
                " transport under TCG (a null ublk target, same queue setup as ours, that"
                " completes every read at once), ours' device 2, and a loop device over a copy"
                " of device 2 in the guest's RAM; these and ours through btrfs (above) ran each"
                " fio job in turn (ours' default mount, `--ublk-poll=auto`; its"
                " `--ublk-poll=off` and `--ublk-poll` mounts right after the others; idle:"
                " the server's CPU while mounted without I/O, sparse200: under psync reads"
                " at 200 IOPS)."
                + queue_note(vm.get("queues", {})) + cpu_note(vm.get("server_cpu", {})),
                "",
                randread_table({"targets": raw}, VM_RAW_RATIOS).rstrip("\n"),
            ]  # fmt: skip
        for t, e in vm.get("errors", {}).items():
            lines.append(f"\nVM {t}: {e}")
    return "\n".join(lines) + "\n"


def laziness_section(doc: dict[str, Any]) -> str:
    lz = doc["laziness"]
    return (
        f"Run `{doc.get('command', 'bench/run')}` on {machine_line(doc['machine'])}.\n\n"
        f"The Debian image (packs: {human(lz['pack_bytes_total'])}); ublkd's counters"
        " (`ublkd status --json`) after each step, fuse frontend, page cache dropped before"
        " each mount. Every pack read is a whole 1 MiB chunk (verified before use).\n\n"
        + laziness_table(lz)
    )
