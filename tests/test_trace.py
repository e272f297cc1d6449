"""Root integration tests for prefetch traces (docs/trace-format.md, docs/ublkd.md).

Record the chunks a command reads (`ublkd record`), mount again with `--prefetch`: once
the prefetch is done the same command loads no pack chunk on demand
(`demand_chunk_loads`, counted by the server apart from prefetch loads). A trace made
for another image is refused before anything is mounted; build's `prefetch:` list is
applied by a plain `ublkd mount`. Fuse frontend, private UBLKD_RUN_DIR, `no_leftovers`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_ublkd import (
    build_bundle,
    fresh_seed,
    make_tarball,
    our_mounts,
    read_file,
    status,
    status_of,
    ublkd,
)
from test_ublkd import no_leftovers as no_leftovers  # noqa: F401  (a fixture)

from btrfs_ublk_image import trace
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.manifest import read_manifest

from bundletools import DEBIAN_CACHE, prepare_debian_inputs

pytestmark = pytest.mark.root

COMMAND_FILES = ["data/c.bin", "etc/extent", "data/a.bin"]


def wait_stats(
    mnt: Path, ok: Callable[[dict[str, object]], bool], what: str, timeout: float = 30
) -> dict[str, object]:
    """The mount's status once ``ok`` holds (the server rewrites stats.json every 200 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        st = status_of(mnt)
        if ok(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout} s: {st}")
        time.sleep(0.1)


def settled(mnt: Path) -> dict[str, object]:
    """Status after the counters stopped changing (two equal reads 0.5 s apart)."""
    prev = status_of(mnt)
    while True:
        time.sleep(0.5)
        st = status_of(mnt)
        if st == prev:
            return st
        prev = st


def prefetch_finished(mnt: Path) -> dict[str, object]:
    def done(st: dict[str, object]) -> bool:
        total = st["prefetch_total"]
        return isinstance(total, int) and total > 0 and st["prefetch_done"] == total

    return wait_stats(mnt, done, "prefetch finished")


def run_command(mnt: Path, files: dict[str, bytes]) -> None:
    for name in COMMAND_FILES:
        assert read_file(mnt / name) == files[name], name


def loads(st: dict[str, object]) -> int:
    n = st["demand_chunk_loads"]
    assert isinstance(n, int)
    return n


def loaded(st: dict[str, object]) -> int:
    """Chunks loaded for reads: on demand, or ahead of them (a fuse server reads local
    packs ahead once it sees three chunks in a row)."""
    n = st["readahead_chunks"]
    assert isinstance(n, int)
    return loads(st) + n


def test_recorded_trace_makes_the_command_need_no_demand_loads(no_leftovers: Path) -> None:
    tmp = no_leftovers
    bundle, _, files = build_bundle(tmp, "rec")
    manifest, image_id = read_manifest(str(bundle))
    mnt = tmp / "mnt"
    mnt.mkdir()
    rec = tmp / "rec.trace"

    # 1. without a trace: the command loads chunks on demand; record them
    ublkd("mount", bundle, mnt, "--frontend", "fuse")
    try:
        before = loaded(settled(mnt))
        run_command(mnt, files)
        cold = loaded(settled(mnt)) - before
        assert cold >= 4, f"a.bin alone spans 4 pack chunks: {before} {status_of(mnt)}"
        r = ublkd("record", mnt, "-o", rec)
        assert "recorded" in r.stdout and str(rec) in r.stdout
    finally:
        ublkd("umount", mnt)
    t = trace.read(str(rec))  # the Python reader accepts what ublkd wrote
    assert (t.source, t.image_id, t.chunk_size) == ("record", image_id, manifest["chunk_size"])
    trace.check_for_bundle(t, manifest, image_id, str(rec))
    assert len(t.chunks) >= cold
    assert rec.read_bytes() == trace.encode(t)  # same canonical bytes on both sides
    assert not (bundle / trace.FILE_NAME).exists()

    # 2. with it: once the prefetch is done, the same command loads nothing on demand
    r = ublkd("mount", bundle, mnt, "--frontend", "fuse", "--prefetch", rec)
    assert f"prefetching {len(t.chunks)} chunks (record trace {rec})" in r.stdout, r.stdout
    try:
        st = prefetch_finished(mnt)
        assert st["prefetch_total"] == len(t.chunks) and st["prefetch_errors"] == 0
        assert isinstance(st["prefetch_bytes"], int) and st["prefetch_bytes"] > 0
        text = ublkd("status").stdout
        assert f"prefetch {len(t.chunks)}/{len(t.chunks)} chunks done (finished)" in text, text
        ready = settled(mnt)
        before = loads(ready)
        run_command(mnt, files)
        after = settled(mnt)
        if loads(after) != before:
            ublkd("record", mnt, "-o", tmp / "again.trace")
            raise AssertionError(f"{(tmp / 'again.trace').read_text()} {t.chunks} {before} {after}")
        # reading something the trace does not hold still loads it (the counters work; on
        # demand, or already by the readahead the command's sequential reads started)
        assert read_file(mnt / "data" / "b.bin") == files["data/b.bin"]
        assert loaded(settled(mnt)) > loaded(ready)
    finally:
        ublkd("umount", mnt)
    assert status() == []


def test_trace_for_another_image_is_refused_before_mounting(no_leftovers: Path) -> None:
    tmp = no_leftovers
    a, _, _ = build_bundle(tmp, "a")
    b, _, _ = build_bundle(tmp, "b")
    _, id_a = read_manifest(str(a))
    _, id_b = read_manifest(str(b))
    mnt = tmp / "mnt"
    mnt.mkdir()
    wrong = tmp / "a.trace"
    trace.write(str(wrong), trace.Trace(id_a, 1 << 20, "record", ((0, 0),)))
    r = ublkd("mount", b, mnt, "--frontend", "fuse", "--prefetch", wrong, check=False)
    assert r.returncode != 0
    assert f"trace was made for image {id_a}, this bundle is image {id_b}" in r.stderr, r.stderr
    assert str(wrong) in r.stderr
    assert status() == [] and not our_mounts(tmp)
    # the same trace found beside the manifest: refused too, unless --no-prefetch
    shutil.copy(wrong, b / trace.FILE_NAME)
    r = ublkd("mount", b, mnt, "--frontend", "fuse", check=False)
    assert r.returncode != 0 and f"made for image {id_a}" in r.stderr, r.stderr
    assert status() == [] and not our_mounts(tmp)
    r = ublkd("mount", b, mnt, "--frontend", "fuse", "--no-prefetch")
    assert "prefetching" not in r.stdout
    try:
        assert status_of(mnt)["prefetch_total"] == 0
    finally:
        ublkd("umount", mnt)
    # a damaged trace names the file
    bad = tmp / "bad.trace"
    bad.write_text(json.dumps({"format": "btrfs-ublk-image.trace", "format_version": 9}))
    r = ublkd("mount", b, mnt, "--frontend", "fuse", "--prefetch", bad, check=False)
    assert r.returncode != 0 and f"{bad}: trace format_version 9 is not supported" in r.stderr
    assert status() == []


def test_build_time_prefetch_list_is_applied_by_mount(no_leftovers: Path) -> None:
    tmp = no_leftovers
    work = tmp / "src"
    work.mkdir()
    files = make_tarball(work / "rootfs.tar", fresh_seed())
    spec = work / "spec.yaml"
    spec.write_text(
        "version: 1\nname: pf\nlayers:\n  - tar: {path: rootfs.tar}\n"
        'prefetch: ["/data/c.bin", "/etc/**", "/data/a.bin"]\n'
    )
    bundle = tmp / "pf.bundle"
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    t = trace.read(str(bundle / trace.FILE_NAME))
    assert t.source == "build"
    mnt = tmp / "mnt"
    mnt.mkdir()
    r = ublkd("mount", bundle, mnt, "--frontend", "fuse")
    assert f"prefetching {len(t.chunks)} chunks (build trace {bundle.resolve()}/" in r.stdout
    try:
        st = prefetch_finished(mnt)
        assert st["prefetch_total"] == len(t.chunks)
        before = loads(settled(mnt))
        run_command(mnt, files)
        assert loads(settled(mnt)) == before
    finally:
        ublkd("umount", mnt)
    assert status() == []


@pytest.mark.slow
def test_chroot_true_on_debian_with_recorded_trace(no_leftovers: Path) -> None:
    """The issue's case: a trace recorded while `chroot MNT /bin/true` runs on a Debian
    minbase bundle, applied to a fresh mount without a rebuild: the command then loads
    no chunk on demand."""
    tmp = no_leftovers
    prepare_debian_inputs()
    spec = tmp / "spec.yaml"
    spec.write_text(
        f"version: 1\nname: debian-trace\nlayers:\n  - tar: {{path: {DEBIAN_CACHE / 'rootfs.tar'}}}\n"
        f'  - files:\n      - {{path: /etc/trace-test, content: "{os.urandom(8).hex()}"}}\n'
    )
    bundle = tmp / "debian.bundle"
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    mnt = tmp / "mnt"
    mnt.mkdir()
    rec = bundle / trace.FILE_NAME  # beside the manifest: found by the next mount

    def chroot_true() -> None:
        r = subprocess.run(["chroot", str(mnt), "/bin/true"], capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr

    ublkd("mount", bundle, mnt, "--frontend", "fuse")
    try:
        before = loads(settled(mnt))
        chroot_true()
        cold = loads(settled(mnt)) - before
        assert cold > 0
        ublkd("record", mnt, "-o", rec)
    finally:
        ublkd("umount", mnt)
    ublkd("mount", bundle, mnt, "--frontend", "fuse")
    try:
        prefetch_finished(mnt)
        before = loads(settled(mnt))
        chroot_true()
        assert loads(settled(mnt)) == before
    finally:
        ublkd("umount", mnt)
    assert status() == []
