"""Equality with the reference, `umoci unpack`, on a real Debian image built on this machine.

The base image is the Debian golden image's pinned bookworm minbase rootfs
(specs/golden/debian/prepare.sh, no network) packed with umoci as one layer. It is cached
in /var/cache/btrfs-ublk-image/oci/ under the recipe's name.

On top of it: layer 2 is a real `umoci repack` diff (deleted files, a directory replaced
by a file and a file by a directory, new hard links, new xattrs, changed modes and
owners, a device node); layer 3 is `umoci insert --opaque` (an opaque directory); layer 4
is written here with `umoci raw add-layer` to hit the whiteout corner cases (whiteout
and opaque marker in the same layer as new entries, in either order, a whiteout through
a symlinked parent, a hard link to a lower-layer file).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from btrfs_ublk_image.cli import main as cli

from bundletools import (
    Entry,
    dmesg_btrfs_problems,
    dmesg_len,
    list_dir,
    mounted_bundle,
    prepare_debian_inputs,
    run,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]

CACHE = Path(os.environ.get("BUI_CACHE", "/var/cache/btrfs-ublk-image")) / "oci"
BASE = CACHE / "debian-pinned-minbase-1"  # rename when the recipe changes


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _sh(*cmd: str | Path, cwd: Path | None = None) -> str:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd)
    if res.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))}: exit {res.returncode}\n{res.stderr}")
    return res.stdout


def debian_base_layout() -> Path:
    """The cached OCI layout (tag 'base') of the golden image's pinned minbase rootfs."""
    with _locked(CACHE / ".lock"):
        if (BASE / "index.json").exists():
            return BASE
        rootfs_tar = prepare_debian_inputs() / "rootfs.tar"
        work = CACHE / f".build-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            rootfs = work / "bundle" / "rootfs"
            _sh("umoci", "init", "--layout", work / "oci")
            _sh("umoci", "new", "--image", f"{work / 'oci'}:base")
            _sh("umoci", "unpack", "--image", f"{work / 'oci'}:base", work / "bundle")
            _sh("tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-xpf", rootfs_tar,
                "-C", rootfs)  # fmt: skip
            _sh("umoci", "repack", "--image", f"{work / 'oci'}:base", work / "bundle")
            _sh("umoci", "gc", "--layout", work / "oci")
            os.rename(work / "oci", BASE)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for old in CACHE.glob("debian-bookworm-minbase-*"):  # the dated caches of an older recipe
            shutil.rmtree(old, ignore_errors=True)
        return BASE


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **kw: object) -> tuple[tarfile.TarInfo, bytes]:  # fmt: skip
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    ti.mtime = 1_650_000_000
    ti.size = len(data)
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti, data


def _layer_two(rootfs: Path) -> None:
    """What a user might do in a container, diffed by `umoci repack`."""
    (rootfs / "etc" / "motd").unlink()  # delete files
    for p in sorted((rootfs / "usr" / "share" / "doc").iterdir())[:20]:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    shutil.rmtree(rootfs / "var" / "lib" / "apt" / "lists")  # a directory becomes a file
    (rootfs / "var" / "lib" / "apt" / "lists").write_text("not a directory any more\n")
    (rootfs / "etc" / "issue.net").unlink()  # a file becomes a directory
    (rootfs / "etc" / "issue.net").mkdir(mode=0o750)
    (rootfs / "etc" / "issue.net" / "inside").write_text("x")
    os.link(rootfs / "usr" / "bin" / "dpkg", rootfs / "usr" / "local" / "bin" / "dpkg-hl")
    (rootfs / "srv" / "data").write_bytes(os.urandom(3 << 20))
    os.link(rootfs / "srv" / "data", rootfs / "srv" / "data-2")
    os.link(rootfs / "srv" / "data", rootfs / "srv" / "data-3")
    os.setxattr(rootfs / "srv" / "data", "user.origin", b"layer two")
    os.setxattr(rootfs / "usr" / "bin" / "dpkg", "security.capability",
                bytes.fromhex("0100000200200000000000000000000000000000"))  # fmt: skip
    os.chmod(rootfs / "etc" / "issue", 0o600)  # changed mode and owner
    os.chown(rootfs / "etc" / "issue", 1234, 5678)
    os.mknod(rootfs / "dev" / "loop-test", 0o660 | 0o060000, os.makedev(7, 99))
    os.symlink("../usr/share/zoneinfo/Etc/UTC", rootfs / "etc" / "localtime-test")
    os.utime(rootfs / "srv" / "data", ns=(1, 1_600_000_000_123_456_789))


def _layer_four() -> bytes:
    """Whiteout corner cases, in an order umoci itself would not write."""
    d, reg, lnk = tarfile.DIRTYPE, tarfile.REGTYPE, tarfile.LNKTYPE
    members = [
        _member("etc/apt/new-before-opq", data=b"kept: same layer"),
        _member("etc/apt/.wh..wh..opq"),  # opaque AFTER a sibling of this layer
        _member("etc/apt/sources.list.d", d),  # recreated: its lower children stay hidden
        _member("usr/share/doc/.wh.dpkg"),  # a lower directory whited out
        _member("usr/share/doc/dpkg", d, mode=0o700),
        _member("usr/share/doc/dpkg/new", data=b"new in a whited-out dir"),
        _member("lib/.wh.os-release"),  # through the symlink lib -> usr/lib
        _member("etc/version-hl", lnk, linkname="etc/debian_version"),  # hard link to a lower file
        _member("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n", mode=0o644),
        _member("etc/.wh.passwd"),  # whiteout after the same layer wrote it: no effect
        _member(".wh.no-such-file"),
        _member("var/lib/apt/lists", reg, data=b"replaced again\n"),
        _member("opt/implicit/deeper/file", data=b"parents without entries"),
    ]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if data else None)
    return buf.getvalue()


@pytest.fixture(scope="module")
def debian_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An OCI layout with tag 'four': base + the three layers above."""
    for tool in ("mmdebstrap", "umoci", "skopeo"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed (scripts/setup.sh installs it)")
    base = debian_base_layout()
    work = tmp_path_factory.mktemp("debian")
    img = work / "img"
    shutil.copytree(base, img, symlinks=True)
    _sh("umoci", "unpack", "--image", f"{img}:base", work / "b2")
    _layer_two(work / "b2" / "rootfs")
    _sh("umoci", "repack", "--image", f"{img}:two", work / "b2")
    shutil.rmtree(work / "b2")
    (work / "apt").mkdir()
    (work / "apt" / "apt.conf").write_text("// only file left in /etc/apt\n")
    _sh("umoci", "insert", "--opaque", "--image", f"{img}:two", "--tag", "three",
        work / "apt", "/etc/apt")  # fmt: skip
    (work / "layer4.tar").write_bytes(_layer_four())
    _sh("umoci", "raw", "add-layer", "--image", f"{img}:three", "--tag", "four",
        work / "layer4.tar")  # fmt: skip
    return img


def _dir_times(root: Path, listing: dict[str, Entry]) -> dict[str, int]:
    return {
        p: os.lstat(str(root) + (p if p != "/" else "")).st_mtime_ns
        for p, e in listing.items()
        if e["type"] == "dir"
    }


IMPLICIT = ["/opt/implicit", "/opt/implicit/deeper"]  # parents with no tar entry


def test_debian_image_equals_umoci_unpack(debian_image: Path, tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    started_ns = time.time_ns()
    t0 = time.monotonic()
    _sh("umoci", "raw", "unpack", "--image", f"{debian_image}:four", ref)
    t_umoci = time.monotonic() - t0
    (tmp_path / "spec.yaml").write_text(
        f"version: 1\nname: debian\nlayers:\n  - oci: {{path: {debian_image}, ref: four}}\n"
    )
    t0 = time.monotonic()
    assert cli(["build", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "bundle")]) == 0
    t_ours = time.monotonic() - t0
    check = run("btrfs", "check", "--readonly", tmp_path / "bundle" / "meta.img", check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    want = list_dir(ref, with_root=True)
    before = dmesg_len()
    with mounted_bundle(tmp_path / "bundle", tmp_path) as m:
        got = list_dir(m.mountpoint, with_root=True)
        got_times = _dir_times(m.mountpoint, got)
        loops = m.loops
    assert dmesg_btrfs_problems(before, loops) == []
    want_times = _dir_times(ref, want)
    assert len(got) > 5000
    # the layers did what they say (checked on umoci's result: it is the reference)
    assert "/etc/motd" not in want and want["/var/lib/apt/lists"]["type"] == "file"
    # layer 3's opaque /etc/apt left apt.conf alone, layer 4's opaque hid apt.conf too
    assert sorted(p for p in want if p.startswith("/etc/apt/")) == [
        "/etc/apt/new-before-opq",
        "/etc/apt/sources.list.d",
    ]
    assert want["/etc/version-hl"]["link"] == "/etc/debian_version"
    assert want["/srv/data-3"]["link"] == "/srv/data"
    assert want["/etc/passwd"]["size"] == len(b"root:x:0:0:root:/root:/bin/sh\n")
    assert "/usr/lib/os-release" not in want and "/usr/share/doc/dpkg/new" in want
    # equality: names, types, modes, owners, mtimes (ns), xattrs, content, hard links
    assert got == want
    # directory mtimes too, except the intended difference: parents that no entry names
    for p in IMPLICIT:
        assert got_times.pop(p) == 1_650_000_000 * 10**9  # ours: the entry's mtime
        assert want_times.pop(p) >= started_ns  # umoci: the time of the unpack
    # umoci's mkdir of /opt/implicit also touches /opt (the parent it restores is the
    # entry's own, /opt/implicit/deeper); ours keeps /opt's mtime from its layer
    assert got_times.pop("/opt") < started_ns <= want_times.pop("/opt")
    assert got_times == want_times
    print(f"\numoci raw unpack {t_umoci:.1f} s, btrfs-ublk-image build {t_ours:.1f} s")


def test_debian_image_same_id_from_every_container(debian_image: Path, tmp_path: Path) -> None:
    """The layout, an oci-archive and a docker-archive (both made by skopeo): one image id."""
    ids = {}
    config = None
    for kind in ("layout", "oci-archive", "docker-archive"):
        work = tmp_path / kind
        work.mkdir()
        if kind == "layout":
            os.symlink(debian_image, work / "image")
        elif kind == "oci-archive":
            _sh("skopeo", "copy", "-q", f"oci:{debian_image}:four", f"oci-archive:{work / 'image'}:four")  # fmt: skip
        else:
            _sh("skopeo", "copy", "-q", f"oci:{debian_image}:four",
                f"docker-archive:{work / 'image'}:example/debian:four")  # fmt: skip
        (work / "spec.yaml").write_text(
            "version: 1\nname: debian\nlayers:\n  - oci: {path: image, ref: four}\n"
        )
        assert cli(["build", str(work / "spec.yaml"), "-o", str(work / "bundle")]) == 0
        manifest_bytes = (work / "bundle" / "manifest.json").read_bytes()
        ids[kind] = manifest_bytes
        config = json.loads(manifest_bytes)["image_config"]
    assert ids["layout"] == ids["oci-archive"] == ids["docker-archive"]
    assert config is not None and config["os"] == "linux"
