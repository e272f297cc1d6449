"""The tarball's digest begun at start-up (``native.Prehash``, ``cli._start_prehashes``): the
layer's native read takes it over from whatever offset it reached; digests, image ids and
errors are the same as without it."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import tarfile
import time
import types
from pathlib import Path

import pytest

from btrfs_ublk_image import native
from btrfs_ublk_image.cli import main

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        native.module() is None or not hasattr(native.module(), "Prehash"),
        reason="native extension (with Prehash) not built",
    ),
]

# past one read block of the reader (256 KiB) and of the prehash, not aligned to either
SIZES = [0, 100, 300_001, 1 << 20, None]


def _tarball(path: Path, gz: bool = False) -> str:
    """A ~2.5 MiB archive (files, a directory, a symlink); its sha256 hex."""
    rng = random.Random(7)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        d = tarfile.TarInfo("d")
        d.type, d.mode = tarfile.DIRTYPE, 0o755
        t.addfile(d)
        for i, n in enumerate([0, 1, 511, 513, 4096, 300_000, 1_500_000, 77, 700_000]):
            info = tarfile.TarInfo(f"d/f{i}")
            info.size, info.mode, info.mtime = n, 0o644, 1_700_000_000
            t.addfile(info, io.BytesIO(rng.randbytes(n)))
        s = tarfile.TarInfo("d/link")
        s.type, s.linkname = tarfile.SYMTYPE, "f1"
        t.addfile(s)
    data = buf.getvalue()
    if gz:
        import gzip

        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _spec(tmp: Path, tar: str, extra: str = "") -> Path:
    spec = tmp / "spec.yaml"
    spec.write_text(
        f"version: 1\nname: t\nsource_date_epoch: 1\n{extra}layers:\n  - tar: {{path: {tar}}}\n"
    )
    return spec


def _build(spec: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["build", str(spec), "-o", str(out)])
    got = capsys.readouterr()
    return rc, got.out, got.err


def _prehash_threads() -> int:
    """The prehash threads still in /proc/self/task, after a moment's grace: a joined
    thread's task leaves the list shortly after pthread_join returns (the kernel clears
    the tid the join waits on before it unlinks the task)."""
    deadline = time.monotonic() + 2
    while True:
        n = 0
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):  # ended meanwhile
                n += (task / "comm").read_text().strip() == "prehash"
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.01)


def _fds_to(path: Path) -> int:
    n = 0
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            n += os.readlink(fd) == str(path)
    return n


@pytest.mark.parametrize("gz", [False, True])
def test_digest_and_id_same_whatever_the_offset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], gz: bool
) -> None:
    tar = tmp_path / ("l.tar.gz" if gz else "l.tar")
    want = _tarball(tar, gz)
    spec = _spec(tmp_path, tar.name)
    results = set()
    # the reference: the Python reader (no prehash, no native read)
    os.environ[native.ENV] = "0"
    try:
        rc, ref, err = _build(spec, tmp_path / "ref", capsys)
    finally:
        del os.environ[native.ENV]
    assert rc == 0, err
    for limit in ["none", *SIZES]:
        out = tmp_path / f"out-{limit}"
        pre = None
        if limit != "none":  # registered first: the command's start keeps it
            native.start_prehash(tar, None if limit is None else int(limit))
            pre = native._prehashes[os.path.abspath(tar)]
            reached = pre.wait()
            assert reached == (tar.stat().st_size if limit is None else limit)
        rc, stdout, err = _build(spec, out, capsys)
        assert rc == 0, err
        assert native._prehashes == {}
        if pre is not None:
            assert pre.taken, "the read did not take the prehash over"
        manifest = json.loads((out / "manifest.json").read_text())
        assert [s["sha256"] for s in manifest["sources"]] == ["sha256:" + want]
        results.add(stdout.split(": ")[1])
    assert results == {ref.split(": ")[1]}


def test_the_reader_hashes_only_from_where_the_prehash_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A byte changed behind the check's back (size and mtime restored) inside the part
    the prehash hashed: the digest is of the prehash's bytes there and the reader's after,
    so the reader took the state over and hashed none of those bytes again."""
    tar = tmp_path / "l.tar"
    _tarball(tar)
    old = tar.read_bytes()
    n = 300_001
    native.start_prehash(tar, n)
    assert native._prehashes[os.path.abspath(tar)].wait() == n
    st = tar.stat()
    at = n - 1000  # inside d/f5's 300,000 bytes of content: the archive stays valid
    with open(tar, "r+b") as f:
        f.seek(at)
        f.write(bytes([old[at] ^ 0xFF]))
    os.utime(tar, ns=(st.st_atime_ns, st.st_mtime_ns))
    new = tar.read_bytes()
    rc, _, err = _build(_spec(tmp_path, tar.name), tmp_path / "out", capsys)
    assert rc == 0, err
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    got = manifest["sources"][0]["sha256"]
    assert got == "sha256:" + hashlib.sha256(old[:n] + new[n:]).hexdigest()
    assert got != "sha256:" + hashlib.sha256(new).hexdigest()


def test_the_command_starts_and_hands_it_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tar = tmp_path / "l.tar"
    _tarball(tar)
    started = []
    real = native.start_prehash

    def spy(path: Path, limit: int | None = None) -> None:
        real(path, limit)
        started.append(native._prehashes[os.path.abspath(path)])

    monkeypatch.setattr(native, "start_prehash", spy)
    rc, _, err = _build(_spec(tmp_path, tar.name), tmp_path / "out", capsys)
    assert rc == 0, err
    assert len(started) == 1 and started[0].taken
    # filters: the Python reader reads it, so no digest begins
    spec = tmp_path / "f.yaml"
    spec.write_text(f"version: 1\nname: t\nlayers:\n  - tar: {{path: {tar}, exclude: ['/d/f1']}}\n")
    rc, _, err = _build(spec, tmp_path / "out2", capsys)
    assert rc == 0, err
    assert len(started) == 1


def test_no_prehash_without_the_native_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tar = tmp_path / "l.tar"
    _tarball(tar)
    monkeypatch.setenv(native.ENV, "0")
    native.start_prehash(tar)
    assert native._prehashes == {}


def test_no_prehash_with_an_extension_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tar = tmp_path / "l.tar"
    _tarball(tar)
    nat = native.module()
    older = types.ModuleType("btrfs_ublk_native")  # the extension as built before Prehash
    older.__dict__.update({k: v for k, v in vars(nat).items() if k != "Prehash"})
    monkeypatch.setattr(native, "module", lambda: older)
    del native.fallbacks[:]
    rc, out, err = _build(_spec(tmp_path, tar.name), tmp_path / "out", capsys)
    assert rc == 0, err
    assert native._prehashes == {} and native.fallbacks == []
    assert out.split(": ")[1].startswith("sha256:")


@pytest.mark.parametrize("problem", ["missing", "directory"])
def test_unreadable_files_keep_their_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], problem: str
) -> None:
    tar = tmp_path / "l.tar"
    if problem == "directory":
        tar.mkdir()
    spec = _spec(tmp_path, tar.name)
    rc, _, err = _build(spec, tmp_path / "out", capsys)
    why = "No such file or directory" if problem == "missing" else "Is a directory"
    assert (rc, err) == (1, f"btrfs-ublk-image: error: {tar}: cannot open tarball: {why}\n")
    assert native._prehashes == {}
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change", ["written", "replaced", "touched"])
def test_a_changed_file_is_an_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: str
) -> None:
    tar = tmp_path / "l.tar"
    _tarball(tar)
    native.start_prehash(tar, 100_000)
    native._prehashes[os.path.abspath(tar)].wait()
    if change == "written":  # same size, new bytes inside the part already hashed
        with open(tar, "r+b") as f:
            f.seek(2000)
            f.write(b"\xff" * 8)
    elif change == "replaced":  # same bytes, another inode
        other = tmp_path / "new.tar"
        other.write_bytes(tar.read_bytes())
        other.rename(tar)
    else:
        st = tar.stat()
        os.utime(tar, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    rc, _, err = _build(_spec(tmp_path, tar.name), tmp_path / "out", capsys)
    assert (rc, err) == (
        1,
        f"btrfs-ublk-image: error: {tar}: changed while the build read it (its device,"
        " inode, size or mtime differ from when its sha256 began)\n",
    )
    assert native._prehashes == {}
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("failure", ["invalid spec", "an earlier layer"])
def test_an_early_error_stops_the_prehash_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], failure: str
) -> None:
    big = tmp_path / "big.tar"
    with open(big, "wb") as f:  # 2 GiB sparse: hashing it all would take ~1 s
        f.truncate(2 << 30)
    if failure == "invalid spec":
        spec = _spec(tmp_path, big.name, extra="pack_chunk_size: 7\n")
        want = [str(spec), "pack_chunk_size"]
    else:  # the build starts and fails before the tarball's layer
        spec = tmp_path / "spec.yaml"
        spec.write_text(
            "version: 1\nname: t\nlayers:\n  - dir: {path: nowhere}\n"
            f"  - tar: {{path: {big.name}}}\n"
        )
        want = [str(tmp_path / "nowhere")]
    t = time.monotonic()
    rc, _, err = _build(spec, tmp_path / "out", capsys)
    took = time.monotonic() - t
    assert rc == 1 and all(w in err for w in want), err
    assert took < 0.5, took
    assert native._prehashes == {}
    assert _prehash_threads() == 0
    assert _fds_to(big) == 0
