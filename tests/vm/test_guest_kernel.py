"""The guest kernel has what the ublk frontend needs: runs inside the VM only (marker `vm`)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm


def sh(*cmd: str | Path) -> str:
    p = subprocess.run([str(c) for c in cmd], check=False, capture_output=True, text=True)
    assert p.returncode == 0, f"{cmd}: exit {p.returncode}\n{p.stdout}{p.stderr}"
    return p.stdout


def test_running_in_the_vm() -> None:
    assert os.environ.get("BUI_IN_VM") == "1"
    assert os.geteuid() == 0


def test_kernel_is_6_12() -> None:
    release = platform.release()
    print(f"guest kernel {release}")
    assert release.startswith("6.12."), release


def test_ublk_drv_loads() -> None:
    sh("modprobe", "ublk_drv")
    ctl = Path("/dev/ublk-control")
    for _ in range(50):  # devtmpfs node creation is asynchronous
        if ctl.exists():
            break
        time.sleep(0.1)
    assert ctl.is_char_device(), "modprobe ublk_drv did not create /dev/ublk-control"
    assert "ublk_drv" in Path("/proc/modules").read_text()
    print("/dev/ublk-control present")


@pytest.mark.parametrize("module", ["btrfs", "loop", "fuse"])
def test_module_available(module: str) -> None:
    sh("modprobe", module)  # a no-op for built-ins; /sys/module/<name> exists either way
    assert Path(f"/sys/module/{module}").exists(), f"/sys/module/{module} missing"


def test_loop_control_autoloads_loop() -> None:
    """/dev/loop-control exists before loop is loaded (a static node, as on a real system) and
    opening it loads the module: ublkd and losetup rely on that."""
    ctl = Path("/dev/loop-control")
    assert ctl.is_char_device(), "no static /dev/loop-control node"
    fd = os.open(ctl, os.O_RDWR)
    os.close(fd)
    assert Path("/sys/module/loop").exists()


def test_btrfs_on_loop(tmp_path: Path) -> None:
    sh("modprobe", "btrfs")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(256 << 20)
    sh("mkfs.btrfs", "-q", "-f", img)
    dev = sh("losetup", "--find", "--show", img).strip()
    try:
        sh("mount", "-t", "btrfs", dev, mnt)
        try:
            payload = os.urandom(3 << 20)
            (mnt / "f").write_bytes(payload)
            sh("sync")
        finally:
            sh("umount", mnt)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        sh("mount", "-t", "btrfs", "-o", "ro", dev, mnt)
        try:
            assert (mnt / "f").read_bytes() == payload
        finally:
            sh("umount", mnt)
        sh("btrfs", "check", "--readonly", dev)
    finally:
        sh("losetup", "-d", dev)
