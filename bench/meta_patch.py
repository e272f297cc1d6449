"""How large a delta image's meta.img patch is, by kind of change (issue 24).

v1 is a tree (the 100,000-file synthetic tree, or the Debian minbase tarball extracted);
each v2 is v1 with one kind of change that keeps every other path's inode number and
data offsets (the writer assigns those afresh; see docs/design.md):

* ``xattr``: a ``user.`` xattr added to every 100th regular file;
* ``rename``: every 100th regular file renamed to a longer name that sorts where its
  old one did among its siblings;
* ``append``: files numbering 1% of v1's regular files added to the directory walked
  last (DFS, sorted names), with names after its last: new inodes after every old one;
* ``resize``: every 100th regular file given new bytes of another size (+-50%);
* ``addremove``: every 100th regular file removed and a new one added beside it;
* ``bound``: the issue's case: ``resize``, plus one file added and one removed.

The last three renumber inodes and move extents with the writer of main; they stay put
only where the writer keeps the base's inode numbers and device-2 offsets.

For each: v1 built, v2 built with ``--base`` v1, by this checkout and by a baseline
checkout (``--baseline-src``, the same builder before this work); reported: the patch of
meta.img (the manifest's ``patches``), meta.img's size, the 16 KiB blocks of meta.img that
differ from v1's, those that differ only in the block header (fsid, checksum), the bytes
a push of v2 to a registry holding v1 uploads and a host holding v1 fetches (``diff
--delta``: new chunks or packs, manifest, patches) against the changed bytes (v2's
files whose content v1 lacks at that path; the issue's bound is these + 10 %). With
``--levels``, also the time and size of the patch at each zstd level (patch.py's
parameters otherwise, between block forms as builds make it).

Run: ``.venv/bin/python -m bench.meta_patch --input synthetic --work DIR [--baseline-src SRC]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EVERY = 100
KINDS = ("xattr", "rename", "append", "resize", "addremove", "bound")
HEADER = 101  # bytes of a tree block's header


def regular_files(root: Path) -> list[Path]:
    """Every regular file with one name in the tree, in sorted path order. Names outside
    it do not count: every file of a hard-linked copy (``cp -al``) of a tree is listed."""
    names: dict[tuple[int, int], list[Path]] = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                names.setdefault((st.st_dev, st.st_ino), []).append(p)
    return sorted(paths[0] for paths in names.values() if len(paths) == 1)


def _own_copy(p: Path) -> None:
    """Break ``p``'s hard link with v1's tree (v2 starts as ``cp -al``)."""
    tmp = p.with_name(p.name + ".tmp-own")
    shutil.copy2(p, tmp)
    st = p.lstat()
    os.chown(tmp, st.st_uid, st.st_gid)
    os.rename(tmp, p)


def make_v2(v1: Path, v2: Path, kind: str) -> int:
    """v2 = v1 with one kind of change; -> the number of files changed."""
    files = [v2 / p.relative_to(v1) for p in regular_files(v1)]
    subprocess.run(["cp", "-al", v1, v2], check=True)
    changed = 0
    if kind == "xattr":
        for p in files[::EVERY]:
            _own_copy(p)
            st = p.lstat()
            os.setxattr(p, "user.v2", b"tag-" + p.name.encode())
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
            changed += 1
    elif kind == "rename":
        for p in files[::EVERY]:
            siblings = sorted(os.listdir(p.parent))
            new = p.name + "-v2"
            at = siblings.index(p.name)
            after = siblings[at + 1] if at + 1 < len(siblings) else None
            if after is not None and not new < after:
                continue  # it would sort elsewhere: another inode order
            p.rename(p.with_name(new))
            changed += 1
    elif kind == "append":
        last = v2
        while True:
            subdirs = sorted(e.name for e in os.scandir(last) if e.is_dir(follow_symlinks=False))
            if not subdirs:
                break
            last = last / subdirs[-1]
        names = sorted(os.listdir(last))
        top = max([*names, ""])
        for i in range(len(files) // EVERY):
            data = os.urandom(1000 + (i * 7919) % 7000)
            p = last / f"{top}~{i:06d}"
            p.write_bytes(data)
            os.utime(p, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
            changed += 1
    elif kind in ("resize", "addremove", "bound"):
        for i, p in enumerate(files[::EVERY]):
            size = p.stat().st_size
            data = os.urandom(max(1, size + (i % 11 - 5) * size // 10))
            p.unlink()  # v1's file is a hard link of this one
            if kind == "addremove":
                p = p.with_name(p.name + "-new")
            p.write_bytes(data)
            os.utime(p, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
            changed += 1
        if kind == "bound":  # one file removed, one added beside it
            gone = files[EVERY // 2]
            gone.unlink()
            added = gone.with_name(gone.name + "-added")
            added.write_bytes(os.urandom(3000))
            os.utime(added, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
            changed += 2
    else:
        raise ValueError(kind)
    return changed


def _spec(path: Path, src: Path) -> Path:
    path.write_text(
        f"version: 1\nname: {path.stem}\nsource_date_epoch: 1700000000\n"
        f"layers:\n  - dir: {{path: {src}}}\n"
    )
    return path


def _build(src: Path | None, spec: Path, out: Path, *more: str | Path) -> float:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    t = time.monotonic()
    cmd = [sys.executable, "-m", "btrfs_ublk_image", "build", spec, "-o", out, *more]
    subprocess.run(cmd, check=True, env=env, cwd=src or ROOT, stdout=subprocess.DEVNULL)
    return time.monotonic() - t


def changed_bytes(v1: Path, v2: Path) -> int:
    """Bytes of v2's regular files whose content v1 does not have at the same path."""
    out = 0
    for p in regular_files(v2):
        old = v1 / p.relative_to(v2)
        if not (old.is_file() and (old.samefile(p) or old.read_bytes() == p.read_bytes())):
            out += p.stat().st_size
    return out


def transfer(src: Path | None, b1: Path, b2: Path) -> dict[str, int]:
    """``diff --delta b1 b2`` (by the builder in ``src``): what a registry or host holding
    v1 gets for v2."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    cmd = [sys.executable, "-m", "btrfs_ublk_image", "diff", "--delta", b1, b2]
    out = subprocess.run(cmd, env=env, cwd=src or ROOT, capture_output=True, text=True)
    if out.returncode not in (0, 1):  # 1: the bundles differ
        raise RuntimeError(f"diff --delta {b1} {b2}: {out.stderr.strip()}")
    return {k: int(v) for k, v in (line.split(": ") for line in out.stdout.splitlines())}


def compare(b1: Path, b2: Path) -> dict[str, Any]:
    m = json.loads((b2 / "manifest.json").read_text())
    a, b = (b1 / "meta.img").read_bytes(), (b2 / "meta.img").read_bytes()
    differ = header_only = 0
    n = 16384
    for off in range(0, max(len(a), len(b)), n):
        x, y = a[off : off + n], b[off : off + n]
        if x != y:
            differ += 1
            header_only += len(x) == len(y) == n and x[HEADER:] == y[HEADER:]
    return {
        "meta_img_bytes": len(b),
        "patch_bytes": m["patches"]["meta.img"]["size"],
        "blocks_differing": differ,
        "blocks_header_only": header_only,
    }


def level_times(b1: Path, b2: Path, levels: list[int]) -> list[dict[str, Any]]:
    from btrfs_ublk_image import patch

    base = patch.block_form((b1 / "meta.img").read_bytes())
    new = patch.block_form((b2 / "meta.img").read_bytes())
    out = []
    saved = patch.LEVEL
    try:
        for level in levels:
            patch.LEVEL = level
            t = time.process_time()
            p = patch.make(base, new)
            out.append({"level": level, "patch_bytes": len(p), "cpu_s": time.process_time() - t})
    finally:
        patch.LEVEL = saved
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", choices=("synthetic", "debian"), required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--files", type=int, default=100_000, help="synthetic tree's entries")
    ap.add_argument("--debian-tar", type=Path, help="the Debian minbase rootfs.tar")
    ap.add_argument("--baseline-src", type=Path, help="a checkout of the builder to compare")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--levels", default="", help="zstd levels to time, e.g. 3,9,19")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    v1 = work / "v1"
    if not v1.exists():
        tmp = work / "v1.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if args.input == "synthetic":
            from bench.inputs import InputParams, generate_tree

            generate_tree(tmp, InputParams(files=args.files, large_bytes=0, large_count=0))
        else:
            subprocess.run(["tar", "-xf", args.debian_tar, "-C", tmp], check=True)
        tmp.rename(v1)
    b1 = work / "b1"
    if not b1.exists():
        _build(None, _spec(work / "v1.yaml", v1), b1)
    builders: dict[str, Path | None] = {"ours": None}
    if args.baseline_src is not None:
        builders["baseline"] = args.baseline_src.resolve()
    results: dict[str, Any] = {
        "input": args.input,
        "v1_meta_img_bytes": (b1 / "meta.img").stat().st_size,
    }
    for kind in args.kinds.split(","):
        v2 = work / f"v2-{kind}"
        shutil.rmtree(v2, ignore_errors=True)
        changed = make_v2(v1, v2, kind)
        row: dict[str, Any] = {"files_changed": changed, "changed_bytes": changed_bytes(v1, v2)}
        for name, src in builders.items():
            b2 = work / f"b2-{kind}-{name}"
            shutil.rmtree(b2, ignore_errors=True)
            secs = _build(src, _spec(work / f"v2-{kind}.yaml", v2), b2, "--base", b1)
            row[name] = {"build_s": round(secs, 2), **compare(b1, b2)}
            d = transfer(src, b1, b2)
            # what a registry (push) or a host (fetch) holding v1 gets for v2, metadata included
            row[name]["push_bytes"] = d["push_bytes"] + d["meta_bytes"]
            row[name]["fetch_bytes"] = d["fetch_bytes"] + d["meta_bytes"]
            row[name]["diff_delta"] = d
            check = subprocess.run(
                ["btrfs", "check", "--readonly", b2 / "meta.img"], capture_output=True, text=True
            )
            row[name]["btrfs_check_rc"] = check.returncode
            if args.levels:
                row[name]["levels"] = level_times(b1, b2, [int(x) for x in args.levels.split(",")])
        results[kind] = row
        print(json.dumps({kind: row}), flush=True)
        shutil.rmtree(v2)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
