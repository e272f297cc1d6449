"""`ublkd mount --ephemeral` shows the image exactly (issue 22): xattrs in every namespace,
overlayfs's own included.

overlayfs (as ublkd mounts it: root, no `userxattr`) hides a lower file's
`trusted.overlay.*` xattrs, shows `trusted.overlay.overlay.X` as `trusted.overlay.X`, and
takes a character device 0:0 for a whiteout; `user.overlay.*`, other `trusted.*`,
`security.*` and `user.*` it shows as they are. The test checks those kernel facts on a
hand-made overlay (the oracle), then that ublkd's ephemeral mount lists identically to
the read-only mount: overlayfs for an image without such names, a btrfs sprout (and
`status` says why) for one with them. Writes vanish at umount; nothing is left behind.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from test_ublkd import no_leftovers as no_leftovers  # noqa: F401  (a fixture)
from test_ublkd import status_of, ublkd

from btrfs_ublk_image.cli import main as cli

from bundletools import list_dir, list_tar

pytestmark = pytest.mark.root

# shown by overlayfs as they are
PLAIN = {
    "user.a": b"u",
    "user.overlay.opaque": b"y",
    "user.overlay.x": b"ux",
    "trusted.a": b"t",
    "security.a": b"s",
}
# overlayfs's own names (trusted mode): hidden, or unescaped
OVERLAY = {
    "trusted.overlay.x": b"tx",
    "trusted.overlay.overlay.esc": b"escaped",
}


def make_tarball(path: Path, seed: int, overlay_names: bool) -> None:
    def member(name: str, kind: bytes = tarfile.REGTYPE, **kw: object) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type = kind
        ti.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
        ti.mtime = 1_700_000_000
        for k, v in kw.items():
            setattr(ti, k, v)
        return ti

    def xattrs(d: dict[str, bytes]) -> dict[str, str]:
        return {f"SCHILY.xattr.{k}": v.decode() for k, v in d.items()}

    names = {**PLAIN, **(OVERLAY if overlay_names else {})}
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(member("etc", tarfile.DIRTYPE, pax_headers=xattrs(names)))
        data = f"seed {seed}\n".encode()
        tf.addfile(
            member("etc/hostname", size=len(data), pax_headers=xattrs(names)), io.BytesIO(data)
        )
        tf.addfile(member("etc/plain", size=3), io.BytesIO(b"abc"))
        tf.addfile(member("null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666))
        if overlay_names:
            # an opaque directory, and xattr whiteouts (6.7+): a directory marked as
            # holding them and an empty file marked as one
            tf.addfile(
                member(
                    "opaque", tarfile.DIRTYPE, pax_headers=xattrs({"trusted.overlay.opaque": b"y"})
                )
            )
            tf.addfile(member("opaque/kept", size=1), io.BytesIO(b"k"))
            tf.addfile(
                member(
                    "wdir", tarfile.DIRTYPE, pax_headers=xattrs({"trusted.overlay.whiteouts": b"y"})
                )
            )
            tf.addfile(member("wdir/gone", pax_headers=xattrs({"trusted.overlay.whiteout": b"y"})))
            # a whiteout device
            tf.addfile(member("wh", tarfile.CHRTYPE, devmajor=0, devminor=0, mode=0o600))


def bundle_with(tmp: Path, name: str, overlay_names: bool) -> tuple[Path, Path]:
    work = tmp / f"src-{name}"
    work.mkdir()
    tarball = work / "rootfs.tar"
    make_tarball(tarball, int.from_bytes(os.urandom(3), "little"), overlay_names)
    spec = work / "spec.yaml"
    spec.write_text(f"version: 1\nname: {name}\nlayers:\n  - tar: {{path: rootfs.tar}}\n")
    bundle = tmp / f"{name}.bundle"
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    return bundle, tarball


def overlay_by_hand(lower: Path, tmp: Path, overlay_names: bool) -> None:
    """Check what an overlayfs over `lower`, mounted the way ublkd does (root, no
    userxattr), shows on this kernel: the facts that make ublkd sprout instead."""
    upper, work, mnt = tmp / "o-upper", tmp / "o-work", tmp / "o-mnt"
    for d in (upper, work, mnt):
        d.mkdir()
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "-o", opts, "ovl", mnt], check=True)
    try:
        names = sorted(os.listxattr(mnt / "etc" / "hostname"))
        assert set(PLAIN) <= set(names)  # user.overlay.* too: not userxattr
        if not overlay_names:
            assert dict(list_dir(mnt, with_root=True)) == dict(list_dir(lower, with_root=True))
            return
        assert "trusted.overlay.x" not in names  # hidden
        assert "trusted.overlay.overlay.esc" not in names  # shown unescaped:
        assert os.getxattr(mnt / "etc" / "hostname", "trusted.overlay.esc") == b"escaped"
        assert "wh" not in os.listdir(mnt)  # a character device 0:0 is a whiteout
        # an xattr whiteout: listed, but no such file
        assert "gone" in os.listdir(mnt / "wdir")
        with pytest.raises(FileNotFoundError):
            os.lstat(mnt / "wdir" / "gone")
    finally:
        subprocess.run(["umount", mnt], check=True)


def hexed(d: dict[str, bytes]) -> dict[str, str]:
    return {k: v.hex() for k, v in d.items()}


@pytest.mark.parametrize("overlay_names", [False, True], ids=["plain-names", "overlay-names"])
def test_ephemeral_lists_like_the_read_only_mount(no_leftovers: Path, overlay_names: bool) -> None:
    tmp = no_leftovers
    bundle, tarball = bundle_with(tmp, "xattrs", overlay_names)
    ro, eph = tmp / "ro", tmp / "eph"
    ro.mkdir()
    eph.mkdir()
    ublkd("mount", bundle, ro, "--frontend", "fuse")
    try:
        want = dict(list_dir(ro, with_root=True))
        # the image has every name (the read-only mount is the kernel's btrfs)
        assert {k: v for k, v in want.items() if k != "/"} == list_tar(tarball)
        names = {**PLAIN, **(OVERLAY if overlay_names else {})}
        assert want["/etc/hostname"]["xattrs"] == dict(sorted(hexed(names).items()))

        # what plain overlayfs makes of it on this kernel
        overlay_by_hand(ro, tmp, overlay_names)

        r = ublkd("mount", bundle, eph, "--frontend", "fuse", "--ephemeral")
        st = status_of(eph)
        assert st["mode"] == "ephemeral"
        text = ublkd("status").stdout
        if overlay_names:
            assert st["ephemeral"] == "sprout" and st["upper"] is None, st
            why = str(st["ephemeral_why"])
            assert "xattr(s) named trusted.overlay.*" in why and "character device(s) 0:0" in why, (
                why
            )
            assert "btrfs sprout, not overlayfs" in r.stderr, r.stderr
            assert "ephemeral, btrfs sprout onto" in text and "not overlayfs" in text, text
            sprout_file = Path(str(st["rw_path"]))
            assert sprout_file.exists() and sprout_file.is_relative_to(
                Path(os.environ["UBLKD_RUN_DIR"])
            )
        else:
            assert st["ephemeral"] == "overlay" and st["ephemeral_why"] is None, st
            assert "ephemeral, overlay, upper" in text, text
            sprout_file = None
        assert dict(list_dir(eph, with_root=True)) == want

        # writes: a new file, a changed file, a new and a removed xattr
        (eph / "new-file").write_text("new")
        (eph / "etc" / "plain").write_text("changed")
        os.setxattr(eph / "etc" / "hostname", "user.added", b"1")
        os.removexattr(eph / "etc" / "hostname", "user.a")
        os.setxattr(eph / "etc" / "hostname", "trusted.overlay.y", b"2")
        assert dict(list_dir(eph, with_root=True)) != want
        assert dict(list_dir(ro, with_root=True)) == want
        ublkd("umount", eph)
        if sprout_file is not None:
            assert not sprout_file.exists()

        # they vanished with the mount
        ublkd("mount", bundle, eph, "--frontend", "fuse", "--ephemeral")
        try:
            assert dict(list_dir(eph, with_root=True)) == want
            assert status_of(eph)["ephemeral"] == ("sprout" if overlay_names else "overlay")
        finally:
            ublkd("umount", eph)
    finally:
        ublkd("umount", ro)
