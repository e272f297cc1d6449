"""The ``tar`` layer: a tarball streamed once, straight into the tree, never extracted.

Compression (none, gzip, zstd, xz, bzip2) is detected from the first bytes, not
the file name. The raw file passes through a hashing reader (the source digest
costs no second read), then a decompressor, then our forward-only tar reader
(``tarheader``: ustar, GNU long names and sparse files, PAX headers), which hands
each member's data straight to the pack writer.

With ``in_place: true`` (uncompressed tarballs only) the tarball itself becomes a
pack of the bundle (``packs.PackWriter.open_in_place``): the source reads the
bundle's copy (a reflink where possible), the same pass digests its pack chunks
beside the source digest, and each regular member's data is referenced at its
offset in the tarball instead of being written (GNU sparse members are still
copied: their data is not one contiguous range).

Strictness: a corrupt header, an archive that ends inside a member and a truncated
zstd stream (``zstandard``'s stream reader stops quietly) are errors; an archive that
ends at a member boundary without its end-of-archive marker is read with a warning
(as GNU tar and bsdtar read it). Sparse members keep their holes (``packs.put_sparse``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import struct
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, Protocol, cast

from btrfs_ublk_image import native
from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.hashing import BackgroundSha256
from btrfs_ublk_image.packs import InPlacePack, PackWriter
from btrfs_ublk_image.sources.base import WHITEOUT, Cancelled, LayerContext, SourceRecord
from btrfs_ublk_image.sources.globs import normalize, selector
from btrfs_ublk_image.sources.tarheader import (
    BLKTYPE,
    BLOCK,
    CHRTYPE,
    DIRTYPE,
    FIFOTYPE,
    LNKTYPE,
    READ_SIZE,
    SYMTYPE,
    HeaderProblem,
    Member,
    MemberError,
    SparseData,
    TarFormatError,
    TarReader,
    checksum_ok,
    is_regular_type,
)
from btrfs_ublk_image.tree import Blob, Content, FileType, Inode, split_path

if TYPE_CHECKING:  # a build's first tar layer is read while the spec's models import
    from btrfs_ublk_image.sources.gunzip import ThreadedGunzip
    from btrfs_ublk_image.spec import TarLayer

ZSTD_READ_SIZE = 1 << 14  # compressed bytes per decompress call: bounds a call's output
NO_OWNER = 0xFFFFFFFF  # (uid_t)-1 / (gid_t)-1
# the native reader's common members placed by the extension (``Placer``); False: all by
# ``_place_member``, the reference the tests compare it with
NATIVE_PLACE = True

# magic bytes -> compression name
_MAGICS: list[tuple[bytes, str]] = [
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"BZh", "bzip2"),
]
# recognised but unsupported: named in the error
_OTHER_MAGICS: list[tuple[bytes, str]] = [
    (b"\x04\x22\x4d\x18", "lz4"),
    (b"\x5d\x00\x00", "lzma (legacy .lzma)"),
    (b"\x89LZO", "lzop"),
    (b"\x1f\x9d", "compress (.Z)"),
    (b"PK\x03\x04", "zip"),
]


class _Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


def detect_compression(head: bytes) -> str | None:
    """'gzip', 'zstd', 'xz', 'bzip2', 'none' (a tar header or an empty archive), or None."""
    for magic, name in _MAGICS:
        if head.startswith(magic):
            return name
    if len(head) >= 4 and 0x50 <= head[0] <= 0x5F and head[1:4] == b"\x2a\x4d\x18":
        return "zstd"  # a skippable frame (magic 0x184D2A5?) first, e.g. pzstd's or seekable's
    if len(head) >= BLOCK:
        block = head[:BLOCK]
        if block == bytes(BLOCK) or checksum_ok(block):
            return "none"
    return None


class _HashingReader:
    """Reads the raw source file, hashing every byte once; can give back a peeked head."""

    mode = "rb"

    def __init__(self, f: _Readable, path: Path | str, chunk_size: int | None = None) -> None:
        self.f = f
        self.path = path
        # on the second core, while the main thread parses; with chunk_size (a tarball used
        # in place as a pack) its pack chunk digests too, in the same pass
        self.hash = BackgroundSha256(chunk_size=chunk_size)
        self.nbytes = 0
        self._head = b""

    def peek_head(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            piece = self._raw_read(n - len(data))
            if not piece:
                break
            data += piece
        self._head = data
        return data

    def _raw_read(self, n: int) -> bytes:
        try:
            data = self.f.read(n)
        except OSError as e:
            raise SourceError(f"{self.path}: read error: {e.strerror or e}") from None
        self.hash.update(data)
        self.nbytes += len(data)
        return data

    def read(self, n: int = -1) -> bytes:
        head = self._head
        if not head:
            return self._raw_read(n)
        if 0 <= n < len(head):
            self._head = head[n:]
            return head[:n]
        self._head = b""
        if n == len(head):
            return head
        return head + self._raw_read(-1 if n < 0 else n - len(head))

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        self._head = b""
        while self._raw_read(READ_SIZE):
            pass


class _ZstdReader:
    """zstd frames, one after another, with an error for a truncated last frame."""

    def __init__(self, raw: _Readable) -> None:
        import zstandard  # zstd layers only: its 11 MiB library is not loaded otherwise

        self.raw = raw
        self.dctx = zstandard.ZstdDecompressor()
        self.obj = self.dctx.decompressobj()
        self.in_frame = False
        self.buf = b""
        self.pos = 0
        self.eof = False

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = 1 << 62
        avail = len(self.buf) - self.pos
        if avail >= n:
            out = self.buf[self.pos : self.pos + n]
            self.pos += n
            return out
        pieces = [self.buf[self.pos :]] if avail else []
        have = avail
        self.buf, self.pos = b"", 0
        while have < n and not self.eof:
            data = self._more()
            if data:
                pieces.append(data)
                have += len(data)
        joined = b"".join(pieces)
        if len(joined) > n:
            self.buf, self.pos = joined, n
            return joined[:n]
        return joined

    def _more(self) -> bytes:
        if self.obj.eof:
            leftover = self.obj.unused_data
            self.obj = self.dctx.decompressobj()
            self.in_frame = False
            chunk = leftover
        else:
            chunk = b""
        if not chunk:
            chunk = self.raw.read(ZSTD_READ_SIZE)
        if not chunk:
            if self.in_frame:
                raise EOFError("zstd stream ended before the end of the frame")
            self.eof = True
            return b""
        self.in_frame = True
        data: bytes = self.obj.decompress(chunk)
        return data

    def readable(self) -> bool:
        return True


class _DigestStream:
    """Hashes what is read through it: the uncompressed layer (an OCI diff_id)."""

    def __init__(self, inner: _Readable) -> None:
        self.inner = inner
        self.hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read(n)
        self.hash.update(data)
        return data

    def hexdigest(self) -> str:
        return self.hash.hexdigest()

    def readable(self) -> bool:
        return True


def _decompressor(kind: str, raw: _HashingReader) -> tuple[_Readable, tuple[type[Exception], ...]]:
    """The reader of ``kind`` (not gzip) and what its library raises for corrupt data; each
    library is imported when its format is met (not at every start)."""
    if kind == "none":
        return raw, ()
    if kind == "zstd":
        import zstandard

        return _ZstdReader(raw), (zstandard.ZstdError,)
    if kind == "xz":
        import lzma

        return lzma.LZMAFile(cast(BinaryIO, raw), mode="rb"), (lzma.LZMAError,)
    if kind == "bzip2":
        import bz2

        return bz2.BZ2File(cast(BinaryIO, raw), mode="rb"), ()  # bz2 raises OSError
    raise AssertionError(kind)


# ---- members -> tree --------------------------------------------------------------------


def parse_pax_time(value: str) -> int:
    """A PAX time ("1700000000.123456789", "-1.5") as integer nanoseconds, exactly."""
    s = value.strip()
    neg = s.startswith("-")
    if neg or s.startswith("+"):
        s = s[1:]
    whole, _, frac = s.partition(".")
    if not (whole or frac) or not (whole or "0").isdigit() or not (frac or "0").isdigit():
        raise ValueError(f"invalid PAX time {value!r}")
    ns = int(whole or "0") * 1_000_000_000 + int((frac + "000000000")[:9])
    return -ns if neg else ns


# xattr namespaces the kernel stores on btrfs (and the two POSIX ACL names of "system.")
XATTR_PREFIXES = (b"user.", b"trusted.", b"security.")
XATTR_SYSTEM_NAMES = (b"system.posix_acl_access", b"system.posix_acl_default")
XATTR_NAME_MAX = 255


def xattr_name_problem(name: bytes) -> str | None:
    """Why setxattr(2) on btrfs would refuse ``name`` (GNU tar then warns and goes on),
    or None."""
    if b"\0" in name:
        return "a NUL byte in the name"
    if len(name) > XATTR_NAME_MAX:
        return f"a name longer than {XATTR_NAME_MAX} bytes"
    if name in XATTR_SYSTEM_NAMES:
        return None
    for prefix in XATTR_PREFIXES:
        if name.startswith(prefix):
            return None if len(name) > len(prefix) else "an empty name after the namespace"
    return "no namespace the kernel stores (user., trusted., security., system.posix_acl_*)"


def _xattrs(pax: Mapping[str, str]) -> dict[bytes, bytes]:
    """The xattrs PAX records name (SCHILY.xattr.*, LIBARCHIVE.xattr.*), names unchecked."""
    out: dict[bytes, bytes] = {}
    for key, value in pax.items():
        if key.startswith("SCHILY.xattr."):
            name = key[13:].encode("utf-8", "surrogateescape")
            data = value.encode("utf-8", "surrogateescape")
        elif key.startswith("LIBARCHIVE.xattr."):
            name = urllib.parse.unquote_to_bytes(key[17:])
            raw = value.encode("ascii", "surrogateescape").strip()
            try:
                data = base64.b64decode(raw + b"=" * (-len(raw) % 4), validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"invalid base64 in PAX header {key}") from None
            if name in out:  # SCHILY.xattr.NAME of the same name wins
                continue
        else:
            continue
        out[name] = data
    return out


def _valid_xattrs(
    xattrs: dict[bytes, bytes], warn: Callable[[str], None], where: str
) -> dict[bytes, bytes]:
    """``xattrs`` without the names setxattr(2) would refuse, each skipped with a warning."""
    out: dict[bytes, bytes] = {}
    for name, data in xattrs.items():
        problem = xattr_name_problem(name)
        if problem is not None:
            warn(f"{where}: xattr {name!r} skipped: {problem}")
            continue
        out[name] = data
    return out


# POSIX ACLs as btrfs keeps them: the system.posix_acl_* xattr (linux/posix_acl_xattr.h)
ACL_XATTR_VERSION = 2
_ACL_TAGS = {"user": 0x02, "group": 0x08, "mask": 0x10, "other": 0x20}  # named USER/GROUP
_ACL_OBJ = {"user": 0x01, "group": 0x04}  # USER_OBJ, GROUP_OBJ (empty qualifier)
_ACL_NO_ID = 0xFFFFFFFF
_ACL_RECORDS = (
    ("SCHILY.acl.access", b"system.posix_acl_access"),
    ("SCHILY.acl.default", b"system.posix_acl_default"),
)


def parse_text_acl(text: str) -> list[tuple[int, int, int]]:
    """A text ACL as GNU tar (one entry a line) and star/bsdtar (comma separated, the
    numeric id appended as a 4th field) write it -> (tag, perm, id) entries in the order
    the kernel requires; ValueError says why it is not one. Named qualifiers need the
    numeric id: resolving a name on the build host would make the image depend on it."""
    entries: list[tuple[int, int, int]] = []
    for raw in text.replace("\n", ",").split(","):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        fields = entry.split(":")
        if len(fields) not in (3, 4):
            raise ValueError(f"invalid ACL entry {entry!r}")
        tag_name, qualifier, perms = fields[0], fields[1], fields[2]
        tag_name = {"u": "user", "g": "group", "m": "mask", "o": "other"}.get(tag_name, tag_name)
        if tag_name not in _ACL_TAGS or len(perms) != 3:
            raise ValueError(f"invalid ACL entry {entry!r}")
        perm = 0
        for char, want, bit in zip(perms, "rwx", (4, 2, 1), strict=True):
            if char == want:
                perm |= bit
            elif char != "-":
                raise ValueError(f"invalid ACL permissions in {entry!r}")
        ident = fields[3] if len(fields) == 4 else qualifier
        if tag_name in _ACL_OBJ and not qualifier:
            entries.append((_ACL_OBJ[tag_name], perm, _ACL_NO_ID))
        elif tag_name in ("mask", "other"):
            if qualifier:
                raise ValueError(f"invalid ACL entry {entry!r}")
            entries.append((_ACL_TAGS[tag_name], perm, _ACL_NO_ID))
        elif ident.isdigit() and int(ident) < _ACL_NO_ID:
            entries.append((_ACL_TAGS[tag_name], perm, int(ident)))
        else:
            raise ValueError(f"ACL entry {entry!r} names {qualifier!r} without its numeric id")
    entries.sort(key=lambda e: (e[0], e[2]))
    tags = [tag for tag, _, _ in entries]
    keys = [(tag, ident) for tag, _, ident in entries]
    if len(set(keys)) != len(keys):
        raise ValueError("an ACL entry repeats")
    if tags.count(0x01) != 1 or tags.count(0x04) != 1 or tags.count(0x20) != 1:
        raise ValueError("an ACL needs one user::, group:: and other:: entry")
    if (0x02 in tags or 0x08 in tags) and 0x10 not in tags:
        raise ValueError("an ACL with named entries needs a mask:: entry")
    return entries


def _acls(
    pax: Mapping[str, str],
    mode: int,
    xattrs: dict[bytes, bytes],
    is_dir: bool,
    warn: Callable[[str], None],
    where: str,
) -> int:
    """The PAX ACL records into ``xattrs``, as setting them through the kernel would:
    an access ACL sets the mode's permission bits (owner, mask or group, other) and is
    no xattr when those bits say it all; a default ACL only on a directory. Returns the
    mode. An ACL that is not one is skipped with a warning (GNU tar warns and goes on)."""
    for key, name in _ACL_RECORDS:
        text = pax.get(key)
        if text is None:
            continue
        if name == b"system.posix_acl_default" and not is_dir:
            warn(f"{where}: {key} skipped: a default ACL on a non-directory")
            continue
        try:
            entries = parse_text_acl(text)
        except ValueError as e:
            warn(f"{where}: {key} skipped: {e}")
            continue
        if not entries and name == b"system.posix_acl_default":
            continue
        if name == b"system.posix_acl_access":
            perm = {tag: p for tag, p, _ in entries}
            group = perm.get(0x10, perm[0x04])
            mode = (mode & ~0o777) | perm[0x01] << 6 | group << 3 | perm[0x20]
            if len(entries) == 3:  # user::, group::, other:: only: the mode is the ACL
                xattrs.pop(name, None)
                continue
        xattrs[name] = struct.pack("<I", ACL_XATTR_VERSION) + b"".join(
            struct.pack("<HHI", tag, p, ident) for tag, p, ident in entries
        )
    return mode


def _fail(tar_path: Path | str, member: str | None, msg: str) -> SourceError:
    at = f": member {member!r}" if member is not None else ""
    return SourceError(f"{tar_path}{at}: {msg}")


class TarFields(Protocol):
    """A tar layer's options as ``apply_source`` reads them: ``spec.TarSource``'s fields
    (``early.EarlyRead`` gives them from the spec's YAML before the models are imported)."""

    @property
    def path(self) -> str: ...
    @property
    def dest(self) -> str: ...
    @property
    def include(self) -> list[str] | None: ...
    @property
    def exclude(self) -> list[str]: ...
    @property
    def uid(self) -> int | None: ...
    @property
    def gid(self) -> int | None: ...
    @property
    def sha256(self) -> str | None: ...
    @property
    def strip_components(self) -> int: ...
    @property
    def in_place(self) -> bool: ...


def apply(layer: TarLayer, ctx: LayerContext) -> SourceRecord:
    return apply_source(layer.tar, ctx)


def apply_source(src: TarFields, ctx: LayerContext) -> SourceRecord:
    """A tar layer with the options ``src`` applied to ``ctx``'s tree."""
    tar_path = ctx.resolve(src.path)
    try:
        f = open(tar_path, "rb")  # noqa: SIM115 - closed below; open errors get their own message
    except OSError as e:
        raise SourceError(f"{tar_path}: cannot open tarball: {e.strerror or e}") from None
    opts = TarOptions(
        rename=_renamer(src.dest, src.strip_components),
        keep=selector(src.include, src.exclude),
        uid=src.uid,
        gid=src.gid,
    )
    with f:
        if src.in_place:
            kind = _in_place_kind(f, tar_path)
            if kind == "none":
                pack = ctx.packs.open_in_place(str(tar_path))
                opts = opts._replace(in_place=pack)
                digest = read_tar(pack, tar_path, ctx, opts).raw
            else:  # not a tar archive at all: read_tar says what it is
                digest = read_tar(f, tar_path, ctx, opts).raw
        else:
            digest = read_tar(f, tar_path, ctx, opts).raw
    if src.sha256 is not None:
        want = src.sha256.removeprefix("sha256:")
        if digest != "sha256:" + want:
            raise SourceError(
                f"{tar_path}: sha256 mismatch: the spec pins {want}, the file is {digest[7:]}"
            )
    return SourceRecord(kind="tar", path=src.path, sha256=digest)


def _in_place_kind(f: _Readable, tar_path: Path | str) -> str | None:
    """The compression of a tarball wanted in place; refused unless it is none (a pack must
    hold the content bytes as they are). Rewinds ``f``."""
    try:
        head = f.read(BLOCK)
        cast(BinaryIO, f).seek(0)
    except OSError as e:
        raise SourceError(f"{tar_path}: read error: {e.strerror or e}") from None
    kind = detect_compression(head)
    if kind is not None and kind != "none":
        raise SourceError(
            f"{tar_path}: in_place needs an uncompressed tarball, this one is"
            f" {kind}-compressed (decompress it first, or drop in_place)"
        )
    return kind


Renamer = Callable[[bytes], "bytes | None"]


class TarOptions(NamedTuple):
    """How members become image entries (a NamedTuple: early.py)."""

    rename: Renamer | None = None  # member name -> image path; None result: skip the member
    keep: Callable[[bytes], bool] | None = None  # on the normalized image path: keep it?
    uid: int | None = None  # owner overrides
    gid: int | None = None
    whiteouts: bool = False  # OCI layer: .wh.NAME and .wh..wh..opq entries hide lower layers
    diff_id: bool = False  # hash the uncompressed stream too
    # accept a stream that ends after the last member's data, without padding or the
    # end-of-archive blocks (umoci 0.4's `insert` writes such layers; Go's reader takes
    # them). Only for OCI layers, whose diff_id proves the stream is what its author wrote.
    lenient_end: bool = False
    # the tarball read is this in-place pack (uncompressed): regular members are referenced
    in_place: InPlacePack | None = None


class TarDigests(NamedTuple):
    """A tarball's digests (a NamedTuple: early.py)."""

    raw: str  # sha256:<hex> of the bytes as stored
    uncompressed: str  # sha256:<hex> of the tar stream (== raw when not compressed)
    compression: str  # "none", "gzip", ...


def _renamer(dest: str, strip: int) -> Renamer | None:
    """Member name -> image path (``dest``, ``strip_components``); None: keep names as they are."""
    prefix = b"/".join(split_path(dest))
    if not prefix and not strip:
        return None

    def rename(name: bytes) -> bytes | None:
        parts = split_path(name)
        if strip:
            if len(parts) <= strip:
                return None
            parts = parts[strip:]
        return prefix + b"/" + b"/".join(parts)

    return rename


def read_tar(
    f: _Readable, tar_path: Path | str, ctx: LayerContext, opts: TarOptions | None = None
) -> TarDigests:
    """Stream the tarball ``f`` into ``ctx.tree``; returns the digests of what was read.

    ``tar_path`` names the archive in errors.
    """
    opts = opts or TarOptions()
    done = _read_native(f, tar_path, ctx, opts)
    if done is not None:
        return done
    in_place = opts.in_place
    raw = _HashingReader(f, tar_path, None if in_place is None else ctx.packs.chunk_size)
    head = raw.peek_head(BLOCK)
    kind = detect_compression(head)
    if kind is None:
        if not head:
            raise _fail(tar_path, None, "empty file, not a tar archive")
        for magic, name in _OTHER_MAGICS:
            if head.startswith(magic):
                raise _fail(tar_path, None, f"unsupported compression: {name}")
        raise _fail(
            tar_path,
            None,
            f"unknown compression or not a tar archive (first bytes: {head[:8].hex(' ')})",
        )
    if in_place is not None and kind != "none":  # apply() checks first: a changed file
        raise _fail(tar_path, None, f"in_place needs an uncompressed tarball, this is {kind}")
    reader: TarReader | None = None
    diff: _DigestStream | ThreadedGunzip | None = None
    gunzip: ThreadedGunzip | None = None
    corrupt: tuple[type[Exception], ...] = (TarFormatError, EOFError, OSError)
    read_whole = False
    try:
        if kind == "gzip":  # inflated and hashed (raw and inflated) on a worker thread
            # (imported here: the native reader inflates the layers it reads itself)
            from btrfs_ublk_image.sources.gunzip import InflateError, ThreadedGunzip

            corrupt += (InflateError,)
            raw.hash.hash_inline()
            gunzip = ThreadedGunzip(raw, digest=opts.diff_id)
            stream: _Readable = gunzip
            if opts.diff_id:
                diff = gunzip
        else:
            stream, more = _decompressor(kind, raw)
            corrupt += more
            if opts.diff_id and kind != "none":
                stream = diff = _DigestStream(stream)
        reader = TarReader(stream, lambda msg: ctx.warn(f"{tar_path}: {msg}"))
        _read_members(reader, tar_path, ctx, opts)
        # validate the compressed stream's end and hash every remaining byte
        while stream.read(READ_SIZE):
            pass
        raw.drain()
        read_whole = True
    except SourceError:
        raise
    except MemberError as e:
        raise _fail(tar_path, e.name, str(e)) from None
    except corrupt as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise  # a system error (the pack's disk is full, ...), not a problem of the archive
        what = "corrupt or truncated archive"
        if kind != "none":
            what += f" ({kind})"
        last = reader.last_name if reader is not None else None
        at = f" at or after member {last!r}" if last is not None else ""
        raise _fail(tar_path, None, f"{what}{at}: {e}") from None
    except (ValueError, OverflowError) as e:
        raise _fail(tar_path, reader.last_name if reader is not None else None, str(e)) from None
    finally:
        if gunzip is not None:
            gunzip.close()
        if not read_whole:
            raw.hash.abandon()  # its thread would wait on its queue until the process exits
    raw_digest = "sha256:" + raw.hash.hexdigest()
    if in_place is not None:
        in_place.complete(raw.hash.chunk_digests(), raw.nbytes)
    uncompressed = raw_digest if diff is None else "sha256:" + diff.hexdigest()
    return TarDigests(raw_digest, uncompressed, kind)


# a member as the native reader hands it over (``btrfs_ublk_native.Members``): name, type,
# mode, uid, gid, mtime_ns, atime_ns, ctime_ns, xattrs, linkname, devmajor, devminor,
# content (None, inline bytes or (crc32c, size, pack, offset))
NativeMember = tuple[
    bytes,
    bytes,
    int,
    int,
    int,
    int,
    "int | None",
    "int | None",
    "dict[bytes, bytes] | None",
    bytes,
    int,
    int,
    "bytes | tuple[int, int, int, int] | None",
]


def _read_native(
    f: _Readable, tar_path: Path | str, ctx: LayerContext, opts: TarOptions
) -> TarDigests | None:
    """The layer read by the native reader (``btrfs_ublk_image.native``); None where it
    does not apply (no native pack, a tarball in place, renames or filters, not a plain
    file) or hands the archive back (the Python reader then reads it all)."""
    prehash = native.take_prehash(tar_path)  # the tarball's digest, begun at start-up
    try:
        return _read_native_with(f, tar_path, ctx, opts, prehash)
    finally:
        if prehash is not None:
            prehash.close()  # unused (or taken over: then a no-op)


def _read_native_with(
    f: _Readable, tar_path: Path | str, ctx: LayerContext, opts: TarOptions, prehash: Any
) -> TarDigests | None:
    core = ctx.packs.core
    nat = native.module()
    if core is None or nat is None or opts.in_place is not None:
        return None
    if opts.rename is not None or opts.keep is not None or type(f) is not io.BufferedReader:
        return None
    try:
        if f.tell() != 0:
            return None
        fd = f.fileno()
    except (OSError, ValueError):
        return None

    def place_one(member: NativeMember) -> None:
        name, t, mode, uid, gid, mtime, atime, ctime, xattrs, link, major, minor, data = member
        _place_member(
            ctx,
            opts,
            tar_path,
            name.decode("utf-8", "surrogateescape"),
            t,
            link.decode("utf-8", "surrogateescape"),
            mode,
            uid,
            gid,
            major,
            minor,
            (mtime, atime, ctime, xattrs, None),  # ACL records: the Python reader's
            Blob(*data) if isinstance(data, tuple) else (data or b""),
        )

    def place_all(members: Iterable[NativeMember]) -> None:
        for member in members:
            place_one(member)

    # the common member (a plain file, directory or symlink new in the directory placed
    # last) placed by the extension itself; every other one by ``place_one``, in order
    placer: Callable[[Iterable[NativeMember]], None] = place_all
    if NATIVE_PLACE and hasattr(nat, "Placer"):
        placer = nat.Placer(ctx, opts.uid, opts.gid, opts.whiteouts, place_one).place

    def place(members: Iterable[NativeMember]) -> None:
        if ctx.cancelled:  # the read stops here (its pack writes are the caller's to drop)
            raise Cancelled(f"{tar_path}: read cancelled")
        placer(members)

    # members are placed while the native side still reads (its threads leave part of the
    # second core idle); should it hand the archive back, the Python reader places them again
    if prehash is not None:
        _check_prehashed(prehash, fd, tar_path)
    ctx.begin_undoable()
    try:
        raw, unc, kind, _, content_bytes = nat.read_tar(
            core,
            fd,
            0,
            None,
            ctx.packs.keep_inline,
            opts.whiteouts,
            opts.diff_id,
            opts.lenient_end,
            place,
            prehash=prehash,
        )
        if prehash is not None:
            _check_prehashed(prehash, fd, tar_path)
    except nat.Unsupported as e:
        ctx.undo()
        if prehash is not None:  # a file changed under the read is no archive to reread
            _check_prehashed(prehash, fd, tar_path)
        native.fallbacks.append(f"{tar_path}: {e}")
        return None
    except BaseException:
        ctx.commit()  # the warnings before the error
        raise
    ctx.commit()
    if ctx.progress is not None:
        ctx.progress.add_bytes(content_bytes)
    return TarDigests("sha256:" + raw, "sha256:" + unc, kind)


def _check_prehashed(prehash: Any, fd: int, tar_path: Path | str) -> None:
    """The file read is the one whose digest began at start-up, unchanged since (checked
    before and after the read: the digest is of both reads' bytes)."""
    if not prehash.same_file(fd):
        raise SourceError(
            f"{tar_path}: changed while the build read it (its device, inode, size or mtime"
            " differ from when its sha256 began)"
        )


def _read_members(
    reader: TarReader, tar_path: Path | str, ctx: LayerContext, opts: TarOptions
) -> None:
    in_place = opts.in_place
    last: str | None = None
    while True:
        if ctx.cancelled:
            raise Cancelled(f"{tar_path}: read cancelled")
        try:
            m = reader.next()
        except HeaderProblem as e:  # where a member's first header should be
            if e.kind == "end":
                return
            if e.kind == "empty":  # the stream ends at a member boundary
                if not opts.lenient_end:  # OCI layers: umoci writes them so, nothing to say
                    after = f" after member {last!r}" if last is not None else ""
                    ctx.warn(
                        f"{tar_path}: no end-of-archive marker: the archive ends{after} at a"
                        " member boundary (read as complete, as GNU tar and bsdtar do)"
                    )
                return
            if last is None:
                raise TarFormatError(str(e)) from None
            if e.kind == "truncated":
                msg = "truncated archive: it ends inside a header"
            else:
                msg = f"corrupt archive: invalid header ({e})"
            raise _fail(tar_path, None, f"{msg} after member {last!r}") from None
        except MemberError:
            raise
        except TarFormatError as e:
            if last is None:
                raise
            if opts.lenient_end and str(e) == "unexpected end of data":
                return  # the stream ends right after the last member's (complete) data
            if str(e) == "unexpected end of data":
                raise _fail(
                    tar_path,
                    None,
                    f"corrupt or truncated archive after member {last!r}: {e} (the archive"
                    " ends inside that member's data or padding)",
                ) from None
            raise _fail(
                tar_path, None, f"corrupt or truncated archive after member {last!r}: {e}"
            ) from None
        name = m.name
        last = reader.last_name = name
        _place_member(
            ctx,
            opts,
            tar_path,
            name,
            m.type,
            m.linkname,
            m.mode,
            m.uid,
            m.gid,
            m.devmajor,
            m.devminor,
            partial(_pax_meta, m),
            partial(_read_content, reader, m, ctx.packs, in_place),
        )


# (mtime_ns, atime_ns, ctime_ns, xattrs as the archive names them, the PAX records when
# they hold an ACL)
Meta = tuple[
    int, "int | None", "int | None", "dict[bytes, bytes] | None", "Mapping[str, str] | None"
]


def _pax_meta(m: Member) -> Meta:
    """A member's times, xattrs and ACL records: its PAX records, else its header."""
    pax = m.pax
    if not pax:
        return m.mtime * 1_000_000_000, None, None, None, None
    mt = pax.get("mtime")
    mtime = parse_pax_time(mt) if mt is not None else m.mtime * 10**9
    at = pax.get("atime")
    atime = parse_pax_time(at) if at is not None else None
    ct = pax.get("ctime")
    ctime = parse_pax_time(ct) if ct is not None else None
    acls = pax if any(key in pax for key, _ in _ACL_RECORDS) else None
    return mtime, atime, ctime, _xattrs(pax), acls


def _read_content(
    reader: TarReader, m: Member, packs: PackWriter, in_place: InPlacePack | None, where: str
) -> Content:
    """A regular member's data, packed (or kept inline)."""
    if m.sparse is not None:
        return packs.put_sparse(SparseData(reader, m), m.size, m.sparse, where)
    if in_place is not None:  # the data lies in the pack at its tarball offset
        return packs.put_in_place(in_place, cast(BinaryIO, reader), m.data_start, m.size, where)
    return packs.put_stream(cast(BinaryIO, reader), m.size, where)


def _place_member(
    ctx: LayerContext,
    opts: TarOptions,
    tar_path: Path | str,
    name: str,
    t: bytes,
    linkname: str,
    mode: int,
    uid: int,
    gid: int,
    devmajor: int,
    devminor: int,
    meta: Meta | Callable[[], Meta],
    content_of: Content | Callable[[str], Content],
) -> None:
    """One member into the tree (both readers: the Python one and the native one)."""
    progress = ctx.progress
    bname = name.encode("utf-8", "surrogateescape")
    rename, keep = opts.rename, opts.keep
    if rename is not None:
        renamed = rename(bname)
        if renamed is None:
            if progress is not None:
                progress.add_file()
            return
        bname = renamed
    if keep is not None and not keep(normalize(bname)):
        if progress is not None:
            progress.add_file()
        return
    if opts.whiteouts and bname[bname.rfind(b"/") + 1 :].startswith(WHITEOUT):
        ctx.whiteout(bname, f"{tar_path}: member {name!r}")
        if progress is not None:
            progress.add_file()
        return
    if t == LNKTYPE:
        target: bytes | None = linkname.encode("utf-8", "surrogateescape")
        if rename is not None and target is not None:
            target = rename(target)
        if target is not None and keep is not None and not keep(normalize(target)):
            raise _fail(
                tar_path,
                name,
                f"hard link to {linkname!r}, which include/exclude leave out",
            )
        linked = ctx.lookup(target) if target is not None else None
        if linked is None:
            raise _fail(tar_path, name, f"hard link to {linkname!r}, which is not in the image")
        if linked.type == FileType.DIR:
            raise _fail(tar_path, name, f"hard link to directory {linkname!r}")
        ctx.place(bname, linked, f"{tar_path}: member {name!r}")
        if progress is not None:
            progress.add_file()
        return
    regular = is_regular_type(t)
    symlink = b""
    rdev = 0
    if regular:
        ftype = FileType.REG
    elif t == DIRTYPE:
        ftype = FileType.DIR
    elif t == SYMTYPE:
        ftype = FileType.SYMLINK
        symlink = linkname.encode("utf-8", "surrogateescape")
    elif t == CHRTYPE:
        ftype = FileType.CHR
        rdev = os.makedev(devmajor, devminor)
    elif t == BLKTYPE:
        ftype = FileType.BLK
        rdev = os.makedev(devmajor, devminor)
    elif t == FIFOTYPE:
        ftype = FileType.FIFO
    else:  # pragma: no cover - the reader resolves every other type
        raise _fail(tar_path, name, f"unsupported member type {t!r}")
    own_uid, own_gid = opts.uid, opts.gid
    # (uid_t)-1 is "leave unchanged" to chown(2): GNU tar, run as root, leaves root's 0
    uid = (0 if uid == NO_OWNER else uid) if own_uid is None else own_uid
    gid = (0 if gid == NO_OWNER else gid) if own_gid is None else own_gid
    if not (0 <= uid <= 0xFFFFFFFF and 0 <= gid <= 0xFFFFFFFF):
        raise _fail(tar_path, name, f"owner {uid}:{gid} out of range")
    where = f"{tar_path}: member {name!r}"
    # a symlink's mode is always 0777 on Linux (symlink(2) ignores the umask and the mode)
    mode = 0o777 if t == SYMTYPE else mode & 0o7777
    try:
        mtime, atime, ctime, named, acls = meta if isinstance(meta, tuple) else meta()
        xattrs = None if named is None else _valid_xattrs(named, ctx.warn, where)
        if acls is not None and t != SYMTYPE:
            xattrs = {} if xattrs is None else xattrs
            mode = _acls(acls, mode, xattrs, ftype == FileType.DIR, ctx.warn, where)
    except ValueError as e:
        raise _fail(tar_path, name, str(e)) from None
    content: Content = b""
    if regular:
        content = content_of(where) if callable(content_of) else content_of
    inode = Inode(
        ftype,
        mode=mode,
        uid=uid,
        gid=gid,
        mtime_ns=mtime,
        atime_ns=atime,
        ctime_ns=ctime,
        xattrs=xattrs,
        rdev=rdev,
        target=symlink,
        content=content,
    )
    ctx.place(bname, inode, where)
    if progress is not None:
        progress.add_file()
