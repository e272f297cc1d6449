"""The ``dir`` layer: a local directory tree, read once, file by file, never followed.

The directory's CONTENTS go under ``dest`` (the directory itself is not an entry, as
with ``COPY dir/ /dest``: the image's ``dest`` keeps its own metadata). Every entry
keeps its type, mode, owner, mtime (nanoseconds), xattrs and device number; hard
links inside the tree stay hard links (same device and inode -> one image inode);
symlinks are copied as symlinks, never followed. Regular files stream into the pack
in buffer-sized pieces (never whole in memory); a file whose size changes while it is
read is an error. Entries are visited in sorted byte order, so the result does not
depend on the order ``readdir`` happens to return.

The source digest is sha256 over a canonical listing (path, type, mode, owner, mtime,
xattrs, target / device / content digest of every entry): the same tree gives the same
digest wherever it lives.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from typing import TYPE_CHECKING

from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.sources.base import LayerContext, SourceRecord
from btrfs_ublk_image.sources.globs import selector
from btrfs_ublk_image.tree import Blob, FileType, Inode, split_path

if TYPE_CHECKING:
    from btrfs_ublk_image.spec import DirLayer

_TYPES = {
    stat.S_IFREG: FileType.REG,
    stat.S_IFDIR: FileType.DIR,
    stat.S_IFLNK: FileType.SYMLINK,
    stat.S_IFCHR: FileType.CHR,
    stat.S_IFBLK: FileType.BLK,
    stat.S_IFIFO: FileType.FIFO,
    stat.S_IFSOCK: FileType.SOCK,
}


def _xattrs(path: bytes, where: str) -> dict[bytes, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENODATA):  # the filesystem has none
            return {}
        raise SourceError(f"{where}: cannot list xattrs: {e.strerror or e}") from None
    out: dict[bytes, bytes] = {}
    for name in sorted(names):
        try:
            out[os.fsencode(name)] = os.getxattr(path, name, follow_symlinks=False)
        except OSError as e:
            if e.errno == errno.ENODATA:  # removed meanwhile
                continue
            raise SourceError(f"{where}: cannot read xattr {name}: {e.strerror or e}") from None
    return out


def _read_file(path: bytes, st: os.stat_result, packs: PackWriter, where: str) -> bytes | Blob:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as e:
        raise SourceError(f"{where}: cannot open: {e.strerror or e}") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        now = os.fstat(f.fileno())
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
            raise SourceError(f"{where}: replaced while the build read it")
        try:
            content = packs.put_stream(f, st.st_size, where)
        except OSError as e:
            if e.errno != errno.EIO:
                raise  # not a read error of this file (the pack's disk is full, ...)
            raise SourceError(f"{where}: read error: {e.strerror or e}") from None
        except SourceError as e:
            raise SourceError(f"{where}: changed while the build read it ({e})") from None
        if f.read(1):
            raise SourceError(f"{where}: grew while the build read it")
    return content


def apply(layer: DirLayer, ctx: LayerContext) -> SourceRecord:
    src = layer.dir
    root = ctx.resolve(src.path)
    root_b = os.fsencode(root)
    try:
        st = os.stat(root_b)
    except OSError as e:
        raise SourceError(f"{root}: cannot read directory: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SourceError(f"{root}: not a directory")
    keep = selector(src.include, src.exclude)
    dest = split_path(src.dest)
    dest_path = b"/" + b"/".join(dest)
    listing = hashlib.sha256()
    # (st_dev, st_ino) -> (image inode, first path) of files with several links
    hardlinks: dict[tuple[int, int], tuple[Inode, bytes]] = {}
    ctx.ensure_dir(src.dest, f"{root}: dest {src.dest}")
    packs, progress, place = ctx.packs, ctx.progress, ctx.place
    # (host path, path relative to the source dir) of directories still to read
    todo: list[tuple[bytes, bytes]] = [(root_b, b"")]
    while todo:
        host_dir, rel_dir = todo.pop()
        try:
            with os.scandir(host_dir) as it:
                names = sorted(e.name for e in it)
        except OSError as e:
            raise SourceError(
                f"{os.fsdecode(host_dir)}: cannot read directory: {e.strerror or e}"
            ) from None
        subdirs: list[tuple[bytes, bytes]] = []
        for name in names:
            host = host_dir + b"/" + name
            rel = rel_dir + b"/" + name
            where = f"{root}: {os.fsdecode(rel[1:])}"
            image_path = dest_path.rstrip(b"/") + rel
            if keep is not None and not keep(image_path):
                continue
            try:
                st = os.lstat(host)
            except OSError as e:
                raise SourceError(f"{where}: cannot stat: {e.strerror or e}") from None
            ftype = _TYPES.get(stat.S_IFMT(st.st_mode))
            if ftype is None:
                raise SourceError(f"{where}: unsupported file type {stat.S_IFMT(st.st_mode):o}")
            linked = None
            if ftype != FileType.DIR and st.st_nlink > 1:
                linked = hardlinks.get((st.st_dev, st.st_ino))
            if linked is not None:
                listing.update(b"L\0" + rel + b"\0" + linked[1] + b"\n")
                place(image_path, linked[0], where)
                if progress is not None:
                    progress.add_file()
                continue
            inode = Inode(ftype, mode=stat.S_IMODE(st.st_mode))
            inode.uid = st.st_uid if src.uid is None else src.uid
            inode.gid = st.st_gid if src.gid is None else src.gid
            inode.mtime_ns = st.st_mtime_ns
            inode.xattrs = _xattrs(host, where)
            detail = b""
            if ftype == FileType.REG:
                inode.content = _read_file(host, st, packs, where)
                c = inode.content
                # packed content is identified by its CRC-32C and size (hashed once, while packed)
                detail = (
                    b"%08x:%d" % (c.crc32c, c.size)
                    if isinstance(c, Blob)
                    else hashlib.sha256(c).digest()
                )
            elif ftype == FileType.SYMLINK:
                try:
                    inode.target = os.readlink(host)
                except OSError as e:
                    raise SourceError(f"{where}: cannot read symlink: {e.strerror or e}") from None
                detail = inode.target
            elif ftype in (FileType.CHR, FileType.BLK):
                inode.rdev = st.st_rdev
                detail = str(st.st_rdev).encode()
            elif ftype == FileType.DIR:
                subdirs.append((host, rel))
            if ftype != FileType.DIR and st.st_nlink > 1:
                hardlinks[(st.st_dev, st.st_ino)] = (inode, rel)
            listing.update(
                b"%s\0%o\0%d:%d\0%d\0" % (rel, inode.st_mode, inode.uid, inode.gid, inode.mtime_ns)
                + b"".join(k + b"=" + v.hex().encode() + b";" for k, v in inode.xattrs.items())
                + b"\0"
                + detail
                + b"\n"
            )
            place(image_path, inode, where)
            if progress is not None:
                progress.add_file()
        todo.extend(reversed(subdirs))
    return SourceRecord(kind="dir", path=src.path, sha256="sha256:" + listing.hexdigest())
