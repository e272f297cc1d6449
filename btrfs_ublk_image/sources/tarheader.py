"""A forward-only tar reader: ustar, GNU and PAX headers parsed from a stream read once.

Replaces Python's ``tarfile``, whose per-member overhead (objects, regexes, seeks)
dominated the build of archives with many small files. What it reads:

* ustar/V7 headers (name + prefix, octal or GNU base-256 numbers, the checksum as
  unsigned or old-style signed byte sum);
* GNU long names and link targets ('L', 'K'), GNU old sparse files ('S' with
  extension blocks);
* PAX extended ('x', 'X') and global ('g') headers, incl. GNU sparse 0.0, 0.1 and 1.0.

The meaning of every field follows GNU tar's extraction (docs/sources.md lists the
rules; tests/test_tar_fidelity.py checks them against GNU tar): the last of each kind
of extension header wins ('L', 'K', 'x' whole), PAX records over 'L'/'K'; the ustar
prefix only under the POSIX magic; 'g' and 'V' are not members, 'D' is a directory;
every member's data is skipped but a hard link's; unknown member types are regular
files (with a warning). Stricter where it would silently misread hostile input: a PAX
record whose length does not end at its newline, an extension header over
``MAX_EXTENSION`` bytes, a negative size, an invalid number in a PAX size/uid/gid
record, a sparse map that is unsorted, overlapping or larger than the stored data are
errors.

Errors: ``HeaderProblem`` where a member's first header should be (the caller decides:
the end of the archive, or an error); ``TarFormatError`` for a broken archive;
``MemberError`` for a problem of one member (it carries the member's name).
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Callable
from typing import Protocol

BLOCK = 512
READ_SIZE = 1 << 20
LARGE_READ = 64 << 10  # reads this large may come back short (and uncopied)
MAX_EXTENSION = 16 << 20  # a long name or PAX header larger than this is refused
MAX_CHAIN = 64  # extension headers in a row before a member's own header

REGTYPE = b"0"
AREGTYPE = b"\0"
LNKTYPE = b"1"
SYMTYPE = b"2"
CHRTYPE = b"3"
BLKTYPE = b"4"
DIRTYPE = b"5"
FIFOTYPE = b"6"
CONTTYPE = b"7"
GNU_LONGNAME = b"L"
GNU_LONGLINK = b"K"
GNU_SPARSE = b"S"
PAX_HEADER = b"x"
PAX_GLOBAL = b"g"
SOLARIS_PAX_HEADER = b"X"
VOLHDR = b"V"  # GNU volume label
GNU_DUMPDIR = b"D"  # GNU incremental (-G): a directory, its data the names it held

REGULAR_TYPES = frozenset((REGTYPE, AREGTYPE, CONTTYPE, GNU_SPARSE))
# types with a meaning of their own; any other type is a regular file (as tarfile does)
SUPPORTED_TYPES = REGULAR_TYPES | {
    LNKTYPE,
    SYMTYPE,
    DIRTYPE,
    FIFOTYPE,
    CHRTYPE,
    BLKTYPE,
    GNU_DUMPDIR,
}
_EXTENSION_TYPES = (PAX_HEADER, SOLARIS_PAX_HEADER, GNU_LONGNAME, GNU_LONGLINK)
_POSIX_MAGIC = b"ustar\0"  # GNU's is "ustar  \0" (magic and version)
_DEV_TYPES = (CHRTYPE, BLKTYPE)
_HDR = struct.Struct("100s8s8s8s12s12s8sc100s6s2s32s32s8s8s155s")
_ZERO_BLOCK = bytes(BLOCK)
_NUL_TO_SPACE = bytes.maketrans(b"\0", b" ")
_SPARSE00 = re.compile(rb"\d+ GNU.sparse.(offset|numbytes)=(\d+)\n")


class _Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class TarFormatError(Exception):
    """The archive is malformed (the message says how and, where it can, at which header)."""


class HeaderProblem(TarFormatError):
    """No valid header where a member should start: ``kind`` is "end" (a zero block:
    the end-of-archive marker), "empty" (the stream ends), "truncated" (it ends inside
    the block) or "invalid" (bad checksum, bad number, negative size)."""

    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind


class MemberError(TarFormatError):
    """A problem of one member, named by its (already known) name."""

    def __init__(self, name: str, msg: str) -> None:
        super().__init__(msg)
        self.name = name


class Member:
    """One archive member, its extension headers applied."""

    __slots__ = (
        "name",
        "type",
        "mode",
        "uid",
        "gid",
        "size",
        "mtime",
        "linkname",
        "devmajor",
        "devminor",
        "pax",
        "sparse",
        "data_start",
    )

    def __init__(
        self,
        name: str,
        type: bytes,
        mode: int,
        uid: int,
        gid: int,
        size: int,
        mtime: int,
        linkname: str,
        data_start: int,
    ) -> None:
        self.name = name
        self.type = type
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.size = size  # content size (a sparse file: its full size, holes included)
        self.mtime = mtime  # whole seconds from the header (PAX times are in ``pax``)
        self.linkname = linkname
        self.devmajor = 0
        self.devminor = 0
        self.pax: dict[str, str] | None = None  # PAX records (extended + global), if any
        self.sparse: list[tuple[int, int]] | None = None  # (offset, length) data segments
        self.data_start = data_start  # stream offset of the member's data

    @property
    def is_regular(self) -> bool:
        return is_regular_type(self.type)


def is_regular_type(t: bytes) -> bool:
    """A regular file's typeflag: its data follows the header (unknown types included)."""
    return t in REGULAR_TYPES or t not in SUPPORTED_TYPES


def nti(field: bytes) -> int:
    """A numeric header field: octal (NUL/space padded) or GNU base-256."""
    first = field[0]
    if first == 0o200 or first == 0o377:  # GNU base-256
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if first == 0o377 else n
    p = field.find(b"\0")
    if p != -1:
        field = field[:p]
    try:
        return int(field.strip() or b"0", 8)
    except ValueError:
        raise HeaderProblem("invalid", "invalid header") from None


def checksum_ok(block: bytes) -> bool:
    """The header checksum, as unsigned or (old Sun/NeXT tars) signed byte sum."""
    try:
        chk = nti(block[148:156])
    except HeaderProblem:
        return False
    field = block[148:156]
    unsigned = 256 + sum(block) - sum(field)
    if chk == unsigned:
        return True
    high = sum(1 for b in block if b >= 128) - sum(1 for b in field if b >= 128)
    return chk == unsigned - 256 * high


def _block_sum(block: bytes) -> int:
    """The sum of a header block's bytes, computed in C: adler32's low half is 1 + the
    byte sum modulo 65521, and 256 bytes sum to at most 65280 (``sum(block)`` iterates
    in Python, four times slower: a few microseconds of every member)."""
    return (zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2


def _nts(s: bytes) -> str:
    p = s.find(b"\0")
    if p != -1:
        s = s[:p]
    return s.decode("utf-8", "surrogateescape")


def _block(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def parse_pax_records(payload: bytes, into: dict[str, str]) -> None:
    """PAX records ``"%d %s=%s\\n"`` (length, keyword, value) into ``into``; strict.

    Trailing NUL bytes are tolerated; any other byte that is not a whole record is an
    error (``tarfile`` silently stops reading records there).
    """
    pos = 0
    end = len(payload)
    while pos < end:
        sp = payload.find(b" ", pos, pos + 21)
        if sp == -1 or sp == pos:
            if not payload[pos:].strip(b"\0"):
                return
            raise TarFormatError(f"invalid PAX record at byte {pos}: no length")
        digits = payload[pos:sp]
        if not digits.isdigit():
            raise TarFormatError(f"invalid PAX record at byte {pos}: length {digits[:20]!r}")
        rec_end = pos + int(digits)
        if rec_end > end or rec_end <= sp + 2 or payload[rec_end - 1] != 0x0A:
            raise TarFormatError(
                f"invalid PAX record at byte {pos}: its length ({int(digits)})"
                " does not end at its newline"
            )
        eq = payload.find(b"=", sp + 1, rec_end - 1)
        if eq <= sp + 1:
            raise TarFormatError(f"invalid PAX record at byte {pos}: no keyword")
        value = payload[eq + 1 : rec_end - 1]
        into[payload[sp + 1 : eq].decode("utf-8", "surrogateescape")] = value.decode(
            "utf-8", "surrogateescape"
        )
        pos = rec_end


def _pax_int(m: Member, key: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise MemberError(m.name, f"invalid number in PAX record {key}: {value[:40]!r}") from None
    if n < 0 and key in ("size", "GNU.sparse.size", "GNU.sparse.realsize"):
        raise MemberError(m.name, f"negative size in PAX record {key}: {n}")
    return n


def _apply_pax(m: Member, pax: dict[str, str], stored: int) -> int:
    """The PAX records that replace header fields; returns the member's stored data size
    (``size``: the data in the archive; a sparse file's own size comes from its map's
    records). ``GNU.sparse.name`` wins over ``path`` whatever their order (GNU tar)."""
    for key, value in pax.items():
        if key == "path":
            if "GNU.sparse.name" not in pax:
                m.name = value.rstrip("/")
        elif key == "linkpath":
            m.linkname = value
        elif key == "size":
            stored = _pax_int(m, key, value)
            if m.sparse is None:
                m.size = stored
        elif key == "uid":
            m.uid = _pax_int(m, key, value)
        elif key == "gid":
            m.gid = _pax_int(m, key, value)
        elif key == "GNU.sparse.name":
            m.name = value
    m.pax = pax
    return stored


def _parse_pax(payload: bytes, into: dict[str, str], start: int) -> None:
    try:
        parse_pax_records(payload, into)
    except TarFormatError as e:
        raise TarFormatError(f"PAX header at byte {start}: {e}") from None


def _ignore(_msg: str) -> None:
    pass


class TarReader:
    """Members of a tar stream, in order; ``read`` gives the current member's data."""

    def __init__(self, raw: _Readable, warn: Callable[[str], None] = _ignore) -> None:
        self.raw = raw
        self.warn = warn  # what is read differently from the archive's word, or skipped
        self._buf = b""
        self._off = 0  # read position in _buf
        self.pos = 0  # stream offset of _buf[_off]
        self._next_header = 0  # stream offset of the next member's first header
        self.last_name: str | None = None  # the member being read (the caller's, for errors)
        self.globals: dict[str, str] = {}  # PAX global records ('g')

    # ---- bytes ----

    def _take(self, n: int) -> bytes:
        """Up to ``n`` bytes (fewer only at the end of the stream)."""
        buf, off = self._buf, self._off
        end = off + n
        if end <= len(buf):
            self._off = end
            self.pos += n
            return buf[off:end]
        parts = [buf[off:]] if off < len(buf) else []
        need = n - (len(buf) - off)
        self._buf, self._off = b"", 0
        raw = self.raw
        while need > 0:
            chunk = raw.read(max(need, READ_SIZE))
            if not chunk:
                break
            if len(chunk) <= need:
                parts.append(chunk)
                need -= len(chunk)
            else:
                parts.append(chunk[:need])
                self._buf, self._off = chunk, need
                need = 0
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        self.pos += len(out)
        return out

    def read(self, n: int = -1, /) -> bytes:
        """Up to ``n`` stream bytes (the caller reads at most the current member's data):
        exactly ``n`` for small reads, possibly fewer (but some) for large ones."""
        if n < 0:
            raise ValueError("TarReader.read needs a size")
        avail = len(self._buf) - self._off
        if n <= avail or n < LARGE_READ:
            return self._take(n)
        # a large member's data: what is buffered, or one raw read, without copying
        if avail:
            out = self._buf[self._off :] if self._off else self._buf
            self._buf, self._off = b"", 0
        else:
            out = self.raw.read(n)
        self.pos += len(out)
        return out

    def _skip(self, n: int) -> int:
        """Skip ``n`` bytes; returns how many were there."""
        avail = len(self._buf) - self._off
        if n <= avail:
            self._off += n
            self.pos += n
            return n
        done = avail
        self._buf, self._off = b"", 0
        while done < n:
            chunk = self.raw.read(READ_SIZE)
            if not chunk:
                break
            if done + len(chunk) <= n:
                done += len(chunk)
            else:
                self._buf, self._off = chunk, n - done
                done = n
        self.pos += done
        return done

    # ---- headers ----

    def next(self) -> Member:
        """The next member. Raises ``HeaderProblem`` where its first header should be
        (kind "end": the end-of-archive marker), ``TarFormatError`` after it."""
        skip = self._next_header - self.pos
        if skip > 0 and self._skip(skip) != skip:
            raise TarFormatError("unexpected end of data")
        return self._member()

    def _member(self) -> Member:
        """A member's header with the extension headers before it ('x', 'L', 'K'; 'g'
        and 'V' stand alone) applied: the last of each kind wins (as GNU tar and Go)."""
        long_name: str | None = None
        long_link: str | None = None
        pax: dict[str, str] | None = None  # the records of this member's last 'x' header
        pax_payload = b""
        ext_start = -1  # stream offset of the first extension header of this member
        chain = 0
        typ = b""
        while True:
            start = self.pos
            block = self._take(BLOCK)
            if len(block) != BLOCK or block == _ZERO_BLOCK:
                if len(block) == BLOCK:
                    kind, msg = "end", "end of file header"
                elif block:
                    kind, msg = "truncated", "truncated header"
                else:
                    kind, msg = "empty", "empty header"
                if ext_start < 0:
                    raise HeaderProblem(kind, msg)
                if kind != "end":
                    raise TarFormatError(
                        f"truncated archive: it ends after the extension header at byte {ext_start}"
                    )
                if long_name or long_link or pax:
                    self.warn(
                        f"the extension header at byte {ext_start} applies to no member:"
                        " the end-of-archive marker follows it"
                    )
                raise HeaderProblem(kind, msg)
            (name, _mode, _uid, _gid, _size, _mtime, chksum, typ, linkname, magic, _version,
             _uname, _gname, devmajor, devminor, prefix) = _HDR.unpack_from(block)  # fmt: skip
            # the six numeric fields in one go (NUL and space padding both become spaces);
            # base-256, empty or odd fields take the careful path
            nums = block[100:156].translate(_NUL_TO_SPACE)
            try:
                mode, uid, gid = int(nums[0:8], 8), int(nums[8:16], 8), int(nums[16:24], 8)
                size, mtime, chk = int(nums[24:36], 8), int(nums[36:48], 8), int(nums[48:56], 8)
            except ValueError:
                try:
                    mode, uid, gid = nti(block[100:108]), nti(block[108:116]), nti(block[116:124])
                    size, mtime, chk = nti(block[124:136]), nti(block[136:148]), nti(chksum)
                except HeaderProblem:
                    if ext_start < 0:
                        raise
                    raise TarFormatError(
                        f"invalid header at byte {start} after an extension header"
                    ) from None
            if chk != 256 + _block_sum(block) - sum(chksum) and not checksum_ok(block):
                if ext_start < 0:
                    raise HeaderProblem("invalid", "bad checksum")
                raise TarFormatError(f"bad checksum at byte {start} after an extension header")
            if size < 0:
                msg = f"negative size {size} in the header at byte {start}"
                if ext_start < 0:
                    raise HeaderProblem("invalid", msg)
                raise TarFormatError(msg)
            if typ == PAX_GLOBAL:  # archive-wide records: no member of its own
                payload = self._extension(size, start, "PAX global header")
                _parse_pax(payload, self.globals, start)
                continue
            if typ == VOLHDR:  # a volume label: archive metadata (GNU tar lists, never extracts it)
                if self._skip(_block(size)) != _block(size):
                    raise TarFormatError(
                        f"truncated archive: it ends inside the volume label at byte {start}"
                    )
                continue
            if typ in _EXTENSION_TYPES:
                chain += 1
                if chain > MAX_CHAIN:
                    raise TarFormatError(f"more than {MAX_CHAIN} extension headers in a row")
                if ext_start < 0:
                    ext_start = start
                if typ in (GNU_LONGNAME, GNU_LONGLINK):
                    text = _nts(self._extension(size, start, "GNU long name"))
                    if typ == GNU_LONGNAME:
                        long_name = text
                    else:
                        long_link = text
                else:  # 'x' (or Solaris 'X'): replaces an earlier one whole
                    pax_payload = self._extension(size, start, "PAX header")
                    pax = {}
                    _parse_pax(pax_payload, pax, start)
                continue
            break
        # the ustar prefix holds a path only under the POSIX magic: GNU headers keep
        # atime/ctime there (-G, --listed-incremental), as GNU tar reads them
        if long_name is not None:
            sname = long_name
        else:
            sname = _nts(name)
            if prefix[0] and magic == _POSIX_MAGIC:
                sname = _nts(prefix) + "/" + sname
        if typ == AREGTYPE and sname.endswith("/"):
            typ = DIRTYPE  # an old V7 directory
        elif typ == GNU_DUMPDIR:
            typ = DIRTYPE  # its data (names for an incremental restore) is skipped
        elif typ not in SUPPORTED_TYPES:
            self.warn(
                f"member {sname!r}: unknown type {typ.decode('latin-1')!r}, read as a regular"
                " file (as GNU tar extracts it)"
            )
        data_start = self.pos
        m = Member(
            sname,
            typ,
            mode,
            uid,
            gid,
            size,
            mtime,
            long_link if long_link is not None else (_nts(linkname) if linkname[0] else ""),
            data_start,
        )
        if typ in _DEV_TYPES:
            m.devmajor, m.devminor = nti(devmajor), nti(devminor)
        stored = size  # the member's data in the archive
        if typ == GNU_SPARSE:
            self._gnu_sparse(m, block)
            stored = m.size
            m.size = nti(block[483:495])  # the file's real size
            if m.size < 0:
                raise MemberError(m.name, f"negative size {m.size} in the sparse header")
        records = self.globals
        if pax is not None:
            records = {**self.globals, **pax} if self.globals else pax
        if records:
            stored = _apply_pax(m, records, stored)
        # every member's data is skipped but a hard link's (GNU tar: "links 0 size on tape")
        self._next_header = m.data_start + (_block(stored) if typ != LNKTYPE else 0)
        if pax is not None and typ != GNU_SPARSE:
            self._pax_sparse(m, records, pax_payload, stored)
        elif m.sparse is not None:
            _check_sparse(m, stored)
        if typ == DIRTYPE:
            m.name = m.name.rstrip("/")
        return m

    def _extension(self, size: int, start: int, what: str) -> bytes:
        """An extension header's payload (its padding skipped)."""
        if size > MAX_EXTENSION:
            raise TarFormatError(
                f"{what} at byte {start} is {size} bytes long (at most {MAX_EXTENSION})"
            )
        padded = _block(size)
        payload = self._take(padded)
        if len(payload) != padded:
            raise TarFormatError(f"truncated archive: it ends inside the {what} at byte {start}")
        return payload[:size]

    def _pax_sparse(self, m: Member, pax: dict[str, str], payload: bytes, stored: int) -> None:
        """GNU sparse 0.0, 0.1, 1.0 (PAX): the map, and the file's real size."""
        if "GNU.sparse.map" in pax:  # GNU sparse 0.1
            m.sparse = _pairs(m, pax["GNU.sparse.map"].split(","))
        elif "GNU.sparse.size" in pax or "GNU.sparse.numblocks" in pax:
            # GNU sparse 0.0: the records repeat, so from the bytes
            m.sparse = _pairs(m, [v.decode() for _, v in _SPARSE00.findall(payload)], payload)
        elif pax.get("GNU.sparse.major") == "1" and pax.get("GNU.sparse.minor") == "0":
            self._sparse_map_10(m)
        else:
            return
        # GNU.sparse.realsize (1.0) or GNU.sparse.size (0.x): the file's size; the last
        # of them in the header wins (GNU tar decodes both into one field)
        keys = [k for k in ("GNU.sparse.realsize", "GNU.sparse.size") if k in pax]
        if not keys:
            raise MemberError(m.name, "GNU sparse member without GNU.sparse.realsize or .size")
        key = max(keys, key=lambda k: payload.rfind(b" " + k.encode() + b"="))
        m.size = _pax_int(m, key, pax[key])
        _check_sparse(m, self._next_header - m.data_start)

    def _gnu_sparse(self, m: Member, block: bytes) -> None:
        """GNU old sparse ('S'): the map in the header and its extension blocks."""
        structs: list[tuple[int, int]] = []
        pos = 386
        for _ in range(4):
            structs.append((nti(block[pos : pos + 12]), nti(block[pos + 12 : pos + 24])))
            pos += 24
        extended = block[482]
        while extended:
            ext = self._take(BLOCK)
            if len(ext) != BLOCK:
                raise TarFormatError(
                    f"truncated archive: it ends inside the sparse map of {m.name!r}"
                )
            pos = 0
            for _ in range(21):
                off, num = nti(ext[pos : pos + 12]), nti(ext[pos + 12 : pos + 24])
                if off and num:
                    structs.append((off, num))
                pos += 24
            extended = ext[504]
        m.data_start = self.pos
        m.sparse = structs

    def _sparse_map_10(self, m: Member) -> None:
        """GNU sparse 1.0: the map, as decimal lines, in the blocks where the data begins."""
        limit = min(self._next_header - m.data_start, MAX_EXTENSION)
        want = -1  # numbers to read: twice the segment count
        numbers: list[str] = []
        tail = b""
        used = 0
        while want < 0 or len(numbers) < want:
            if used >= limit or len(tail) > 40:
                raise MemberError(m.name, "invalid GNU sparse 1.0 map (too long)")
            block = self._take(BLOCK)
            used += len(block)
            if len(block) != BLOCK:
                raise MemberError(m.name, "truncated archive: it ends inside the sparse map")
            lines = (tail + block).split(b"\n")
            tail = lines.pop()
            for line in lines:
                if not line.isdigit():
                    raise MemberError(m.name, f"invalid GNU sparse 1.0 map: {line[:40]!r}")
                if want < 0:
                    want = 2 * int(line)
                elif len(numbers) < want:
                    numbers.append(line.decode())
        m.data_start = self.pos
        m.sparse = _pairs(m, numbers)


def _pairs(m: Member, values: list[str], payload: bytes | None = None) -> list[tuple[int, int]]:
    if payload is not None:  # sparse 0.0: offset, numbytes, offset, numbytes, ... in order
        found = _SPARSE00.findall(payload)
        if [k for k, _ in found] != [b"offset", b"numbytes"] * (len(found) // 2) or len(found) % 2:
            raise MemberError(m.name, "invalid GNU sparse 0.0 map")
    try:
        nums = [int(v) for v in values] if values != [""] else []
    except ValueError:
        raise MemberError(m.name, "invalid GNU sparse map") from None
    if len(nums) % 2:
        raise MemberError(m.name, "invalid GNU sparse map: an odd count of numbers")
    return list(zip(nums[::2], nums[1::2], strict=True))


def _check_sparse(m: Member, stored: int) -> None:
    """Segments in order, inside the file, their data stored in full."""
    assert m.sparse is not None
    end = 0
    total = 0
    for off, num in m.sparse:
        if num == 0:  # GNU tar marks a trailing hole with (file size, 0); 'S' pads with (0, 0)
            continue
        if off < end or num < 0 or off + num > m.size:
            raise MemberError(
                m.name,
                f"invalid sparse map: segment ({off}, {num}) overlaps, is out of order"
                f" or beyond the file size {m.size}",
            )
        end = off + num
        total += num
    if total > stored:
        raise MemberError(m.name, f"invalid sparse map: {total} data bytes, only {stored} stored")
    m.sparse = [(off, num) for off, num in m.sparse if num]


class SparseData:
    """``read`` over a sparse member: zeros for holes, its stored segments in between."""

    def __init__(self, reader: TarReader, m: Member) -> None:
        assert m.sparse is not None
        self.reader = reader
        self.segments = m.sparse
        self.index = 0
        self.position = 0
        self.size = m.size

    def read(self, n: int = -1, /) -> bytes:
        n = self.size - self.position if n < 0 else min(n, self.size - self.position)
        parts: list[bytes] = []
        while n > 0:
            if self.index < len(self.segments):
                off, num = self.segments[self.index]
            else:
                off, num = self.size, 0
            if self.position < off:  # a hole
                take = min(n, off - self.position)
                parts.append(bytes(take))
            else:
                take = min(n, off + num - self.position)
                data = self.reader._take(take)
                parts.append(data)
                if len(data) != take:
                    self.position += len(data)
                    break  # the caller reports the short read
                if self.position + take == off + num:
                    self.index += 1
            self.position += take
            n -= take
        return b"".join(parts)

    def skip_hole(self, n: int) -> None:
        """Move over ``n`` bytes of one hole (nothing is read)."""
        off = self.segments[self.index][0] if self.index < len(self.segments) else self.size
        if n < 0 or self.position + n > off:
            raise AssertionError(f"skip_hole({n}) at {self.position}: not inside a hole")
        self.position += n
