"""Runtime benchmarks: mount, random reads (host and VM), laziness. See docs/benchmarks.md.

Images (prepared untimed, deleted at the end):

* ``debian``: the Debian minbase rootfs tarball that specs/golden/debian/prepare.sh makes
  and caches (pinned minbase; the same cache as tests/test_golden.py), as a one-``tar:``-layer
  spec;
* ``synthetic``: the build benchmark's input tarball (bench/inputs.py).

For each: our bundle (``btrfs-ublk-image build``), the extracted tree (``tar -x``) and,
from that tree, an uncompressed squashfs (``mksquashfs -noI -noD -noF -noX``) and an
erofs image (``mkfs.erofs``, uncompressed), as in the Build section.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import inputs as inp
from bench.fio import MATRIX, FioJob, fio_args, parse_fio_json, run_fio
from bench.measure import Result, Sample, drop_caches, remove, tree_size
from bench.mounts import (
    Ublkd,
    btrfs_loop_mounted,
    erofs_loop_mounted,
    fuse_umount,
    mount_file_backed,
    read_direct,
    read_file,
    squashfuse_mount,
    squashfuse_mounted,
    umount,
)
from bench.remote import measure_remote

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DEBIAN = ROOT / "specs" / "golden" / "debian"
DEBIAN_CACHE = (
    Path(os.environ.get("BUI_GOLDEN_CACHE", "/var/tmp/btrfs-ublk-image-golden")) / "debian-pinned"
)
DEBIAN_REF = "bookworm"  # the ref of the OCI layout prepare.sh makes beside rootfs.tar
COUNTERS = ("reads", "bytes_served", "chunks_verified", "pack_bytes_read", "cache_hits")
VM_INPUT = inp.InputParams(files=200, large_bytes=64 << 20, large_count=1, seed=5)
MiB = 1 << 20


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _sh(cmd: Sequence[str | Path], log: Path, timeout: float = 3600) -> None:
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(map(str, cmd))}\n".encode())
        out.flush()
        subprocess.run(
            [str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, check=True,
            timeout=timeout,
        )  # fmt: skip


@dataclass
class Image:
    name: str
    label: str
    tar: Path
    spec: Path
    work: Path
    entries: int = 0
    content_bytes: int = 0
    probe: str = ""  # the "first file" read after mounting (relative path)

    @property
    def bundle(self) -> Path:
        return self.work / "bundle"

    @property
    def tree(self) -> Path:
        return self.work / "tree"

    @property
    def squashfs(self) -> Path:
        return self.work / "tree.squashfs"

    @property
    def erofs(self) -> Path:
        return self.work / "tree.erofs"

    @property
    def data_img(self) -> Path:
        return self.work / "dev2.img"


def debian_inputs(log: Path) -> tuple[Path | None, str]:
    """The cached pinned minbase tarball (made by prepare.sh on first use), or why not."""
    tar = DEBIAN_CACHE / "rootfs.tar"
    if not tar.exists():
        try:
            _sh(["bash", GOLDEN_DEBIAN / "prepare.sh", DEBIAN_CACHE], log)
        except (subprocess.CalledProcessError, OSError) as e:
            return None, f"specs/golden/debian/prepare.sh failed ({e}; see {log})"
    return tar, ""


def prepare_image(
    name: str, label: str, tar: Path, work: Path, log: Path, probe: str | None = None
) -> Image:
    """Bundle, extracted tree, squashfs and erofs of one input tarball (untimed)."""
    remove(work)
    work.mkdir(parents=True)
    spec = work / "spec.yaml"
    spec.write_text(f"version: 1\nname: bench-{name}\nlayers:\n  - tar: {{path: {tar}}}\n")
    img = Image(name, label, tar, spec, work)
    _log(f"{name}: building the bundle, extracting, mksquashfs, mkfs.erofs (untimed)")
    _sh([sys.executable, "-m", "btrfs_ublk_image", "build", spec, "-o", img.bundle], log)
    img.tree.mkdir()
    _sh(["tar", "-xf", tar, "-C", img.tree], log)
    _sh(["mksquashfs", img.tree, img.squashfs, "-noappend", "-no-progress", "-quiet",
         "-noI", "-noD", "-noF", "-noX"], log)  # fmt: skip
    _sh(["mkfs.erofs", "--quiet", img.erofs, img.tree], log)
    entries = 0
    for _dirpath, dirs, files in os.walk(img.tree):
        entries += len(dirs) + len(files)
    img.entries = entries
    img.content_bytes = tree_size(img.tree)[0]
    img.probe = probe or first_probe(img.tree)
    return img


def first_probe(tree: Path) -> str:
    """A deterministic first file to read: the first regular file (sorted walk) of 8-16 KiB
    (larger than any inline limit, so it is read from device 2)."""
    for dirpath, dirs, files in os.walk(tree):
        dirs.sort()
        for f in sorted(files):
            p = Path(dirpath) / f
            if not p.is_symlink() and 8192 <= p.stat().st_size <= 16384:
                return str(p.relative_to(tree))
    raise RuntimeError(f"no 8-16 KiB file under {tree}")


def closest_file(tree: Path, size: int) -> str:
    """The regular file whose size is closest to ``size`` (ties: the first in sorted order)."""
    best: tuple[int, str] | None = None
    for dirpath, dirs, files in os.walk(tree):
        dirs.sort()
        for f in sorted(files):
            p = Path(dirpath) / f
            if p.is_symlink() or not p.is_file():
                continue
            d = abs(p.stat().st_size - size)
            if best is None or d < best[0]:
                best = (d, str(p.relative_to(tree)))
    if best is None:
        raise RuntimeError(f"no regular file under {tree}")
    return best[1]


# ------------------------------------------------------------------------------- mount


@dataclass
class MountTool:
    name: str
    label: str
    needs: str | None
    timed: Callable[[Image, Path], None]  # mount (or extract) + read the probe file
    teardown: Callable[[Image, Path], None]  # untimed


def _mount_tools(ublkd: Ublkd) -> list[MountTool]:
    def ours(img: Image, mnt: Path) -> None:
        subprocess.run(ublkd.mount_cmd(img.bundle, mnt), env=ublkd.env, check=True,
                       capture_output=True)  # fmt: skip
        read_file(mnt / img.probe)

    def squash(img: Image, mnt: Path) -> None:
        squashfuse_mount(img.squashfs, mnt)
        read_file(mnt / img.probe)

    def erofs(img: Image, mnt: Path) -> None:
        mount_file_backed(img.erofs, mnt, "erofs")
        read_file(mnt / img.probe)

    def tar_x(img: Image, dest: Path) -> None:
        subprocess.run(["tar", "-xf", str(img.tar), "-C", str(dest)], check=True)

    return [
        MountTool("ours", "**ours: ublkd mount** (fuse frontend)", None, ours,
                  lambda img, mnt: ublkd.umount(mnt)),
        MountTool("squashfuse", "squashfuse", "squashfuse", squash,
                  lambda img, mnt: fuse_umount(mnt)),
        MountTool("erofs", "erofs, kernel, file-backed", "mkfs.erofs", erofs,
                  lambda img, mnt: umount(mnt)),
        MountTool("tar_x", "tar -x (whole image)", "tar", tar_x, lambda img, d: remove(d)),
    ]  # fmt: skip


def measure_mounts(img: Image, ublkd: Ublkd, repeats: int) -> list[Result]:
    """Each repeat: for each tool, drop caches, then time mount + reading the probe file whole
    (``tar -x``: the whole extraction); teardown untimed. Interleaved, so drift hits all."""
    tools = _mount_tools(ublkd)
    results = {t.name: Result(t.name, t.label, []) for t in tools}
    for i in range(repeats):
        for t in tools:
            res = results[t.name]
            if res.error:
                continue
            target = img.work / f"m-{t.name}"
            target.mkdir(exist_ok=True)
            drop_caches()
            t0 = time.perf_counter()
            try:
                t.timed(img, target)
                wall = time.perf_counter() - t0
            except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
                res.error = f"{type(e).__name__}: {e}"[:300]
                _teardown_quietly(t, img, target)
                continue
            t1 = time.perf_counter()
            os.sync()
            sync_s = time.perf_counter() - t1
            t.teardown(img, target)
            res.samples.append(Sample(wall, 0, 0, sync_s))
            _log(f"  {img.name} mount {i + 1}/{repeats} {t.name}: {wall * 1000:.0f} ms")
    return [results[t.name] for t in tools]


def _teardown_quietly(t: MountTool, img: Image, target: Path) -> None:
    with contextlib.suppress(Exception):
        t.teardown(img, target)


# --------------------------------------------------------------------------- laziness


def _delta(after: dict[str, Any], before: dict[str, Any] | None) -> dict[str, int]:
    return {k: int(after.get(k, 0)) - int((before or {}).get(k, 0)) for k in COUNTERS}


def measure_laziness(img: Image, ublkd: Ublkd, one_mib: str) -> dict[str, Any]:
    """ublkd's counters (pack bytes read, chunks verified, ...) for: the mount itself, reading
    one ~1 MiB file, ``chroot MNT /bin/true`` (a fresh mount, caches dropped) and, for scale,
    reading every file of the image."""
    mnt = img.work / "m-lazy"
    steps: list[dict[str, Any]] = []
    size = (img.tree / one_mib).stat().st_size
    drop_caches()
    with ublkd.mounted(img.bundle, mnt):
        at_mount = ublkd.settled_status(mnt)
        steps.append({"step": "mount", "what": "ublkd mount", **_delta(at_mount, None)})
        read_file(mnt / one_mib)
        after = ublkd.settled_status(mnt)
        steps.append({"step": "read_1mib", "what": f"read /{one_mib} ({size:,} B) after mount",
                      "file_bytes": size, **_delta(after, at_mount)})  # fmt: skip
    drop_caches()
    with ublkd.mounted(img.bundle, mnt):
        at_mount = ublkd.settled_status(mnt)
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}
        subprocess.run(["chroot", str(mnt), "/bin/true"], check=True, env=env)
        after = ublkd.settled_status(mnt)
        steps.append({"step": "chroot_true", "what": "chroot MNT /bin/true after mount",
                      **_delta(after, at_mount)})  # fmt: skip
    drop_caches()
    with ublkd.mounted(img.bundle, mnt):
        at_mount = ublkd.settled_status(mnt)
        total = 0
        for dirpath, _dirs, files in os.walk(mnt):
            for f in files:
                p = Path(dirpath) / f
                if p.is_file() and not p.is_symlink():
                    total += read_file(p)
        after = ublkd.settled_status(mnt)
        steps.append({"step": "read_all", "what": "read every file after mount",
                      "file_bytes": total, **_delta(after, at_mount)})  # fmt: skip
    packs = sum(p.stat().st_size for p in (img.bundle / "packs").iterdir())
    return {"image": img.name, "pack_bytes_total": packs, "one_mib_file": one_mib,
            "steps": steps}  # fmt: skip


# ------------------------------------------------------------------------ random reads


def _fio_all(
    target: str, path: Path, jobs: Sequence[FioJob], runtime_s: float, log: Path
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for j in jobs:
        try:
            r = run_fio(j, path, runtime_s, log)
            out[j.name] = r.to_json()
            _log(f"  fio {target} {j.name}: {r.iops:,.0f} IOPS")
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            out[j.name] = {"error": str(e)[:300]}
            _log(f"  fio {target} {j.name}: FAILED {e}")
    return out


# ours and the loop baseline cannot be mounted together (one btrfs fsid)
INTERLEAVED = ("ours_fuse", "btrfs_loop")


def randread_schedule(jobs: Sequence[FioJob], targets: Sequence[str]) -> list[tuple[FioJob, str]]:
    """Each fio job on each target in turn, the targets' order alternating from one job to the
    next (A B, B A, ...): drift (load from outside, the age of a page cache) hits both alike."""
    out: list[tuple[FioJob, str]] = []
    for i, j in enumerate(jobs):
        out += [(j, t) for t in (targets if i % 2 == 0 else list(reversed(targets)))]
    return out


def measure_randread(
    img: Image, ublkd: Ublkd, big: str, jobs: Sequence[FioJob], runtime_s: float, log: Path
) -> dict[str, Any]:
    """fio on ``big`` inside each: ours (fuse frontend, every chunk verified and cached
    first), the same btrfs image with device 2 materialized on a loop device, erofs on a loop
    device, squashfuse. Each target's file is read once with O_DIRECT before fio (warm).

    Ours and the loop baseline take turns per fio job (:func:`randread_schedule`), each
    mounted afresh and warmed right before its job; for ours the reads that reached the
    server during the job (device 2's page cache missed) are recorded as ``server_reads``."""
    from tests.bundletools import materialize_data_device

    size = (img.tree / big).stat().st_size
    cache_mb = max(256, math.ceil(size / MiB) + 128)
    mnt = img.work / "m-fio"
    targets: dict[str, Any] = {}
    errors: dict[str, str] = {}

    def mounted(name: str) -> contextlib.AbstractContextManager[Path]:
        if name == "ours_fuse":
            return ublkd.mounted(img.bundle, mnt, "fuse", cache_mb)
        return btrfs_loop_mounted(img.bundle / "meta.img", img.data_img, mnt)

    def one_job(name: str, j: FioJob) -> dict[str, Any]:
        with mounted(name) as m:
            read_direct(m / big)
            before = ublkd.settled_status(m) if name == "ours_fuse" else None
            r = run_fio(j, m / big, runtime_s, log)
            res = r.to_json()
            if before is not None:
                res["server_reads"] = _delta(ublkd.settled_status(m), before)["reads"]
        _log(f"  fio {name} {j.name}: {r.iops:,.0f} IOPS"
             + (f", {res['server_reads']:,} reads reached the server" if "server_reads" in res else ""))  # fmt: skip
        return res

    _log(f"{img.name}: materializing device 2 for the loop baseline (untimed)")
    materialize_data_device(img.bundle, img.data_img)
    try:
        for j, name in randread_schedule(jobs, INTERLEAVED):
            try:
                targets.setdefault(name, {})[j.name] = one_job(name, j)
            except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
                targets.setdefault(name, {})[j.name] = {"error": str(e)[:300]}
                _log(f"  fio {name} {j.name}: FAILED {e}")
    finally:
        remove(img.data_img)

    def one(name: str, cm: contextlib.AbstractContextManager[Path]) -> None:
        try:
            with cm as m:
                read_direct(m / big)
                targets[name] = _fio_all(name, m / big, jobs, runtime_s, log)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            errors[name] = f"{type(e).__name__}: {e}"[:300]
            _log(f"  randread {name}: FAILED {e}")

    one("erofs_loop", erofs_loop_mounted(img.erofs, mnt))
    one("squashfuse", squashfuse_mounted(img.squashfs, mnt))
    return {"image": img.name, "file": big, "file_bytes": size, "ours_cache_mb": cache_mb,
            "runtime_s": runtime_s, "interleaved": list(INTERLEAVED), "targets": targets,
            "errors": errors}  # fmt: skip


# ---------------------------------------------------------------------- VM (ublk frontend)

# Targets inside the VM. Through btrfs: ours (ublk, fuse frontend) and the same image with
# device 2 on a loop device. Raw block devices, to split the gap: a null ublk target
# (`ublkd ublk-null`, same queue setup, completes every read at once: the transport's
# ceiling), ours' /dev/ublkbN (device 2) and a loop device over device 2's bytes in RAM.
# ours_ublk*: the default `--ublk-poll=auto` (the server polls its queue between requests
# while they come close together); `_off`: `--ublk-poll=off` (it always sleeps); `_poll`:
# `--ublk-poll` (it always polls 2 ms). null_ublk: off; null_ublk_poll: `--ublk-poll`.
VM_TARGETS = ("null_ublk", "null_ublk_poll", "ours_ublk_raw", "ours_ublk_off_raw",
              "ours_ublk_poll_raw", "loop_raw", "ours_ublk", "ours_ublk_off", "ours_ublk_poll",
              "ours_fuse", "btrfs_loop", "btrfs_loop_off", "btrfs_loop_poll",
              "btrfs_loop_fuse")  # fmt: skip
# targets live at the same time run each fio job in turn (A/B/C/D per job, not one target's
# whole matrix after the other): TCG is noisy, drift then hits every target alike. The
# baseline (btrfs on loop devices, under a fsid of its own so it can stay mounted beside
# ours) runs in every block under a tag of the block's: each ratio pairs ours with the
# baseline runs beside it, and both take the best of the same number of runs.
VM_INTERLEAVED = ("null_ublk", "null_ublk_poll", "loop_raw", "ours_ublk_raw", "ours_ublk",
                  "btrfs_loop")  # fmt: skip
# then ours again, mounted with --ublk-poll=off, then with --ublk-poll (one server per
# bundle: one mode at a time), then the fuse frontend
VM_INTERLEAVED_OFF = ("ours_ublk_off_raw", "ours_ublk_off", "btrfs_loop_off")
VM_INTERLEAVED_POLL = ("ours_ublk_poll_raw", "ours_ublk_poll", "btrfs_loop_poll")
VM_INTERLEAVED_FUSE = ("ours_fuse", "btrfs_loop_fuse")
# the server whose CPU time each ublk target's fio job costs (utime+stime, $O/cpu.txt)
VM_SERVER_PID = {"null_ublk": "$NP", "null_ublk_poll": "$NPP", "ours_ublk_raw": "$SP",
                 "ours_ublk": "$SP", "ours_ublk_off_raw": "$SP", "ours_ublk_off": "$SP",
                 "ours_ublk_poll_raw": "$SP", "ours_ublk_poll": "$SP"}  # fmt: skip
# each ours_ublk mount's server CPU while idle (mounted, no I/O) and under sparse reads
# (psync at 200 IOPS, evenly spaced), as jobs "idle" and "sparse200" of its cpu.txt rows
VM_IDLE_S = 5.0
# every target's whole matrix this many times (mounting afresh each round); a job's figure
# is its best round
VM_ROUNDS = 2

VM_SCRIPT = """\
set -u
U={ublkd}; B={bundle}; D={data}; F={file}
O=/vmout/fio; mkdir -p $O /tmp/m
modprobe ublk_drv || true
qsettings() {{  # TAG DEV: the block queue settings fio runs against
  local q=/sys/block/$(basename $2)/queue
  for k in scheduler nr_requests max_sectors_kb rotational read_ahead_kb nomerges; do
    echo "$1 $k $(cat $q/$k)"; done >> $O/queues.txt
  echo "$1 nr_hw_queues $(ls /sys/block/$(basename $2)/mq | wc -l)" >> $O/queues.txt
}}
fiojob() {{  # TAG PATH JOB ARGS...: one fio job, its JSON in $O/TAG/JOB.rROUND.json
  local tag=$1 path=$2 job=$3; shift 3; mkdir -p $O/$tag
  fio --filename=$path "$@" > $O/$tag/$job.r$R.json 2>>$O/fio.err
}}
cpujob() {{  # PID TAG PATH JOB ARGS...: fiojob, and PID's CPU ticks over it to cpu.txt
  local pid=$1 c0 c1 t0 t1; shift
  c0=$(awk '{{print $14+$15}}' /proc/$pid/stat); t0=$(date +%s%N)
  fiojob "$@"
  c1=$(awk '{{print $14+$15}}' /proc/$pid/stat); t1=$(date +%s%N)
  echo "$1 $3 $R $((c1 - c0)) $(getconf CLK_TCK) $((t1 - t0))" >> $O/cpu.txt
}}
idlecpu() {{  # PID TAG: PID's CPU ticks over {idle_s} s without I/O to cpu.txt
  local c0 c1 t0 t1
  c0=$(awk '{{print $14+$15}}' /proc/$1/stat); t0=$(date +%s%N); sleep {idle_s}
  c1=$(awk '{{print $14+$15}}' /proc/$1/stat); t1=$(date +%s%N)
  echo "$2 idle $R $((c1 - c0)) $(getconf CLK_TCK) $((t1 - t0))" >> $O/cpu.txt
}}
lightload() {{  # TAG: idle, then sparse reads of /tmp/m/$F, the server's ($SP) CPU of each
  sleep 1; idlecpu $SP $1
{sparse_line}
}}
server_pid() {{ $U status --json | jq '.[] | select(.mountpoint == "/tmp/m") | .server_pid'; }}
# each block's fio jobs, every job on its live targets in turn
fio_auto() {{
  if [ $R = 1 ]; then
    qsettings null_ublk $NULL; qsettings null_ublk_poll $NULLP; qsettings loop_raw $LR
    qsettings btrfs_loop $L2
  fi
  dd if=$LR of=/dev/null bs=1M iflag=direct status=none
{interleaved}
}}
fio_fuse() {{
  dd if=/tmp/m/$F of=/dev/null bs=1M iflag=direct status=none
{interleaved_fuse}
}}
fio_off() {{
{interleaved_off}
}}
fio_poll() {{
{interleaved_poll}
}}
ublkmode() {{  # TAG FIOFN MOUNT-ARGS...: mount ours over ublk, read it once, its server's
  # CPU idle and under sparse reads, FIOFN, umount
  local tag=$1 fn=$2; shift 2
  if $U mount --frontend ublk "$@" --cache-mb 256 $B /tmp/m; then
    UB=$(ls -t /dev/ublkb* | grep -vx -e "$NULL" -e "$NULLP" | head -1); SP=$(server_pid)
    [ $R = 1 ] && qsettings $tag $UB
    dd if=/tmp/m/$F of=/dev/null bs=1M iflag=direct status=none
    dd if=$UB of=/dev/null bs=1M iflag=direct status=none
    lightload $tag
    $fn
    $U umount /tmp/m
  else echo "VM: ublkd mount --frontend ublk $* failed"; fi
}}
cp $D /tmp/dev2.img
$U ublk-null --ublk-poll=off --size-mb $(( $(stat -c %s $D) >> 20 )) > /tmp/null.dev 2>/tmp/null.err & NP=$!
$U ublk-null --ublk-poll --size-mb $(( $(stat -c %s $D) >> 20 )) > /tmp/nullp.dev 2>/tmp/nullp.err & NPP=$!
for i in $(seq 100); do [ -s /tmp/null.dev ] && [ -s /tmp/nullp.dev ] && break; sleep 0.2; done
NULL=$(cat /tmp/null.dev); NULLP=$(cat /tmp/nullp.dev)
# the baseline: the same image with device 2 on a loop device over its bytes in RAM, made
# a fs of its own so that it stays mounted at /tmp/b beside ours (same fsid: one of the two
# mounts is refused). A new fsid rewritten into every block (-U; -M's metadata_uuid still
# clashes with ours), after the seeding flag (btrfstune changes no seed's fsid).
cp $B/meta.img /tmp/meta.img; mkdir -p /tmp/b
L1=$(losetup -f --show /tmp/meta.img); L2=$(losetup -f --show /tmp/dev2.img)
# Before any other device shows device 2's superblock: btrfstune refuses duplicates.
btrfs device scan $L1 $L2 >/dev/null
NEWFSID=$(cat /proc/sys/kernel/random/uuid)
if (echo y | btrfstune -S 0 $L1 && btrfstune -f -U $NEWFSID $L1) > /tmp/tune.log 2>&1; then
  mount -t btrfs -o ro,device=$L1,device=$L2 $L1 /tmp/b || echo "VM: btrfs on loop devices: mount failed"
  dd if=/tmp/b/$F of=/dev/null bs=1M iflag=direct status=none
else echo "VM: btrfstune failed: $(cat /tmp/tune.log)"; fi
LR=$(losetup -f --show -r /tmp/dev2.img)
[ -n "$NULL" ] || echo "VM: ublkd ublk-null failed: $(cat /tmp/null.err)"
[ -n "$NULLP" ] || echo "VM: ublkd ublk-null --ublk-poll failed: $(cat /tmp/nullp.err)"
for R in $(seq {rounds}); do
  # the null targets, ours over ublk (its /dev/ublkbN raw and through btrfs) and a loop
  # device over device 2 in RAM are live at once: each fio job runs on each in turn. Then
  # ours again with --ublk-poll=off, then --ublk-poll (one server per bundle: one mode at
  # a time)
  ublkmode ours_ublk fio_auto
  ublkmode ours_ublk_off fio_off --ublk-poll=off
  ublkmode ours_ublk_poll fio_poll --ublk-poll
  if $U mount --frontend fuse --cache-mb 256 $B /tmp/m; then
    fio_fuse
    $U umount /tmp/m
  else echo "VM: ublkd mount --frontend fuse failed"; fi
done
kill $NP $NPP; wait $NP $NPP
umount /tmp/b || true; btrfs device scan --forget $L1 $L2 || true
losetup -d $LR $L1 $L2
echo "VM: bench done"
"""


def vm_script(
    ublkd: str,
    bundle: Path,
    data: Path,
    file: str,
    jobs: Sequence[FioJob],
    runtime_s: float,
    rounds: int,
) -> str:
    def line(tag: str, path: str, j: FioJob, indent: str) -> str:
        args = shlex.join(fio_args(j, "X", runtime_s)[2:])  # all but --name, --filename
        pid = VM_SERVER_PID.get(tag)
        run = f"cpujob {pid} {tag}" if pid else f"fiojob {tag}"
        return f"{indent}{run} {path} {j.name} --name=randread {args}"

    paths = {"null_ublk": "$NULL", "null_ublk_poll": "$NULLP", "loop_raw": "$LR",
             "ours_ublk_raw": "$UB", "ours_ublk": "/tmp/m/$F", "ours_ublk_poll_raw": "$UB",
             "ours_ublk_poll": "/tmp/m/$F", "ours_ublk_off_raw": "$UB",
             "ours_ublk_off": "/tmp/m/$F", "ours_fuse": "/tmp/m/$F",
             "btrfs_loop": "/tmp/b/$F", "btrfs_loop_off": "/tmp/b/$F",
             "btrfs_loop_poll": "/tmp/b/$F", "btrfs_loop_fuse": "/tmp/b/$F"}  # fmt: skip

    def interleaved(tags: Sequence[str]) -> str:
        return "\n".join(line(t, paths[t], j, "  ") for j in jobs for t in tags)

    sparse = shlex.join([*fio_args(FioJob("psync", 1, 1), "X", VM_IDLE_S)[2:], "--rate_iops=200"])
    return VM_SCRIPT.format(
        ublkd=shlex.quote(ublkd), bundle=shlex.quote(str(bundle)), data=shlex.quote(str(data)),
        file=shlex.quote(file), interleaved=interleaved(VM_INTERLEAVED),
        interleaved_off=interleaved(VM_INTERLEAVED_OFF),
        interleaved_poll=interleaved(VM_INTERLEAVED_POLL),
        interleaved_fuse=interleaved(VM_INTERLEAVED_FUSE), rounds=rounds, idle_s=f"{VM_IDLE_S:g}",
        sparse_line=f"  cpujob $SP $1 /tmp/m/$F sparse200 --name=randread {sparse}",
    )  # fmt: skip


def vm_job_result(d: Path, job: str) -> dict[str, Any]:
    """One target's figure for ``job``: its best round (the host's load and other VMs only
    ever take IOPS away), with every round's IOPS in ``rounds``."""
    got: list[dict[str, Any]] = []
    errors: list[str] = []
    for f in sorted(d.glob(f"{job}.r*.json")):
        try:
            got.append(parse_fio_json(f.read_text()).to_json())
        except (OSError, ValueError, KeyError) as e:
            errors.append(f"{f.name}: {e}"[:200])
    if not got:
        return {"error": "; ".join(errors) or "no fio output"}
    got.sort(key=lambda r: float(r["iops"]))
    return {**got[-1], "rounds": [r["iops"] for r in got]}


def parse_queues(text: str) -> dict[str, dict[str, str]]:
    """``TAG KEY VALUE...`` lines -> {tag: {key: value}} (the scheduler: the active one)."""
    out: dict[str, dict[str, str]] = {}
    for ln in text.splitlines():
        parts = ln.split(maxsplit=2)
        if len(parts) == 3:
            tag, key, val = parts
            if key == "scheduler":
                val = next((w.strip("[]") for w in val.split() if w.startswith("[")), val)
            out.setdefault(tag, {})[key] = val
    return out


def parse_cpu(text: str) -> dict[str, dict[str, float]]:
    """``TAG JOB ROUND TICKS HZ NS`` lines (cpujob) -> {tag: {job: CPUs busy}}: the server's
    CPU time over the fio job's wall time, the mean over rounds."""
    got: dict[str, dict[str, list[float]]] = {}
    for ln in text.splitlines():
        parts = ln.split()
        if len(parts) != 6:
            continue
        tag, job, _, ticks, hz, ns = parts
        try:
            cpus = int(ticks) / int(hz) / (int(ns) / 1e9)
        except (ValueError, ZeroDivisionError):
            continue
        got.setdefault(tag, {}).setdefault(job, []).append(cpus)
    return {t: {j: round(sum(v) / len(v), 3) for j, v in js.items()} for t, js in got.items()}


def measure_randread_vm(
    workdir: Path, jobs: Sequence[FioJob], runtime_s: float, log: Path
) -> dict[str, Any]:
    """fio inside the VM harness (6.12 guest, QEMU TCG): ours through the ublk and the fuse
    frontend vs the same btrfs image on loop devices (device 2 materialized, copied into the
    guest's RAM); and on raw block devices: a null ublk target, ours' /dev/ublkbN, a loop
    device over device 2 in RAM (VM_TARGETS). Only the ratios mean something under TCG."""
    from bench.mounts import ublkd_binary
    from tests.bundletools import materialize_data_device
    from tests.vm import harness

    data = inp.ensure_inputs(workdir, VM_INPUT, log=_log)
    work = workdir / "vm"
    remove(work)
    work.mkdir(parents=True)
    bundle, dev2 = work / "bundle", work / "dev2.img"
    _sh([sys.executable, "-m", "btrfs_ublk_image", "build", data.spec, "-o", bundle], log)
    materialize_data_device(bundle, dev2)
    file = "large/blob-0.bin"
    script = vm_script(ublkd_binary(), bundle, dev2, file, jobs, runtime_s, VM_ROUNDS)
    _log("VM: booting the 6.12 guest (TCG) for the ublk random-read runs")
    res = harness.run_in_vm(
        harness.SCRIPT_BODY.format(script="/vmout/script.sh"),
        files={"script.sh": script.encode()},
        timeout=float(os.environ.get("BUI_VM_TIMEOUT", 1200)),
    )
    targets: dict[str, Any] = {}
    errors: dict[str, str] = {}
    fio_dir = res.share / "fio"
    for tag in VM_TARGETS:
        d = fio_dir / tag
        if not d.is_dir():
            errors[tag] = "not run (see the guest log)"
            continue
        targets[tag] = {j.name: vm_job_result(d, j.name) for j in jobs}
    qf = fio_dir / "queues.txt"
    queues = parse_queues(qf.read_text()) if qf.exists() else {}
    cf = fio_dir / "cpu.txt"
    server_cpu = parse_cpu(cf.read_text()) if cf.exists() else {}
    remove(work)
    return {"kernel": res.kver, "accel": harness.accel(), "icount": harness.icount(), "rc": res.rc, "results_dir": str(res.out), "file": file,
            "file_bytes": VM_INPUT.large_bytes, "runtime_s": runtime_s, "rounds": VM_ROUNDS,
            "targets": targets, "queues": queues, "server_cpu": server_cpu, "errors": errors,
            "guest_log_tail": res.read("pytest.log")[-1500:]}  # fmt: skip


# ------------------------------------------------------------------------------ driver


@contextlib.contextmanager
def _scratch(workdir: Path) -> Iterator[Path]:
    base = workdir / "runtime"
    remove(base)
    base.mkdir(parents=True)
    try:
        yield base
    finally:
        remove(base)


def run_runtime(
    sections: set[str],
    workdir: Path,
    synthetic: inp.Inputs | None,
    repeats: int,
    runtime_s: float,
    jobs: Sequence[FioJob] = MATRIX,
) -> dict[str, Any]:
    """Run the selected runtime sections; the JSON document parts keyed by section."""
    log = workdir / "bench.log"
    ublkd = Ublkd(workdir / "ublkd-run")
    doc: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    with _scratch(workdir) as base:
        images: list[Image] = []
        if sections & {"mount", "laziness", "remote"}:
            tar, why = debian_inputs(log)
            if tar is None:
                skipped["debian"] = why
            else:
                images.append(prepare_image("debian", "Debian minbase", tar, base / "debian",
                                            log, probe="usr/bin/dpkg"))  # fmt: skip
        if sections & {"mount", "randread"}:
            assert synthetic is not None, "bench.build makes it for these sections"
            s = synthetic.stats
            images.append(
                prepare_image(
                    "synthetic",
                    f"synthetic ({s.entries:,} entries)",
                    synthetic.tar,
                    base / "synthetic",
                    log,
                )  # fmt: skip
            )
        by = {i.name: i for i in images}
        for img in images:
            _log(f"{img.name}: {img.entries:,} entries, {img.content_bytes / MiB:.0f} MiB")
        if "mount" in sections:
            doc["mount"] = {
                "repeats": repeats,
                "images": {
                    i.name: {
                        "label": i.label, "entries": i.entries, "content_bytes": i.content_bytes,
                        "probe": i.probe,
                        "results": {r.name: r.to_json(i.content_bytes, i.entries)
                                    for r in measure_mounts(i, ublkd, repeats)},
                    }
                    for i in images
                },
            }  # fmt: skip
        if "laziness" in sections and "debian" in by:
            deb = by["debian"]
            doc["laziness"] = measure_laziness(deb, ublkd, closest_file(deb.tree, MiB))
        if "remote" in sections and "debian" in by:
            deb = by["debian"]
            doc["remote"] = measure_remote(deb.bundle, deb.tar, base / "remote", ublkd, repeats)
        if "randread" in sections and "synthetic" in by:
            syn = by["synthetic"]
            doc["randread"] = measure_randread(syn, ublkd, "large/blob-0.bin", jobs, runtime_s, log)
        if "delta" in sections:
            from bench.delta import measure_delta

            tar, why = debian_inputs(log)
            if tar is None:
                skipped["delta"] = why
            else:
                doc["delta"] = measure_delta(tar, base / "delta", ublkd)
        if "containerd" in sections:
            from bench.containerd import measure_containerd

            tar, why = debian_inputs(log)
            if tar is None:
                skipped["containerd"] = why
            else:
                doc["containerd"] = measure_containerd(DEBIAN_CACHE / "oci", base / "ctd", repeats)
    if "vm" in sections:
        try:
            doc["randread_vm"] = measure_randread_vm(workdir, jobs, min(runtime_s, 2.0), log)
        except Exception as e:  # noqa: BLE001 - a benchmark section that could not run
            skipped["vm"] = f"{type(e).__name__}: {e}"[:300]
    if skipped:
        doc["runtime_skipped"] = skipped
    return doc
