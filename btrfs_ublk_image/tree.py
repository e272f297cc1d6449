"""The merged file tree: what every source writes into and the btrfs writer reads.

An ``Inode`` is one file object; a hardlink is the same ``Inode`` object under
several names. Names are ``bytes`` (Linux file names are bytes, not text).
Regular file content is either ``bytes`` (small, kept in memory, may become an
inline extent), a ``Blob``: deduplicated content already written to a pack, or
a ``Sparse``: a file with holes, its data runs Blobs at file offsets.

The tree is the one structure a build keeps for every entry until the image is
written, so its objects are compact (the build's peak memory is mostly these):
an ``Inode`` has slots only, one slot for whatever its type carries (content,
symlink target, directory entries or device number), no xattr dict when it has
none, type, mode, owner and xattrs in one (shared) tuple, the three timestamps in one bytes
object; a ``Blob`` is one int. Sources set small files' content aside in a file
(``Tree.set_content_aside``) rather than keep it in memory.
"""

from __future__ import annotations

import enum
import os
import stat
import struct
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from types import MappingProxyType

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

_NO_XATTRS: Mapping[bytes, bytes] = MappingProxyType({})

# (type, mode, uid, gid, xattrs or None) tuples, shared by every inode without xattrs that
# has the same values: an image has few distinct ones
_Meta = tuple[FileType, int, int, int, Mapping[bytes, bytes] | None]
_SHARED_META: dict[_Meta, _Meta] = {}
_SHARED_META_MAX = 1 << 16

# the three timestamps packed in one bytes object; None (same as mtime) as the sentinel.
# Values that do not fit (or equal the sentinel) are kept as a tuple instead.
_TIMES = struct.Struct("<qqq")
_NONE_TIME = -(1 << 63)
_Times = bytes | tuple[int, int | None, int | None]
SavedMetadata = tuple[_Meta, _Times]


def _meta(
    ftype: FileType, mode: int, uid: int, gid: int, xattrs: Mapping[bytes, bytes] | None
) -> _Meta:
    key = (ftype, mode, uid, gid, xattrs or None)
    if xattrs:
        return key  # a mapping is not hashable: not shared
    got = _SHARED_META.get(key)
    if got is not None:
        return got
    if len(_SHARED_META) < _SHARED_META_MAX:
        _SHARED_META[key] = key
    return key


def _pack_times(mtime_ns: int, atime_ns: int | None, ctime_ns: int | None) -> _Times:
    a = _NONE_TIME if atime_ns is None else atime_ns
    c = _NONE_TIME if ctime_ns is None else ctime_ns
    try:
        if _NONE_TIME not in (mtime_ns, atime_ns, ctime_ns):
            return _TIMES.pack(mtime_ns, a, c)
    except struct.error:
        pass
    return (mtime_ns, atime_ns, ctime_ns)


def _unpack_times(times: _Times) -> tuple[int, int | None, int | None]:
    if type(times) is tuple:
        return times
    m, a, c = _TIMES.unpack(times)  # type: ignore[arg-type]
    return m, None if a == _NONE_TIME else a, None if c == _NONE_TIME else c


# content up to this size stays in memory (a reference to set-aside content costs about this)
_ASIDE_MIN = 96
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

    def put(self, data: bytes) -> _SetAside:
        self._file.write(data)
        self._dirty = True
        at = self._end
        self._end += len(data)
        return _SetAside(self, at, len(data))

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


class _SetAside:
    """Content of ``size`` bytes at ``offset`` of an ``AsideFile``."""

    __slots__ = ("offset", "size", "store")

    def __init__(self, store: AsideFile, offset: int, size: int) -> None:
        self.store, self.offset, self.size = store, offset, size

    def read(self) -> bytes:
        return self.store.read(self.offset, self.size)


def _payload_default(ftype: FileType) -> object:
    if ftype is FileType.DIR:
        return {}
    if ftype is FileType.REG or ftype is FileType.SYMLINK:
        return b""
    return 0


class Inode:
    """One file object. ``content`` (regular files), ``target`` (symlinks), ``entries``
    (directories) and ``rdev`` (devices) share one slot: each reads as empty (or 0) on
    other types, and setting ``type`` resets it. ``xattrs`` reads as an empty mapping
    when there are none; set a new mapping to change them."""

    __slots__ = ("_meta", "_times", "_payload", "ino")

    def __init__(
        self,
        type: FileType,
        mode: int = 0o644,  # permission bits only (0o7777): setuid/setgid/sticky included
        uid: int = 0,
        gid: int = 0,
        mtime_ns: int = 0,
        atime_ns: int | None = None,  # None: same as mtime
        ctime_ns: int | None = None,  # None: same as mtime
        xattrs: Mapping[bytes, bytes] | None = None,
        rdev: int = 0,  # devices: os.makedev(major, minor)
        target: bytes = b"",  # symlinks
        content: Content = b"",  # regular files
        entries: dict[bytes, Inode] | None = None,  # directories
    ) -> None:
        self._meta = _meta(type, mode, uid, gid, xattrs)
        self._times = _pack_times(mtime_ns, atime_ns, ctime_ns)
        # the btrfs writer's scratch while it writes an image: a mark, or the inode number of
        # a directory or hardlinked file
        self.ino: object = 0
        if type is FileType.REG:
            self._payload: object = content
        elif type is FileType.DIR:
            self._payload = {} if entries is None else entries
        elif type is FileType.SYMLINK:
            self._payload = target
        elif type is FileType.CHR or type is FileType.BLK:
            self._payload = rdev
        else:
            self._payload = 0

    def __repr__(self) -> str:
        t, mode, uid, gid, _ = self._meta
        return f"Inode({t.name}, mode={mode:#o}, uid={uid}, gid={gid})"

    @property
    def type(self) -> FileType:
        return self._meta[0]

    @type.setter
    def type(self, value: FileType) -> None:
        _, mode, uid, gid, x = self._meta
        self._meta = _meta(value, mode, uid, gid, x)
        self._payload = _payload_default(value)

    @property
    def mode(self) -> int:
        return self._meta[1]

    @mode.setter
    def mode(self, value: int) -> None:
        t, _, uid, gid, x = self._meta
        self._meta = _meta(t, value, uid, gid, x)

    @property
    def uid(self) -> int:
        return self._meta[2]

    @uid.setter
    def uid(self, value: int) -> None:
        t, mode, _, gid, x = self._meta
        self._meta = _meta(t, mode, value, gid, x)

    @property
    def gid(self) -> int:
        return self._meta[3]

    @gid.setter
    def gid(self, value: int) -> None:
        t, mode, uid, _, x = self._meta
        self._meta = _meta(t, mode, uid, value, x)

    @property
    def mtime_ns(self) -> int:
        return _unpack_times(self._times)[0]

    @mtime_ns.setter
    def mtime_ns(self, value: int) -> None:
        _, a, c = _unpack_times(self._times)
        self._times = _pack_times(value, a, c)

    @property
    def atime_ns(self) -> int | None:
        return _unpack_times(self._times)[1]

    @atime_ns.setter
    def atime_ns(self, value: int | None) -> None:
        m, _, c = _unpack_times(self._times)
        self._times = _pack_times(m, value, c)

    @property
    def ctime_ns(self) -> int | None:
        return _unpack_times(self._times)[2]

    @ctime_ns.setter
    def ctime_ns(self, value: int | None) -> None:
        m, a, _ = _unpack_times(self._times)
        self._times = _pack_times(m, a, value)

    def meta(self) -> tuple[FileType, int, int, int, Mapping[bytes, bytes] | None]:
        """(type, mode, uid, gid, xattrs or None) in one go (the writer reads them all)."""
        return self._meta

    def times(self) -> tuple[int, int | None, int | None]:
        """(mtime_ns, atime_ns, ctime_ns) in one go."""
        return _unpack_times(self._times)

    @property
    def xattrs(self) -> Mapping[bytes, bytes]:
        x = self._meta[4]
        return _NO_XATTRS if x is None else x

    @xattrs.setter
    def xattrs(self, value: Mapping[bytes, bytes] | None) -> None:
        t, mode, uid, gid, _ = self._meta
        self._meta = _meta(t, mode, uid, gid, value)

    def _check(self, want: FileType, what: str) -> None:
        if self._meta[0] is not want:
            raise ValueError(f"a {self._meta[0].name} inode has no {what}")

    @property
    def content(self) -> Content:
        p = self._payload
        if self._meta[0] is not FileType.REG:
            return b""
        if type(p) is _SetAside:
            return p.read()
        return p  # type: ignore[return-value]

    @content.setter
    def content(self, value: Content) -> None:
        self._check(FileType.REG, "content")
        self._payload = value

    @property
    def target(self) -> bytes:
        p = self._payload
        return p if self._meta[0] is FileType.SYMLINK else b""  # type: ignore[return-value]

    @target.setter
    def target(self, value: bytes) -> None:
        self._check(FileType.SYMLINK, "target")
        self._payload = value

    @property
    def entries(self) -> dict[bytes, Inode]:
        p = self._payload
        return p if self._meta[0] is FileType.DIR else {}  # type: ignore[return-value]

    @entries.setter
    def entries(self, value: dict[bytes, Inode]) -> None:
        self._check(FileType.DIR, "entries")
        self._payload = value

    @property
    def rdev(self) -> int:
        t, p = self._meta[0], self._payload
        return p if t is FileType.CHR or t is FileType.BLK else 0  # type: ignore[return-value]

    @rdev.setter
    def rdev(self, value: int) -> None:
        t = self._meta[0]
        if t is not FileType.CHR and t is not FileType.BLK:
            raise ValueError(f"a {t.name} inode has no device number")
        self._payload = value

    @property
    def size(self) -> int:
        t, p = self._meta[0], self._payload
        if t is FileType.REG:
            return p.size if isinstance(p, Blob | _SetAside | Sparse) else len(p)  # type: ignore[arg-type]
        if t is FileType.SYMLINK:
            return len(p)  # type: ignore[arg-type]
        return 0

    @property
    def st_mode(self) -> int:
        t, mode = self._meta[0], self._meta[1]
        return int(t) | (mode & 0o7777)

    def set_content_aside(self, store: AsideFile) -> None:
        """Move in-memory content (worth moving) to ``store``; it reads back unchanged."""
        p = self._payload
        if self._meta[0] is FileType.REG and type(p) is bytes and len(p) > _ASIDE_MIN:
            self._payload = store.put(p)

    def saved_metadata(self) -> SavedMetadata:
        """What ``take_metadata`` replaces, for ``restore_metadata`` (a layer's placement
        undone)."""
        return self._meta, self._times

    def restore_metadata(self, saved: SavedMetadata) -> None:
        self._meta, self._times = saved

    def take_metadata(self, other: Inode) -> None:
        """Mode, owner, times and xattrs of ``other`` (a later layer's entry for this directory)."""
        _, mode, uid, gid, x = other._meta
        self._meta = _meta(self._meta[0], mode, uid, gid, x)
        self._times = other._times


def _clamped(times: _Times, limit_ns: int) -> _Times | None:
    """``times`` with none later than ``limit_ns``; None when none is."""
    if type(times) is bytes:
        m, a, c = _TIMES.unpack(times)  # the sentinel (None) is below any limit
        if m > limit_ns or a > limit_ns or c > limit_ns:
            return _TIMES.pack(min(m, limit_ns), min(a, limit_ns), min(c, limit_ns))
        return None
    m, a, c = times
    if not any(t is not None and t > limit_ns for t in (m, a, c)):
        return None
    return _pack_times(
        min(m, limit_ns),
        None if a is None else min(a, limit_ns),
        None if c is None else min(c, limit_ns),
    )


def clamp_tree_times(tree: Tree, limit_ns: int) -> None:
    """No timestamp in ``tree`` later than ``limit_ns`` (SOURCE_DATE_EPOCH clamping): the
    packed times read and rewritten in place, not through each inode's properties (a
    hard link's inode is seen once per name: clamping twice changes nothing)."""
    root = tree.root
    got = _clamped(root._times, limit_ns)
    if got is not None:
        root._times = got
    todo = [root] if root._meta[0] is FileType.DIR else []
    seen: set[int] = set()
    unpack, pack, directory = _TIMES.unpack, _TIMES.pack, FileType.DIR
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for child in node._payload.values():  # type: ignore[attr-defined]
            times = child._times
            if type(times) is bytes:  # nearly always: _clamped's first case, inline
                m, a, c = unpack(times)
                if m > limit_ns or a > limit_ns or c > limit_ns:
                    child._times = pack(min(m, limit_ns), min(a, limit_ns), min(c, limit_ns))
            else:
                got = _clamped(times, limit_ns)
                if got is not None:
                    child._times = got
            if child._meta[0] is directory:
                todo.append(child)


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
