"""End to end: a tarball -> `btrfs-ublk-image build` -> the stock kernel mounts exactly that tree."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from btrfs_ublk_image.cli import main as cli

from bundletools import (
    ACL_XATTR,
    CAPABILITY_XATTR,
    dmesg_btrfs_problems,
    dmesg_len,
    list_dir,
    list_tar,
    mounted_bundle,
    run,
)


def _xattr(value: bytes) -> str:
    return value.decode("utf-8", "surrogateescape")


def make_tarball(path: Path) -> None:
    """Every member type tar can carry, with xattrs, odd modes and nanosecond mtimes."""
    big = os.urandom(5 * 1024 * 1024 + 7)

    def member(name: str, kind: bytes = tarfile.REGTYPE, **kw: object) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type = kind
        ti.mode = 0o644
        ti.mtime = 1_700_000_000
        ti.pax_headers = {"mtime": "1700000000.123456789"}
        for k, v in kw.items():
            setattr(ti, k, v)
        return ti

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(member("./", tarfile.DIRTYPE, mode=0o755))
        tf.addfile(member("etc", tarfile.DIRTYPE, mode=0o755))
        for name, data, extra in [
            ("etc/empty", b"", {}),
            ("etc/hostname", b"image\n", {"uid": 0, "gid": 0}),
            ("etc/inline-2048", b"x" * 2048, {}),
            ("etc/extent-2049", b"y" * 2049, {"uid": 1000, "gid": 1000, "mode": 0o600}),
            ("big", big, {}),
            ("big-copy", big, {}),
            ("usr-bin-setuid", b"#!/bin/sh\n", {"mode": 0o4755}),
        ]:
            tf.addfile(member(name, **extra, size=len(data)), io.BytesIO(data))  # type: ignore[arg-type]
        cap = member("ping", size=4)
        cap.pax_headers["SCHILY.xattr.security.capability"] = _xattr(CAPABILITY_XATTR)
        tf.addfile(cap, io.BytesIO(b"ping"))
        acl = member("acl", size=3)
        acl.pax_headers["SCHILY.xattr.system.posix_acl_access"] = _xattr(ACL_XATTR)
        acl.pax_headers["SCHILY.xattr.user.comment"] = "hello"
        tf.addfile(acl, io.BytesIO(b"acl"))
        tf.addfile(member("shared", tarfile.DIRTYPE, mode=0o2775, gid=50))
        tf.addfile(member("tmp", tarfile.DIRTYPE, mode=0o1777))
        tf.addfile(member("etc/link", tarfile.LNKTYPE, linkname="etc/hostname"))
        tf.addfile(member("shared/link2", tarfile.LNKTYPE, linkname="etc/hostname"))
        tf.addfile(member("symlink", tarfile.SYMTYPE, linkname="etc/hostname", mode=0o777))
        tf.addfile(member("null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666))
        tf.addfile(member("disk", tarfile.BLKTYPE, devmajor=8, devminor=1, mode=0o660))
        tf.addfile(member("fifo", tarfile.FIFOTYPE, mode=0o600))


@pytest.mark.root
def test_tarball_mounts_identical(tmp_path: Path) -> None:
    tarball = tmp_path / "rootfs.tar"
    make_tarball(tarball)
    (tmp_path / "spec.yaml").write_text(
        "version: 1\nname: tartest\nlayers:\n  - tar: {path: rootfs.tar}\n"
    )
    assert cli(["build", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "bundle")]) == 0
    assert_kernel_mount_matches(tmp_path / "bundle", tarball, tmp_path)


def assert_kernel_mount_matches(bundle: Path, tarball: Path, tmp: Path) -> None:
    """A bundle of make_tarball's tarball: btrfs check passes, the kernel mounts it with
    the tarball's tree and no btrfs complaint in dmesg, `big` and `big-copy` share one
    extent."""
    check = run("btrfs", "check", "--readonly", bundle / "meta.img", check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    before = dmesg_len()
    with mounted_bundle(bundle, tmp) as m:
        got = list_dir(m.mountpoint)
        # identical content is one extent with two refs (FIEMAP: same physical offset)
        fiemap = [run("filefrag", "-v", m.mountpoint / n).stdout for n in ("big", "big-copy")]
    assert got == list_tar(tarball)
    assert dmesg_btrfs_problems(before, m.loops) == []
    physical = [f.splitlines()[3].split()[3] for f in fiemap]
    assert physical[0] == physical[1], fiemap


@pytest.mark.unit
def test_build_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "spec.yaml").write_text(
        "version: 1\nname: t\nlayers:\n  - tar: {path: missing.tar}\n"
    )
    assert cli(["build", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("btrfs-ublk-image: error: ") and "missing.tar" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["spec.yaml"]


@pytest.mark.unit
def test_example_builds_are_reproducible(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = Path(__file__).parent.parent / "examples" / "webroot" / "spec.yaml"
    for out in ("a", "b"):
        assert cli(["build", str(spec), "-o", str(tmp_path / out)]) == 0
    ids = [line.split(": ")[1] for line in capsys.readouterr().out.splitlines()]
    assert len(ids) == 2 and ids[0] == ids[1]
    for name in ("manifest.json", "meta.img", "blockmap"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
