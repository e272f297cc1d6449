"""The tarball read in place through a mapping (``native/src/mapped.rs``): a file truncated
while the native reader has it mapped is an error of the read, never a SIGBUS that kills
the process; SIGBUS that is not ours still reaches the handler before ours (Python's
faulthandler) or the default action."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from btrfs_ublk_image import native
from btrfs_ublk_image.cli import main
from btrfs_ublk_image.sources import tar as tar_source

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(native.module() is None, reason="native extension not built"),
]

SMALL = 6000  # members before the cut: more than the first segment's 4,096 records
CUT = 7 << 20  # inside the small members after the first segment (~6.3 MB into the file)


def _tarball(path: Path) -> None:
    """~22 MB: 6,000 members of 1,000 bytes, a 12 MiB member, 100 more small ones."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for i in range(SMALL):
            info = tarfile.TarInfo(f"s/{i:05d}")
            info.size = 1000
            t.addfile(info, io.BytesIO(i.to_bytes(4, "little") * 250))
        big = tarfile.TarInfo("big")
        big.size = 12 << 20
        t.addfile(big, io.BytesIO(os.urandom(big.size)))
        for i in range(100):
            info = tarfile.TarInfo(f"t/{i:03d}")
            info.size = 1000
            t.addfile(info, io.BytesIO(b"t" * 1000))
    path.write_bytes(buf.getvalue())
    assert path.stat().st_size > CUT + (12 << 20)


def test_a_file_truncated_under_the_native_read_is_its_error(tmp_path: Path) -> None:
    """Truncated from the parser's first hand-over (the reader a few MiB ahead, every window
    still mapped): the read fails with the mapping's message, the pack is rolled back."""
    nat = native.module()
    assert nat is not None
    tar = tmp_path / "in.tar"
    _tarball(tar)
    fd = os.open(tmp_path / "pack", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    pack = nat.Pack(fd, 4096)
    seen: list[Any] = []

    def place(members: Any) -> None:
        if not seen:
            os.truncate(tar, CUT)
        seen.extend(members)

    try:
        with open(tar, "rb") as f, pytest.raises(nat.Unsupported) as e:
            nat.read_tar(pack, f.fileno(), 0, None, 64, False, False, False, place)
    finally:
        pack.abort()  # closes fd
    assert "the file changed under the read" in str(e.value)
    assert seen, "the parser handed no segment over before the end"
    assert os.path.getsize(tmp_path / "pack") == 0  # rolled back


def test_the_build_names_the_file_truncated_under_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command (its prehash begun at start-up): the file that changed is the error, as
    for a file changed between the prehash and the read."""
    tar = tmp_path / "l.tar"
    _tarball(tar)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"version: 1\nname: t\nlayers:\n  - tar: {{path: {tar.name}}}\n")
    real = tar_source._place_member
    cut: list[bool] = []

    def place_member(*args: Any) -> None:
        if not cut:
            cut.append(True)
            os.truncate(tar, CUT)
        real(*args)

    monkeypatch.setattr(tar_source, "NATIVE_PLACE", False)  # every member through Python
    monkeypatch.setattr(tar_source, "_place_member", place_member)
    rc = main(["build", str(spec), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert cut
    assert (rc, err) == (
        1,
        f"btrfs-ublk-image: error: {tar}: changed while the build read it (its device,"
        " inode, size or mtime differ from when its sha256 began)\n",
    )
    assert not (tmp_path / "out").exists()


# a child that truncates the tarball under a native read (ours handles that SIGBUS), with
# faulthandler enabled again after our handler was installed (its handler now in front),
# then takes a SIGBUS of its own: outside our mappings (Python's mmap module) or sent
_CHILD = textwrap.dedent(
    """
    import faulthandler, mmap, os, signal, sys
    import btrfs_ublk_native as nat
    tar, pack_path, how = sys.argv[1:4]
    if how != "no-faulthandler":
        faulthandler.enable()
    nat.Prehash(tar).wait()  # our handler installed, chaining to what was there
    if how != "no-faulthandler":
        faulthandler.disable()
        faulthandler.enable()  # faulthandler's in front again: the read puts ours back
    fd = os.open(pack_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    pack = nat.Pack(fd, 4096)
    seen = []
    def place(members):
        if not seen:
            os.truncate(tar, {cut})
        seen.extend(members)
    try:
        with open(tar, "rb") as f:
            nat.read_tar(pack, f.fileno(), 0, None, 64, False, False, False, place)
    except nat.Unsupported as e:
        print("read:", e, flush=True)
    pack.abort()
    if how == "kill":
        os.kill(os.getpid(), signal.SIGBUS)
    else:  # an access past the end of a file mapped by Python: not ours
        with open(tar, "r+b") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            os.truncate(tar, 0)
            m[len(m) - 1]
    print("survived", flush=True)
    """
).format(cut=CUT)


@pytest.mark.parametrize("how", ["faulthandler", "no-faulthandler", "kill"])
def test_sigbus_not_ours_goes_on_as_it_would(tmp_path: Path, how: str) -> None:
    tar = tmp_path / "in.tar"
    _tarball(tar)
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    proc = subprocess.run(
        [sys.executable, str(script), str(tar), str(tmp_path / "pack"), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.startswith("read: the file changed under the read"), proc.stderr
    assert "survived" not in proc.stdout
    assert proc.returncode == -signal.SIGBUS, proc.stderr
    # faulthandler reports the foreign fault (and only that one: ours raised nothing)
    fatal = proc.stderr.count("Fatal Python error: Bus error")
    assert fatal == (how != "no-faulthandler"), proc.stderr
