"""Types of the extension's classes and functions that Python code uses by name (the rest
it reaches through ``native.module()``, untyped)."""

from collections.abc import Mapping
from typing import Any

from btrfs_ublk_image.tree import AsideFile, Content, FileType, SavedMetadata

class Inode:
    """One file object (``btrfs_ublk_image.tree``; native/src/inode.rs)."""

    ino: object
    type: FileType
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    atime_ns: int | None
    ctime_ns: int | None
    content: Content
    target: bytes
    entries: dict[bytes, Inode]
    rdev: int
    def __init__(
        self,
        type: FileType,
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        mtime_ns: int = 0,
        atime_ns: int | None = None,
        ctime_ns: int | None = None,
        xattrs: Mapping[bytes, bytes] | None = None,
        rdev: int = 0,
        target: bytes = b"",
        content: Content = b"",
        entries: dict[bytes, Inode] | None = None,
    ) -> None: ...
    @property
    def xattrs(self) -> Mapping[bytes, bytes]: ...
    @xattrs.setter
    def xattrs(self, value: Mapping[bytes, bytes] | None) -> None: ...
    @property
    def size(self) -> int: ...
    @property
    def st_mode(self) -> int: ...
    def meta(self) -> tuple[FileType, int, int, int, Mapping[bytes, bytes] | None]: ...
    def times(self) -> tuple[int, int | None, int | None]: ...
    def set_content_aside(self, store: AsideFile) -> None: ...
    def aside_at(self) -> tuple[int, int] | None: ...
    def saved_metadata(self) -> SavedMetadata: ...
    def restore_metadata(self, saved: SavedMetadata) -> None: ...
    def take_metadata(self, other: Inode) -> None: ...

def clamp_tree_times(root: Inode, limit_ns: int) -> None: ...
def __getattr__(name: str) -> Any: ...
