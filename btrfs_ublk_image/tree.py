"""The merged file tree: what every source writes into and the btrfs writer reads.

An ``Inode`` is one file object; a hardlink is the same ``Inode`` object under
several names. Names are ``bytes`` (Linux file names are bytes, not text).
Regular file content is either ``bytes`` (small, kept in memory, may become an
inline extent) or a ``Blob``: deduplicated content already written to a pack.
"""

from __future__ import annotations

import enum
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from btrfs_ublk_image.errors import SourceError


class FileType(enum.IntEnum):
    """File types, valued as the ``S_IFMT`` bits of ``st_mode``."""

    REG = stat.S_IFREG
    DIR = stat.S_IFDIR
    SYMLINK = stat.S_IFLNK
    CHR = stat.S_IFCHR
    BLK = stat.S_IFBLK
    FIFO = stat.S_IFIFO
    SOCK = stat.S_IFSOCK


@dataclass(frozen=True, slots=True)
class Blob:
    """Content stored in a pack: ``size`` bytes at ``offset`` of pack number ``pack``."""

    crc32c: int  # CRC-32C of the content (a deduplication key; matches are compared bytewise)
    size: int
    pack: int
    offset: int


Content = bytes | Blob


@dataclass(eq=False, slots=True)
class Inode:
    type: FileType
    mode: int = 0o644  # permission bits only (0o7777): setuid/setgid/sticky included
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    atime_ns: int | None = None  # None: same as mtime
    ctime_ns: int | None = None  # None: same as mtime
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    rdev: int = 0  # devices: os.makedev(major, minor)
    target: bytes = b""  # symlinks
    content: Content = b""  # regular files
    entries: dict[bytes, Inode] = field(default_factory=dict)  # directories

    @property
    def size(self) -> int:
        if self.type == FileType.REG:
            return self.content.size if isinstance(self.content, Blob) else len(self.content)
        if self.type == FileType.SYMLINK:
            return len(self.target)
        return 0

    @property
    def st_mode(self) -> int:
        return int(self.type) | (self.mode & 0o7777)

    def take_metadata(self, other: Inode) -> None:
        """Mode, owner, times and xattrs of ``other`` (a later layer's entry for this directory)."""
        self.mode, self.uid, self.gid = other.mode, other.uid, other.gid
        self.mtime_ns, self.atime_ns, self.ctime_ns = other.mtime_ns, other.atime_ns, other.ctime_ns
        self.xattrs = other.xattrs


def new_dir(mode: int = 0o755, mtime_ns: int = 0) -> Inode:
    return Inode(FileType.DIR, mode=mode, mtime_ns=mtime_ns)


def check_name(name: bytes, where: str) -> None:
    """Refuse names the kernel would refuse, naming the entry."""
    if not name or name in (b".", b".."):
        raise SourceError(f"{where}: invalid file name {name!r}")
    if len(name) > 255:
        raise SourceError(f"{where}: file name longer than 255 bytes: {name[:40]!r}...")
    if b"/" in name or b"\0" in name:
        raise SourceError(f"{where}: file name contains '/' or NUL: {name!r}")


def split_path(path: bytes | str) -> list[bytes]:
    """Image path -> components, resolved lexically inside the image root.

    ``..`` never climbs above ``/``; absolute and relative paths are the same.
    """
    raw = path.encode() if isinstance(path, str) else path
    parts: list[bytes] = []
    for comp in raw.split(b"/"):
        if comp in (b"", b"."):
            continue
        if comp == b"..":
            if parts:
                parts.pop()
            continue
        parts.append(comp)
    return parts


class Tree:
    """The merged tree. Later writes replace earlier ones (layers apply in order)."""

    def __init__(self, root: Inode | None = None) -> None:
        self.root = root if root is not None else new_dir()

    def lookup(self, path: bytes | str) -> Inode | None:
        node = self.root
        for comp in split_path(path):
            if node.type != FileType.DIR:
                return None
            child = node.entries.get(comp)
            if child is None:
                return None
            node = child
        return node

    def parent_dir(
        self, path: bytes | str, where: str, default_mtime_ns: int = 0
    ) -> tuple[Inode, bytes]:
        """The directory that holds ``path`` (created as 0755 dirs if missing) and the leaf name."""
        parts = split_path(path)
        if not parts:
            raise SourceError(f"{where}: the image root cannot be replaced by an entry")
        node = self.root
        for comp in parts[:-1]:
            check_name(comp, where)
            child = node.entries.get(comp)
            if child is None or child.type != FileType.DIR:
                # a missing parent, or a non-directory in the way: a directory wins (as tar -x does)
                child = new_dir(mtime_ns=default_mtime_ns)
                node.entries[comp] = child
            node = child
        check_name(parts[-1], where)
        return node, parts[-1]

    def put(self, path: bytes | str, inode: Inode, where: str) -> None:
        """Place ``inode`` at ``path``. An existing directory stays (its metadata is updated)."""
        parent, name = self.parent_dir(path, where, inode.mtime_ns)
        old = parent.entries.get(name)
        if old is not None and old.type == FileType.DIR and inode.type == FileType.DIR:
            old.take_metadata(inode)
            return
        parent.entries[name] = inode

    def walk(self) -> Iterator[tuple[bytes, Inode]]:
        """(path, inode) in sorted depth-first order; ``/`` first. Hardlinks appear once per name."""
        stack: list[tuple[bytes, Inode]] = [(b"/", self.root)]
        while stack:
            path, node = stack.pop()
            yield path, node
            if node.type == FileType.DIR:
                prefix = path if path.endswith(b"/") else path + b"/"
                for name in sorted(node.entries, reverse=True):
                    stack.append((prefix + name, node.entries[name]))
