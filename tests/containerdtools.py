"""containerd and btrfs-ublk-snapshotter as our own child processes (tests and bench).

    with containerd_stack(tmp_path, flavour) as st:
        st.pull(ref)                   # the snapshotter's pull client (1.6) or ctr (2.x)
        st.ctr("run", "--rm", "--snapshotter", SNAPSHOTTER, ref, "c1", "/bin/true")
        st.snapshotter.kill()          # SIGKILL, by pid
        st.snapshotter.start()

Each stack has its own containerd root, state and socket and its own snapshotter root,
under a short directory in /tmp (unix socket paths are limited to 108 bytes). Leaving
the context kills every task, removes every image and container (so the snapshotter
unmounts its bundles), stops both daemons and checks that nothing is left mounted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from servers import stop_child

REPO = Path(__file__).resolve().parent.parent
SNAPSHOTTER = "btrfs-ublk"  # the proxy plugin's name in containerd's config
NAMESPACE = "bui-test"
# containerd 2.x, built by scripts/setup.sh from the Go module proxy (Debian ships 1.6)
CONTAINERD2_DIR = Path(
    os.environ.get("BUI_CONTAINERD2_DIR", "/var/cache/btrfs-ublk-image/containerd2/bin")
)
FLAVOURS = ("1.6", "2.x")


def snapshotter_binary() -> str:
    found = shutil.which("btrfs-ublk-snapshotter")
    return found or str(REPO / "snapshotter" / "btrfs-ublk-snapshotter")


def containerd_binaries(flavour: str) -> tuple[str, str, str]:
    """(containerd, ctr, directory to put first on PATH for the shim) of a flavour."""
    if flavour == "1.6":
        return "/usr/bin/containerd", "/usr/bin/ctr", "/usr/bin"
    d = CONTAINERD2_DIR
    return str(d / "containerd"), str(d / "ctr"), str(d)


class Daemon:
    """A long-running child process of ours, stopped by its pid."""

    def __init__(self, argv: list[str], log: Path, ready: Path, env: dict[str, str]) -> None:
        self.argv, self.log, self.ready, self.env = argv, log, ready, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        assert self.proc is None
        self.ready.unlink(missing_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"{self.argv[0]} exited at start:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.argv[0]}: no {self.ready} within {timeout} s")
            time.sleep(0.05)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL: the daemon dies without cleaning anything up."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 20 s: containerd may be stopping containers) and reap."""
        if self.proc is not None:
            stop_child(self.proc, 20)
        self.proc = None


@dataclass
class Stack:
    flavour: str
    dir: Path
    containerd: Daemon
    snapshotter: Daemon
    ctr_binary: str
    env: dict[str, str]

    @property
    def socket(self) -> Path:
        return self.dir / "containerd.sock"

    @property
    def snapshotter_root(self) -> Path:
        return self.dir / "snapshotter"

    def ctr(
        self, *args: str, check: bool = True, timeout: float = 300, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [self.ctr_binary, "--address", str(self.socket), "--namespace", NAMESPACE, *args],
            capture_output=True, text=True, timeout=timeout, env=self.env, input=input,
        )  # fmt: skip
        if check:
            assert r.returncode == 0, f"ctr {' '.join(args)}: {r.returncode}\n{r.stdout}{r.stderr}"
        return r

    def pull(
        self, ref: str, snapshotter: str = SNAPSHOTTER, check: bool = True, user: str = ""
    ) -> subprocess.CompletedProcess[str]:
        """Pull and unpack ``ref`` into ``snapshotter`` with the layers' annotations passed
        as labels: the snapshotter's pull client on 1.6 (credentials from docker's
        config.json in the stack's environment), ctr's transfer service on 2.x (``user``:
        USER:PASS)."""
        if self.flavour == "1.6":  # its ctr pull passes no layer annotations
            argv = [snapshotter_binary(), "pull", "--address", str(self.socket)]
            argv += ["--namespace", NAMESPACE, "--snapshotter", snapshotter, ref]
        else:
            argv = [self.ctr_binary, "--address", str(self.socket), "--namespace", NAMESPACE]
            argv += ["image", "pull", "--plain-http", "--snapshotter", snapshotter, ref]
            argv += ["--user", user] if user else []
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=self.env)
        if check:
            assert r.returncode == 0, f"pull {ref}: {r.returncode}\n{r.stdout}{r.stderr}"
        return r

    def status(self) -> dict[str, object]:
        out = subprocess.run(
            [snapshotter_binary(), "status", "--json", "--root", str(self.snapshotter_root)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        doc: dict[str, object] = json.loads(out.stdout)
        return doc

    def restart_containerd(self) -> None:
        self.containerd.stop()
        self.containerd.start()
        self.wait_snapshotter()

    def start_snapshotter(self) -> None:
        self.snapshotter.start()
        self.wait_snapshotter()

    def wait_snapshotter(self, timeout: float = 60) -> None:
        """Until containerd reaches the snapshotter (its gRPC client reconnects with a
        backoff after the snapshotter went away)."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.ctr("snapshot", "--snapshotter", SNAPSHOTTER, "ls", check=False)
            if r.returncode == 0:
                return
            assert time.monotonic() < deadline, (
                f"containerd cannot reach the snapshotter: {r.stderr}"
            )
            time.sleep(0.2)

    def clear(self) -> None:
        """Kill and delete every task and container, remove every image (synchronously:
        containerd's garbage collection then removes the snapshots)."""
        for cid in self.ctr("container", "ls", "-q").stdout.split():
            self.ctr("task", "kill", "--signal", "SIGKILL", cid, check=False)
            for _ in range(100):
                if self.ctr("task", "delete", cid, check=False).returncode == 0:
                    break
                if "not found" in self.ctr("task", "ls", check=False).stdout:
                    break
                time.sleep(0.1)
            self.ctr("container", "delete", cid, check=False)
        for ref in self.ctr("image", "ls", "-q").stdout.split():
            self.ctr("image", "rm", "--sync", ref, check=False)


def _config(d: Path, flavour: str) -> str:
    text = f"""version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime",
  "io.containerd.cri.v1.images", "io.containerd.podsandbox.controller.v1.podsandbox"]
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[proxy_plugins]
  [proxy_plugins.{SNAPSHOTTER}]
    type = "snapshot"
    address = "{d}/snapshotter.sock"
"""
    if flavour != "1.6":
        # the transfer service unpacks only into snapshotters listed here
        text += '[plugins."io.containerd.transfer.v1.local"]\n'
        for sn in (SNAPSHOTTER, "overlayfs"):
            text += '  [[plugins."io.containerd.transfer.v1.local".unpack_config]]\n'
            text += f'    platform = "linux/amd64"\n    snapshotter = "{sn}"\n'
    return text


def busybox_bundle(work: Path) -> Path:
    """A small image of its own (the host's busybox as sh, cat, echo; /etc/motd; a random
    /etc/run-id), built into work/bundle."""
    root = work / "rootfs"
    for d in ("bin", "etc", "proc", "dev", "sys", "run", "tmp"):
        (root / d).mkdir(parents=True)
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    for cmd in ("sh", "cat", "echo"):
        (root / "bin" / cmd).symlink_to("busybox")
    (root / "etc" / "motd").write_text("small\n")
    # unique per call: runs at once must not mount one image (one kernel btrfs per fsid)
    (root / "etc" / "run-id").write_text(os.urandom(16).hex())
    (work / "spec.yaml").write_text(
        f"version: 1\nname: ctd-small\nlayers:\n  - dir: {{path: {root}, uid: 0, gid: 0}}\n"
    )
    subprocess.run(
        ["btrfs-ublk-image", "build", str(work / "spec.yaml"), "-o", str(work / "bundle")],
        check=True, capture_output=True,
    )  # fmt: skip
    return work / "bundle"


def mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mnt = line.split()[4].replace("\\040", " ")
        if mnt.startswith(prefix):
            out.append(mnt)
    return out


@contextlib.contextmanager
def containerd_stack(
    flavour: str = "1.6",
    *,
    extra_env: dict[str, str] | None = None,
    snapshotter_args: tuple[str, ...] = (),
) -> Iterator[Stack]:
    """``snapshotter_args``: more options of ``btrfs-ublk-snapshotter serve``."""
    d = Path(tempfile.mkdtemp(prefix="bui-ctd-", dir="/tmp"))
    containerd, ctr, shim_dir = containerd_binaries(flavour)
    env = dict(os.environ)
    env["PATH"] = f"{shim_dir}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
    env["UBLKD_CACHE_DIR"] = str(d / "ublkd-cache")  # cold: nothing from earlier stacks
    env.update(extra_env or {})
    (d / "config.toml").write_text(_config(d, flavour))
    snap = Daemon(
        [snapshotter_binary(), "serve", "--address", str(d / "snapshotter.sock"),
         "--root", str(d / "snapshotter"), *snapshotter_args],
        d / "snapshotter.log", d / "snapshotter.sock", env,
    )  # fmt: skip
    ctd = Daemon(
        [containerd, "--config", str(d / "config.toml")], d / "containerd.log",
        d / "containerd.sock", env,
    )  # fmt: skip
    st = Stack(flavour, d, ctd, snap, ctr, env)
    try:
        snap.start()
        ctd.start()
        yield st
    finally:
        try:
            if ctd.proc is not None and snap.proc is not None:
                st.clear()
        finally:
            ctd.stop()
            snap.stop()
            left = mounts_under(d)
            for mnt in sorted(left, reverse=True):  # a failed test's leftovers
                subprocess.run(["ublkd", "umount", mnt], capture_output=True)
                subprocess.run(["umount", "-l", mnt], capture_output=True)
            shutil.rmtree(d, ignore_errors=True)
    assert not left, f"left mounted under {d}: {left}"
