"""Automatic recovery (issue 22): `mount` starts a bundle's server under a supervisor
(`ublkd serve --supervise`) that starts a new server when one dies. fuse (root, this
host): the supervisor holds the FUSE connection, so the loop devices and mounts stay,
readers wait instead of failing, and the requests the dead server had taken are sent
again to the next one (FUSE_NOTIFY_RESEND). ublk (vm): the kernel queues I/O and the
supervisor reattaches through USER_RECOVERY. `status` shows the restarts.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from servers import slow_http
from test_ublkd import (
    build_bundle,
    status,
    status_of,
    ublkd,
)
from test_ublkd import no_leftovers as no_leftovers  # noqa: F401  (a fixture)


def restarts(mnt: Path) -> dict[str, object]:
    r = status_of(mnt)["restarts"]
    assert isinstance(r, dict)
    return r


def kill_worker(mnt: Path, timeout: float = 60) -> dict[str, object]:
    """SIGKILL the server that serves `mnt` now (the supervisor's child, not the
    supervisor), wait until the supervisor has a new one up; -> `restarts` of status."""
    before = restarts(mnt)
    pid = before["server_pid"]
    assert isinstance(pid, int) and pid > 0
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = restarts(mnt)
        if now["count"] != before["count"] and now["server_pid"] != pid:
            return now
        time.sleep(0.02)
    raise AssertionError(f"no new server {timeout} s after killing pid {pid}: {restarts(mnt)}")


def read_direct(path: Path) -> bytes:
    """The whole file through O_DIRECT reads (past every page cache, to the server)."""
    buf = mmap.mmap(-1, 256 << 10)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    out = bytearray()
    try:
        while (n := os.preadv(fd, [buf], len(out))) > 0:
            out += buf[:n]
    finally:
        os.close(fd)
        buf.close()
    return bytes(out)


class Readers:
    """Threads reading files again and again with O_DIRECT, every byte compared."""

    def __init__(self, files: dict[Path, bytes], threads: int) -> None:
        self.files = files
        self.errors: list[str] = []
        self.reads = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]

    def run(self) -> None:
        while not self.stop.is_set():
            for path, want in self.files.items():
                try:
                    ok = read_direct(path) == want
                    err = None if ok else f"{path}: wrong bytes"
                except OSError as e:
                    err = f"{path}: {e}"
                with self.lock:
                    self.reads += 1
                    if err is not None:
                        self.errors.append(err)

    def __enter__(self) -> Readers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads), "a reader hangs"


@pytest.mark.parametrize(
    "frontend",
    [pytest.param("fuse", marks=pytest.mark.root), pytest.param("ublk", marks=pytest.mark.vm)],
)
def test_server_killed_readers_wait_mounts_stay(no_leftovers: Path, frontend: str) -> None:
    """Three SIGKILLs of the server while 4 threads read through a read-only and a --rw
    mount with O_DIRECT (every read reaches the server: fuse --dev2-cache direct, ublk
    always): no read fails or returns a wrong byte (fuse: FUSE_NOTIFY_RESEND; ublk:
    USER_RECOVERY_REISSUE requeues the reads the dead server had taken), reads go on
    after each kill, the supervisor (the recorded server pid) stays, the sprout stays
    writable, `status` counts 3 restarts and names the cause; `umount` leaves nothing."""
    tmp = no_leftovers
    if frontend == "ublk":
        subprocess.run(["modprobe", "ublk_drv"], check=False)
    bundle, _, files = build_bundle(tmp, "restart")
    ro, rw = tmp / "ro", tmp / "rw"
    ro.mkdir()
    rw.mkdir()
    ublkd("mount", bundle, ro, "--frontend", frontend, "--dev2-cache", "direct")
    try:
        ublkd("mount", bundle, rw, "--rw", tmp / "rw.img", "--rw-size", "1G")
        supervisor = status_of(ro)["server_pid"]
        assert restarts(ro)["count"] == 0
        want = {m / "data" / n: files[f"data/{n}"] for m in (ro, rw) for n in ("a.bin", "b.bin")}
        with Readers(want, 4) as r:
            for i in range(3):
                time.sleep(0.3)
                seen = r.reads
                after = kill_worker(ro, timeout=120)
                assert after["count"] == i + 1
                deadline = time.monotonic() + 60
                while r.reads <= seen + 4 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert r.reads > seen + 4, "reads stopped after a restart"
        assert r.errors == [], r.errors[:10]
        st = status_of(ro)
        assert st["server_pid"] == supervisor and st["server_alive"] is True
        after = restarts(ro)
        assert after["count"] == 3 and after["last_cause"] == "killed by SIGKILL", after
        assert restarts(rw) == after  # one server for the bundle
        assert "restarts 3 (" in ublkd("status").stdout
        (rw / "written").write_text("after restarts\n")
        assert (rw / "written").read_text() == "after restarts\n"
    finally:
        ublkd("umount", rw, check=False, timeout=120)
        ublkd("umount", ro, timeout=120)
    assert status() == []


@pytest.mark.root
def test_fuse_server_killed_with_a_read_in_flight_resends_it(no_leftovers: Path) -> None:
    """A remote bundle whose web server answers every request 300 ms late: the server
    is killed while a cold read waits for its fetch, so the kernel had handed that
    request to the dead server. The next server gets it again (FUSE_NOTIFY_RESEND) and
    the read returns the right bytes (without the resend it would wait forever)."""
    tmp = no_leftovers
    site = tmp / "site"
    site.mkdir()
    bundle, _, files = build_bundle(tmp, "inflight")
    bundle.rename(site / "bundle")
    with slow_http(site, tmp / "http", 300) as web:
        mnt = tmp / "mnt"
        mnt.mkdir()
        url = f"{web.url}/bundle/manifest.json"
        ublkd("mount", url, mnt, "--frontend", "fuse", "--readahead", "0", "--no-prefetch",
              "--cache-dir", tmp / "cache")  # fmt: skip
        try:
            for name in ("data/b.bin", "data/a.bin"):
                got: list[bytes | Exception] = []

                def read(name: str = name, got: list[bytes | Exception] = got) -> None:
                    try:
                        got.append(read_direct(mnt / name))
                    except OSError as e:
                        got.append(e)

                t = threading.Thread(target=read, daemon=True)
                t.start()
                time.sleep(0.15)  # its first fetch is in flight
                assert t.is_alive()
                kill_worker(mnt)
                t.join(60)
                assert not t.is_alive(), f"the read of {name} hangs after the restart"
                assert got == [files[name]], f"{name}: {got[0]!r:.200}"
            assert restarts(mnt)["count"] == 2
        finally:
            ublkd("umount", mnt)
    assert status() == []


@pytest.mark.vm
def test_ublk_server_killed_restarted_by_the_supervisor(no_leftovers: Path) -> None:
    """ublk: SIGKILL of the server, then a cold read (caches dropped); the supervisor sends
    START_USER_RECOVERY and starts a server that reattaches to the same /dev/ublkbN; the
    read completes with the right bytes, twice, without `ublkd recover`."""
    tmp = no_leftovers
    subprocess.run(["modprobe", "ublk_drv"], check=False)
    bundle, _, files = build_bundle(tmp, "vmrestart")
    mnt = tmp / "mnt"
    mnt.mkdir()
    r = ublkd("mount", bundle, mnt, "--frontend", "ublk", "--rw", tmp / "rw.img", "--rw-size", "1G")
    try:
        node = status_of(mnt)["devices"]
        for i, name in enumerate(("data/b.bin", "data/a.bin")):
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            kill_worker(mnt, timeout=120)
            digest = hashlib.sha256(read_direct(mnt / name)).hexdigest()
            assert digest == hashlib.sha256(files[name]).hexdigest()
            assert restarts(mnt)["count"] == i + 1
        assert status_of(mnt)["devices"] == node  # the same /dev/ublkbN
        (mnt / "written").write_text("ok\n")
    finally:
        ublkd("umount", mnt, timeout=120)
    assert status() == [], r.stderr
    assert not list(Path("/dev").glob("ublkb*"))
