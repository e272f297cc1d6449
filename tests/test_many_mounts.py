"""Many mounts of one bundle at once (issue 10): read-only, --ephemeral and --rw mixed,
one server per bundle, one shared read-only mount for the ro and ephemeral modes.

The host runs the fuse frontend (16 mounts); the VM harness runs the same scenario
through ublk (5 mounts, marker `vm`). `no_leftovers` (from test_ublkd) fails a test
that leaves a mount, loop device, server or state behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_ublkd import UBLKD, build_bundle, our_servers, read_file, status, ublkd
from test_ublkd import no_leftovers as no_leftovers  # noqa: F401  (a fixture)

from btrfs_ublk_image.cli import main as cli

from bundletools import DEBIAN_CACHE, list_dir, list_tar, prepare_debian_inputs

pytestmark = pytest.mark.root


def _mount(bundle: Path, mnt: Path, mode: str, tmp: Path, frontend: str) -> str:
    args: list[str | Path] = ["mount", bundle, mnt, "--frontend", frontend]
    if mode == "ephemeral":
        args.append("--ephemeral")
    elif mode == "rw":
        args += ["--rw", tmp / f"{mnt.name}.rw", "--rw-size", "1G"]
    return ublkd(*args, timeout=180).stdout


def _parallel(fn: object, items: Sequence[object], workers: int) -> list[object]:
    """Run fn over items from `workers` threads, each starting its own ublkd process."""
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(fn, items))  # type: ignore[call-overload]


def _drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _write_errno(path: Path) -> int:
    try:
        path.write_text("x")
    except OSError as e:
        return e.errno or 0
    return 0


def _unchanged(tree: dict[str, object]) -> dict[str, object]:
    """The tree without what the test wrote (and the hardlink of the file it changed)."""
    skip = ("/etc/hostname", "/etc/hardlink")
    return {k: v for k, v in tree.items() if k not in skip and not k.startswith("/written-")}


def many_mounts(tmp: Path, modes: list[str], frontend: str, workers: int) -> None:
    bundle, tarball, files = build_bundle(tmp, "many")
    expected = list_tar(tarball)
    mnts = []
    for i, mode in enumerate(modes):
        m = tmp / f"m{i:02d}-{mode}"
        m.mkdir()
        mnts.append((m, mode))
    mounted: list[Path] = []
    try:
        # mount all of them from `workers` concurrent ublkd processes
        def do_mount(x: tuple[Path, str]) -> str:
            out = _mount(bundle, x[0], x[1], tmp, frontend)
            mounted.append(x[0])
            return out

        _parallel(do_mount, mnts, workers)
        st = status()
        assert len(st) == len(modes)
        assert {e["mode"] for e in st} == set(modes)
        # one server per bundle, shared by every mount
        assert len({e["server_pid"] for e in st}) == 1
        assert all(e["server_alive"] and e["mounted"] for e in st)
        assert len({e["bundle_key"] for e in st}) == 1
        assert len({e["shared"] for e in st if e["mode"] != "rw"}) == 1
        if frontend == "fuse":
            # the supervisor (the recorded server pid) and the one server it runs
            restarts = st[0]["restarts"]
            assert isinstance(restarts, dict)
            assert sorted(our_servers(tmp)) == sorted([st[0]["server_pid"], restarts["server_pid"]])
        else:
            # the shared mount is on /dev/ublkbN itself, each --rw mount on a loop device
            # over it
            for e in st:
                devs = [str(d) for d in e["devices"]]  # type: ignore[attr-defined]
                want = "dev2=/dev/ublkb" if e["mode"] != "rw" else " on /dev/ublkb"
                assert sum(want in d for d in devs) == 1, (e["mode"], devs)
        text = ublkd("status").stdout
        assert (
            sum(x.startswith("bundle ") for x in text.splitlines()) == 1
            and f"mounts   {len(modes)}" in text
        ), text

        # every tree identical to the source
        for m, _ in mnts:
            assert list_dir(m) == expected, m
        # read-only mounts refuse writes; a write in one writable mount is absent elsewhere
        for m, mode in mnts:
            if mode == "ro":
                assert _write_errno(m / "new-file") == errno.EROFS, m
            else:
                (m / f"written-{m.name}").write_text(m.name)
                (m / "etc" / "hostname").write_text(f"changed in {m.name}\n")
        _drop_caches()
        for m, mode in mnts:
            names = sorted(p.name for p in m.glob("written-*"))
            assert names == ([] if mode == "ro" else [f"written-{m.name}"]), (m, names)
            want = files["etc/hostname"] if mode == "ro" else f"changed in {m.name}\n".encode()
            assert (m / "etc" / "hostname").read_bytes() == want, m

        # a failing mount rolls back without disturbing the others
        bad = tmp / "bad.rw"
        bad.write_bytes(b"not a btrfs" * 1000)
        extra = tmp / "extra"
        extra.mkdir()
        r = ublkd("mount", bundle, extra, "--frontend", frontend, "--rw", bad, check=False)
        assert r.returncode != 0 and "refusing to overwrite" in r.stderr, r.stderr
        r = ublkd("mount", bundle, mnts[0][0], "--frontend", frontend, check=False)
        assert r.returncode != 0 and "already a mount point" in r.stderr, r.stderr
        assert len(status()) == len(modes)

        # umount one of each mode: the rest keep reading correctly
        gone: list[Path] = []
        for mode in ("ro", "ephemeral", "rw"):
            m = next(m for m, md in mnts if md == mode and m not in gone)
            ublkd("umount", m)
            mounted.remove(m)
            gone.append(m)
        _drop_caches()
        big = "data/a.bin"
        digest = hashlib.sha256(files[big]).digest()
        for m, _ in mnts:
            if m in gone:
                assert not list(m.iterdir()), m
                continue
            data = read_file(m / big)
            assert isinstance(data, bytes) and hashlib.sha256(data).digest() == digest, m
            assert _unchanged(list_dir(m)) == _unchanged(expected), m
        # the rest unmounted from several processes in parallel
        rest = list(mounted)
        _parallel(lambda m: ublkd("umount", m, timeout=180), rest, workers)
        mounted.clear()
        assert status() == []
        # and mounted again, in parallel, after the bundle's server went away
        again = [x for x in mnts if x[1] != "rw"][:4]
        _parallel(do_mount, again, workers)
        assert len({e["server_pid"] for e in status()}) == 1
        for m, _ in again:
            assert (m / "etc" / "hostname").read_bytes() == files["etc/hostname"]
        _parallel(lambda m: ublkd("umount", m, timeout=180), list(mounted), workers)
        mounted.clear()
    finally:
        for m in list(mounted):
            ublkd("umount", "--lazy", m, check=False)
    assert status() == []


@pytest.mark.usefixtures("no_leftovers")
def test_sixteen_mounts_of_one_bundle(tmp_path: Path) -> None:
    modes = ["ro"] * 6 + ["ephemeral"] * 6 + ["rw"] * 4
    many_mounts(tmp_path, modes, "fuse", workers=6)


@pytest.mark.vm
@pytest.mark.usefixtures("no_leftovers")
def test_ublk_many_mounts_of_one_bundle(tmp_path: Path) -> None:
    subprocess.run(["modprobe", "ublk_drv"], check=False)
    many_mounts(tmp_path, ["ro", "ro", "ephemeral", "ephemeral", "rw"], "ublk", workers=3)
    assert not list(Path("/dev").glob("ublkb*"))


def _shared_scratch(bundle_name: str) -> bool:
    """Is the shared mount of the bundle called `bundle_name` sprouted (has a scratch device)?"""
    entries = [e for e in status() if e["name"] == bundle_name and e["mode"] == "ro"]
    assert entries, f"no read-only mount of {bundle_name}"
    return any(str(d).startswith("scratch") for d in entries[0]["devices"])  # type: ignore[attr-defined]


@pytest.mark.usefixtures("no_leftovers")
def test_shared_mount_sprouts_only_when_an_instance_needs_the_fsid(tmp_path: Path) -> None:
    """A read-only mount leaves the image unsprouted (faster first mount); a later --rw
    mount of the same image, or a mount of ANOTHER image with the same filesystem (same
    tree from a different spec file: another image id, the same fsid), sprouts it first,
    so the kernel accepts the new device instances."""
    bundle, tarball, _ = build_bundle(tmp_path, "lazy")
    expected = list_tar(tarball)
    # the same tree from a spec that differs by one comment: another image id, same fsid
    spec2 = tmp_path / "src-lazy" / "spec-copy.yaml"
    spec2.write_text("# a copy\n" + (tmp_path / "src-lazy" / "spec.yaml").read_text())
    twin = tmp_path / "twin.bundle"
    assert cli(["build", str(spec2), "-o", str(twin)]) == 0
    m1 = json.loads((bundle / "manifest.json").read_text())
    m2 = json.loads((twin / "manifest.json").read_text())
    assert (
        m1["fsid"] == m2["fsid"]
        and (bundle / "manifest.json").read_bytes() != (twin / "manifest.json").read_bytes()
    )

    mnts = {n: tmp_path / n for n in ("ro", "twin-ro", "rw")}
    for m in mnts.values():
        m.mkdir()
    try:
        _mount(bundle, mnts["ro"], "ro", tmp_path, "fuse")
        assert not _shared_scratch("lazy")
        _mount(twin, mnts["twin-ro"], "ro", tmp_path, "fuse")  # sprouts the first one
        assert _shared_scratch("lazy")
        assert list_dir(mnts["twin-ro"]) == expected
        _mount(bundle, mnts["rw"], "rw", tmp_path, "fuse")
        (mnts["rw"] / "written-by-rw").write_text("x")
        for m in mnts.values():
            assert _unchanged(list_dir(m)) == _unchanged(expected), m
        assert _write_errno(mnts["ro"] / "etc" / "hostname") == errno.EROFS
    finally:
        for m in mnts.values():
            ublkd("umount", m, check=False)
    assert status() == []


assert UBLKD is not None


# --- a real container runtime on a mounted Debian minbase bundle ------------------------


def bwrap(root: Path, *cmd: str, ro: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "bwrap",
            "--ro-bind" if ro else "--bind",
            str(root),
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            "--unshare-all",
            "--die-with-parent",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/sbin:/usr/bin:/sbin:/bin",
            *cmd,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.usefixtures("no_leftovers")
def test_bwrap_runs_a_shell_on_a_mounted_debian_bundle(tmp_path: Path) -> None:
    """bwrap (bubblewrap) runs `/bin/sh -c 'echo ok'` with a read-only mount and an
    --ephemeral mount of a Debian minbase bundle as its root; what the ephemeral
    container writes stays in its mount."""
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("needs bwrap (bubblewrap) and mmdebstrap: run scripts/setup.sh")
    prepare_debian_inputs()
    # the golden minbase tree plus one file of ours: a different image (and fsid) than
    # the golden one, so that other users' mounts of that image cannot interfere
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "version: 1\nname: debian-bwrap\nlayers:\n"
        f"  - tar: {{path: {DEBIAN_CACHE / 'rootfs.tar'}}}\n"
        '  - files:\n      - {path: /etc/bwrap-test, content: "bwrap test\\n"}\n'
    )
    bundle = tmp_path / "debian.bundle"
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    ro, eph = tmp_path / "ro", tmp_path / "eph"
    ro.mkdir()
    eph.mkdir()
    mounted = []
    try:
        for m, extra in ((ro, []), (eph, ["--ephemeral"])):
            ublkd("mount", bundle, m, "--frontend", "fuse", *extra)
            mounted.append(m)
        r = bwrap(ro, "/bin/sh", "-c", "echo ok", ro=True)
        assert (r.returncode, r.stdout) == (0, "ok\n"), r.stderr
        r = bwrap(ro, "/bin/sh", "-c", "echo x > /etc/x", ro=True)
        assert r.returncode != 0 and "Read-only file system" in r.stderr, r.stderr
        r = bwrap(eph, "/bin/sh", "-c", "echo ok; echo hi > /etc/x; cat /etc/bwrap-test", ro=False)
        assert (r.returncode, r.stdout) == (0, "ok\nbwrap test\n"), r.stderr
        assert (eph / "etc" / "x").read_text() == "hi\n"
        assert not (ro / "etc" / "x").exists()
    finally:
        for m in mounted:
            ublkd("umount", m)
    assert status() == []
