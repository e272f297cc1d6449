"""Hand-made tar archives (the forms no tool writes on demand) and GNU tar as the oracle."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

POSIX_MAGIC = b"ustar\x0000"
GNU_MAGIC = b"ustar  \x00"


def _number12(n: int) -> bytes:
    """A 12-byte octal field as GNU tar writes it: 11 digits and a NUL, or all 12 digits
    when the value needs them."""
    field = b"%011o\0" % n if n < 8**11 else b"%012o" % n
    assert len(field) == 12, f"{n} does not fit an octal field"
    return field


def header(
    name: bytes,
    typ: bytes = b"0",
    size: int | bytes = 0,
    *,
    checksum: bytes | None = None,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    mtime: int = 1_700_000_000,
    linkname: bytes = b"",
    magic: bytes = POSIX_MAGIC,
    prefix: bytes = b"",
    extra: dict[int, bytes] | None = None,
) -> bytes:
    """One header block; ``size`` as a number or a raw 12-byte field; ``extra``: bytes
    placed at offsets (a GNU sparse map, atime/ctime in the prefix area...)."""
    field = size if isinstance(size, bytes) else _number12(size)
    block = bytearray(512)
    block[0 : len(name)] = name
    block[100:108] = b"%07o\0" % mode
    block[108:116] = _number8(uid)
    block[116:124] = _number8(gid)
    block[124:136] = field
    block[136:148] = _number12(mtime)
    block[156:157] = typ
    block[157 : 157 + len(linkname)] = linkname
    block[257:265] = magic
    block[345 : 345 + len(prefix)] = prefix
    for at, data in (extra or {}).items():
        block[at : at + len(data)] = data
    block[148:156] = b" " * 8
    block[148:156] = checksum if checksum is not None else b"%06o\0 " % sum(block)
    return bytes(block)


def _number8(n: int) -> bytes:
    """An 8-byte numeric field: octal, or GNU base-256 when it does not fit."""
    return b"%07o\0" % n if n < 8**7 else b"\x80" + n.to_bytes(7, "big")


def octal12(n: int) -> bytes:
    return b"%011o\0" % n


def rec(key: bytes, value: bytes) -> bytes:
    """One PAX record, its length field counting itself."""
    body = b" " + key + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode() + body


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def pax(records: bytes, typ: bytes = b"x") -> bytes:
    """A PAX extended (or global, ``typ`` b"g") header with its records."""
    return header(b"PaxHeader/x", typ, len(records)) + padded(records)


def long_name(text: bytes, typ: bytes = b"L") -> bytes:
    """A GNU long name ('L') or long link target ('K') header."""
    return header(b"././@LongLink", typ, len(text) + 1, magic=GNU_MAGIC) + padded(text + b"\0")


def regular(name: bytes, data: bytes = b"", **kw: object) -> bytes:
    return header(name, b"0", len(data), **kw) + padded(data)  # type: ignore[arg-type]


END = bytes(1024)


def gnu_tar_extract(tarball: Path, dest: Path) -> subprocess.CompletedProcess[str]:
    """GNU tar's extraction as root, every attribute kept (xattrs of every namespace,
    ACLs, numeric owners, exact modes). Its exit status is returned, not checked: GNU tar exits
    2 after warnings it goes on from (an xattr the kernel refuses, ...)."""
    dest.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [
            "tar",
            "--xattrs",
            "--xattrs-include=*",
            "--acls",
            "--numeric-owner",
            "--same-owner",
            "-p",
            "-C",
            str(dest),
            "-xf",
            str(tarball),
        ],
        capture_output=True,
        text=True,
    )


def have_root_and_gnu_tar() -> bool:
    return os.geteuid() == 0 and shutil.which("tar") is not None
