"""Build benchmark: ``btrfs-ublk-image build`` vs ``tar -x`` + ``mkfs.btrfs --rootdir`` and peers.

Run as ``bench/run [--quick] [--json OUT] [--workdir DIR] [--repeat N] [--profile]
[--update-docs]``. One run measures, side by side and on the same cached input
(bench/inputs.py), each of:

* ours: ``btrfs-ublk-image build spec.yaml -o OUT`` on a spec with one tar layer;
* ours, tar in place: the same with ``in_place: true`` on the tar layer (the tarball
  becomes a pack of the bundle: a reflink, or a copy on filesystems without them), in
  the work directory and (root) on a loop-mounted btrfs, where the copy is a reflink;
* the baseline: ``tar -xf`` into a directory, then ``mkfs.btrfs --rootdir`` on it;
* peers on the extracted tree (when installed): ``mksquashfs`` and ``mkfs.erofs``,
  both uncompressed; and ``mksquashfs -tar`` straight from the tarball.

Each repeat drops the page cache (when root) before ours and before ``tar -x``, so
both read the input tarball cold; the steps after ``tar -x`` find the extracted tree
warm in the page cache, as a shell pipeline would. Every command is followed by an
untimed ``sync``. Outputs and the extracted tree are deleted after each step.

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
    build_section,
    build_table,
    laziness_section,
    laziness_table,
    machine_info,
    mount_section,
    mount_table,
    randread_section,
    randread_table,
    remote_section,
    remote_table,
    update_doc,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKDIR = Path("/var/tmp/btrfs-ublk-image-bench")
FULL = inp.InputParams(files=100_000, large_bytes=2 << 30, large_count=4)
QUICK = inp.InputParams(files=10_000, large_bytes=256 << 20, large_count=4)
GiB = 1 << 30
IN_PLACE_SPEC = "spec-in-place.yaml"  # written into scratch: the input's spec, tar in place
SECTIONS = ("build", "mount", "randread", "laziness", "vm", "remote")


@dataclass
class Step:
    """One measured command of a repeat; ``cmd`` gets (tar, spec, tree, output path)."""

    name: str
    label: str
    output: str | None  # file or directory name under scratch, None for tar -x
    make_cmd: Callable[[Path, Path, Path, Path], list[str]]
    needs: str | None = None  # the executable that must exist
    stdin_tar: bool = False
    presize: bool = False  # create the output file sparse first (mkfs.btrfs)
    cold: bool = False  # drop caches before it
    reflink_fs: bool = False  # input copy and output on a loop-mounted btrfs (reflinks work)


def _steps() -> list[Step]:
    py = sys.executable
    return [
        Step(
            "ours",
            "**ours: btrfs-ublk-image build**",
            "ours.bundle",
            lambda tar, spec, tree, out: [py, "-m", "btrfs_ublk_image", "build", str(spec), "-o", str(out)],
            cold=True,
        ),
        Step(
            "ours_in_place",
            "**ours, tar in place**",
            "ours-in-place.bundle",
            lambda tar, spec, tree, out: [
                py, "-m", "btrfs_ublk_image", "build", str(out.parent / IN_PLACE_SPEC),
                "-o", str(out),
            ],
            cold=True,
        ),
        Step(
            "ours_in_place_reflink",
            "**ours, tar in place, reflink** (on a loop-mounted btrfs)",
            "ours-in-place.bundle",
            lambda tar, spec, tree, out: [
                py, "-m", "btrfs_ublk_image", "build", str(out.parent / IN_PLACE_SPEC),
                "-o", str(out),
            ],
            needs="mkfs.btrfs",
            cold=True,
            reflink_fs=True,
        ),
        Step(
            "tar_x",
            "tar -x (step)",
            None,
            lambda tar, spec, tree, out: ["tar", "-xf", str(tar), "-C", str(tree)],
            needs="tar",
            cold=True,
        ),
        Step(
            "mkfs_btrfs",
            "mkfs.btrfs --rootdir (step)",
            "btrfs.img",
            lambda tar, spec, tree, out: [
                "mkfs.btrfs", "-q", "-K", "--shrink", "--rootdir", str(tree), str(out),
            ],
            needs="mkfs.btrfs",
            presize=True,
        ),
        Step(
            "mksquashfs",
            "mksquashfs uncompressed (step)",
            "tree.squashfs",
            lambda tar, spec, tree, out: [
                "mksquashfs", str(tree), str(out), "-noappend", "-no-progress",
                "-noI", "-noD", "-noF", "-noX",
            ],
            needs="mksquashfs",
        ),
        Step(
            "mkfs_erofs",
            "mkfs.erofs uncompressed (step)",
            "tree.erofs",
            lambda tar, spec, tree, out: ["mkfs.erofs", str(out), str(tree)],
            needs="mkfs.erofs",
        ),
        Step(
            "mksquashfs_tar",
            "mksquashfs -tar, uncompressed (from the tarball)",
            "tar.squashfs",
            lambda tar, spec, tree, out: [
                "mksquashfs", "-", str(out), "-tar", "-noappend", "-no-progress",
                "-noI", "-noD", "-noF", "-noX",
            ],
            needs="mksquashfs",
            stdin_tar=True,
            cold=True,
        ),
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


def _measure(
    step: Step, res: Result, data: inp.Inputs, scratch: Path, tree: Path, log: Path
) -> None:
    out = scratch / (step.output or "unused")
    if step.output:
        remove(out)
    if step.presize:
        with open(out, "wb") as f:
            f.truncate(2 * data.stats.content_bytes + 2 * GiB)
    cmd = step.make_cmd(data.tar, data.spec, tree, out)
    res.cmd = cmd
    if step.cold:
        drop_caches()
    sample = run_measured(cmd, log, stdin=data.tar if step.stdin_tar else None)
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
    _log(f"  {step.name}: {sample.wall_s:.2f} s, peak RSS {sample.maxrss_kib / 1024:.0f} MiB")


def _in_place_spec(directory: Path, tar: Path) -> None:
    (directory / IN_PLACE_SPEC).write_text(
        f"version: 1\nname: bench\nlayers:\n  - tar: {{path: {tar}, in_place: true}}\n"
    )


@contextlib.contextmanager
def _reflink_fs(workdir: Path, data: inp.Inputs) -> Iterator[Path]:
    """A btrfs on a loop device (this host's work filesystem, ext4, has no reflinks)
    holding a copy of the input tarball (untimed), for the reflink row. Torn down after."""
    img = workdir / "reflinkfs.img"
    mnt = workdir / "reflinkfs"
    remove(img)
    mnt.mkdir(exist_ok=True)
    with open(img, "wb") as f:
        f.truncate(data.tar.stat().st_size * 2 + 8 * GiB)
    mounted = False
    try:
        subprocess.run(["mkfs.btrfs", "-q", "-f", str(img)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
        mounted = True
        tar = mnt / "input.tar"
        shutil.copyfile(data.tar, tar)
        _in_place_spec(mnt, tar)
        yield mnt
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)
        remove(img)
        mnt.rmdir()


def run_build(
    data: inp.Inputs, workdir: Path, repeats: int, peers: bool
) -> tuple[list[Result], dict[str, str]]:
    scratch = workdir / "scratch"
    remove(scratch)
    scratch.mkdir(parents=True)
    _in_place_spec(scratch, data.tar)
    log = workdir / "bench.log"
    log.write_bytes(b"")
    tree = scratch / "tree"
    skipped: dict[str, str] = {}
    steps = []
    for s in _steps():
        if not peers and s.name in ("mksquashfs", "mkfs_erofs", "mksquashfs_tar"):
            continue
        if s.needs and shutil.which(s.needs) is None:
            skipped[s.name] = f"{s.needs} not installed"
            continue
        if s.name == "mksquashfs_tar" and not _supports_squashfs_tar():
            skipped[s.name] = "mksquashfs has no -tar"
            continue
        if s.reflink_fs and os.geteuid() != 0:
            skipped[s.name] = "mounting a loop device needs root"
            continue
        steps.append(s)
    results = {s.name: Result(s.name, s.label, []) for s in steps}
    stack = contextlib.ExitStack()
    reflink_scratch = scratch
    if any(s.reflink_fs for s in steps):
        _log("creating a loop-mounted btrfs for the reflink row (untimed) ...")
        reflink_scratch = stack.enter_context(_reflink_fs(workdir, data))
    try:
        for i in range(repeats):
            _log(f"repeat {i + 1}/{repeats}")
            for s in steps:
                res = results[s.name]
                if res.error:
                    continue
                if s.name == "tar_x":
                    remove(tree)
                    tree.mkdir()
                needs_tree = s.name in ("mkfs_btrfs", "mksquashfs", "mkfs_erofs")
                if needs_tree and (results["tar_x"].error or not tree.is_dir()):
                    res.error = "tar -x failed"
                    continue
                _measure(s, res, data, reflink_scratch if s.reflink_fs else scratch, tree, log)
            remove(tree)
    finally:
        stack.close()
        remove(scratch)
    out = [results[s.name] for s in steps]
    if "tar_x" in results:
        tx = results["tar_x"]
        for name, label in (
            ("mkfs_btrfs", "**baseline: tar -x + mkfs.btrfs --rootdir**"),
            ("mksquashfs", "tar -x + mksquashfs uncompressed"),
            ("mkfs_erofs", "tar -x + mkfs.erofs uncompressed"),
        ):
            if name in results:
                p = pipeline(f"tar_x+{name}", label, [tx, results[name]])
                out.insert(out.index(results[name]) + 1, p)
    return out, skipped


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
    ap.add_argument("--no-peers", action="store_true", help="skip mksquashfs and mkfs.erofs")
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
        "--fio-runtime",
        type=float,
        metavar="S",
        help="seconds per fio job (default 10, --quick 3; at most 2 in the VM)",
    )
    args = ap.parse_args(argv)  # fmt: skip

    if args.from_json:
        saved: dict[str, Any] = json.loads(Path(args.from_json).read_text())
        built = saved.get("build", {}).get("results", {})
        return _emit(
            saved, [Result.from_json(k, v) for k, v in built.items()], args, Path(args.workdir)
        )
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sections - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s): {', '.join(sorted(unknown))}")

    params = QUICK if args.quick else FULL
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    cached = (workdir / "inputs" / params.key / "input.json").exists()
    _check_disk(workdir, params, cached, bool(sections & {"mount", "randread"}))
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
    results: list[Result] = []
    if "build" in sections:
        doc["build"], results = _run_build_section(args, params, data, workdir, can_drop, commit)
    runtime_s = args.fio_runtime or (3.0 if args.quick else 10.0)
    if sections - {"build"}:
        from bench.runtime import run_runtime

        doc["runtime_commit"] = commit
        doc.update(run_runtime(sections, workdir, data, max(1, args.repeat), runtime_s))
    return _emit(doc, results, args, workdir)


def _run_build_section(
    args: argparse.Namespace,
    params: inp.InputParams,
    data: inp.Inputs,
    workdir: Path,
    can_drop: bool,
    commit: str | None,
) -> tuple[dict[str, Any], list[Result]]:
    s = data.stats
    cache_policy = (
        "Page cache dropped before ours, before `tar -x` and before `mksquashfs -tar` (cold"
        " input tarball); the steps that follow `tar -x` read the extracted tree warm, as a"
        " pipeline would. Each command is followed by an untimed `sync`."
        if can_drop
        else "Page cache NOT dropped (not root): the input is warm for every command."
    )
    results, skipped = run_build(data, workdir, max(1, args.repeat), not args.no_peers)
    ours = next((r for r in results if r.name == "ours"), None)
    ratios = {}
    if ours is not None and ours.ok:
        for r in results:
            if r.ok and r is not ours:
                ratios[r.name] = r.wall_median / ours.wall_median
    build: dict[str, Any] = {
        "command": "bench/run" + (" --quick" if args.quick else ""),
        "builder_commit": commit,
        "repeats": max(1, args.repeat),
        "cache_policy": cache_policy,
        "input": {"params": asdict(params), "tar": str(data.tar), "stats": s.to_json()},
        "results": {r.name: r.to_json(s.content_bytes, s.entries) for r in results},
        "speedup_of_ours": ratios,
        "skipped": skipped,
    }
    if args.profile and ours is not None and ours.ok:
        build["profile"] = profile_ours(data, workdir)
    return build, results


def _emit(
    doc: dict[str, Any], results: list[Result], args: argparse.Namespace, workdir: Path
) -> int:
    """Print the report; write the JSON and the docs sections if asked."""
    failed = _emit_build(doc, results, args) if "build" in doc else []
    failed += _emit_runtime(doc, args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        _log(f"JSON written to {args.json}")
    if failed:
        _log(f"failed: {', '.join(failed)} (see {workdir / 'bench.log'})")
        return 1
    return 0


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
        print(
            randread_table(
                doc["randread_vm"], [("ours_ublk", "btrfs_loop"), ("ours_fuse", "btrfs_loop")]
            )
        )
        failed += [f"randread_vm {k}" for k in doc["randread_vm"].get("errors", {})]
    if "remote" in doc:
        print("\nRemote cold start over nginx (Debian image):\n")
        print(remote_table(doc["remote"]))
        if args.update_docs:
            update_doc(path, "remote", remote_section(doc))
    if "randread" in doc and args.update_docs:
        update_doc(path, "randread", randread_section(doc))
    for name, why in doc.get("runtime_skipped", {}).items():
        print(f"skipped {name}: {why}")
    if args.update_docs and any(k in doc for k in ("mount", "laziness", "randread", "remote")):
        _log(f"{path}: runtime sections updated")
    return failed


def _emit_build(doc: dict[str, Any], results: list[Result], args: argparse.Namespace) -> list[str]:
    b = doc["build"]
    st = b["input"]["stats"]
    table = build_table(results, st["content_bytes"], st["entries"], "ours")
    print()
    print(
        f"Build benchmark ({b['command']}; {st['entries']:,} entries,"
        f" {st['content_bytes'] / 2**20:.0f} MiB content; {b['repeats']} repeats;"
        f" builder {b.get('builder_commit')})"
    )
    print(b["cache_policy"])
    print()
    print(table)
    for name, why in b.get("skipped", {}).items():
        print(f"skipped {name}: {why}")
    by = {r.name: r for r in results}
    base = by.get("tar_x+mkfs_btrfs")
    for name in ("ours", "ours_in_place", "ours_in_place_reflink"):
        ours = by.get(name)
        if ours is None or base is None or not ours.ok or not base.ok:
            continue
        for what, x in (
            ("median wall", base.wall_median / ours.wall_median),
            ("median wall + sync", base.synced_median / ours.synced_median),
        ):
            verdict = f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"
            print(f"{name} vs baseline (tar -x + mkfs.btrfs --rootdir): {verdict} ({what})")
    if "profile" in b:
        _print_profile(b["profile"])
    if args.update_docs:
        path = ROOT / "docs" / "benchmarks.md"
        update_doc(path, "build", build_section(doc, table))
        _log(f"{path}: Build section updated")
    return [r.name for r in results if r.error]


if __name__ == "__main__":
    raise SystemExit(main())
