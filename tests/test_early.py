"""The first tar layer read while the program starts (``early.EarlyRead``): the same image
ids, errors and warnings as a build that reads every layer after the validation
(``BUI_EARLY_READ=0``), nothing left behind on an invalid spec, an error or a cancel."""

from __future__ import annotations

import errno
import io
import os
import random
import tarfile
import threading
import time
from pathlib import Path

import pytest

from btrfs_ublk_image import early, native
from btrfs_ublk_image.bundle import build_spec
from btrfs_ublk_image.cli import EARLY_READ_ENV, main
from btrfs_ublk_image.sources.base import Cancelled
from btrfs_ublk_image.spec import TarSource, load_spec
from btrfs_ublk_image.specyaml import PLAIN_TAR_KEYS, read_spec_yaml

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        native.module() is None or not hasattr(native.module(), "Placer"),
        reason="native extension (with Placer) not built",
    ),
]


def _tarball(
    path: Path,
    members: int = 40,
    end_marker: bool = True,
    sizes: tuple[int, ...] = (0, 10, 3000, 70_000),
) -> None:
    rng = random.Random(3)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        d = tarfile.TarInfo("d")
        d.type, d.mode, d.mtime = tarfile.DIRTYPE, 0o755, 1_800_000_000
        t.addfile(d)
        for i in range(members):
            n = rng.choice(sizes)
            info = tarfile.TarInfo(f"d/f{i}")
            info.size, info.mode, info.mtime = n, 0o644, 1_600_000_000 + i * 10**7
            t.addfile(info, io.BytesIO(rng.randbytes(n)))
    data = buf.getvalue()
    if not end_marker:
        data = data[: -2 * 512]
        data = data.rstrip(b"\0")
        data += b"\0" * (-len(data) % 512)
    path.write_bytes(data)


def _spec(tmp: Path, body: str) -> Path:
    (tmp / "overlay").mkdir(exist_ok=True)
    (tmp / "overlay/etc").mkdir(exist_ok=True)
    (tmp / "overlay/etc/motd").write_text("hi\n")
    spec = tmp / "spec.yaml"
    spec.write_text(body)
    return spec


SPEC = """version: 1
name: t
source_date_epoch: 1700000000
layers:
  - tar: {path: l.tar}
  - dir: {path: overlay, uid: 0, gid: 0}
"""


def _build(
    spec: Path, out: Path, capsys: pytest.CaptureFixture[str], on: bool
) -> tuple[int, str, str]:
    os.environ[EARLY_READ_ENV] = "1" if on else "0"
    try:
        rc = main(["build", str(spec), "-o", str(out)])
    finally:
        del os.environ[EARLY_READ_ENV]
    got = capsys.readouterr()
    return rc, got.out, got.err


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[early.EarlyRead]:
    """The early reads the builds took over (``result`` called)."""
    got: list[early.EarlyRead] = []
    real = early.EarlyRead.result

    def spy(self: early.EarlyRead) -> object:
        got.append(self)
        return real(self)

    monkeypatch.setattr(early.EarlyRead, "result", spy)
    return got


@pytest.mark.parametrize(
    "body",
    [
        SPEC,
        SPEC.replace("source_date_epoch: 1700000000\n", ""),  # no clamping
        SPEC.replace("{path: l.tar}", "{path: l.tar, uid: 7, gid: 8}"),
        SPEC.replace("name: t\n", "name: t\nbtrfs: {inline_limit: 100}\npack_chunk_size: 65536\n"),
        SPEC + "remove: ['/d/f1']\n",
    ],
)
def test_same_image_as_reading_after_the_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], taken: list[early.EarlyRead], body: str
) -> None:
    _tarball(tmp_path / "l.tar")
    spec = _spec(tmp_path, body)
    rc, ref, err = _build(spec, tmp_path / "ref", capsys, on=False)
    assert rc == 0, err
    assert taken == []
    rc, got, err = _build(spec, tmp_path / "out", capsys, on=True)
    assert rc == 0, err
    assert len(taken) == 1, "the build did not take the early read over"
    assert got.split(": ")[1] == ref.split(": ")[1]
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "body",
    [
        SPEC.replace("{path: l.tar}", "{path: l.tar, dest: /x}"),  # a key read otherwise
        SPEC.replace("{path: l.tar}", "{path: l.tar, uid: true}"),  # invalid: no start
        SPEC.replace("name: t\n", "name: t\npack_compression: zstd\n"),
        SPEC.replace("name: t\n", "name: t\nbtrfs: {inline_limit: 5000}\n"),
        SPEC.replace("name: t\n", "name: t\npack_chunk_size: 1000\n"),
        SPEC.replace("  - tar: {path: l.tar}\n", "").replace("overlay, uid", "overlay, uid"),
        "version: 1\nname: t\nlayers: []\n",
        "- not a mapping\n",
    ],
)
def test_not_started(tmp_path: Path, body: str) -> None:
    _tarball(tmp_path / "l.tar")
    spec = _spec(tmp_path, body)
    got = early.EarlyRead.start(read_spec_yaml(spec), spec, str(tmp_path / "out"), None, None)
    assert got is None
    assert _leftovers(tmp_path) == []


def test_not_started_with_a_base_or_an_existing_output(tmp_path: Path) -> None:
    _tarball(tmp_path / "l.tar")
    spec = _spec(tmp_path, SPEC)
    text = read_spec_yaml(spec)
    assert early.EarlyRead.start(text, spec, str(tmp_path / "out"), "base.bundle", None) is None
    (tmp_path / "out").mkdir()
    assert early.EarlyRead.start(text, spec, str(tmp_path / "out"), None, None) is None
    assert early.EarlyRead.start(text, spec, str(tmp_path / "no/out"), None, None) is None
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "problem",
    [
        ("name: t\n", "name: '-t'\n"),  # the first layer fine, the spec not
        ("  - dir: {path: overlay, uid: 0, gid: 0}\n", "  - dir: {path: overlay, bad: 1}\n"),
    ],
)
def test_invalid_spec_same_error_no_warning_nothing_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], problem: tuple[str, str]
) -> None:
    """The tarball warns (no end-of-archive marker), the spec is invalid: the spec's error
    alone, as without the early read, and no temporary bundle left."""
    _tarball(tmp_path / "l.tar", end_marker=False)
    spec = _spec(tmp_path, SPEC.replace(*problem))
    want = _build(spec, tmp_path / "out", capsys, on=False)
    got = _build(spec, tmp_path / "out", capsys, on=True)
    assert got == want and got[0] == 1 and "warning" not in got[2]
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_warning_given_once_the_build_takes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], taken: list[early.EarlyRead]
) -> None:
    _tarball(tmp_path / "l.tar", end_marker=False)
    spec = _spec(tmp_path, SPEC)
    rc, ref, want = _build(spec, tmp_path / "ref", capsys, on=False)
    assert rc == 0 and "no end-of-archive marker" in want
    rc, got, err = _build(spec, tmp_path / "out", capsys, on=True)
    assert rc == 0 and len(taken) == 1
    assert (got.split(": ")[1], err) == (ref.split(": ")[1], want)


@pytest.mark.parametrize("problem", ["corrupt", "sha256", "missing"])
def test_read_errors_same_as_after_the_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], problem: str
) -> None:
    tar = tmp_path / "l.tar"
    _tarball(tar)
    body = SPEC
    if problem == "corrupt":
        data = bytearray(tar.read_bytes())
        data[512 * 3 + 148 : 512 * 3 + 156] = b"garbage!"  # a later member's checksum
        tar.write_bytes(bytes(data))
    elif problem == "sha256":
        body = SPEC.replace("{path: l.tar}", "{path: l.tar, sha256: '" + "0" * 64 + "'}")
    else:
        tar.unlink()
    spec = _spec(tmp_path, body)
    want = _build(spec, tmp_path / "out", capsys, on=False)
    got = _build(spec, tmp_path / "out", capsys, on=True)
    assert got == want and got[0] == 1 and "error" in got[2]
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_discard_stops_the_read_and_removes_the_bundle(tmp_path: Path) -> None:
    _tarball(tmp_path / "l.tar", members=3000)
    spec = _spec(tmp_path, SPEC)
    read = early.EarlyRead.start(read_spec_yaml(spec), spec, str(tmp_path / "out"), None, None)
    assert read is not None
    assert _leftovers(tmp_path) != []  # the temporary bundle, being written
    read.discard()
    assert not read._thread.is_alive()
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()
    assert not any(t.name == "early-read" for t in threading.enumerate())


def test_discard_stops_the_python_reader_too(tmp_path: Path) -> None:
    """An archive the native reader hands back (no end-of-archive marker): the Python
    reader, on the read's thread, stops at its next member too."""
    _tarball(tmp_path / "l.tar", members=20_000, end_marker=False, sizes=(0, 10))
    spec = _spec(tmp_path, SPEC)
    del native.fallbacks[:]
    read = early.EarlyRead.start(read_spec_yaml(spec), spec, str(tmp_path / "out"), None, None)
    assert read is not None
    deadline = time.monotonic() + 60
    while not native.fallbacks:
        assert time.monotonic() < deadline and read._thread.is_alive()
        time.sleep(0.001)
    read.discard()
    assert not read._thread.is_alive()
    assert isinstance(read._error, Cancelled)
    placed = read._ctx.tree.root.entries.get(b"d")  # none yet if it stopped at the first
    assert placed is None or len(placed.entries) < 20_000
    assert _leftovers(tmp_path) == []


def test_not_started_for_a_fifo(tmp_path: Path) -> None:
    """A FIFO's read may block where no signal reaches it (a thread): read after the
    validation, on the main thread, as before."""
    os.mkfifo(tmp_path / "l.tar")
    spec = _spec(tmp_path, SPEC)
    got = early.EarlyRead.start(read_spec_yaml(spec), spec, str(tmp_path / "out"), None, None)
    assert got is None and _leftovers(tmp_path) == []


def test_not_started_for_a_large_tarball(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tarball(tmp_path / "l.tar")
    spec = _spec(tmp_path, SPEC)
    monkeypatch.setattr(early, "MAX_BYTES", (tmp_path / "l.tar").stat().st_size - 1)
    got = early.EarlyRead.start(read_spec_yaml(spec), spec, str(tmp_path / "out"), None, None)
    assert got is None and _leftovers(tmp_path) == []


def test_not_started_when_its_pack_cannot_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error making the pack (a full disk) is the build's to report, after the spec's
    validation: no early read, nothing left."""
    _tarball(tmp_path / "l.tar")
    spec = _spec(tmp_path, SPEC)

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(early, "new_pack_writer", full)
    got = early.EarlyRead.start(read_spec_yaml(spec), spec, str(tmp_path / "out"), None, None)
    assert got is None and _leftovers(tmp_path) == []


def test_a_spec_read_otherwise_discards_it(tmp_path: Path) -> None:
    """The validated spec differs from what the read assumed (here SOURCE_DATE_EPOCH that
    the read saw and load_spec did not): the build reads the layer again, same image."""
    _tarball(tmp_path / "l.tar")
    spec = _spec(tmp_path, SPEC.replace("source_date_epoch: 1700000000\n", ""))
    ref = build_spec(load_spec(spec, environ={}), spec, str(tmp_path / "ref"), None)
    read = early.EarlyRead.start(
        read_spec_yaml(spec), spec, str(tmp_path / "out"), None, None, {"SOURCE_DATE_EPOCH": "5"}
    )
    assert read is not None
    got = build_spec(load_spec(spec, environ={}), spec, str(tmp_path / "out"), None, early=read)
    assert got.image_id == ref.image_id
    assert read._claimed and not read._thread.is_alive()
    assert _leftovers(tmp_path) == []


def test_every_tar_source_field_is_known() -> None:
    """A field added to the tar source's model must be one the early read gives (else
    ``matches`` refuses every early read: this test says so first)."""
    fields = early._TarFields("p", None, None, None)
    for name, info in TarSource.model_fields.items():
        if name in PLAIN_TAR_KEYS:
            continue
        assert getattr(fields, name) == info.get_default(call_default_factory=True), name
