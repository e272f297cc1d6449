"""Small file helpers shared by the package's writers."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
import threading

from btrfs_ublk_image.errors import ImageError

FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
# errors of FICLONE / copy_file_range that mean "not here", not "broken"
UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS}
# and of link(2): hard links refused (EPERM: protected_hardlinks, some filesystems)
_NO_LINK = UNSUPPORTED | {errno.EPERM, errno.EMLINK}


def write_atomic(path: str | os.PathLike[str], data: bytes, prefix: str = ".tmp-") -> None:
    """Write ``data`` to ``path`` atomically: a temp file (``prefix``) in the same
    directory, fsynced, mode 0644, renamed over ``path``; removed on any failure."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def link_or_copy(src: str, dst: str) -> str:
    """Make ``dst`` hold ``src``'s bytes without writing them where the filesystem allows:
    a hard link, else a reflink (``FICLONE``), else a copy. Returns which it was."""
    try:
        os.link(src, dst)
        return "link"
    except OSError as e:
        if e.errno not in _NO_LINK:
            raise
    try:
        with open(src, "rb") as fs, open(dst, "wb") as fd:
            try:
                fcntl.ioctl(fd.fileno(), FICLONE, fs.fileno())
                how = "reflink"
            except OSError as e:
                if e.errno not in UNSUPPORTED:
                    raise
                shutil.copyfileobj(fs, fd, 1 << 20)
                how = "copy"
            fd.flush()
            os.fsync(fd.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dst)
        raise
    os.chmod(dst, 0o644)
    return how


class Syncer:
    """fsyncs started as soon as a file (or directory) is complete, each on a thread of its
    own, and waited for together: the disk writes one file back while the next is made,
    and on ext4 fsyncs that wait at the same time share one journal commit (one at a time,
    each file would cost a commit of its own). ``wait`` raises the first error (an
    ``ImageError`` naming the path); ``close`` (also on errors) waits without raising."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._errors: list[ImageError] = []

    def start(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

        def sync() -> None:
            try:
                os.fsync(fd)
            except OSError as e:
                self._errors.append(ImageError(f"{path}: fsync failed: {e.strerror}"))
            finally:
                os.close(fd)

        t = threading.Thread(target=sync, name="fsync", daemon=True)
        try:
            t.start()
        except BaseException:
            os.close(fd)
            raise
        self._threads.append(t)

    def close(self) -> None:
        for t in self._threads:
            t.join()
        self._threads.clear()

    def wait(self) -> None:
        self.close()
        if self._errors:
            raise self._errors[0]


def sync_dir(path: str) -> None:
    """fsync a directory: its entries (a rename into it) are on disk when this returns."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
