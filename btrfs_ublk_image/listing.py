"""Listings: one line per path of an image, stable and sorted (format: docs/listing-format.md).

A listing comes from a bundle (read by ``reader.BundleReader``, no root, no
mount), from a directory tree (for example the bundle mounted by the kernel), or
from a listing file; ``diff`` compares any two of them.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from btrfs_ublk_image.errors import ImageError

FORMAT_VERSION = 1
HEADER = f"#btrfs-ublk-image listing {FORMAT_VERSION}"

TYPES = {
    stat.S_IFREG: "file",
    stat.S_IFDIR: "dir",
    stat.S_IFLNK: "symlink",
    stat.S_IFCHR: "char",
    stat.S_IFBLK: "block",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
}
# the order of the fields in a line; xattrs (xattr.NAME=HEX, sorted by name) come last
FIELDS = ("type", "mode", "uid", "gid", "size", "mtime", "sha256", "target", "rdev", "link")


# --- escaping: bytes outside printable ASCII, space, '\', '=' and '#' become \ooo ---------
def _needs_escape(b: int) -> bool:
    return b <= 0x20 or b >= 0x7F or b in (0x5C, 0x3D, 0x23)


_ESCAPE = [f"\\{b:03o}" if _needs_escape(b) else chr(b) for b in range(256)]


_PLAIN = re.compile(rb"[\x21-\x22\x24-\x3c\x3e-\x5b\x5d-\x7e]*")


def escape(raw: bytes) -> str:
    if _PLAIN.fullmatch(raw):  # the common case: nothing to escape
        return raw.decode("ascii")
    return "".join(_ESCAPE[b] for b in raw)


def unescape(text: str, where: str = "listing") -> bytes:
    out = bytearray()
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            digits = text[i + 1 : i + 4]
            if len(digits) != 3 or any(ch not in "01234567" for ch in digits):
                raise ImageError(f"{where}: bad escape {text[i : i + 4]!r}")
            out.append(int(digits, 8) & 0xFF)
            i += 4
        else:
            out += c.encode("utf-8", "surrogateescape")
            i += 1
    return bytes(out)


def sort_key(path: bytes) -> list[bytes]:
    """Paths sort component by component (byte order), so a directory precedes its contents."""
    return path.split(b"/")


@dataclass(frozen=True, slots=True)
class Entry:
    """One path of an image, with what a listing records about it."""

    path: bytes  # absolute, "/" for the root
    type: str  # a value of TYPES
    mode: int  # permission bits (0o7777)
    uid: int
    gid: int
    mtime_ns: int
    size: int | None = None  # regular files
    sha256: str | None = None  # regular files: hex
    target: bytes | None = None  # symlinks
    rdev: tuple[int, int] | None = None  # char and block devices: (major, minor)
    link: bytes | None = None  # hardlinks (non-directories with several names): the first path
    xattrs: tuple[tuple[bytes, bytes], ...] = ()  # sorted by name

    def fields(self) -> dict[str, str]:
        """field -> value as written in a listing line, in line order."""
        out = {
            "type": self.type,
            "mode": f"{self.mode:04o}",
            "uid": str(self.uid),
            "gid": str(self.gid),
        }
        if self.size is not None:
            out["size"] = str(self.size)
        out["mtime"] = str(self.mtime_ns)
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        if self.target is not None:
            out["target"] = escape(self.target)
        if self.rdev is not None:
            out["rdev"] = f"{self.rdev[0]},{self.rdev[1]}"
        if self.link is not None:
            out["link"] = escape(self.link)
        for name, value in self.xattrs:
            out["xattr." + escape(name)] = value.hex()
        return out

    def line(self) -> str:
        return " ".join([escape(self.path), *(f"{k}={v}" for k, v in self.fields().items())])


def format_listing(entries: Iterable[Entry]) -> str:
    lines = [HEADER]
    lines.extend(e.line() for e in sorted(entries, key=lambda e: sort_key(e.path)))
    return "\n".join(lines) + "\n"


def _link_groups(entries: list[Entry], ident: dict[bytes, object]) -> list[Entry]:
    """Set ``link`` = the first path (in listing order) on every path sharing an inode."""
    groups: dict[object, list[bytes]] = {}
    for path, key in ident.items():
        groups.setdefault(key, []).append(path)
    first: dict[bytes, bytes] = {}
    for paths in groups.values():
        if len(paths) > 1:
            head = min(paths, key=sort_key)
            for p in paths:
                first[p] = head
    return [replace(e, link=first[e.path]) if e.path in first else e for e in entries]


# --- from a bundle ----------------------------------------------------------------------------
def from_bundle(bundle: str, under: bytes = b"/") -> list[Entry]:
    """The listing of a bundle (or of the subtree at ``under``), read without mounting it."""
    from btrfs_ublk_image.reader import BundleReader, kernel_rdev_split

    under = b"/" + under.strip(b"/") if under.strip(b"/") else b"/"
    entries: list[Entry] = []
    ident: dict[bytes, object] = {}
    digests: dict[int, str] = {}
    with BundleReader(bundle) as r:
        for path, node in r.walk():
            if under != b"/" and path != under and not path.startswith(under + b"/"):
                continue
            it = node.item
            kind = TYPES.get(stat.S_IFMT(it.mode))
            if kind is None:
                raise ImageError(f"{bundle}: {path!r}: unknown file type in mode {it.mode:o}")
            size = sha = target = rdev = None
            if kind == "file":
                size = it.size
                if it.ino not in digests:
                    digests[it.ino] = r.sha256(node)
                sha = digests[it.ino]
            elif kind == "symlink":
                target = r.read(node)
            elif kind in ("char", "block"):
                rdev = kernel_rdev_split(it.rdev)
            if kind != "dir" and (it.nlink > 1 or len(node.refs) > 1):
                ident[path] = it.ino
            entries.append(
                Entry(
                    path=path,
                    type=kind,
                    mode=stat.S_IMODE(it.mode),
                    uid=it.uid,
                    gid=it.gid,
                    mtime_ns=it.mtime_ns,
                    size=size,
                    sha256=sha,
                    target=target,
                    rdev=rdev,
                    xattrs=tuple(sorted(node.xattrs.items())),
                )
            )
    return _link_groups(entries, ident)


# --- from a directory tree (e.g. a mounted image) ---------------------------------------------
def from_directory(root: str) -> list[Entry]:
    """The listing of the tree under ``root`` as the running kernel shows it (does not cross mounts)."""
    root_b = os.fsencode(root)
    try:
        dev = os.lstat(root_b).st_dev
    except OSError as e:
        raise ImageError(f"{root}: {e.strerror}") from None
    entries: list[Entry] = []
    ident: dict[bytes, object] = {}

    def visit(full: bytes, path: bytes) -> Iterator[tuple[bytes, bytes]]:
        st = os.lstat(full)
        kind = TYPES[stat.S_IFMT(st.st_mode)]
        size = sha = target = rdev = None
        if kind == "file":
            size = st.st_size
            h = hashlib.sha256()
            with open(full, "rb") as f:
                while piece := f.read(1 << 20):
                    h.update(piece)
            sha = h.hexdigest()
        elif kind == "symlink":
            target = os.readlink(full)
        elif kind in ("char", "block"):
            rdev = (os.major(st.st_rdev), os.minor(st.st_rdev))
        if kind != "dir" and st.st_nlink > 1:
            ident[path] = (st.st_dev, st.st_ino)
        xattrs = []
        for xname in os.listxattr(full, follow_symlinks=False):
            value = os.getxattr(full, xname, follow_symlinks=False)
            xattrs.append((os.fsencode(xname), value))
        entries.append(
            Entry(
                path=path,
                type=kind,
                mode=stat.S_IMODE(st.st_mode),
                uid=st.st_uid,
                gid=st.st_gid,
                mtime_ns=st.st_mtime_ns,
                size=size,
                sha256=sha,
                target=target,
                rdev=rdev,
                xattrs=tuple(sorted(xattrs)),
            )
        )
        if kind == "dir" and (st.st_dev == dev):
            for name in sorted(os.listdir(full)):
                yield os.path.join(full, name), (path.rstrip(b"/") + b"/" + name)

    stack = [(root_b, b"/")]
    while stack:
        full, path = stack.pop()
        stack.extend(reversed(list(visit(full, path))))
    return _link_groups(entries, ident)


# --- from a listing file ----------------------------------------------------------------------
def parse_listing(text: str, where: str = "listing") -> list[Entry]:
    entries: list[Entry] = []
    seen: set[bytes] = set()
    header = False
    for lineno, line in enumerate(text.splitlines(), 1):
        loc = f"{where}:{lineno}"
        if not line.strip():
            continue
        if not header:
            if line.strip() != HEADER:
                raise ImageError(f"{loc}: not a listing: the first line must be {HEADER!r}")
            header = True
            continue
        if line.startswith("#"):
            continue
        parts = line.split(" ")
        path = unescape(parts[0], loc)
        if not path.startswith(b"/"):
            raise ImageError(f"{loc}: path {parts[0]!r} is not absolute")
        if path in seen:
            raise ImageError(f"{loc}: {parts[0]} listed twice")
        seen.add(path)
        fields: dict[str, str] = {}
        for part in parts[1:]:
            key, eq, value = part.partition("=")
            if not eq or key in fields:
                raise ImageError(f"{loc}: bad field {part!r}")
            fields[key] = value
        entries.append(_entry_from_fields(path, fields, loc))
    if not header:
        raise ImageError(f"{where}: empty, not a listing")
    return entries


def _entry_from_fields(path: bytes, f: dict[str, str], loc: str) -> Entry:
    try:
        xattrs = tuple(
            sorted(
                (unescape(k[len("xattr.") :], loc), bytes.fromhex(v))
                for k, v in f.items()
                if k.startswith("xattr.")
            )
        )
        unknown = [k for k in f if k not in FIELDS and not k.startswith("xattr.")]
        if unknown:
            raise ImageError(f"{loc}: unknown field {unknown[0]!r}")
        for k in ("type", "mode", "uid", "gid", "mtime"):
            if k not in f:
                raise ImageError(f"{loc}: field {k!r} missing")
        if f["type"] not in TYPES.values():
            raise ImageError(f"{loc}: unknown type {f['type']!r}")
        rdev = None
        if "rdev" in f:
            major, _, minor = f["rdev"].partition(",")
            rdev = (int(major), int(minor))
        return Entry(
            path=path,
            type=f["type"],
            mode=int(f["mode"], 8),
            uid=int(f["uid"]),
            gid=int(f["gid"]),
            mtime_ns=int(f["mtime"]),
            size=int(f["size"]) if "size" in f else None,
            sha256=f.get("sha256"),
            target=unescape(f["target"], loc) if "target" in f else None,
            rdev=rdev,
            link=unescape(f["link"], loc) if "link" in f else None,
            xattrs=xattrs,
        )
    except ValueError as e:
        raise ImageError(f"{loc}: bad value: {e}") from None


# --- any source --------------------------------------------------------------------------------
def load(source: str) -> list[Entry]:
    """A bundle directory (has manifest.json), a listing file, or any other directory (walked)."""
    if os.path.isdir(source):
        if os.path.exists(os.path.join(source, "manifest.json")):
            return from_bundle(source)
        return from_directory(source)
    try:
        with open(source, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    except OSError as e:
        raise ImageError(f"{source}: cannot read: {e.strerror}") from None
    return parse_listing(text, source)


def diff(a: Iterable[Entry], b: Iterable[Entry]) -> list[str]:
    """Lines naming every difference: ``- PATH`` (only in A), ``+ PATH`` (only in B),
    ``~ PATH FIELD: A-VALUE -> B-VALUE`` (a field differs or is missing on one side: ``-``)."""
    da = {e.path: e for e in a}
    db = {e.path: e for e in b}
    out: list[str] = []
    for path in sorted(da.keys() | db.keys(), key=sort_key):
        ea, eb = da.get(path), db.get(path)
        if eb is None:
            out.append(f"- {escape(path)}")
        elif ea is None:
            out.append(f"+ {escape(path)}")
        else:
            fa, fb = ea.fields(), eb.fields()
            keys = list(fa) + [k for k in fb if k not in fa]
            for k in keys:
                va, vb = fa.get(k, "-"), fb.get(k, "-")
                if va != vb:
                    out.append(f"~ {escape(path)} {k}: {va} -> {vb}")
    return out


# --- ls -l ---------------------------------------------------------------------------------------
def _time(ns: int) -> str:
    sec, nsec = divmod(ns, 1_000_000_000)
    try:
        when = datetime.datetime.fromtimestamp(sec, tz=datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return f"@{sec}.{nsec:09d}"
    return f"{when:%Y-%m-%d %H:%M:%S}.{nsec:09d}"


def ls_lines(bundle: str, path: str = "/", recursive: bool = False) -> list[str]:
    """``ls -l`` (``-R``) of a path of the bundle: mode, links, uid, gid, size, mtime (UTC), name."""
    from btrfs_ublk_image.reader import BundleReader, Inode, kernel_rdev_split

    def line(r: BundleReader, node: Inode, name: bytes) -> str:
        it = node.item
        if stat.S_ISCHR(it.mode) or stat.S_ISBLK(it.mode):
            major, minor = kernel_rdev_split(it.rdev)
            size = f"{major}, {minor}"
        else:
            size = str(it.size)
        text = f"{stat.filemode(it.mode)} {it.nlink} {it.uid} {it.gid} {size} {_time(it.mtime_ns)} {escape(name)}"
        if stat.S_ISLNK(it.mode):
            text += " -> " + escape(r.read(node))
        return text

    out: list[str] = []
    raw = os.fsencode(path)
    with BundleReader(bundle) as r:
        node = r.lookup(raw)
        if not node.is_dir:
            return [line(r, node, raw)]
        stack = [(b"/" + raw.strip(b"/"), node)]
        while stack:
            dpath, dnode = stack.pop()
            children = [
                (e.name, r.child(dnode, e)) for e in sorted(dnode.entries, key=lambda e: e.name)
            ]
            if recursive:
                if out:
                    out.append("")
                out.append(escape(dpath) + ":")
            out.extend(line(r, child, name) for name, child in children)
            if recursive:
                prefix = dpath.rstrip(b"/") + b"/"
                stack.extend(reversed([(prefix + n, c) for n, c in children if c.is_dir]))
    return out
