"""Types of the extension's classes and functions that Python code uses by name (the rest
it reaches through ``native.module()``, untyped)."""

from collections.abc import Iterator, Mapping
from typing import Any, TypeVar, overload

from btrfs_ublk_image.tree import (
    AsideFile,
    Content,
    FileType,
    SavedMetadata,
)
from btrfs_ublk_image.tree import (
    Entries as TreeEntries,
)

_T = TypeVar("_T")

class Entries:
    """A directory's entries held natively (native/src/entries.rs); ``tree.Entries`` is
    the mapping Python code uses."""

    def __init__(self, entries: Mapping[bytes, Inode] | None = None) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, name: object) -> bool: ...
    def __getitem__(self, name: bytes) -> Inode: ...
    def __setitem__(self, name: bytes, child: Inode) -> None: ...
    def __delitem__(self, name: bytes) -> None: ...
    def __iter__(self) -> Iterator[bytes]: ...
    @overload
    def get(self, name: bytes) -> Inode | None: ...
    @overload
    def get(self, name: bytes, default: Inode) -> Inode: ...
    @overload
    def get(self, name: bytes, default: _T) -> Inode | _T: ...

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
    @property
    def entries(self) -> TreeEntries: ...
    @entries.setter
    def entries(self, value: Mapping[bytes, Inode]) -> None: ...
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
        entries: Mapping[bytes, Inode] | None = None,
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
