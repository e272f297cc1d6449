"""Build benchmark: ``btrfs-ublk-image build`` vs ``umoci unpack`` / ``tar -x`` + ``mkfs.btrfs
--rootdir`` and peers.

Run as ``bench/run [--quick] [--json OUT] [--workdir DIR] [--repeat N] [--debian-repeat N]
[--build-inputs synthetic,debian] [--profile] [--update-docs]``. Two inputs, one after the
other, each as a tarball and as an OCI image layout of the same tree:

* the synthetic set (bench/inputs.py; ``--repeat`` runs): its tarball, and a layout
  made once beside it (``ensure_oci_layout``: the tarball hardlinked as the one
  uncompressed layer);
* the Debian image (``--debian-repeat`` runs, default 5: it is small): the rootfs.tar
  and the OCI layout (umoci-made, gzip) of specs/golden/debian/prepare.sh.

One run measures, side by side on each input, each of:

* ours: ``btrfs-ublk-image build spec.yaml -o OUT`` on a spec with one tar layer;
* ours from the OCI layout: the same with one ``oci:`` layer;
* ours, tar in place: ``in_place: true`` on the tar layer (the tarball becomes a pack
  of the bundle: a reflink, or a copy on filesystems without them), in the work
  directory and (root) on a loop-mounted btrfs, where the copy is a reflink;
* the baselines: ``umoci unpack`` of the layout then ``mkfs.btrfs --rootdir`` on the
  bundle's rootfs; ``tar -xf`` into a directory then ``mkfs.btrfs --rootdir`` on it;
* peers on the extracted tree (when installed): ``mksquashfs`` and ``mkfs.erofs``,
  both uncompressed; and ``mksquashfs -tar`` straight from the tarball.

Each repeat drops the page cache (when root) before ours, ``umoci unpack`` and
``tar -x``, so each reads its input cold; ours and the builder at the baseline commit take
turns going first (``in_turn``); the steps after them find the unpacked tree
warm in the page cache, as a shell pipeline would. Every command is followed by an
untimed ``sync``. Outputs, umoci's bundle and the extracted tree are deleted untimed.

A benchmark, not a test: it fails only when a command fails, never on speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pstats
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import inputs as inp
from bench.measure import Result, drop_caches, pipeline, remove, run_measured, tree_size
from bench.report import (
    TAR_BASELINE,
    UMOCI_BASELINE,
    VM_FS_RATIOS,
    VM_RAW_RATIOS,
    build_inputs,
    build_section,
    build_summary,
    build_table,
    containerd_section,
    containerd_table,
    input_results,
    laziness_section,
    laziness_table,
    machine_info,
    mount_section,
    mount_table,
    randread_section,
    randread_table,
    remote_section,
    remote_table,
    repeats_text,
    update_doc,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKDIR = Path("/var/tmp/btrfs-ublk-image-bench")
FULL = inp.InputParams(files=100_000, large_bytes=2 << 30, large_count=4)
QUICK = inp.InputParams(files=10_000, large_bytes=256 << 20, large_count=4)
# issue 23's inputs: 100,000 small files + one 1 GiB file; 1,000,000 small files (how cost grows)
ISSUE23 = inp.InputParams(files=100_000, large_bytes=1 << 30, large_count=1)
MILLION = inp.InputParams(files=1_000_000, large_bytes=0, large_count=0)
EXTRA_INPUTS = {
    "issue23": (ISSUE23, "100,000 small files + one 1 GiB file"),
    "million": (MILLION, "1,000,000 small files"),
}
GiB = 1 << 30
# Specs written into scratch (and the reflink filesystem) for each input:
TAR_SPEC = "spec.yaml"  # one tar: layer
OCI_SPEC = "spec-oci.yaml"  # one oci: layer, the input's OCI layout
IN_PLACE_SPEC = "spec-in-place.yaml"  # one tar: layer, in_place: true
BUILD_INPUTS = ("synthetic", "debian", "issue23", "million")
SECTIONS = (
    "build", "mount", "randread", "laziness", "vm", "remote", "containerd", "latency", "latency_vm",
    "delta",
    "soak", "soak_vm", "passthrough",
)  # fmt: skip
# the runtime sections that mount the synthetic set (the build section's synthetic rows, too)
SYNTHETIC_SECTIONS = {"mount", "randread"}


@dataclass
class Job:
    """The paths one input's steps work on; a step's spec lies beside its output."""

    tar: Path
    layout: Path | None  # OCI image layout of the same tree, None if there is none
    ref: str
    tree: Path  # tar -x destination
    umoci: Path  # umoci unpack's bundle (config.json, rootfs/, mtree)
    pack_bytes: int = 0  # the content a build writes to its pack (identical contents once)


@dataclass
class Step:
    """One measured command of a repeat; ``make_cmd`` gets the job and the output path."""

    name: str
    label: str
    output: str | None  # file or directory name under scratch, None for tar -x, umoci
    make_cmd: Callable[[Job, Path], list[str]]
    needs: str | None = None  # the executable that must exist
    stdin_tar: bool = False
    presize: bool = False  # create the output file sparse first (mkfs.btrfs)
    cold: bool = False  # drop caches before it
    reflink_fs: bool = False  # input copy and output on a loop-mounted btrfs (reflinks work)
    makes: str | None = None  # the directory it writes: "tree" (tar -x) or "umoci"
    uses: str | None = None  # the directory it reads, made by an earlier step
    oci: bool = False  # reads the OCI layout


MAKERS = {"tree": "tar_x", "umoci": "umoci_unpack"}
PEERS = ("mksquashfs", "mkfs_erofs", "mksquashfs_tar")


# a checkout of an earlier builder (--baseline-builder): its row runs that code
BASELINE_BUILDER: list[str] = []


def _ours(
    spec: str, python_path: bool = False, baseline: bool = False
) -> Callable[[Job, Path], list[str]]:
    py = sys.executable

    def command(job: Job, out: Path) -> list[str]:
        env = ["env", "BUI_NATIVE=0"] if python_path else []  # the Python reader and packer
        if baseline:  # read when the row runs: --baseline-builder is set after import
            env = ["env", f"PYTHONPATH={BASELINE_BUILDER[0]}"]
        # -P: `-m` would put the working directory first on sys.path, and run from the
        # checkout's root, the baseline row would import the checkout's package, not DIR's
        cmd = [py, "-P", "-m", "btrfs_ublk_image", "build", str(out.parent / spec), "-o", str(out)]
        return [*env, *cmd]

    return command


def _mkfs_btrfs(root: Callable[[Job], Path]) -> Callable[[Job, Path], list[str]]:
    return lambda job, out: [
        "mkfs.btrfs", "-q", "-K", "--shrink", "--rootdir", str(root(job)), str(out)
    ]  # fmt: skip


def _read_and_write_floor(job: Job, out: Path) -> list[str]:
    """The input read and hashed (as the floor) while its content is written durably
    beside it (O_DIRECT, fsynced): what any builder that writes a pack pays the disk."""
    blocks = max(1, -(-job.pack_bytes // (4 << 20)))
    script = (
        'openssl dgst -sha256 "$1" >/dev/null & h=$!; '
        'dd if=/dev/zero of="$2" bs=4M count="$3" oflag=direct conv=fsync status=none; w=$?; '
        'wait "$h" || exit 1; exit "$w"'
    )
    return ["sh", "-c", script, "sh", str(job.tar), str(out), str(blocks)]


def _steps() -> list[Step]:
    return [
        Step("sha256_floor", "floor: `openssl dgst -sha256` of the input", None,
             lambda job, out: ["openssl", "dgst", "-sha256", str(job.tar)], needs="openssl",
             cold=True),
        Step("sha256_floor_warm", "floor: `openssl dgst -sha256`, warm", None,
             lambda job, out: ["openssl", "dgst", "-sha256", str(job.tar)], needs="openssl"),
        Step("io_floor", "floor + the pack's durable write: `openssl dgst -sha256` of the"
             " input beside `dd oflag=direct conv=fsync` of its content size", "io-floor.bin",
             _read_and_write_floor, needs="openssl", cold=True),
        Step("ours", "**ours: btrfs-ublk-image build**", "ours.bundle", _ours(TAR_SPEC),
             cold=True),
        Step("ours_warm", "**ours, warm**", "ours.bundle", _ours(TAR_SPEC)),
        Step("ours_baseline", "builder at the baseline commit (`--baseline-builder`)",
             "ours.bundle", _ours(TAR_SPEC, baseline=True), cold=True),
        Step("ours_baseline_warm", "builder at the baseline commit, warm", "ours.bundle",
             _ours(TAR_SPEC, baseline=True)),
        Step("ours_python", "ours, Python path (`BUI_NATIVE=0`)", "ours.bundle",
             _ours(TAR_SPEC, python_path=True), cold=True),
        Step("ours_python_warm", "ours, Python path, warm", "ours.bundle",
             _ours(TAR_SPEC, python_path=True)),
        Step("ours_oci", "**ours from the OCI layout** (`oci:` layer)", "ours-oci.bundle",
             _ours(OCI_SPEC), cold=True, oci=True),
        Step("ours_oci_python", "ours from the OCI layout, Python path", "ours-oci.bundle",
             _ours(OCI_SPEC, python_path=True), cold=True, oci=True),
        Step("ours_in_place", "**ours, tar in place**", "ours-in-place.bundle",
             _ours(IN_PLACE_SPEC), cold=True),
        Step("ours_in_place_reflink", "**ours, tar in place, reflink** (on a loop-mounted btrfs)",
             "ours-in-place.bundle", _ours(IN_PLACE_SPEC), needs="mkfs.btrfs", cold=True,
             reflink_fs=True),
        Step("umoci_unpack", "umoci unpack (step)", None,
             lambda job, out: ["umoci", "unpack", "--image", f"{job.layout}:{job.ref}",
                               str(job.umoci)],
             needs="umoci", cold=True, makes="umoci", oci=True),
        Step("mkfs_btrfs_umoci", "mkfs.btrfs --rootdir of umoci's rootfs (step)", "btrfs.img",
             _mkfs_btrfs(lambda job: job.umoci / "rootfs"), needs="mkfs.btrfs", presize=True,
             uses="umoci", oci=True),
        Step("tar_x", "tar -x (step)", None,
             lambda job, out: ["tar", "-xf", str(job.tar), "-C", str(job.tree)],
             needs="tar", cold=True, makes="tree"),
        Step("mkfs_btrfs", "mkfs.btrfs --rootdir (step)", "btrfs.img",
             _mkfs_btrfs(lambda job: job.tree), needs="mkfs.btrfs", presize=True, uses="tree"),
        Step("mksquashfs", "mksquashfs uncompressed (step)", "tree.squashfs",
             lambda job, out: ["mksquashfs", str(job.tree), str(out), "-noappend",
                               "-no-progress", "-noI", "-noD", "-noF", "-noX"],
             needs="mksquashfs", uses="tree"),
        Step("mkfs_erofs", "mkfs.erofs uncompressed (step)", "tree.erofs",
             lambda job, out: ["mkfs.erofs", str(out), str(job.tree)],
             needs="mkfs.erofs", uses="tree"),
        Step("mksquashfs_tar", "mksquashfs -tar, uncompressed (from the tarball)",
             "tar.squashfs",
             lambda job, out: ["mksquashfs", "-", str(out), "-tar", "-noappend", "-no-progress",
                               "-noI", "-noD", "-noF", "-noX"],
             needs="mksquashfs", stdin_tar=True, cold=True),
    ]  # fmt: skip


def _supports_squashfs_tar() -> bool:
    p = subprocess.run(["mksquashfs"], capture_output=True, text=True, check=False)
    return "-tar" in (p.stdout + p.stderr)


def _git_state() -> str | None:
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "btrfs_ublk_image"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+uncommitted changes in btrfs_ublk_image/" if dirty else "")


def _check_disk(workdir: Path, params: inp.InputParams, cached: bool, runtime: bool) -> None:
    content = params.large_bytes + params.files * 5 * 1024
    need = int(2.3 * content) + GiB  # extracted tree + one output + slack
    if runtime:  # bundle, tree, squashfs, erofs and a materialized device 2 at once
        need = int(5.5 * content) + 2 * GiB
    if not cached:
        need += int(1.1 * content) + params.files * 2048  # the tarball itself
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise SystemExit(
            f"bench: {workdir}: {free / GiB:.1f} GiB free, about {need / GiB:.1f} GiB needed"
            " (use --workdir on a bigger filesystem, or --quick)"
        )


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


@dataclass
class BuildInput:
    """One input of the build section: a tarball, and an OCI layout of the same tree."""

    name: str  # "synthetic", "debian"
    label: str
    tar: Path
    layout: Path | None
    ref: str
    stats: inp.InputStats
    repeats: int
    about: dict[str, Any]  # what the report says about it (JSON)


def _measure(step: Step, res: Result, job: Job, scratch: Path, log: Path) -> None:
    out = scratch / (step.output or "unused")
    if step.output:
        remove(out)
    if step.presize:
        with open(out, "wb") as f:
            f.truncate(2 * job.tar.stat().st_size + 2 * GiB)
    cmd = step.make_cmd(job, out)
    res.cmd = cmd
    if step.cold:
        drop_caches()
    sample = run_measured(cmd, log, stdin=job.tar if step.stdin_tar else None)
    if sample.returncode != 0:
        res.error = f"exit status {sample.returncode} (see {log})"
        if step.output:
            remove(out)
        return
    res.samples.append(sample)
    if step.output:
        size = tree_size(out)
        if res.output_bytes is None:
            res.output_bytes, res.output_alloc_bytes = size
        remove(out)
    _log(
        f"  {step.name}: {sample.wall_s:.2f} s, CPU {sample.cpu_s:.2f} s,"
        f" peak RSS {sample.maxrss_kib / 1024:.0f} MiB"
    )


def _write_specs(directory: Path, tar: Path, layout: Path | None, ref: str) -> None:
    layer = {
        TAR_SPEC: f"tar: {{path: {tar}}}",
        IN_PLACE_SPEC: f"tar: {{path: {tar}, in_place: true}}",
    }
    if layout is not None:
        layer[OCI_SPEC] = f"oci: {{path: {layout}, ref: {ref}}}"
    for name, text in layer.items():
        (directory / name).write_text(f"version: 1\nname: bench\nlayers:\n  - {text}\n")


@contextlib.contextmanager
def _reflink_fs(workdir: Path, tar: Path) -> Iterator[Path]:
    """A btrfs on a loop device (this host's work filesystem, ext4, has no reflinks)
    holding a copy of the input tarball (untimed), for the reflink row. Torn down after."""
    img = workdir / "reflinkfs.img"
    mnt = workdir / "reflinkfs"
    remove(img)
    mnt.mkdir(exist_ok=True)
    with open(img, "wb") as f:
        f.truncate(tar.stat().st_size * 2 + 8 * GiB)
    mounted = False
    try:
        subprocess.run(["mkfs.btrfs", "-q", "-f", str(img)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
        mounted = True
        copy = mnt / "input.tar"
        shutil.copyfile(tar, copy)
        _write_specs(mnt, copy, None, "")
        yield mnt
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)
        remove(img)
        mnt.rmdir()


def _runnable(
    bi: BuildInput, peers: bool, only: set[str] | None = None
) -> tuple[list[Step], dict[str, str]]:
    skipped: dict[str, str] = {}
    steps = []
    for s in _steps():
        if only is not None and s.name not in only:
            continue
        if not peers and s.name in PEERS:
            continue
        if s.oci and bi.layout is None:
            skipped[s.name] = "no OCI layout of this input"
            continue
        if s.needs and shutil.which(s.needs) is None:
            skipped[s.name] = f"{s.needs} not installed"
            continue
        if s.name.startswith("ours_baseline") and not BASELINE_BUILDER:
            skipped[s.name] = "no --baseline-builder"
            continue
        if s.name == "mksquashfs_tar" and not _supports_squashfs_tar():
            skipped[s.name] = "mksquashfs has no -tar"
            continue
        if s.reflink_fs and os.geteuid() != 0:
            skipped[s.name] = "mounting a loop device needs root"
            continue
        steps.append(s)
    return steps, skipped


# ours and the builder at the baseline commit take turns going first, each with its warm
# run after its cold one: in a fixed order the one right after the floors' writes ran
# slower on this VM (bench/results/issue23-log.md, "Session 18 together")
_TURNS = {
    "ours": "ours_baseline",
    "ours_warm": "ours_baseline_warm",
    "ours_baseline": "ours",
    "ours_baseline_warm": "ours_warm",
}


def in_turn(steps: list[Step], repeat: int) -> list[Step]:
    """The steps of repeat number ``repeat`` (from 0) in the order they run: on odd
    repeats the baseline builder's two steps run where ours do, and ours where its did."""
    by_name = {s.name: s for s in steps}
    if repeat % 2 == 0 or not _TURNS.keys() <= by_name.keys():
        return steps
    return [by_name[_TURNS.get(s.name, s.name)] for s in steps]


PIPELINES = (  # (steps, name, label): sums per repeat
    (("umoci_unpack", "mkfs_btrfs_umoci"), UMOCI_BASELINE,
     "**baseline: umoci unpack + mkfs.btrfs --rootdir**"),
    (("tar_x", "mkfs_btrfs"), TAR_BASELINE, "**baseline: tar -x + mkfs.btrfs --rootdir**"),
    (("tar_x", "mksquashfs"), "tar_x+mksquashfs", "tar -x + mksquashfs uncompressed"),
    (("tar_x", "mkfs_erofs"), "tar_x+mkfs_erofs", "tar -x + mkfs.erofs uncompressed"),
)  # fmt: skip


def run_build(
    bi: BuildInput, workdir: Path, peers: bool, only: set[str] | None = None
) -> tuple[list[Result], dict[str, str]]:
    """Every runnable step on one input, ``bi.repeats`` times in turn; then the pipelines."""
    scratch = workdir / "scratch"
    remove(scratch)
    scratch.mkdir(parents=True)
    _write_specs(scratch, bi.tar, bi.layout, bi.ref)
    log = workdir / "bench.log"
    pack_bytes = bi.stats.unique_bytes or bi.stats.content_bytes
    job = Job(bi.tar, bi.layout, bi.ref, scratch / "tree", scratch / "umoci-bundle", pack_bytes)
    dirs = {"tree": job.tree, "umoci": job.umoci}
    steps, skipped = _runnable(bi, peers, only)
    compile_builders()
    results = {s.name: Result(s.name, s.label, []) for s in steps}
    stack = contextlib.ExitStack()
    reflink_scratch = scratch
    if any(s.reflink_fs for s in steps):
        _log("creating a loop-mounted btrfs for the reflink row (untimed) ...")
        reflink_scratch = stack.enter_context(_reflink_fs(workdir, bi.tar))
    try:
        for i in range(bi.repeats):
            _log(f"{bi.name}: repeat {i + 1}/{bi.repeats}")
            for s in in_turn(steps, i):
                res = results[s.name]
                if res.error:
                    continue
                if s.makes:  # one extracted tree on disk at a time (untimed removal)
                    for d in dirs.values():
                        remove(d)
                    if s.makes == "tree":
                        job.tree.mkdir()
                if s.uses:
                    maker = results.get(MAKERS[s.uses])
                    if maker is None or maker.error or not dirs[s.uses].is_dir():
                        res.error = f"{MAKERS[s.uses]} failed or did not run"
                        continue
                _measure(s, res, job, reflink_scratch if s.reflink_fs else scratch, log)
            for d in dirs.values():
                remove(d)
    finally:
        stack.close()
        remove(scratch)
    out = [results[s.name] for s in steps]
    for parts, name, label in PIPELINES:
        if all(p in results for p in parts):
            p = pipeline(name, label, [results[x] for x in parts])
            out.insert(out.index(results[parts[-1]]) + 1, p)
    return out, skipped


def compile_builders() -> None:
    """Byte-compile ours and the baseline builder (untimed), as an install does: a builder
    run with PYTHONDONTWRITEBYTECODE=1 (or from a read-only checkout) would otherwise
    compile every module on every run (~75 ms of CPU per build here)."""
    for d in (ROOT, *map(Path, BASELINE_BUILDER)):
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", str(d / "btrfs_ublk_image")], check=True
        )


def profile_ours(data: inp.Inputs, workdir: Path, top: int = 25) -> dict[str, Any]:
    """One extra (untimed, cold-cache) build under cProfile; the top functions by own time."""
    scratch = workdir / "scratch"
    remove(scratch)
    scratch.mkdir(parents=True)
    prof = workdir / "ours.prof"
    out = scratch / "ours.bundle"
    drop_caches()
    cmd = [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "btrfs_ublk_image"]
    cmd += ["build", str(data.spec), "-o", str(out)]
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    finally:
        remove(scratch)
    st = pstats.Stats(str(prof))
    total = float(st.total_tt)  # type: ignore[attr-defined]
    rows = []
    stats: dict[Any, Any] = st.stats  # type: ignore[attr-defined]
    for (file, line, func), (_cc, nc, tt, ct, _callers) in sorted(
        stats.items(), key=lambda kv: -kv[1][2]
    )[:top]:
        where = f"{Path(file).name}:{line}" if line else file
        rows.append({"function": f"{where}({func})", "calls": nc, "tottime_s": tt, "cumtime_s": ct})
    return {"profile": str(prof), "total_s": total, "top_by_tottime": rows}


def _print_profile(p: dict[str, Any]) -> None:
    print(f"\ncProfile of one build ({p['total_s']:.1f} s under the profiler; {p['profile']}):")
    print(f"{'own s':>8} {'cum s':>8} {'calls':>10}  function")
    for r in p["top_by_tottime"]:
        print(f"{r['tottime_s']:8.2f} {r['cumtime_s']:8.2f} {r['calls']:10d}  {r['function']}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/run", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="10,000 files + 256 MiB instead of 100,000 + 2 GiB"
    )
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    ap.add_argument(
        "--workdir",
        metavar="DIR",
        default=str(DEFAULT_WORKDIR),
        help=f"inputs cache and scratch space (default {DEFAULT_WORKDIR})",
    )
    ap.add_argument(
        "--repeat", type=int, default=3, metavar="N", help="runs of each command (default 3)"
    )
    ap.add_argument(
        "--debian-repeat",
        type=int,
        default=5,
        metavar="N",
        help="build section: runs of each command on the (small) Debian input (default 5)",
    )
    ap.add_argument(
        "--build-inputs",
        default="synthetic,debian",
        metavar="LIST",
        help="build section: comma-separated subset of synthetic,debian (default both)",
    )
    ap.add_argument("--no-peers", action="store_true", help="skip mksquashfs and mkfs.erofs")
    ap.add_argument(
        "--baseline-builder",
        metavar="DIR",
        help="build section: also time the builder in DIR (a `git archive` export of an"
        " earlier commit), with this venv's Python; DIR also holds that commit's"
        " btrfs_ublk_native package when the extension's interface differs",
    )
    ap.add_argument(
        "--steps",
        metavar="LIST",
        help="build section: only these steps (comma-separated names, e.g. ours,ours_python)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also run one build under cProfile and print where the time goes",
    )
    ap.add_argument(
        "--update-docs", action="store_true", help="rewrite the Build section of docs/benchmarks.md"
    )
    ap.add_argument(
        "--from-json",
        metavar="FILE",
        help="run nothing: print (and with --update-docs write) the report of a saved --json FILE",
    )
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    ap.add_argument(
        "--baseline-ublkd",
        metavar="PATH",
        help="latency section: a second ublkd binary (e.g. built from the previous commit)"
        " measured beside this checkout's",
    )
    ap.add_argument(
        "--fio-runtime",
        type=float,
        metavar="S",
        help="seconds per fio job (default 10, --quick 3; at most 2 in the VM)",
    )
    args = ap.parse_args(argv)  # fmt: skip

    if args.baseline_builder:
        BASELINE_BUILDER[:] = [str(Path(args.baseline_builder).resolve())]
    if args.from_json:
        saved: dict[str, Any] = json.loads(Path(args.from_json).read_text())
        return _emit(saved, args, Path(args.workdir))
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sections - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    build_inputs = {x.strip() for x in args.build_inputs.split(",") if x.strip()}
    bad = build_inputs - set(BUILD_INPUTS)
    if bad:
        ap.error(f"unknown build input(s): {', '.join(sorted(bad))}")

    params = QUICK if args.quick else FULL
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    data: inp.Inputs | None = None  # the synthetic set: made only for the sections that read it
    if sections & SYNTHETIC_SECTIONS or ("build" in sections and "synthetic" in build_inputs):
        cached = (workdir / "inputs" / params.key / "input.json").exists()
        _check_disk(workdir, params, cached, bool(sections & SYNTHETIC_SECTIONS))
        data = inp.ensure_inputs(workdir, params, log=_log)
        s = data.stats
        _log(
            f"input: {data.tar} ({s.tar_bytes / 2**20:.0f} MiB tar, {s.entries:,} entries,"
            f" {s.content_bytes / 2**20:.0f} MiB content)"
        )
    can_drop = drop_caches()
    machine = machine_info()
    commit = _git_state()  # before the run: other work may land in the checkout meanwhile
    command = "bench/run" + (" --quick" if args.quick else "")
    if sections != set(SECTIONS):
        command += " --sections " + ",".join(s for s in SECTIONS if s in sections)
    doc: dict[str, Any] = {"command": command, "machine": machine}
    if "build" in sections:
        doc["build"] = _run_build_section(args, params, data, workdir, can_drop, commit)
    runtime_s = args.fio_runtime or (3.0 if args.quick else 10.0)
    if "latency" in sections:
        from bench.latency import measure_latency

        doc["latency"] = measure_latency(workdir / "latency", args.repeat, args.baseline_ublkd)
    if "latency_vm" in sections:
        from bench.latency import measure_latency_vm

        doc["latency_vm"] = measure_latency_vm(
            workdir / "latency", args.repeat, args.baseline_ublkd
        )
    if "soak" in sections:
        from bench.soak import measure_soak

        doc["soak"] = measure_soak(workdir / "soak")
    if "soak_vm" in sections:
        from bench.soak import measure_soak_vm

        doc["soak_vm"] = measure_soak_vm()
    if "passthrough" in sections:
        from bench.passthrough import measure_passthrough

        doc["passthrough"] = measure_passthrough(workdir, runtime_s)
    if sections - {"build", "latency", "latency_vm", "soak", "soak_vm", "passthrough"}:
        from bench.runtime import run_runtime

        doc["runtime_commit"] = commit
        doc.update(run_runtime(sections, workdir, data, max(1, args.repeat), runtime_s))
    return _emit(doc, args, workdir)


def _build_inputs(
    args: argparse.Namespace, params: inp.InputParams, data: inp.Inputs | None, log: Path
) -> tuple[list[BuildInput], dict[str, str]]:
    """The inputs of the build section, with their OCI layouts (made and cached untimed)."""
    wanted = {x.strip() for x in args.build_inputs.split(",") if x.strip()}
    out: list[BuildInput] = []
    skipped: dict[str, str] = {}
    if "synthetic" in wanted:
        assert data is not None, "main makes the synthetic set for the build section"
        layout = inp.ensure_oci_layout(data, log=_log)
        about = {
            "params": asdict(params),
            "tar": str(data.tar),
            "stats": data.stats.to_json(),
            "description": "",
            "oci": {"layout": str(layout), "ref": inp.OCI_REF,
                    "layers": inp.layout_layers(layout, inp.OCI_REF)},
        }  # fmt: skip
        out.append(BuildInput("synthetic", "Synthetic set", data.tar, layout, inp.OCI_REF,
                              data.stats, max(1, args.repeat), about))  # fmt: skip
    for key, (extra, what) in EXTRA_INPUTS.items():
        if key in wanted:  # generated like the synthetic set; tarball rows only
            made = inp.ensure_inputs(Path(args.workdir).resolve(), extra, log=_log)
            about = {"params": asdict(extra), "tar": str(made.tar), "description": what,
                     "stats": made.stats.to_json()}  # fmt: skip
            out.append(BuildInput(key, f"Generated: {what}", made.tar, None, "", made.stats,
                                  max(1, args.repeat), about))  # fmt: skip
    if "debian" in wanted:
        from bench.runtime import DEBIAN_REF, debian_inputs

        tar, why = debian_inputs(log)
        if tar is None:
            skipped["debian"] = why
        else:
            debian_layout: Path | None = tar.parent / "oci"
            about = {"tar": str(tar), "description": DEBIAN_ABOUT}
            if (tar.parent / DEBIAN_DONE).exists():  # prepare.sh wrote the layout too
                about["oci"] = {"layout": str(debian_layout), "ref": DEBIAN_REF,
                                "layers": inp.layout_layers(tar.parent / "oci", DEBIAN_REF)}  # fmt: skip
            else:
                debian_layout = None
            stats = inp.tar_stats(tar)
            about["stats"] = stats.to_json()
            out.append(BuildInput("debian", "Debian image", tar, debian_layout, DEBIAN_REF,
                                  stats, max(1, args.debian_repeat), about))  # fmt: skip
    return out, skipped


# prepare.sh writes it after rootfs.tar and the OCI layout
DEBIAN_DONE = "inputs.done"
DEBIAN_ABOUT = (
    "Debian bookworm minbase (pinned packages, mmdebstrap; `specs/golden/debian/prepare.sh`,"
    " cached): rootfs.tar, the tree as one tarball, and the two-layer OCI layout prepare.sh"
    " writes. "
)


def _run_build_section(
    args: argparse.Namespace,
    params: inp.InputParams,
    data: inp.Inputs | None,
    workdir: Path,
    can_drop: bool,
    commit: str | None,
) -> dict[str, Any]:
    cache_policy = (
        "Page cache dropped before each of ours' rows, before `umoci unpack`, before"
        " `tar -x` and before `mksquashfs -tar` (cold input); the steps that follow"
        " `umoci unpack` and `tar -x` read the unpacked tree warm, as a pipeline would."
        " umoci's bundle and the extracted tree are removed untimed after their last"
        " step. Each command is followed by an untimed `sync`."
        if can_drop
        else "Page cache NOT dropped (not root): the input is warm for every command."
    )
    log = workdir / "bench.log"
    log.write_bytes(b"")
    inputs, skipped_inputs = _build_inputs(args, params, data, log)
    per_input: dict[str, Any] = {}
    for bi in inputs:
        s = bi.stats
        _log(f"build: {bi.name} ({s.entries:,} entries, {s.content_bytes / 2**20:.0f} MiB)")
        only = {x.strip() for x in args.steps.split(",")} if args.steps else None
        results, skipped = run_build(bi, workdir, not args.no_peers, only)
        speedups: dict[str, dict[str, float]] = {}
        for base_name in (UMOCI_BASELINE, TAR_BASELINE):
            base = next((r for r in results if r.name == base_name and r.ok), None)
            if base is not None:
                speedups[base_name] = {
                    r.name: base.wall_median / r.wall_median for r in results if r.ok
                }
        per_input[bi.name] = {
            "label": bi.label,
            "repeats": bi.repeats,
            "input": bi.about,
            "results": {r.name: r.to_json(s.content_bytes, s.entries) for r in results},
            "speedup_vs_baseline": speedups,
            "skipped": skipped,
        }
    build: dict[str, Any] = {
        "command": "bench/run" + (" --quick" if args.quick else ""),
        "builder_commit": commit,
        "repeats": max(1, args.repeat),
        "cache_policy": cache_policy,
        "inputs": per_input,
        "skipped_inputs": skipped_inputs,
    }
    if args.profile and data is not None and "synthetic" in per_input:
        build["profile"] = profile_ours(data, workdir)
    return build


def _emit(doc: dict[str, Any], args: argparse.Namespace, workdir: Path) -> int:
    """Print the report; write the JSON and the docs sections if asked."""
    failed = _emit_build(doc, args) if "build" in doc else []
    failed += _emit_runtime(doc, args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        _log(f"JSON written to {args.json}")
    if failed:
        _log(f"failed: {', '.join(failed)} (see {workdir / 'bench.log'})")
        return 1
    return 0


VM_SAME = "The same through ublk in the VM (TCG)"


def _emit_table(
    doc: dict[str, Any],
    update_docs: bool,
    key: str,
    title: str,
    table: Callable[[dict[str, Any]], str],
) -> None:
    """Section ``key``'s one table, printed under ``title`` and, with --update-docs, put
    into its block of docs/benchmarks.md."""
    if key not in doc:
        return
    text = table(doc[key])
    print(f"\n{title}:\n")
    print(text)
    if update_docs:
        update_doc(ROOT / "docs" / "benchmarks.md", key, text)


def _emit_runtime(doc: dict[str, Any], args: argparse.Namespace) -> list[str]:
    failed: list[str] = []
    path = ROOT / "docs" / "benchmarks.md"
    if "mount" in doc:
        print("\nMount (until the first file is readable):\n")
        print(mount_table(doc["mount"]["images"]))
        for img in doc["mount"]["images"].values():
            failed += [f"mount {k}" for k, r in img["results"].items() if r.get("error")]
        if args.update_docs:
            update_doc(path, "mount", mount_section(doc))
    if "laziness" in doc:
        print("\nLaziness (ublkd counters, Debian image):\n")
        print(laziness_table(doc["laziness"]))
        if args.update_docs:
            update_doc(path, "laziness", laziness_section(doc))
    if "randread" in doc:
        print("\nRandom reads (fio, 4 KiB, O_DIRECT), host:\n")
        print(
            randread_table(
                doc["randread"], [("ours_fuse", "btrfs_loop"), ("ours_fuse", "squashfuse")]
            )
        )
        failed += [f"randread {k}" for k in doc["randread"].get("errors", {})]
    if "randread_vm" in doc:
        print("\nRandom reads in the VM (ratios only):\n")
        print(randread_table(doc["randread_vm"], VM_FS_RATIOS + VM_RAW_RATIOS))
        failed += [f"randread_vm {k}" for k in doc["randread_vm"].get("errors", {})]
    if "remote" in doc:
        print("\nRemote cold start over nginx (Debian image):\n")
        print(remote_table(doc["remote"]))
        if args.update_docs:
            update_doc(path, "remote", remote_section(doc))
    if "delta" in doc:
        from bench.delta import delta_section, delta_table

        print("\nv2 after v1 (Debian image, a few packages replaced):\n")
        print(delta_table(doc["delta"]))
        if args.update_docs:
            update_doc(path, "delta", delta_section(doc))
    if "containerd" in doc:
        print("\nContainers from a registry, cold (Debian image):\n")
        print(containerd_table(doc["containerd"]))
        if args.update_docs:
            update_doc(path, "containerd", containerd_section(doc))
    if "latency" in doc or "latency_vm" in doc:
        from bench.latency import latency_table

        title = "Cold random reads of a remote bundle behind injected latency (fuse)"
        _emit_table(doc, args.update_docs, "latency", title, latency_table)
        _emit_table(doc, args.update_docs, "latency_vm", VM_SAME, latency_table)
    if "soak" in doc or "soak_vm" in doc:
        from bench.soak import soak_table

        title = "Soak: SIGKILLs of the server and a fault-injecting proxy (fuse)"
        _emit_table(doc, args.update_docs, "soak", title, soak_table)
        _emit_table(doc, args.update_docs, "soak_vm", VM_SAME, soak_table)
    if "passthrough" in doc:
        from bench.passthrough import passthrough_table

        title = "FUSE passthrough vs the page-cached FUSE file vs btrfs on a loop device"
        _emit_table(doc, args.update_docs, "passthrough", title, passthrough_table)
    if "randread" in doc and args.update_docs:
        update_doc(path, "randread", randread_section(doc))
    for name, why in doc.get("runtime_skipped", {}).items():
        print(f"skipped {name}: {why}")
    if args.update_docs and any(
        k in doc for k in ("mount", "laziness", "randread", "remote", "containerd")
    ):
        _log(f"{path}: runtime sections updated")
    return failed


def _emit_build(doc: dict[str, Any], args: argparse.Namespace) -> list[str]:
    b = doc["build"]
    print(f"\nBuild benchmark ({b['command']}; builder {b.get('builder_commit')})")
    print(b["cache_policy"])
    failed: list[str] = []
    for name, one in build_inputs(b).items():
        st = one["input"]["stats"]
        results = input_results(one)
        print(
            f"\n{one.get('label', name)}: {st['entries']:,} entries,"
            f" {st['content_bytes'] / 2**20:.0f} MiB content; {repeats_text(one.get('repeats'))}\n"
        )
        print(build_table(results, st["content_bytes"], st["entries"]))
        for line in build_summary(results, st["entries"]):
            print(line)
        for step, why in one.get("skipped", {}).items():
            print(f"skipped {step}: {why}")
        failed += [f"{name} {r.name}" for r in results if r.error]
    for name, why in b.get("skipped_inputs", {}).items():
        print(f"skipped input {name}: {why}")
    if "profile" in b:
        _print_profile(b["profile"])
    if args.update_docs:
        path = ROOT / "docs" / "benchmarks.md"
        update_doc(path, "build", build_section(doc))
        _log(f"{path}: Build section updated")
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
