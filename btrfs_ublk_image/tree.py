"""The merged file tree: what every source writes into and the btrfs writer reads.

An ``Inode`` is one file object; a hardlink is the same ``Inode`` object under
several names. Names are ``bytes`` (Linux file names are bytes, not text).
Regular file content is either ``bytes`` (small, kept in memory, may become an
inline extent), a ``Blob``: deduplicated content already written to a pack, or
a ``Sparse``: a file with holes, its data runs Blobs at file offsets.

The tree is the one structure a build keeps for every entry until the image is
written, so its objects are compact (the build's peak memory is mostly these):
``Inode`` is the extension's class (``native/src/inode.rs``: the tree needs the
extension even with ``BUI_NATIVE=0``), its type, mode, owner and times held as
machine integers, one payload for whatever its type carries (content, symlink
target, directory entries or device number; a Blob as its four fields), no xattr
mapping when it has none; a ``Blob`` is one int. A file the native tar placer places
is no object until Python code reads its entry: its fields stay in its directory's
``Entries``, and the ``Inode`` made then is the one every later access gives. A
directory's ``Entries`` keep their names in the extension too, not as a ``bytes``
object and a dict slot each. Sources set small files' content aside in a file
(``Tree.set_content_aside``) rather than keep it in memory.
"""

from __future__ import annotations

import enum
import os
import stat
import tempfile
import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from types import MappingProxyType

from btrfs_ublk_native import Entries as _NativeEntries
from btrfs_ublk_native import Inode as Inode
from btrfs_ublk_native import clamp_tree_times as _clamp_tree_times

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


_CRC_BITS = 32
_SIZE_BITS = 64
_PACK_BITS = 24


class Blob(int):
    """Content stored in a pack: ``size`` bytes at ``offset`` of pack number ``pack``,
    with ``crc32c`` the CRC-32C of the content (a deduplication key; matches are
    compared bytewise).

    The four fields live in one int (an image has one ``Blob`` per distinct content:
    one object of 48 bytes instead of a record plus four int objects). Two blobs are
    equal when all four fields are; a ``Blob`` is always true.
    """

    __slots__ = ()

    def __new__(cls, crc32c: int, size: int, pack: int, offset: int) -> Blob:
        if not (
            0 <= crc32c < 1 << _CRC_BITS
            and 0 <= size < 1 << _SIZE_BITS
            and 0 <= pack < 1 << _PACK_BITS
            and offset >= 0
        ):
            raise ValueError(f"blob field out of range: {crc32c=} {size=} {pack=} {offset=}")
        packed = ((offset << _PACK_BITS | pack) << _SIZE_BITS | size) << _CRC_BITS | crc32c
        return super().__new__(cls, packed)

    @property
    def crc32c(self) -> int:
        return self & ((1 << _CRC_BITS) - 1)

    @property
    def size(self) -> int:
        return (self >> _CRC_BITS) & ((1 << _SIZE_BITS) - 1)

    @property
    def pack(self) -> int:
        return (self >> (_CRC_BITS + _SIZE_BITS)) & ((1 << _PACK_BITS) - 1)

    @property
    def offset(self) -> int:
        return self >> (_CRC_BITS + _SIZE_BITS + _PACK_BITS)

    def __reduce__(self) -> tuple[type[Blob], tuple[int, int, int, int]]:  # copy and pickle
        return Blob, (self.crc32c, self.size, self.pack, self.offset)

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return (
            f"Blob(crc32c={self.crc32c:#010x}, size={self.size}, pack={self.pack},"
            f" offset={self.offset})"
        )

    __str__ = __repr__


class Sparse:
    """A file with holes: ``size`` bytes, zeros but for its data ``segments``, each
    (file offset, Blob) with the offset a multiple of the btrfs sector size and no two
    overlapping (a segment's last sector is zero-padded). Holes cost no pack byte and no
    extent: the image has file extents only for the segments (``NO_HOLES``)."""

    __slots__ = ("segments", "size")

    def __init__(self, size: int, segments: tuple[tuple[int, Blob], ...]) -> None:
        self.size = size
        self.segments = segments

    def __repr__(self) -> str:
        return f"Sparse(size={self.size}, segments={self.segments!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Sparse)
            and self.size == other.size
            and self.segments == other.segments
        )

    def __hash__(self) -> int:
        return hash((self.size, self.segments))


Content = bytes | Blob | Sparse


class Entries(_NativeEntries, MutableMapping[bytes, Inode]):
    """A directory's entries, name -> ``Inode``, in the order they were added (a name set
    again keeps its place). The names and children are held by the extension
    (``native/src/entries.rs``): a name's ``bytes`` object is made only when Python code
    reads it. ``MutableMapping`` adds the rest of a mapping's methods."""

    __slots__ = ()


_NO_XATTRS: Mapping[bytes, bytes] = MappingProxyType({})  # what ``Inode.xattrs`` reads as

# (type, mode, uid, gid, xattrs or None, (mtime_ns, atime_ns, ctime_ns)) of an inode
SavedMetadata = tuple[
    FileType, int, int, int, Mapping[bytes, bytes] | None, tuple[int, int | None, int | None]
]

# the set-aside file's write buffer: a write(2) per few small files released the GIL each
# time, and the parsing thread then waited to get it back from the inflate/hash threads
_ASIDE_BUFFER = 1 << 20


class AsideFile:
    """Small file content set aside in an unnamed file until the writer reads it back:
    a build would otherwise keep every small file's bytes in memory to the end."""

    def __init__(self, directory: str) -> None:
        # lives with the tree
        self._file = tempfile.TemporaryFile(dir=directory, buffering=_ASIDE_BUFFER)  # noqa: SIM115
        weakref.finalize(self, self._file.close)  # closed (and gone) with the tree
        self._end = 0
        self._dirty = False

    def put(self, data: bytes) -> int:
        """Append ``data``; where it starts."""
        self._file.write(data)
        self._dirty = True
        at = self._end
        self._end += len(data)
        return at

    def fileno(self) -> int:
        """The file's descriptor, everything put so far written to it (the native fs tree
        loop reads the contents back itself)."""
        if self._dirty:
            self._file.flush()
            self._dirty = False
        return self._file.fileno()

    def read(self, offset: int, size: int) -> bytes:
        if self._dirty:
            self._file.flush()
            self._dirty = False
        data = os.pread(self._file.fileno(), size, offset)
        if len(data) != size:
            raise OSError(f"set-aside content: short read at {offset}")
        return data


def clamp_tree_times(tree: Tree, limit_ns: int) -> None:
    """No timestamp in ``tree`` later than ``limit_ns`` (SOURCE_DATE_EPOCH clamping); a
    hard link's inode is clamped once."""
    _clamp_tree_times(tree.root, limit_ns)


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
    comps = raw.split(b"/")
    if b".." not in comps:  # nearly always: no component to climb back from
        return [comp for comp in comps if comp and comp != b"."]
    parts: list[bytes] = []
    for comp in comps:
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
        self._aside: AsideFile | None = None

    def set_content_aside(self, inode: Inode, directory: str) -> None:
        """Keep ``inode``'s small in-memory content in this tree's side file (an unnamed
        file in ``directory``, made on first use) instead of in memory."""
        if self._aside is None:
            self._aside = AsideFile(directory)
        inode.set_content_aside(self._aside)

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
