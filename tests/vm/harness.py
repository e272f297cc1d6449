"""Run pytest inside a QEMU VM whose kernel has ublk (this host's kernel has none).

The VM boots Debian bookworm-backports' 6.12 kernel (``ublk_drv`` is a module there) under
QEMU TCG with a busybox initramfs (``tests/vm/init.sh``). The guest sees the host's root
read-only over 9p with a tmpfs overlay on top, so the checkout's ``.venv`` and
``/usr/local/bin/ublkd`` run in it unchanged, and every guest write goes to RAM. A second,
writable 9p share brings the results back: exit status, junit XML, pytest output, dmesg.

Assets live in ``/var/cache/btrfs-ublk-image/vm`` (``BUI_VM_CACHE``), keyed by kernel version:
the kernel .deb is fetched once through a private APT configuration (the host's sources stay
untouched) and the initramfs is rebuilt when missing or when ``init.sh`` changes.

CLI (stdlib only; works with any python3 >= 3.11)::

    python -m tests.vm.harness prepare [--refresh]   # apt packages, kernel, initramfs
    python -m tests.vm.harness run [--timeout S] [-- PYTEST_ARGS...]
    python -m tests.vm.harness shell-script SCRIPT   # run 'bash SCRIPT' in the guest instead

See tests/vm/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE = Path(os.environ.get("BUI_VM_CACHE", "/var/cache/btrfs-ublk-image/vm"))
RUNS = Path(os.environ.get("BUI_VM_RUNS", str(REPO / "build" / "vm")))

# Host packages the harness needs (scripts/setup.sh installs them too).
APT_PACKAGES = ["qemu-system-x86", "busybox-static", "kmod", "xz-utils", "cpio"]
KERNEL_META = "linux-image-amd64"  # resolved in bookworm-backports to linux-image-6.12.*
INITRD_MODULES = ["virtio_mmio", "9pnet_virtio", "9p", "overlay"]

MEM = os.environ.get("BUI_VM_MEM", "2G")
SMP = os.environ.get("BUI_VM_SMP", "2")
TOTAL_TIMEOUT = float(os.environ.get("BUI_VM_TIMEOUT", "480"))  # all boots of one run together
BOOT_TIMEOUT = float(os.environ.get("BUI_VM_BOOT_TIMEOUT", "90"))  # qemu start -> "init done"
# console loglevel: 7 puts the whole boot log on the console (a hang shows where it stopped)
LOGLEVEL = os.environ.get("BUI_VM_LOGLEVEL", "7")
# one host thread for all vCPUs: MTTCG (thread=multi) oopsed on int3 text patching in ~5%
# of SMP boots; the benchmark may ask for it (a vCPU per host thread, as on hardware)
DEFAULT_ACCEL = "tcg,thread=single"
MARK_DONE = "VM: init done"
MARK_FAIL = "VM: FAIL"
MARK_EXIT = "VM: run exit"


def accel() -> str:
    """QEMU's ``-accel``: ``BUI_VM_ACCEL`` when set (read at each boot), else the default."""
    return os.environ.get("BUI_VM_ACCEL") or DEFAULT_ACCEL


def icount() -> str | None:
    """QEMU's ``-icount`` (``BUI_VM_ICOUNT``, e.g. ``shift=3,sleep=off``), else none: the
    guest's clock then counts the instructions it executed instead of host time, so a
    benchmark's rates no longer follow the host's load (one host thread: not with
    ``thread=multi``)."""
    return os.environ.get("BUI_VM_ICOUNT") or None


class VMError(RuntimeError):
    """The VM could not be prepared or booted; the message says why."""


def log(msg: str) -> None:
    print(f"[vm] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------- preparation


@dataclass(frozen=True)
class Assets:
    kver: str
    vmlinuz: Path
    modules: Path  # the extracted kernel's lib/modules (holds <kver>/)
    initrd: Path


@contextlib.contextmanager
def _cache_lock() -> Iterator[None]:
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        f = open(CACHE / "lock", "a")  # noqa: SIM115
    except PermissionError:  # not root: a warm cache is still usable read-only
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: Sequence[str | Path], timeout: float = 600, **kw: object) -> str:
    """Run a command; raise VMError with its output when it fails."""
    try:
        p = subprocess.run(
            [str(c) for c in cmd],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,  # type: ignore[call-overload]
        )
    except subprocess.TimeoutExpired as e:
        raise VMError(
            f"{cmd[0]} timed out after {timeout:.0f}s: {shlex.join(map(str, cmd))}"
        ) from e
    except FileNotFoundError as e:
        raise VMError(f"{cmd[0]} not found (run scripts/setup.sh)") from e
    if p.returncode != 0:
        raise VMError(
            f"{shlex.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}"
        )
    out: str = p.stdout
    return out


def ensure_host_packages() -> None:
    missing = []
    for pkg in APT_PACKAGES:
        q = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", pkg], check=False, capture_output=True, text=True
        )
        if "install ok installed" not in q.stdout:
            missing.append(pkg)
    if not missing:
        return
    if os.geteuid() != 0:
        raise VMError(f"apt packages missing: {' '.join(missing)} (run scripts/setup.sh as root)")
    log(f"apt: installing {' '.join(missing)}")
    archives = CACHE / "apt-archives"
    (archives / "partial").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _run(["apt-get", "update", "-qq"], env=env)
    _run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends"]
        + [f"-o=Dir::Cache::archives={archives}"]
        + missing,
        env=env,
    )


def _host_mirror() -> str:
    """The Debian mirror the host's apt already uses (scripts/host-mirror.sh)."""
    mirror = _run([REPO / "scripts" / "host-mirror.sh"]).strip()
    if not mirror:
        raise VMError("no Debian mirror in /etc/apt/sources.list{,.d}: configure apt first")
    return mirror


def _private_apt() -> dict[str, str]:
    """An APT config that sees only bookworm-backports, with its own lists and cache."""
    a = CACHE / "apt-bpo"
    for sub in ("lists/partial", "cache/archives/partial", "parts"):
        (a / sub).mkdir(parents=True, exist_ok=True)
    (a / "sources.list").write_text(
        "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
        f"{_host_mirror()} bookworm-backports main\n"
    )
    (a / "apt.conf").write_text(
        f'Dir::Etc::Parts "{a}/parts";\n'
        f'Dir::Etc::SourceList "{a}/sources.list";\n'
        f'Dir::Etc::SourceParts "{a}/parts";\n'
        f'Dir::Etc::Preferences "{a}/preferences";\n'
        f'Dir::Etc::PreferencesParts "{a}/parts";\n'
        f'Dir::State::Lists "{a}/lists";\n'
        f'Dir::State::status "{a}/status";\n'
        f'Dir::Cache "{a}/cache";\n'
        f'Dir::Cache::archives "{a}/cache/archives";\n'
        'Acquire::Languages "none";\n'
        'APT::Get::List-Cleanup "false";\n'
    )
    (a / "status").touch()
    return dict(os.environ, APT_CONFIG=str(a / "apt.conf"), DEBIAN_FRONTEND="noninteractive")


def _kernel_dir(kver: str) -> Path:
    return CACHE / "kernels" / kver


def _current_kver() -> str | None:
    cur = CACHE / "current"
    if not cur.exists():
        return None
    kver = cur.read_text().strip()
    return kver if (_kernel_dir(kver) / "complete").exists() else None


def fetch_kernel() -> str:
    """Download the backports kernel .deb, extract it, depmod it. Returns its version."""
    pkg = os.environ.get("BUI_VM_KERNEL_PKG", "")
    env = _private_apt()
    log("kernel: apt-get update (bookworm-backports, private config)")
    _run(["apt-get", "update", "-qq"], env=env, timeout=600)
    if not pkg:
        deps = _run(["apt-cache", "depends", KERNEL_META], env=env)
        cands = [
            ln.split()[1]
            for ln in deps.splitlines()
            if ln.strip().startswith("Depends: linux-image-6")
        ]
        if not cands:
            raise VMError(f"no linux-image-6.* dependency of {KERNEL_META} in backports:\n{deps}")
        pkg = cands[0]
    debs = CACHE / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    log(f"kernel: downloading {pkg}")
    for old in debs.glob(f"{pkg}_*.deb"):
        old.unlink()
    _run(["apt-get", "download", pkg], env=env, cwd=debs, timeout=1200)
    deb = next(iter(sorted(debs.glob(f"{pkg}_*.deb"))), None)
    if deb is None:
        raise VMError(f"apt-get download {pkg} left no .deb in {debs}")
    staging = Path(tempfile.mkdtemp(prefix="extract.", dir=CACHE))
    try:
        _run(["dpkg-deb", "-x", deb, staging / "k"])
        kvers = sorted(p.name for p in (staging / "k/lib/modules").iterdir())
        if len(kvers) != 1:
            raise VMError(f"{deb.name}: expected one lib/modules/<kver>, found {kvers}")
        kver = kvers[0]
        _run(["depmod", "-b", staging / "k", kver])
        if not (staging / "k/boot" / f"vmlinuz-{kver}").exists():
            raise VMError(f"{deb.name}: no boot/vmlinuz-{kver}")
        (staging / "package").write_text(deb.name + "\n")
        (staging / "complete").touch()
        dest = _kernel_dir(kver)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    (CACHE / "current.tmp").write_text(kver + "\n")
    (CACHE / "current.tmp").rename(CACHE / "current")
    log(f"kernel: {kver} ready in {dest}")
    return kver


def _initrd_key(kver: str) -> str:
    h = hashlib.sha256()
    h.update((HERE / "init.sh").read_bytes())
    h.update(kver.encode())
    h.update(" ".join(INITRD_MODULES).encode())
    busybox = Path("/bin/busybox")
    st = busybox.stat()
    h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def build_initrd(kver: str) -> Path:
    kdir = _kernel_dir(kver)
    out = kdir / f"initrd-{_initrd_key(kver)}.gz"
    if out.exists():
        return out
    busybox = Path("/bin/busybox")
    if not busybox.exists():
        raise VMError("/bin/busybox missing (apt package busybox-static; run scripts/setup.sh)")
    log(f"initrd: building {out.name}")
    st = Path(tempfile.mkdtemp(prefix="initrd.", dir=kdir))
    try:
        for d in ("bin", "dev", "proc", "sys", "mnt", "newroot", "upper", "lib/modules"):
            (st / d).mkdir(parents=True)
        shutil.copy2(busybox, st / "bin/busybox")
        shutil.copy2(HERE / "init.sh", st / "init")
        (st / "init").chmod(0o755)
        paths: list[str] = []
        for mod in INITRD_MODULES:
            dep = _run(["modprobe", "-d", kdir / "k", "-S", kver, "--show-depends", mod])
            for ln in dep.splitlines():
                parts = ln.split()
                if parts[:1] == ["insmod"] and parts[1] not in paths:
                    paths.append(parts[1])
        order = []
        for p in paths:
            name = Path(p).name
            data = Path(p).read_bytes()
            if name.endswith(".xz"):
                name = name[:-3]
                data = subprocess.run(
                    ["xz", "-dc"], input=data, capture_output=True, check=True
                ).stdout
            (st / "lib/modules" / name).write_bytes(data)
            order.append(name)
        (st / "lib/modules/order").write_text("\n".join(order) + "\n")
        tmp = out.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            find = subprocess.Popen(["find", "."], cwd=st, stdout=subprocess.PIPE)
            cpio = subprocess.Popen(
                ["cpio", "-o", "-H", "newc", "--quiet"],
                cwd=st,
                stdin=find.stdout,
                stdout=subprocess.PIPE,
            )
            assert find.stdout is not None
            find.stdout.close()
            gz = subprocess.run(["gzip", "-1"], check=False, stdin=cpio.stdout, stdout=f)
            if find.wait() or cpio.wait() or gz.returncode:
                raise VMError("initrd: find | cpio | gzip failed")
        tmp.rename(out)
        for old in kdir.glob("initrd-*.gz"):
            if old != out:
                old.unlink()
    finally:
        shutil.rmtree(st)
    return out


def prepare(refresh: bool = False) -> Assets:
    """Everything a boot needs, from the cache when present (no network then)."""
    t0 = time.monotonic()
    ensure_host_packages()
    if shutil.which("qemu-system-x86_64") is None:
        raise VMError("qemu-system-x86_64 not found (apt package qemu-system-x86)")
    with _cache_lock():
        kver = None if refresh else _current_kver()
        if kver is None:
            if os.geteuid() != 0:
                raise VMError(f"no VM kernel cached in {CACHE} and not root: run scripts/setup.sh")
            kver = fetch_kernel()
        initrd = build_initrd(kver)
    kdir = _kernel_dir(kver)
    assets = Assets(
        kver=kver,
        vmlinuz=kdir / "k/boot" / f"vmlinuz-{kver}",
        modules=kdir / "k/lib/modules",
        initrd=initrd,
    )
    log(f"prepared kernel {kver} in {time.monotonic() - t0:.1f}s")
    return assets


# ---------------------------------------------------------------------------------------- boot


@dataclass
class Boot:
    """One qemu process: its console log and what the harness saw on it."""

    attempt: int
    console: Path
    status: str = "running"  # ok | boot-hang | boot-fail | timeout | crashed
    reason: str = ""
    boot_s: float = 0.0  # qemu start -> "VM: init done"
    total_s: float = 0.0
    qemu_rc: int | None = None
    init_failed: bool = False  # init printed "VM: FAIL": deterministic, no point retrying

    @property
    def retryable(self) -> bool:
        """A hang or an early exit (panic, oops) before init finished: worth one more boot."""
        return self.status == "boot-hang" or (self.status == "boot-fail" and not self.init_failed)


@dataclass
class RunResult:
    out: Path  # host dir with the results (share/, console logs)
    rc: int | None  # the guest script's exit status; None if it never finished
    boots: list[Boot] = field(default_factory=list)
    kver: str = ""
    limit_s: float = TOTAL_TIMEOUT
    prepare_s: float = 0.0  # prepare(): cached assets, or download + build
    collect_s: float = 0.0  # host-side collection of the vm test files

    @property
    def share(self) -> Path:
        return self.out / "share"

    def read(self, name: str) -> str:
        p = self.share / name
        return p.read_text(errors="replace") if p.exists() else ""

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def failure_reason(self) -> str:
        if self.rc == 124:
            return (
                "the guest run hit its time limit and was interrupted (a hung test?); "
                f"{self.limit_s:.0f}s for the whole VM run (BUI_VM_TIMEOUT)"
            )
        if self.rc == 5:
            return "guest pytest collected no tests (is anything marked `vm`?)"
        if self.rc is not None:
            return f"guest run exited with status {self.rc}"
        return "; ".join(f"boot {b.attempt}: {b.status}: {b.reason}" for b in self.boots)


def _tsc_khz() -> int:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    return 0


def qemu_command(assets: Assets, share: Path) -> list[str]:
    append = [
        "console=ttyS0",
        f"loglevel={LOGLEVEL}",
        "panic=-1",
        "tsc=reliable",
        f"vm.mods={assets.modules}",
    ]
    khz = _tsc_khz()
    if khz:
        # microvm has no HPET/PM timer: a failed PIT calibration under TCG hangs ~4 boots in 10
        append.insert(4, f"tsc_early_khz={khz}")
    ic = icount()
    return [
        "qemu-system-x86_64",
        "-accel",
        accel(),
        *(["-icount", ic] if ic else []),
        "-cpu",
        "max",
        "-M",
        "microvm,acpi=on",
        "-smp",
        SMP,
        "-m",
        MEM,
        "-nodefaults",
        "-no-reboot",
        "-display",
        "none",
        "-serial",
        "stdio",
        "-kernel",
        str(assets.vmlinuz),
        "-initrd",
        str(assets.initrd),
        "-append",
        " ".join(append),
        "-fsdev",
        "local,id=r,path=/,security_model=none,readonly=on,multidevs=remap",
        "-device",
        "virtio-9p-device,fsdev=r,mount_tag=hostroot",
        "-fsdev",
        f"local,id=o,path={share},security_model=none,multidevs=remap",
        "-device",
        "virtio-9p-device,fsdev=o,mount_tag=out",
    ]


def boot_once(
    assets: Assets,
    share: Path,
    console: Path,
    attempt: int,
    deadline: float,
    boot_timeout: float,
    echo: TextIO | None,
) -> Boot:
    """Boot the VM once; the guest runs share/run.sh. Kills qemu (by its pid) on a hang."""
    b = Boot(attempt=attempt, console=console)
    cmd = qemu_command(assets, share)
    (console.parent / "qemu-cmd.txt").write_text(shlex.join(cmd) + "\n")
    t0 = time.monotonic()
    done, ended = threading.Event(), threading.Event()
    seen: dict[str, str] = {}
    with open(console, "w", errors="replace") as con:
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

        def pump(stream: IO[str]) -> None:
            for line in stream:
                con.write(line)
                con.flush()
                if echo is not None:
                    echo.write(line)
                    echo.flush()
                if line.startswith(MARK_DONE) and not done.is_set():
                    b.boot_s = time.monotonic() - t0
                    done.set()
                elif line.startswith(MARK_FAIL):
                    seen.setdefault("fail", line[len(MARK_FAIL) :].strip())
            ended.set()

        assert p.stdout is not None
        reader = threading.Thread(target=pump, args=(p.stdout,), daemon=True)
        reader.start()
        try:
            boot_limit = min(t0 + boot_timeout, deadline)
            while not done.is_set() and not ended.is_set() and time.monotonic() < boot_limit:
                done.wait(0.2)
            if not done.is_set():
                if ended.is_set() or p.poll() is not None:
                    p.wait()
                    b.status = "boot-fail"
                    b.init_failed = "fail" in seen
                    b.reason = (
                        seen.get("fail") or f"qemu exited ({p.returncode}) before init finished"
                    )
                else:
                    b.status = "boot-hang"
                    b.reason = f"'{MARK_DONE}' not seen within {boot_limit - t0:.0f}s"
                    _kill(p)
            else:
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                    b.status = "ok"
                except subprocess.TimeoutExpired:
                    b.status = "timeout"
                    b.reason = (
                        f"the guest run did not finish before the time limit ({deadline - t0:.0f}s)"
                    )
                    _kill(p)
        except BaseException:  # KeyboardInterrupt, or a harness bug: never leave qemu behind
            _kill(p)
            raise
        reader.join(timeout=10)
    b.qemu_rc = p.returncode
    b.total_s = time.monotonic() - t0
    if b.status == "ok" and not (share / "rc").exists():
        b.status = "crashed"
        b.reason = f"qemu exited ({p.returncode}) without the guest writing its exit status"
    return b


def _die_with_parent() -> None:
    """In the qemu child before exec: SIGKILL it if the harness dies (SIGTERM, SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _kill(p: subprocess.Popen[str]) -> None:
    p.terminate()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


GUEST_RUN = """\
#!/bin/bash
# Written by tests/vm/harness.py; runs as root inside the VM (see tests/vm/init.sh).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
export LANG=C.UTF-8 BUI_IN_VM=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TERM=dumb
uname -r > /vmout/uname
echo "VM: kernel $(uname -r)"
cd {repo}
up=$(cut -d. -f1 /proc/uptime)
budget=$(( {budget} - up )); [ "$budget" -gt 10 ] || budget=10
{body}
rc=$?
dmesg > /vmout/dmesg.txt 2>&1
exit $rc
"""

PYTEST_BODY = """\
echo "VM: pytest start at uptime $(cut -d' ' -f1 /proc/uptime)s"
timeout -s INT -k 30 "$budget" {python} -m pytest {plugins} -m vm -v -rA \
  -o junit_logging=all --junitxml=/vmout/junit.xml {args} 2>&1 | tee /vmout/pytest.log
rc=${{PIPESTATUS[0]}}
echo "VM: pytest end at uptime $(cut -d' ' -f1 /proc/uptime)s"
(exit $rc)"""

# Plugins the guest pytest runs without. Under TCG, importing hypothesis costs 10-40 s (its
# pytest plugin loads it for every run); tests that use hypothesis still import it themselves.
GUEST_NO_PLUGINS = ["cacheprovider", "hypothesispytest"]

SCRIPT_BODY = """\
timeout -s INT -k 30 "$budget" bash {script} 2>&1 | tee /vmout/pytest.log
rc=${{PIPESTATUS[0]}}; (exit $rc)"""


def guest_python() -> str:
    venv = REPO / ".venv/bin/python"
    return str(venv) if venv.exists() else sys.executable


def _new_run_dir() -> Path:
    RUNS.mkdir(parents=True, exist_ok=True)
    # keep the 10 newest runs (older than an hour; a concurrent run may be using a newer one)
    old = sorted((p for p in RUNS.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for p in old[:-10]:
        if time.time() - p.stat().st_mtime > 3600:
            shutil.rmtree(p, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=RUNS))


def run_in_vm(
    body: str,
    *,
    timeout: float = TOTAL_TIMEOUT,
    boot_timeout: float = BOOT_TIMEOUT,
    echo: TextIO | None = None,
    assets: Assets | None = None,
    files: dict[str, bytes] | None = None,
) -> RunResult:
    """Boot (retrying once on a boot hang) and run a bash snippet as the guest's run script."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    if assets is None:
        assets = prepare()
    out = _new_run_dir()
    res = RunResult(out=out, rc=None, kver=assets.kver, limit_s=timeout)
    for attempt in (1, 2):
        share = out / "share"
        if share.exists():
            shutil.move(share, out / f"share.boot{attempt - 1}")
        share.mkdir()
        for name, data in (files or {}).items():
            (share / name).write_bytes(data)
        budget = int(deadline - time.monotonic()) - 30  # leave time for dmesg and poweroff
        (share / "run.sh").write_text(
            GUEST_RUN.format(repo=shlex.quote(str(REPO)), budget=budget, body=body)
        )
        console = out / f"console.boot{attempt}.log"
        log(f"boot {attempt}: kernel {assets.kver}, console -> {console}")
        b = boot_once(assets, share, console, attempt, deadline, boot_timeout, echo)
        res.boots.append(b)
        log(
            f"boot {attempt}: {b.status} boot={b.boot_s:.1f}s "
            f"total={b.total_s:.1f}s {b.reason}".rstrip()
        )
        if not b.retryable or time.monotonic() + boot_timeout > deadline:
            break
    rcf = res.share / "rc"
    if rcf.exists():
        res.rc = int(rcf.read_text().strip() or 255)
    log(f"run: rc={res.rc} in {time.monotonic() - t0:.1f}s, results in {out}")
    return res


def run_pytest(
    pytest_args: Sequence[str] = (),
    *,
    timeout: float = TOTAL_TIMEOUT,
    echo: TextIO | None = None,
    assets: Assets | None = None,
) -> RunResult:
    """Run ``pytest -m vm [pytest_args]`` from the checkout's root inside the VM.

    The files holding `vm` tests are found on the host first (collection is ~20x slower under
    TCG, and the guest would otherwise import every test module of the suite just to
    deselect it); the guest then collects only those files.
    """
    t0 = time.monotonic()
    if assets is None:
        assets = prepare()
    t1 = time.monotonic()
    files = vm_test_files(pytest_args)
    t2 = time.monotonic()
    args = [*files, *pytest_args]
    plugins = " ".join(f"-p no:{p}" for p in GUEST_NO_PLUGINS)
    body = PYTEST_BODY.format(
        python=shlex.quote(guest_python()), plugins=plugins, args=shlex.join(args)
    )
    res = run_in_vm(body, timeout=timeout, echo=echo, assets=assets)
    res.prepare_s, res.collect_s = t1 - t0, t2 - t1
    return res


def vm_test_files(pytest_args: Sequence[str] = ()) -> list[str]:
    """Files with tests selected by ``-m vm [pytest_args]``, collected on the host.

    Empty (the guest then collects everything itself and reports any error) when the host
    collection fails or selects nothing.
    """
    t0 = time.monotonic()
    cmd = [guest_python(), "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    cmd += ["-m", "vm", *pytest_args]
    try:
        p = subprocess.run(
            cmd,
            cwd=REPO,
            env=dict(os.environ, BUI_IN_VM="1"),
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        log("host collection timed out; the guest collects the whole suite")
        return []
    files: list[str] = []
    for line in p.stdout.splitlines():
        if "::" in line and not line.startswith(" "):
            f = line.split("::", 1)[0]
            if f not in files and (REPO / f).is_file():
                files.append(f)
    if p.returncode != 0 or not files:
        log(f"host collection: rc={p.returncode}, no files; the guest collects the whole suite")
        return []
    log(f"host collection: {len(files)} file(s) with vm tests in {time.monotonic() - t0:.1f}s")
    return files


def run_script(
    script: Path, *, timeout: float = TOTAL_TIMEOUT, echo: TextIO | None = None
) -> RunResult:
    """Run ``bash SCRIPT`` inside the VM (copied into the share: the guest's /tmp is empty)."""
    body = SCRIPT_BODY.format(script="/vmout/script.sh")
    return run_in_vm(body, timeout=timeout, echo=echo, files={"script.sh": script.read_bytes()})


# ------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class CaseResult:
    nodeid: str
    outcome: str  # passed | failed | error | skipped
    time_s: float
    message: str


def parse_junit(path: Path) -> list[CaseResult]:
    """The test cases of a pytest junit XML file (empty if missing or unreadable)."""
    if not path.exists():
        return []
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return []
    cases = []
    for tc in root.iter("testcase"):
        nodeid = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (el.get("message") or "") + "\n" + (el.text or "")
                break
        for tag in ("system-out", "system-err"):
            el = tc.find(tag)
            if outcome in ("failed", "error") and el is not None and (el.text or "").strip():
                message += f"\n[{tag}]\n{el.text}"
        cases.append(CaseResult(nodeid, outcome, float(tc.get("time") or 0), message.strip()))
    return cases


def tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def summary(res: RunResult) -> str:
    """A human-readable report: timings, each guest test, logs on failure."""
    cases = parse_junit(res.share / "junit.xml")
    boots = ", ".join(
        f"boot {b.attempt}: {b.status} ("
        + (
            f"boot {b.boot_s:.1f}s, run {b.total_s - b.boot_s:.1f}s, "
            if b.boot_s
            else "init not reached, "
        )
        + f"total {b.total_s:.1f}s)"
        for b in res.boots
    )
    lines = [
        f"VM run: kernel {res.read('uname').strip() or res.kver}; {boots}; guest rc={res.rc}",
        f"host side: prepare {res.prepare_s:.1f}s, vm test collection {res.collect_s:.1f}s; "
        f"results in {res.out}",
    ]
    for c in cases:
        lines.append(f"  [guest] {c.outcome.upper():7} {c.nodeid} ({c.time_s:.1f}s)")
    if not res.ok:
        lines.append(f"FAILED: {res.failure_reason()}")
        for c in cases:
            if c.outcome in ("failed", "error"):
                lines += [f"--- {c.nodeid} ({c.outcome}) ---", tail(c.message, 60)]
        out = res.read("pytest.log")
        if not cases and out.strip():
            lines += ["--- guest output (tail) ---", tail(out, 60)]
        dmesg = res.read("dmesg.txt")
        if dmesg:
            lines += ["--- guest dmesg (tail) ---", tail(dmesg, 40)]
        last = res.boots[-1] if res.boots else None
        if res.rc is None and last is not None and last.console.exists():
            lines += [
                f"--- console {last.console.name} (tail) ---",
                tail(last.console.read_text(errors="replace"), 40),
            ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.vm.harness", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_prep = sub.add_parser("prepare", help="install/cache the kernel, initramfs and qemu")
    p_prep.add_argument("--refresh", action="store_true", help="re-resolve the backports kernel")
    p_run = sub.add_parser("run", help="run 'pytest -m vm ARGS' inside the VM")
    p_run.add_argument("--timeout", type=float, default=TOTAL_TIMEOUT)
    p_run.add_argument("--quiet", action="store_true", help="do not echo the console")
    p_run.add_argument("pytest_args", nargs="*")
    p_sh = sub.add_parser("shell-script", help="run 'bash SCRIPT' inside the VM")
    p_sh.add_argument("--timeout", type=float, default=TOTAL_TIMEOUT)
    p_sh.add_argument("script", type=Path)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "prepare":
            assets = prepare(refresh=a.refresh)
            print(f"kernel {assets.kver}\nvmlinuz {assets.vmlinuz}\ninitrd {assets.initrd}")
            return 0
        if a.cmd == "run":
            res = run_pytest(a.pytest_args, timeout=a.timeout, echo=None if a.quiet else sys.stdout)
        else:
            res = run_script(a.script, timeout=a.timeout, echo=sys.stdout)
    except VMError as e:
        print(f"VM error: {e}", file=sys.stderr)
        return 2
    print(summary(res))
    return res.rc if res.rc is not None else 3


if __name__ == "__main__":
    sys.exit(main())
