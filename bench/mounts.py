"""Mounting what the runtime benchmarks compare, each as a context manager that cleans up.

* ours: ``ublkd mount`` (private ``UBLKD_RUN_DIR`` so ``status`` lists only our mounts);
* squashfuse on a squashfs file;
* kernel erofs on a file (file-backed mount, ``mount(2)`` with the file as source: no loop
  device) or on a read-only loop device (O_DIRECT works only there);
* the same btrfs image with device 2 materialized into a local file, on two loop devices.

Every mount, loop device and FUSE daemon started here is torn down on exit, also on errors.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MS_RDONLY = 1


def ublkd_binary() -> str:
    if os.environ.get("UBLKD"):
        return os.environ["UBLKD"]
    built = ROOT / "ublkd" / "target" / "release" / "ublkd"
    if built.exists():
        return str(built)
    found = shutil.which("ublkd")
    if found is None:
        raise RuntimeError("ublkd not found: build it (scripts/setup.sh) or set UBLKD")
    return found


def _run(cmd: list[str], env: dict[str, str] | None = None, check: bool = True) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=300)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {(p.stdout + p.stderr)[-600:]}")
    return p.stdout


class Ublkd:
    """Runs ``ublkd`` with a private state directory."""

    def __init__(self, run_dir: Path) -> None:
        self.bin = ublkd_binary()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, UBLKD_RUN_DIR=str(run_dir))

    def mount_cmd(
        self,
        bundle: Path,
        mnt: Path,
        frontend: str = "fuse",
        cache_mb: int | None = None,
        dev2_cache: str | None = None,
    ) -> list[str]:
        cmd = [self.bin, "mount", str(bundle), str(mnt), "--frontend", frontend]
        if cache_mb is not None:
            cmd += ["--cache-mb", str(cache_mb)]
        if dev2_cache is not None:
            cmd += ["--dev2-cache", dev2_cache]
        return cmd

    def mount(
        self,
        bundle: Path,
        mnt: Path,
        frontend: str = "fuse",
        cache_mb: int | None = None,
        dev2_cache: str | None = None,
    ) -> None:
        _run(self.mount_cmd(bundle, mnt, frontend, cache_mb, dev2_cache), self.env)

    def run(self, args: list[str]) -> str:
        """`ublkd ARGS...` with this state directory; its stdout."""
        return _run([self.bin, *args], self.env)

    def wait_prefetch(self, mnt: Path, timeout_s: float = 600.0) -> dict[str, Any]:
        """The mount's status once its prefetch has done every chunk of the trace."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status(mnt)
            total = int(st.get("prefetch_total", 0))
            if total and int(st.get("prefetch_done", 0)) >= total:
                return st
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mnt}: prefetch not done after {timeout_s} s: {st}")
            time.sleep(0.05)

    def umount(self, mnt: Path) -> None:
        _run([self.bin, "umount", str(mnt)], self.env)

    @contextlib.contextmanager
    def mounted(
        self,
        bundle: Path,
        mnt: Path,
        frontend: str = "fuse",
        cache_mb: int | None = None,
        dev2_cache: str | None = None,
    ) -> Iterator[Path]:
        mnt.mkdir(parents=True, exist_ok=True)
        self.mount(bundle, mnt, frontend, cache_mb, dev2_cache)
        try:
            yield mnt
        finally:
            self.umount(mnt)

    def status(self, mnt: Path) -> dict[str, Any]:
        out = _run([self.bin, "status", "--json"], self.env)
        for m in json.loads(out):
            if Path(m["mountpoint"]) == mnt.resolve():
                return dict(m)
        raise RuntimeError(f"ublkd status: {mnt} not listed")

    def settled_status(self, mnt: Path, timeout_s: float = 5.0) -> dict[str, Any]:
        """The counters once the server has flushed them (it rewrites stats.json at most
        every 200 ms): read until two reads 300 ms apart agree."""
        keys = ("reads", "bytes_served", "chunks_verified", "pack_bytes_read", "cache_hits")
        deadline = time.monotonic() + timeout_s
        prev = self.status(mnt)
        while True:
            time.sleep(0.3)
            cur = self.status(mnt)
            if all(cur.get(k) == prev.get(k) for k in keys) or time.monotonic() > deadline:
                return cur
            prev = cur


def read_file(path: Path) -> int:
    """Read a whole file (through the page cache); its size."""
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            n += len(chunk)
    return n


def read_direct(path: Path) -> None:
    """Read a whole file with O_DIRECT in 1 MiB requests (warms the layers below the page cache)."""
    _run(["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct", "status=none"])


def mount_file_backed(source: Path, target: Path, fstype: str) -> None:
    """``mount(2)`` read-only with a regular file as the source: erofs uses it directly
    (file-backed mount, kernel >= 6.12) where util-linux would set up a loop device."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(bytes(source), bytes(target), fstype.encode(), MS_RDONLY, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t {fstype} {source} {target}: {os.strerror(err)}")


def umount(target: Path) -> None:
    _run(["umount", str(target)])


@contextlib.contextmanager
def erofs_file_mounted(image: Path, mnt: Path) -> Iterator[Path]:
    mnt.mkdir(parents=True, exist_ok=True)
    mount_file_backed(image, mnt, "erofs")
    try:
        yield mnt
    finally:
        umount(mnt)


def squashfuse_mount(image: Path, mnt: Path) -> None:
    """``squashfuse IMG MNT``: returns once mounted (it daemonizes after the mount)."""
    _run(["squashfuse", str(image), str(mnt)])


def fuse_umount(mnt: Path) -> None:
    _run(["fusermount3", "-u", str(mnt)])


@contextlib.contextmanager
def squashfuse_mounted(image: Path, mnt: Path) -> Iterator[Path]:
    mnt.mkdir(parents=True, exist_ok=True)
    squashfuse_mount(image, mnt)
    try:
        yield mnt
    finally:
        fuse_umount(mnt)


def losetup_ro(path: Path) -> str:
    """A read-only loop device on ``path`` (buffered: the backing file's page cache serves it)."""
    return _run(["losetup", "-f", "--show", "-r", str(path)]).strip()


def losetup_detach(dev: str) -> None:
    _run(["losetup", "-d", dev], check=False)


@contextlib.contextmanager
def erofs_loop_mounted(image: Path, mnt: Path) -> Iterator[Path]:
    mnt.mkdir(parents=True, exist_ok=True)
    dev = losetup_ro(image)
    try:
        _run(["mount", "-t", "erofs", "-o", "ro", dev, str(mnt)])
        try:
            yield mnt
        finally:
            umount(mnt)
    finally:
        losetup_detach(dev)


@contextlib.contextmanager
def btrfs_loop_mounted(meta_img: Path, data_img: Path, mnt: Path) -> Iterator[Path]:
    """The seed from two read-only loop devices: meta.img and device 2 materialized in a file."""
    mnt.mkdir(parents=True, exist_ok=True)
    loops: list[str] = []
    try:
        loops.append(losetup_ro(meta_img))
        loops.append(losetup_ro(data_img))
        _run(["btrfs", "device", "scan", *loops])
        _run(["mount", "-t", "btrfs", "-o", f"ro,device={loops[0]},device={loops[1]}", loops[0],
              str(mnt)])  # fmt: skip
        try:
            yield mnt
        finally:
            umount(mnt)
    finally:
        for dev in loops:  # forget them, so ublkd's next mount of this image is not refused
            _run(["btrfs", "device", "scan", "--forget", dev], check=False)
            losetup_detach(dev)
