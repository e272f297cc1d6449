"""Root integration tests for ublkd (fuse frontend; this host has no ublk).

Each test builds small bundles from tarballs made here, mounts them with
`ublkd mount`, and checks the tree, sprouting, integrity and cleanup. State goes
to a private UBLKD_RUN_DIR under tmp_path; the `no_leftovers` fixture fails a test
that leaves a loop device, a mount or a server process of ours behind (and
cleans up after it).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from btrfs_ublk_image.cli import main as cli

from bundletools import list_dir, list_tar, losetup, materialize_data_device

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1 << 20

pytestmark = pytest.mark.root


def ublkd_binary() -> str | None:
    if os.environ.get("UBLKD"):
        return os.environ["UBLKD"]
    built = ROOT / "ublkd" / "target" / "release" / "ublkd"
    if built.exists():
        return str(built)
    return shutil.which("ublkd")


UBLKD = ublkd_binary()
if os.geteuid() != 0 or UBLKD is None:
    pytest.skip("ublkd tests need root and a built ublkd", allow_module_level=True)


# --- helpers --------------------------------------------------------------------------
def ublkd(
    *args: str | Path, check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    assert UBLKD is not None
    r = subprocess.run([UBLKD, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"ublkd {' '.join(map(str, args))} failed:\n{r.stdout}{r.stderr}")
    return r


def status() -> list[dict[str, object]]:
    out: list[dict[str, object]] = json.loads(ublkd("status", "--json").stdout)
    return out


def status_of(mountpoint: Path) -> dict[str, object]:
    for e in status():
        if e["mountpoint"] == str(mountpoint.resolve()):
            return e
    raise AssertionError(f"{mountpoint} not in ublkd status")


def fresh_seed() -> int:
    """Content no other test run has: two runs (each with its own UBLKD_RUN_DIR) mounting
    the same image at once would share one kernel btrfs instance (same fsid and device
    uuids), and one run's reads would show up in the other's server counters."""
    return int.from_bytes(os.urandom(3), "little")


def dev2_dio(mountpoint: Path) -> str:
    """/sys/block/loopN/loop/dio ("1" direct I/O, "0" buffered) of the device-2 loop
    device `ublkd status` lists for the mount (a ro mount: the shared mount's)."""
    devices = status_of(mountpoint)["devices"]
    assert isinstance(devices, list)
    (dev2,) = [str(d) for d in devices if str(d).startswith("dev2=/dev/loop")]
    loop = dev2.removeprefix("dev2=/dev/").split()[0]
    return Path(f"/sys/block/{loop}/loop/dio").read_text().strip()


def make_tarball(path: Path, seed: int) -> dict[str, bytes]:
    """Files of every type; returns name -> content of the regular files."""
    rnd = __import__("random").Random(seed)

    def blob(n: int) -> bytes:
        return rnd.randbytes(n)

    files = {
        "etc/hostname": f"image-{seed}\n".encode(),
        "etc/empty": b"",
        "etc/extent": b"e" * 9000,
        "data/a.bin": blob(3 * CHUNK + 123),  # spans several pack chunks
        "data/b.bin": blob(2 * CHUNK + 77),
        "data/c.bin": blob(70_000),
        "data/a-copy.bin": b"",  # filled below: same content as a.bin (one extent)
        "usr/bin/tool": b"#!/bin/sh\necho tool\n",
    }
    files["data/a-copy.bin"] = files["data/a.bin"]

    def member(name: str, kind: bytes = tarfile.REGTYPE, **kw: object) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type = kind
        ti.mode = 0o644
        ti.mtime = 1_700_000_000 + seed
        for k, v in kw.items():
            setattr(ti, k, v)
        return ti

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for d in ("etc", "data", "usr", "usr/bin", "empty-dir"):
            tf.addfile(member(d, tarfile.DIRTYPE, mode=0o755))
        for name, data in files.items():
            mode = 0o755 if name.startswith("usr/bin") else 0o644
            tf.addfile(member(name, size=len(data), mode=mode), io.BytesIO(data))
        tf.addfile(member("etc/hardlink", tarfile.LNKTYPE, linkname="etc/hostname"))
        tf.addfile(member("usr/bin/sh-link", tarfile.SYMTYPE, linkname="tool", mode=0o777))
        tf.addfile(member("null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666))
        tf.addfile(member("fifo", tarfile.FIFOTYPE, mode=0o600))
    return files


def build_bundle(
    tmp: Path, name: str, seed: int | None = None
) -> tuple[Path, Path, dict[str, bytes]]:
    """-> (bundle dir, tarball, files); content from `seed`, by default a fresh one."""
    work = tmp / f"src-{name}"
    work.mkdir()
    tarball = work / "rootfs.tar"
    files = make_tarball(tarball, fresh_seed() if seed is None else seed)
    spec = work / "spec.yaml"
    spec.write_text(f"version: 1\nname: {name}\nlayers:\n  - tar: {{path: rootfs.tar}}\n")
    bundle = tmp / f"{name}.bundle"
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    return bundle, tarball, files


def read_file(path: Path) -> bytes | int:
    """File content, or the errno of a failed read, in a child with a timeout (a hung
    read must fail the test, not the run)."""
    r = subprocess.run(
        ["python3", "-c", f"import sys;sys.stdout.buffer.write(open({str(path)!r},'rb').read())"],
        capture_output=True,
        timeout=60,
    )
    if r.returncode == 0:
        return r.stdout
    text = r.stderr.decode(errors="replace")
    if "Input/output error" in text:
        return errno.EIO
    if "Transport endpoint" in text:
        return errno.ENOTCONN
    raise AssertionError(f"reading {path} failed unexpectedly: {text}")


def loop_name(dev: str) -> str:
    """lo_file_name of /dev/<dev> (LOOP_GET_STATUS64); ublkd puts the mount's state dir
    there for device 2, whose backing file the kernel reports only as "/dev2"."""
    buf = bytearray(232)
    try:
        with open(f"/dev/{dev}", "rb") as f:
            fcntl.ioctl(f, 0x4C05, buf)
    except OSError:
        return ""
    return bytes(buf[56:120]).split(b"\0")[0].decode(errors="replace")


def our_loops(tmp: Path, run_dir: Path) -> list[str]:
    """Loop devices of ours: backing file under tmp, or device 2 of a mount in run_dir."""
    out = []
    for d in Path("/sys/block").glob("loop*"):
        try:
            backing = (d / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if backing.startswith(str(tmp)) or (
            backing == "/dev2" and loop_name(d.name).startswith(str(run_dir))
        ):
            out.append(f"/dev/{d.name} ({backing})")
    return out


def our_mounts(tmp: Path) -> list[str]:
    return [line for line in Path("/proc/mounts").read_text().splitlines() if str(tmp) in line]


def our_servers(tmp: Path) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and b"serve" in cmd and any(str(tmp).encode() in c for c in cmd):
            pids.append(int(p.name))
    return pids


@pytest.fixture
def no_leftovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Private ublkd state dir; after the test: nothing of ours may remain."""
    # short, so that a state dir fits in lo_file_name (64 bytes)
    run_dir = Path(f"/run/ublkd-test-{os.getpid()}-{tmp_path.name[-12:]}")
    monkeypatch.setenv("UBLKD_RUN_DIR", str(run_dir))
    yield tmp_path
    # give autoclear and exiting servers a moment
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (
        our_mounts(tmp_path) or our_loops(tmp_path, run_dir) or our_servers(tmp_path)
    ):
        time.sleep(0.1)
    left = {
        "mounts": our_mounts(tmp_path),
        "loops": our_loops(tmp_path, run_dir),
        "servers": our_servers(tmp_path),
        "state": sorted(p.name for d in ("mounts", "bundles") for p in (run_dir / d).glob("*")),
    }
    if any(left.values()):
        # clean up for the next test, then fail this one
        for line in left["mounts"]:
            ublkd("umount", "--lazy", line.split()[1], check=False)
        for pid in our_servers(tmp_path):
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"leftovers after the test: {left}")
    shutil.rmtree(run_dir, ignore_errors=True)
    losetup = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in losetup, losetup


# --- tests ----------------------------------------------------------------------------
def test_mount_tree_identical_then_umount(no_leftovers: Path) -> None:
    tmp = no_leftovers
    bundle, tarball, _ = build_bundle(tmp, "one")
    mnt = tmp / "mnt"
    mnt.mkdir()
    r = ublkd("mount", bundle, mnt, "--frontend", "fuse")
    assert "frontend fuse" in r.stderr
    try:
        assert list_dir(mnt) == list_tar(tarball)
        with pytest.raises(OSError) as e:
            (mnt / "new-file").write_text("x")
        assert e.value.errno == errno.EROFS
        st = status_of(mnt)
        assert st["frontend"] == "fuse" and st["mode"] == "ro" and st["mounted"] is True
        assert st["server_alive"] is True
        image_id = "sha256:" + hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()
        assert st["image_id"] == image_id
        time.sleep(0.5)  # the server rewrites stats.json every 200 ms
        st = status_of(mnt)
        assert isinstance(st["bytes_served"], int) and st["bytes_served"] > 5 * CHUNK
        assert st["chunks_verified"] and st["verify_failures"] == 0
        assert any(str(d).startswith("dev2=/dev/loop") for d in st["devices"])  # type: ignore[attr-defined]
    finally:
        ublkd("umount", mnt)
    assert status() == []


def test_expect_id_and_bad_bundles_are_refused(no_leftovers: Path) -> None:
    tmp = no_leftovers
    bundle, _, _ = build_bundle(tmp, "bad")
    mnt = tmp / "mnt"
    mnt.mkdir()
    r = ublkd(
        "mount", bundle, mnt, "--frontend", "fuse", "--expect-id", "sha256:" + "0" * 64, check=False
    )
    assert r.returncode != 0 and "image id is sha256:" in r.stderr
    broken = tmp / "broken.bundle"
    shutil.copytree(bundle, broken)
    with open(broken / "meta.img", "r+b") as f:
        f.seek(70000)
        b = f.read(1)
        f.seek(70000)
        f.write(bytes([b[0] ^ 1]))
    r = ublkd("mount", broken, mnt, "--frontend", "fuse", check=False)
    assert r.returncode != 0 and "meta.img: sha256 is" in r.stderr, r.stderr
    # a failure after the server and loop devices are up rolls all of it back
    junk = tmp / "junk.img"
    junk.write_bytes(b"not a btrfs" * 1000)
    r = ublkd("mount", bundle, mnt, "--frontend", "fuse", "--rw", junk, check=False)
    assert r.returncode != 0 and "refusing to overwrite" in r.stderr, r.stderr
    assert status() == [] and not our_mounts(tmp)


def test_meta_img_verified_record(no_leftovers: Path) -> None:
    """A meta.img hashed once is not hashed again while its (dev, inode, size, mtime,
    ctime) match the verified record; written since (even with its size and mtime put
    back), it is hashed again and refused; a ctime too recent for a record gets none."""
    tmp = no_leftovers
    bundle, _, _ = build_bundle(tmp, "record")
    meta = bundle / "meta.img"
    want = json.loads((bundle / "manifest.json").read_text())["files"]["meta.img"]["sha256"]
    record = Path(os.environ["UBLKD_RUN_DIR"], "verified", want.removeprefix("sha256:") + ".json")
    time.sleep(max(0.0, meta.stat().st_ctime + 2.2 - time.time()))  # no racy ctime
    mnt = tmp / "mnt"
    mnt.mkdir()
    env = dict(os.environ, RUST_LOG="debug")

    def mount() -> subprocess.CompletedProcess[str]:
        assert UBLKD is not None
        return subprocess.run([UBLKD, "mount", str(bundle), str(mnt), "--frontend", "fuse"],
                              capture_output=True, text=True, env=env, timeout=60)  # fmt: skip

    r = mount()
    assert r.returncode == 0, r.stderr
    assert "not hashed" not in r.stderr
    ublkd("umount", mnt)
    rec = json.loads(record.read_text())
    st = meta.stat()
    assert (rec["ino"], rec["size"], rec["ctime_ns"]) == (st.st_ino, st.st_size, st.st_ctime_ns)
    assert record.stat().st_mode & 0o022 == 0 and record.parent.stat().st_mode & 0o777 == 0o700
    r = mount()
    assert r.returncode == 0 and "matches: not hashed" in r.stderr, r.stderr
    ublkd("umount", mnt)
    # one byte changed, size and mtime put back: only the ctime tells
    with open(meta, "r+b") as f:
        f.seek(70000)
        b = f.read(1)
        f.seek(70000)
        f.write(bytes([b[0] ^ 1]))
    os.utime(meta, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = mount()
    assert r.returncode != 0 and "meta.img: sha256 is" in r.stderr, r.stderr
    assert not record.exists()
    with open(meta, "r+b") as f:
        f.seek(70000)
        f.write(b)
    r = mount()  # hashed, matches; the ctime is too recent for a record
    assert r.returncode == 0 and "not hashed" not in r.stderr, r.stderr
    ublkd("umount", mnt)
    assert not record.exists()
    assert status() == []


@pytest.mark.parametrize("frontend", ["fuse", pytest.param("ublk", marks=pytest.mark.vm)])
def test_sprout_write_umount_mount_again(no_leftovers: Path, frontend: str) -> None:
    """Sprout, write, umount, mount again with the same --rw: the data is there and the seed
    is untouched. The ublk case runs inside the VM harness (a kernel with ublk_drv)."""
    tmp = no_leftovers
    if frontend == "ublk":
        subprocess.run(["modprobe", "ublk_drv"], check=False)
    bundle, tarball, files = build_bundle(tmp, "sprout")
    mnt = tmp / "mnt"
    mnt.mkdir()
    rw = tmp / "rw.img"
    r = ublkd("mount", bundle, mnt, "--frontend", frontend, "--rw", rw, "--rw-size", "2G")
    assert "new sprout" in r.stdout and f"frontend {frontend}" in r.stdout + r.stderr
    assert status_of(mnt)["frontend"] == frontend
    assert rw.stat().st_size == 2 << 30 and rw.stat().st_blocks * 512 < 512 << 20  # sparse
    new = os.urandom(3 * CHUNK)
    try:
        (mnt / "new.bin").write_bytes(new)
        (mnt / "etc" / "hostname").write_text("changed\n")
        (mnt / "data" / "c.bin").unlink()
        os.sync()
    finally:
        ublkd("umount", mnt)
    assert not our_mounts(tmp)
    r = ublkd("mount", bundle, mnt, "--frontend", frontend, "--rw", rw)
    assert "existing sprout" in r.stdout
    try:
        assert (mnt / "new.bin").read_bytes() == new
        assert (mnt / "etc" / "hostname").read_text() == "changed\n"
        assert not (mnt / "data" / "c.bin").exists()
        assert (mnt / "data" / "a.bin").read_bytes() == files["data/a.bin"]
        assert status_of(mnt)["mode"] == "rw"
    finally:
        ublkd("umount", mnt)
    # the seed itself is untouched
    ublkd("mount", bundle, mnt, "--frontend", frontend)
    try:
        assert list_dir(mnt) == list_tar(tarball)
    finally:
        ublkd("umount", mnt)


def test_two_bundles_at_once(no_leftovers: Path) -> None:
    tmp = no_leftovers
    b1, t1, _ = build_bundle(tmp, "first")
    b2, t2, _ = build_bundle(tmp, "second")
    m1, m2 = tmp / "m1", tmp / "m2"
    m1.mkdir()
    m2.mkdir()
    ublkd("mount", b1, m1, "--frontend", "fuse")
    try:
        ublkd("mount", b2, m2, "--frontend", "fuse", "--rw", tmp / "rw2.img", "--rw-size", "1G")
        try:
            assert list_dir(m1) == list_tar(t1)
            (m2 / "only-in-2").write_text("2")
            listing = list_dir(m2)
            del listing["/only-in-2"]
            assert listing == list_tar(t2)
            assert {e["mountpoint"] for e in status()} == {str(m1), str(m2)}
        finally:
            ublkd("umount", m2)
        assert list_dir(m1) == list_tar(t1)  # still serving after the other umount
    finally:
        ublkd("umount", m1)
    # the second bundle's sprout is refused as a writable layer for the first
    r = ublkd("mount", b1, m1, "--frontend", "fuse", "--rw", tmp / "rw2.img", check=False)
    assert r.returncode != 0 and "does not mount as a sprout of this image" in r.stderr, r.stderr
    assert status() == []


def kill_server(mnt: Path, wait_s: float = 5.0) -> float:
    """kill -9 the server of the bundle mounted at `mnt`, then wait (at most `wait_s`)
    until ublkd sees it gone; -> the deadline used (time.monotonic())."""
    pid = status_of(mnt)["server_pid"]
    assert isinstance(pid, int)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while status_of(mnt)["server_alive"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return deadline


def chunks_of_files(pack: bytes, files: dict[str, bytes]) -> dict[str, set[int]]:
    """Which pack chunks each file's content (found by its bytes) lies in; files up to
    4 KiB may be inline in meta.img and are left out."""
    chunks: dict[str, set[int]] = {}
    for name, content in files.items():
        if len(content) > 4096:
            at = pack.find(content)
            assert at >= 0, name
            chunks[name] = set(range(at // CHUNK, (at + len(content) - 1) // CHUNK + 1))
    return chunks


def assert_only_bad_chunk_fails(
    mnt: Path, files: dict[str, bytes], chunks: dict[str, set[int]], bad_chunk: int, log_says: str
) -> None:
    """With pack chunk `bad_chunk` corrupted (make_tarball's files): reads of the files in
    it fail with EIO (again when retried: a failed read leaves nothing in the page cache),
    every other file reads right, the server counts and logs it."""
    affected = sorted(n for n, c in chunks.items() if bad_chunk in c)
    fine = sorted(n for n, c in chunks.items() if bad_chunk not in c)
    assert "data/b.bin" in affected and fine
    for name in affected * 2:
        assert read_file(mnt / name) == errno.EIO, name
    for name in fine:
        assert read_file(mnt / name) == files[name], name
    for name in ("etc/hostname", "usr/bin/tool"):  # inline in metadata
        assert read_file(mnt / name) == files[name]
    deadline = time.monotonic() + 3
    while status_of(mnt)["verify_failures"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    st = status_of(mnt)
    assert isinstance(st["verify_failures"], int) and st["verify_failures"] >= 1
    log = Path(os.environ["UBLKD_RUN_DIR"], "bundles").glob("*/server.log")
    assert any(log_says in p.read_text() for p in log), log_says


def test_corrupt_pack_byte_fails_reads_of_that_chunk_only(no_leftovers: Path) -> None:
    tmp = no_leftovers
    clean, _, files = build_bundle(tmp, "corrupt")
    bundle = tmp / "corrupted.bundle"
    shutil.copytree(clean, bundle)
    (pack,) = list((bundle / "packs").iterdir())
    data = bytearray(pack.read_bytes())
    chunks = chunks_of_files(bytes(data), files)
    victim = (data.find(files["data/b.bin"]) + len(files["data/b.bin"]) // 2) // CHUNK * CHUNK + 5
    data[victim] ^= 0xFF
    pack.write_bytes(bytes(data))
    bad_chunk = victim // CHUNK
    mnt = tmp / "mnt"
    mnt.mkdir()
    ublkd("mount", bundle, mnt, "--frontend", "fuse")
    try:
        assert_only_bad_chunk_fails(mnt, files, chunks, bad_chunk, f"chunk {bad_chunk} ")
    finally:
        ublkd("umount", mnt)


def test_kill_9_server_then_recover_and_umount(no_leftovers: Path) -> None:
    """kill -9 of a fuse server: reads of data not yet in the page cache fail with EIO
    (they never hang); `ublkd recover` starts a new server and swaps it under the
    read-only loop device (LOOP_CHANGE_FD), reads work again without unmounting;
    after another kill -9, `ublkd umount` still removes everything."""
    tmp = no_leftovers
    bundle, _, files = build_bundle(tmp, "kill")
    mnt = tmp / "mnt"
    mnt.mkdir()
    ublkd("mount", bundle, mnt, "--frontend", "fuse", "--rw", tmp / "rw.img", "--rw-size", "1G")
    try:
        assert read_file(mnt / "data" / "c.bin") == files["data/c.bin"]
        kill_server(mnt)
        assert status_of(mnt)["server_alive"] is False
        assert read_file(mnt / "data" / "b.bin") == errno.EIO
        assert read_file(mnt / "data" / "c.bin") == files["data/c.bin"]  # page cache
        ublkd("recover", mnt)
        assert status_of(mnt)["server_alive"] is True
        assert read_file(mnt / "data" / "b.bin") == files["data/b.bin"]
        (mnt / "written").write_text("ok")
        pid = status_of(mnt)["server_pid"]
        assert isinstance(pid, int)
        os.kill(pid, signal.SIGKILL)
    finally:
        ublkd("umount", mnt)
    assert status() == []


def test_dev2_cache_page_default_direct_on_request_one_mode_per_server(no_leftovers: Path) -> None:
    """--dev2-cache: a local bundle's device-2 loop device is buffered by default
    (page), direct I/O with `direct`; the mode belongs to the bundle's server: a mount
    asking for another one while it runs is refused (nothing left behind), a mount
    without the flag follows it, and `recover` starts the new server in it (and with the
    first mount's --cache-mb); `status` shows both."""
    tmp = no_leftovers
    bundle, tarball, files = build_bundle(tmp, "dio")
    mnt, other = tmp / "mnt", tmp / "other"
    mnt.mkdir()
    other.mkdir()
    r = ublkd("mount", bundle, mnt, "--frontend", "fuse")
    try:
        assert "--dev2-cache page (default for a local bundle)" in r.stderr, r.stderr
        assert dev2_dio(mnt) == "0"
        assert (status_of(mnt)["dev2_cache"], status_of(mnt)["cache_mb"]) == ("page", 256)
        r = ublkd("mount", bundle, other, "--ephemeral", "--dev2-cache", "direct", check=False)
        assert r.returncode != 0, r.stdout
        assert "already served with --dev2-cache page" in r.stderr, r.stderr
        assert not os.path.ismount(other) and len(status()) == 1
        assert list_dir(mnt) == list_tar(tarball)
    finally:
        ublkd("umount", mnt)
    assert status() == []

    r = ublkd(
        "mount", bundle, mnt, "--frontend", "fuse", "--dev2-cache", "direct", "--cache-mb", "64"
    )
    try:
        assert "--dev2-cache direct (requested)" in r.stderr, r.stderr
        assert (status_of(mnt)["dev2_cache"], status_of(mnt)["cache_mb"]) == ("direct", 64)
        assert "dev2-cache direct, chunk cache 64 MiB" in ublkd("status").stdout
        r = ublkd("mount", bundle, other, "--rw", tmp / "rw.img", "--rw-size", "1G")
        assert "--dev2-cache direct (the bundle's server)" in r.stderr, r.stderr
        for m in (mnt, other):
            assert dev2_dio(m) == "1", m
            assert list_dir(m) == list_tar(tarball)
        kill_server(mnt)
        ublkd("recover", other)
        pid = status_of(mnt)["server_pid"]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"direct" in argv and argv[argv.index(b"--cache-mb") + 1] == b"64", argv
        assert (status_of(mnt)["dev2_cache"], status_of(mnt)["cache_mb"]) == ("direct", 64)
        for m in (mnt, other):
            assert dev2_dio(m) == "1", m
            assert read_file(m / "data" / "b.bin") == files["data/b.bin"]
    finally:
        ublkd("umount", other, check=False)
        ublkd("umount", mnt)
    assert status() == []


def test_dev2_cache_passthrough_reads_bypass_the_server(no_leftovers: Path) -> None:
    """--dev2-cache passthrough (FUSE passthrough onto a verified copy of device 2): the
    mount lists and reads exactly what a page-cached mount does, and none of those reads
    reaches the server (its `reads` counter stays 0). A restarted server (SIGKILL, the
    supervisor's restart) answers a new mount's open with the same backing file; with the
    supervisor killed (the FUSE connection ends) reads still work, from the backing file,
    and `recover` puts a new server's copy under the mounts. The copy is an unnamed file:
    nothing is left in the cache directory."""
    tmp = no_leftovers
    bundle, tarball, _files = build_bundle(tmp, "pt")
    mnt, other = tmp / "mnt", tmp / "other"
    mnt.mkdir()
    other.mkdir()
    ublkd("mount", bundle, mnt, "--frontend", "fuse")
    try:
        page_listing = list_dir(mnt)
    finally:
        ublkd("umount", mnt)
    assert page_listing == list_tar(tarball)

    cache_dir = Path(os.environ.get("UBLKD_CACHE_DIR", "/var/cache/ublkd"))
    cached_before = sorted(cache_dir.iterdir()) if cache_dir.is_dir() else []
    r = ublkd("mount", bundle, mnt, "--frontend", "fuse", "--dev2-cache", "passthrough")
    try:
        assert "--dev2-cache passthrough (requested)" in r.stderr, r.stderr
        assert status_of(mnt)["dev2_cache"] == "passthrough"
        assert dev2_dio(mnt) == "0"
        assert list_dir(mnt) == page_listing
        time.sleep(0.5)  # the server writes its counters every 200 ms
        st = status_of(mnt)
        assert (st["reads"], st["bytes_served"]) == (0, 0), st
        assert sorted(cache_dir.iterdir()) == cached_before

        # the server killed and restarted: a new mount opens dev2 with the same backing id
        pid = st["restarts"]["server_pid"]  # type: ignore[index]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while status_of(mnt)["restarts"]["count"] == 0:  # type: ignore[index]
            assert time.monotonic() < deadline, "the supervisor did not restart the server"
            time.sleep(0.05)
        ublkd("mount", bundle, other, "--rw", tmp / "rw.img", "--rw-size", "1G")
        assert list_dir(other) == page_listing
        assert status_of(other)["reads"] == 0

        # the supervisor killed: the connection ends, reads go on from the backing file
        kill_server(mnt)
        subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
        assert list_dir(mnt) == page_listing
        assert list_dir(other) == page_listing
        # recover: a new server copies device 2 for its new connection
        ublkd("recover", mnt)
        subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
        assert list_dir(other) == page_listing
        time.sleep(0.5)
        st = status_of(mnt)
        assert (st["dev2_cache"], st["server_alive"], st["reads"]) == ("passthrough", True, 0)
    finally:
        ublkd("umount", other, check=False)
        ublkd("umount", mnt)
    assert status() == []


# --- ublk frontend: runs only inside the VM harness (tests/vm/, a 6.12 guest kernel) ---
@pytest.mark.vm
def test_ublk_mount_kill_during_reads_recover(no_leftovers: Path) -> None:
    """ublk with USER_RECOVERY: kill -9 the server, a read started afterwards waits
    (the kernel queues it) instead of failing; `ublkd recover` starts a new server that
    reattaches to the same /dev/ublkbN and the read completes, without unmounting."""
    tmp = no_leftovers
    subprocess.run(["modprobe", "ublk_drv"], check=False)
    bundle, tarball, files = build_bundle(tmp, "vmublk")
    mnt = tmp / "mnt"
    mnt.mkdir()
    r = ublkd("mount", bundle, mnt, "--frontend", "auto", "--rw", tmp / "rw.img", "--rw-size", "1G")
    assert "frontend ublk" in r.stderr, r.stderr
    try:
        st = status_of(mnt)
        assert st["frontend"] == "ublk"
        # device 2: a loop instance on the bundle server's /dev/ublkbN
        assert any("on /dev/ublkb" in str(d) for d in st["devices"])  # type: ignore[attr-defined]
        listing = list_dir(mnt)
        assert listing == list_tar(tarball)
        (mnt / "written").write_text("before kill\n")
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        deadline = kill_server(mnt, wait_s=10)
        reader = subprocess.Popen(
            ["sha256sum", str(mnt / "data" / "b.bin")], stdout=subprocess.PIPE, text=True
        )
        time.sleep(2)
        assert reader.poll() is None, "the read should wait for a new server, not fail"
        ublkd("recover", mnt, timeout=120)
        out, _ = reader.communicate(timeout=120)
        assert out.split()[0] == hashlib.sha256(files["data/b.bin"]).hexdigest()
        assert (mnt / "written").read_text() == "before kill\n"
        assert status_of(mnt)["server_alive"] is True
        # killed again and not recovered: umount must still clean up (the device is
        # deleted first so nothing waits for a server that will not come back)
        pid = status_of(mnt)["server_pid"]
        assert isinstance(pid, int)
        os.kill(pid, signal.SIGKILL)
        while status_of(mnt)["server_alive"] and time.monotonic() < deadline + 30:
            time.sleep(0.05)
    finally:
        ublkd("umount", mnt, timeout=120)
    assert status() == []
    assert not list(Path("/dev").glob("ublkb*"))


@pytest.mark.vm
def test_ublk_poll_mount_read_recover_umount(no_leftovers: Path) -> None:
    """`--ublk-poll`: the server polls its (one) queue; files read back with their
    checksums; the mode is the bundle server's (another value is refused, no value
    follows it, `recover` keeps it); umount stops the polling server and cleans up."""
    tmp = no_leftovers
    subprocess.run(["modprobe", "ublk_drv"], check=False)
    bundle, tarball, files = build_bundle(tmp, "vmpoll", fresh_seed())
    mnt, mnt2 = tmp / "mnt", tmp / "mnt2"
    mnt.mkdir()
    mnt2.mkdir()
    ublkd("mount", bundle, mnt, "--frontend", "ublk", "--ublk-poll=300000")
    try:
        st = status_of(mnt)
        assert (st["frontend"], st["ublk_poll"]) == ("ublk", "300000")
        pid = st["server_pid"]
        assert isinstance(pid, int)
        assert b"--ublk-poll=300000" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        # one queue: the polling thread is not pinned to the CPU of its submitters
        # (the read-only mount uses /dev/ublkbN itself: "dev2=/dev/ublkbN (...)")
        (dev,) = [
            str(d).split()[0].removeprefix("dev2=")
            for d in st["devices"]
            if "dev2=/dev/ublkb" in str(d)
        ]  # type: ignore[attr-defined]
        assert len(list(Path(f"/sys/block/{Path(dev).name}/mq").iterdir())) == 1
        # and no I/O scheduler (the kernel's default for one hw queue is mq-deadline)
        assert "[none]" in Path(f"/sys/block/{Path(dev).name}/queue/scheduler").read_text()
        assert list_dir(mnt) == list_tar(tarball)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        for name in ("data/a.bin", "data/b.bin", "data/c.bin"):
            got = hashlib.sha256((mnt / name).read_bytes()).hexdigest()
            assert got == hashlib.sha256(files[name]).hexdigest(), name
        r = ublkd("mount", bundle, mnt2, "--ublk-poll=5", check=False)
        assert r.returncode != 0 and "--ublk-poll=300000" in r.stderr, r.stderr
        ublkd("mount", bundle, mnt2)  # no value: follows the bundle's server
        assert status_of(mnt2)["server_pid"] == pid
        ublkd("umount", mnt2)
        # kill -9, recover: the new server polls as the old one did
        kill_server(mnt, wait_s=10)
        ublkd("recover", mnt, timeout=120)
        st = status_of(mnt)
        assert st["server_alive"] is True and (st["ublk_poll"], st["ublk_queues"]) == ("300000", 1)
        old, pid = pid, st["server_pid"]
        assert isinstance(pid, int) and pid != old
        assert b"--ublk-poll=300000" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        assert (mnt / "data" / "b.bin").read_bytes() == files["data/b.bin"]
    finally:
        ublkd("umount", mnt, timeout=120)
    assert status() == []
    assert not list(Path("/dev").glob("ublkb*"))


def serving_pid(mnt: Path) -> int:
    """The process that serves `mnt`'s bundle now: not the recorded server pid (its
    supervisor, docs/ublkd.md "Server death") but the supervisor's child."""
    restarts = status_of(mnt)["restarts"]
    assert isinstance(restarts, dict)
    pid = restarts["server_pid"]
    assert isinstance(pid, int) and pid > 0
    return pid


def running_threads(pid: int, settle_s: float) -> list[str]:
    """Names of `pid`'s threads found running (state R) in each of three looks over
    `settle_s` seconds: a polling queue thread always is, a sleeping one never (a thread
    that only wakes now and then, e.g. the stats writer, is not caught in all three)."""
    looks: list[set[str]] = []
    for _ in range(3):
        time.sleep(settle_s / 3)
        seen = set()
        for t in Path(f"/proc/{pid}/task").iterdir():
            try:
                name, rest = (t / "stat").read_text().rsplit(")", 1)
            except OSError:
                continue
            if rest.split()[0] == "R":
                seen.add(f"{t.name} {name.split('(', 1)[1]}")
        looks.append(seen)
    return sorted(set.intersection(*looks))


def first_line(p: subprocess.Popen[str], none: str, timeout: float = 60) -> str:
    """The first line that ``p`` (started with stdout=PIPE) prints; the test fails with
    ``none`` if it prints nothing within ``timeout`` seconds."""
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    assert ready, f"{none} within {timeout:g} s"
    return p.stdout.readline()


def serve_ready_device(p: subprocess.Popen[str]) -> Path:
    """The /dev/ublkbN that a started `ublkd serve --frontend ublk` names in its READY line."""
    line = first_line(p, "ublkd serve printed no READY line")
    assert line.startswith("READY "), line
    return Path(json.loads(line.removeprefix("READY "))["device"])


def ublk_ctrl(dev: Path) -> Path:
    """The control node (/dev/ublkcN) of a ublk block device (/dev/ublkbN)."""
    return Path(f"/dev/ublkc{dev.name.removeprefix('ublkb')}")


def gone(*paths: Path, timeout: float = 10.0) -> bool:
    """Whether all ``paths`` are gone within ``timeout`` seconds (device nodes vanish
    asynchronously: devtmpfs)."""
    end = time.monotonic() + timeout
    while any(p.exists() for p in paths):
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def hw_queues(st: dict[str, object]) -> int:
    """Hardware queues of the read-only mount's /dev/ublkbN ("dev2=/dev/ublkbN")."""
    (dev,) = [
        str(d).split()[0].removeprefix("dev2=")
        for d in st["devices"]  # type: ignore[attr-defined]
        if "dev2=/dev/ublkb" in str(d)
    ]
    return len(list(Path(f"/sys/block/{Path(dev).name}/mq").iterdir()))


@pytest.mark.vm
def test_ublk_poll_default_is_auto_and_off_sleeps(no_leftovers: Path) -> None:
    """Without `--ublk-poll` the server polls adaptively (`auto`: one queue; idle, its
    threads sleep); another mode is refused while it serves; `--ublk-poll=off` gets one
    queue per CPU and never polls; `--ublk-queues=2` gets two polling queues, and another
    count is refused while it serves. `status` shows mode and queues. Files read back
    right in each."""
    tmp = no_leftovers
    subprocess.run(["modprobe", "ublk_drv"], check=False)
    bundle, _, files = build_bundle(tmp, "vmpollauto", fresh_seed())
    mnt, mnt2 = tmp / "mnt", tmp / "mnt2"
    mnt.mkdir()
    mnt2.mkdir()
    ublkd("mount", bundle, mnt, "--frontend", "ublk")
    try:
        st = status_of(mnt)
        assert (st["frontend"], st["ublk_poll"], st["ublk_queues"]) == ("ublk", "auto", 1)
        pid = st["server_pid"]
        assert isinstance(pid, int)
        assert b"--ublk-poll=auto" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert hw_queues(st) == 1
        for _ in range(3):
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            for name in ("data/a.bin", "data/b.bin", "data/c.bin"):
                assert (mnt / name).read_bytes() == files[name], name
        # idle after those reads: nothing polls (a long fixed window would: see
        # test_ublk_poll_serve_raw_device_checksum_sigterm)
        assert running_threads(serving_pid(mnt), settle_s=1.0) == []
        r = ublkd("mount", bundle, mnt2, "--ublk-poll=off", check=False)
        assert r.returncode != 0 and "--ublk-poll=auto" in r.stderr, r.stderr
        assert "--ublk-poll=auto" in ublkd("status").stdout
    finally:
        ublkd("umount", mnt, timeout=120)
    ublkd("mount", bundle, mnt, "--frontend", "ublk", "--ublk-poll=off")
    try:
        st = status_of(mnt)
        assert st["ublk_poll"] == "off"
        assert hw_queues(st) == st["ublk_queues"] == min(4, os.cpu_count() or 1)
        assert f"--ublk-poll=off, --ublk-queues={st['ublk_queues']}" in ublkd("status").stdout
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        assert (mnt / "data" / "c.bin").read_bytes() == files["data/c.bin"]
        assert running_threads(serving_pid(mnt), settle_s=1.0) == []
    finally:
        ublkd("umount", mnt, timeout=120)
    # --ublk-queues: that many queues while polling (the kernel caps them at one per CPU);
    # a property of the server like --ublk-poll
    ublkd("mount", bundle, mnt, "--frontend", "ublk", "--ublk-queues=2")
    try:
        st = status_of(mnt)
        assert st["ublk_poll"] == "auto"
        assert hw_queues(st) == st["ublk_queues"] == min(2, os.cpu_count() or 1)
        pid = st["server_pid"]
        assert isinstance(pid, int)
        assert b"--ublk-queues=2" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        for name in ("data/a.bin", "data/b.bin", "data/c.bin"):
            assert (mnt / name).read_bytes() == files[name], name
        r = ublkd("mount", bundle, mnt2, "--ublk-queues=1", check=False)
        assert r.returncode != 0 and "2 ublk queue(s)" in r.stderr, r.stderr
        assert ublkd("mount", bundle, mnt2, "--ublk-queues=0", check=False).returncode != 0
    finally:
        ublkd("umount", mnt, timeout=120)
    assert status() == []
    assert not list(Path("/dev").glob("ublkb*"))


@pytest.mark.vm
def test_ublk_serve_sigterm_while_mounted_exits(no_leftovers: Path) -> None:
    """SIGTERM to `ublkd serve --frontend ublk` (the default, adaptive polling) while a
    btrfs is still mounted on its device: the server stops the device and exits 0 at
    once (it does not wait in DEL_DEV for the mount to let go); reads that need the
    device then fail with EIO, and the device disappears with the umount."""
    tmp = no_leftovers
    subprocess.run(["modprobe", "ublk_drv"], check=False)
    bundle, _, files = build_bundle(tmp, "vmsigmnt", fresh_seed())
    mnt = tmp / "mnt"
    mnt.mkdir()
    assert UBLKD is not None
    p = subprocess.Popen(
        [UBLKD, "serve", str(bundle), "--frontend", "ublk"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    meta = ""
    mounted = False
    try:
        assert p.stderr is not None
        dev = serve_ready_device(p)
        ctrl = ublk_ctrl(dev)
        meta = losetup(bundle / "meta.img")
        subprocess.run(["btrfs", "device", "scan", meta, str(dev)], check=True, capture_output=True)
        subprocess.run(
            ["mount", "-t", "btrfs", "-o", f"ro,device={meta},device={dev}", meta, str(mnt)],
            check=True,
        )
        mounted = True
        assert (mnt / "data" / "a.bin").read_bytes() == files["data/a.bin"]
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0, p.stderr.read()
        assert time.monotonic() - t0 < 30
        assert "still open" in p.stderr.read()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        assert read_file(mnt / "data" / "b.bin") == errno.EIO
        subprocess.run(["umount", str(mnt)], check=True)
        mounted = False
        assert gone(dev, ctrl), "device left after the umount"
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        if meta:
            subprocess.run(["losetup", "-d", meta], check=False)
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.vm
def test_ublk_poll_serve_raw_device_checksum_sigterm(no_leftovers: Path) -> None:
    """`ublkd serve --ublk-poll` in the foreground: /dev/ublkbN reads back as device 2
    (materialized from the packs by the test's own reader), then SIGTERM, which arrives
    while the queue polls (10 s after the last request), stops and deletes the device
    and the server exits 0."""
    tmp = no_leftovers
    subprocess.run(["modprobe", "ublk_drv"], check=False)
    bundle, _, _ = build_bundle(tmp, "vmpollserve", fresh_seed())
    want = tmp / "dev2.img"
    materialize_data_device(bundle, want)
    assert UBLKD is not None
    p = subprocess.Popen(
        [UBLKD, "serve", str(bundle), "--frontend", "ublk", "--ublk-poll=10000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stderr is not None
        dev = serve_ready_device(p)
        ctrl = ublk_ctrl(dev)
        h = hashlib.sha256()
        with open(dev, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        assert h.hexdigest() == hashlib.sha256(want.read_bytes()).hexdigest()
        # within the 10 s window after a read the queue thread is still polling (the
        # default, auto, is found asleep: test_ublk_poll_default_is_auto_and_off_sleeps)
        subprocess.run(
            ["dd", f"if={dev}", "of=/dev/null", "bs=4k", "count=1", "iflag=direct", "status=none"],
            check=True,
        )
        assert running_threads(p.pid, settle_s=1.0)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0, p.stderr.read()
        assert gone(dev, ctrl), "device left after SIGTERM"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# --- the structural check before the first mount of an image id ------------------------
def structure_record(bundle: Path) -> Path:
    image_id = hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()
    return Path(os.environ["UBLKD_RUN_DIR"], "verified", f"image-{image_id}.json")


def test_structure_check_first_mount_only_recheck(no_leftovers: Path) -> None:
    """The first mount of an image id runs the check and records it; the second skips it
    (its stderr says so, naming the record); --recheck runs it again."""
    tmp = no_leftovers
    bundle, tarball, _ = build_bundle(tmp, "checked")
    mnt = tmp / "mnt"
    mnt.mkdir()
    record = structure_record(bundle)
    assert not record.exists()
    r = ublkd("mount", bundle, mnt, "--frontend", "fuse")
    assert "structural check: passed in" in r.stderr and "file extents" in r.stderr, r.stderr
    ublkd("umount", mnt)
    rec = json.loads(record.read_text())
    assert rec["check"].startswith("ublkd ") and "structure check 3" in rec["check"]
    assert "overlay_inexact" not in rec  # overlayfs shows this image as it is
    assert record.stat().st_mode & 0o022 == 0
    r = ublkd("mount", bundle, mnt, "--frontend", "fuse")
    assert "structural check: passed before" in r.stderr and "skipped" in r.stderr, r.stderr
    assert list_dir(mnt) == list_tar(tarball)
    ublkd("umount", mnt)
    r = ublkd("mount", bundle, mnt, "--frontend", "fuse", "--recheck")
    assert "structural check: passed in" in r.stderr, r.stderr
    ublkd("umount", mnt)
    assert status() == []
