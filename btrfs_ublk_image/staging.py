"""A bundle while it is written: the hidden temporary directory beside its output (marked
with the building process, so a later build removes what a killed one left) and the pack
writer of its ``packs/``. ``bundle.write_bundle`` and ``early.EarlyRead`` both begin a
bundle here; the directory becomes the bundle by one rename (``bundle``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.manifest import PACKS
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.progress import Progress

if TYPE_CHECKING:
    from btrfs_ublk_image.base import BaseImage

# in a build's temporary directory while it is written: "PID BOOT_ID" of the build
BUILDING = ".building"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _build_gone(marker: str) -> bool:
    """Whether the build that wrote ``marker`` (its pid and boot id) no longer runs."""
    try:
        with open(marker) as f:
            pid_text, boot = f.read().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return False  # not ours, or being written: leave it
    if boot != _boot_id():
        return True  # written before a reboot
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def _mark_building(tmp: str) -> None:
    """The BUILDING marker of a temporary directory: removed by a later build once this
    process is gone (``remove_stale_builds``)."""
    with open(os.path.join(tmp, BUILDING), "w") as f:
        f.write(f"{os.getpid()} {_boot_id()}\n")


def unused_output(out_dir: str) -> str:
    """``out_dir`` made absolute; an error if something is there (never overwritten)."""
    out_dir = os.path.abspath(out_dir)
    if os.path.lexists(out_dir):
        raise ImageError(
            f"{out_dir}: already exists (a bundle is never overwritten; remove it first)"
        )
    return out_dir


def new_temporary_dir(parent: str, prefix: str) -> str:
    """A hidden ``PREFIX*.tmp`` directory in ``parent`` marked as this build's (so a later
    build removes it if this one is killed); what killed builds left there goes first."""
    if not os.path.isdir(parent):
        raise ImageError(f"{parent}: no such directory")
    remove_stale_builds(parent)
    tmp = tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=parent)
    try:
        _mark_building(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def remove_stale_builds(parent: str) -> None:
    """Remove the temporary directories that killed builds (SIGKILL, a crash, a power cut)
    left in ``parent``: hidden ``.NAME.*.tmp`` directories whose BUILDING marker names a
    process that is gone."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        path = os.path.join(parent, name)
        hidden_tmp = name.startswith(".") and name.endswith(".tmp") and os.path.isdir(path)
        if hidden_tmp and _build_gone(os.path.join(path, BUILDING)):
            shutil.rmtree(path, ignore_errors=True)


def start_bundle(out_dir: str) -> tuple[str, str]:
    """(``out_dir`` made absolute, the temporary directory beside it the bundle is written
    into); an error if something is at ``out_dir``."""
    out_dir = unused_output(out_dir)
    return out_dir, new_temporary_dir(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.")


def new_pack_writer(
    tmp: str,
    keep_inline: int,
    chunk_size: int,
    progress: Progress | None,
    pack_compression: str = "none",
    base: BaseImage | None = None,
) -> PackWriter:
    """The pack writer of the bundle being written in ``tmp`` (its ``packs/`` made)."""
    packs_dir = os.path.join(tmp, PACKS)
    os.mkdir(packs_dir)
    return PackWriter(
        packs_dir,
        keep_inline=keep_inline,
        chunk_size=chunk_size,
        progress=progress,
        compression=pack_compression,
        base=base,
    )
