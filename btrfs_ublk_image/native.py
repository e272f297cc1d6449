"""The native data path (``native/``, a Rust extension built with maturin): tar layers read
in one pass (source digest, inflate, diff_id, headers, CRC-32C, deduplication, pack writes
and the pack's chunk digests on threads of their own), handing back compact member records.

Used whenever the extension is installed, unless ``BUI_NATIVE=0`` selects the Python path
(the reference semantics, and what the bench compares against). Archives with forms the
native reader does not implement (and every archive with an error) are read by the Python
reader instead, whole, after the native side rolled its pack writes back: results and
errors are the Python reader's either way. ``BUI_NATIVE_TIMES=1`` makes the native reader
print where its time went to stderr: the parser's (waiting for input, writing the pack and
of that waiting for the pack hasher, waiting for Python to take a segment) and Python's
(placing the members: wall and CPU; waiting for segments).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "BUI_NATIVE"
_module: ModuleType | None = None
_loaded = False
# archives handed back to the Python reader (tests check which path ran)
fallbacks: list[str] = []


def module() -> ModuleType | None:
    """The extension module, or None (not built, or ``BUI_NATIVE=0``)."""
    global _module, _loaded
    if os.environ.get(ENV, "1") == "0":
        return None
    if not _loaded:
        _loaded = True
        try:
            import btrfs_ublk_native

            _module = btrfs_ublk_native
        except ImportError:
            _module = None
    return _module


# tarballs whose sha256 began while the program started (``Prehash``), by absolute path:
# the layer's native read takes the digest over from where it got (``take_prehash``)
_prehashes: dict[str, Any] = {}


def start_prehash(path: Path, limit: int | None = None) -> None:
    """Start the sha256 of the tarball at ``path`` on a thread of its own (when the
    extension has ``Prehash``); a file that cannot be opened is left to the layer's read,
    whose error names it. ``limit``: stop after that many bytes (tests)."""
    nat = module()
    key = os.path.abspath(path)
    if nat is None or not hasattr(nat, "Prehash") or key in _prehashes:
        return
    with contextlib.suppress(OSError):
        _prehashes[key] = nat.Prehash(key, limit)


def take_prehash(path: Path | str) -> Any | None:
    """The prehash of the tarball at ``path``, now the caller's (to hand to ``read_tar``
    and close); None if none was started."""
    return _prehashes.pop(os.path.abspath(path), None)


def close_prehashes() -> None:
    """Stop the prehashes no layer took (their threads joined, their fds closed)."""
    while _prehashes:
        _prehashes.popitem()[1].close()
