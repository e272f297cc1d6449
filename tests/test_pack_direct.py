"""Pack 0's streamed content written with O_DIRECT (native/src/direct.rs) on real
filesystems: where O_DIRECT is refused (ramfs refuses the open) the build writes the same
bytes through the page cache; a full output filesystem gives a clear error and leaves
nothing behind."""

from __future__ import annotations

import contextlib
import filecmp
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from btrfs_ublk_image import native
from btrfs_ublk_image.bundle import build_spec
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.spec import load_spec

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts)"),
    pytest.mark.skipif(native.module() is None, reason="native extension not built"),
]

MIB = 1 << 20


def _tarball(path: Path, sizes: list[int]) -> None:
    """Random members of these sizes (> 4 MiB: streamed), a duplicate of the first and
    small files between them."""
    first = b""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for i, size in enumerate(sizes):
            data = os.urandom(size)
            first = first or data
            for name, content in ((f"big{i}", data), (f"small{i}", os.urandom(3000 + i))):
                info = tarfile.TarInfo(name)
                info.size = len(content)
                tar.addfile(info, _Bytes(content))
        info = tarfile.TarInfo("big-dup")
        info.size = len(first)
        tar.addfile(info, _Bytes(first))


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)

    def read(self, n: int = -1) -> bytes:
        n = len(self.data) if n < 0 else n
        out, self.data = self.data[:n], self.data[n:]
        return bytes(out)


def _spec(tmp: Path, tar: Path) -> Path:
    spec = tmp / "spec.yaml"
    spec.write_text(
        f"version: 1\nname: t\nsource_date_epoch: 1\nlayers:\n  - tar: {{path: {tar}}}\n"
    )
    return spec


@contextlib.contextmanager
def _mounted(mnt: Path, *args: str) -> Iterator[Path]:
    mnt.mkdir()
    subprocess.run(["mount", *args, str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
        mnt.rmdir()


def _native_pack_line(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("native pack:")]


def test_direct_refused_same_image(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built onto ext4 (O_DIRECT taken) and onto ramfs (O_DIRECT refused at the open): the
    same image id and the same pack bytes."""
    monkeypatch.setenv("BUI_NATIVE_TIMES", "1")
    tar = tmp_path / "in.tar"
    _tarball(tar, [9 * MIB + 5, 5 * MIB + 4097, 6 * MIB])
    spec = _spec(tmp_path, tar)
    direct = build_spec(load_spec(spec), spec, str(tmp_path / "ext4-out"), None)
    lines = _native_pack_line(capfd.readouterr().err)
    assert len(lines) == 1 and not lines[0].startswith("native pack: 0 MiB"), lines
    assert "refused" not in lines[0]
    with _mounted(tmp_path / "ramfs", "-t", "ramfs", "none") as mnt:
        refused = build_spec(load_spec(spec), spec, str(mnt / "out"), None)
        assert _native_pack_line(capfd.readouterr().err) == []  # no direct writer at all
        assert refused.image_id == direct.image_id
        packs = sorted((mnt / "out" / "packs").iterdir())
        assert [p.name for p in packs] == sorted(
            p.name for p in (tmp_path / "ext4-out" / "packs").iterdir()
        )
        for p in packs:
            assert filecmp.cmp(p, tmp_path / "ext4-out" / "packs" / p.name, shallow=False)


def test_full_output_filesystem_clear_error(tmp_path: Path) -> None:
    """A pack larger than the output's filesystem: the build fails with the output named and
    the problem, and leaves nothing on it. The native reader raises the pack write's error
    itself: the layer is not handed back to be read again by the Python reader."""
    tar = tmp_path / "in.tar"
    _tarball(tar, [30 * MIB, 20 * MIB])
    spec = _spec(tmp_path, tar)
    image = tmp_path / "fs.img"
    with image.open("wb") as f:
        f.truncate(40 * MIB)
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True)
    with _mounted(tmp_path / "mnt", "-o", "loop", str(image)) as mnt:
        out = mnt / "out"
        del native.fallbacks[:]
        try:
            build_spec(load_spec(spec), spec, str(out), None)
        except ImageError as e:
            message = str(e)
        else:
            pytest.fail("the build fit")
        assert message == f"{out}: writing the bundle: No space left on device"
        assert native.fallbacks == []
        assert sorted(p.name for p in mnt.iterdir()) == ["lost+found"]
        # and no file of it is still open (the umount would fail: busy)
