"""Small file helpers shared by the package's writers."""

from __future__ import annotations

import contextlib
import os
import tempfile


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
