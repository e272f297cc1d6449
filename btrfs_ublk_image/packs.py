"""Pack files: the image's file content, deduplicated, in fixed-size verified chunks.

Sources stream each regular file into a ``PackWriter`` exactly once. Content at
most ``keep_inline`` bytes long stays in memory (the btrfs writer may make it an
inline extent); anything larger is appended to the open pack while two hashes
run over it: the content's CRC-32C (deduplication: a copy whose CRC and size
match earlier content is compared byte by byte, then rolled back and the first
``Blob`` returned) and the pack's chunk digests (sha256 of every ``chunk_size``
bytes of the pack, which ublkd checks before serving a byte). So the content
is hashed with sha256 once: by a worker thread (on the second core) that reads
each chunk back from the page cache once every byte of it is final (no later
rollback can touch it). The native pack (``core``, native/src/pack.rs) hashes the
bytes as they are written instead, from the buffers they are written from (nothing is
read back), and snapshots its hash state where a rollback may return to.

A pack's id is sha256 over its chunk digests, so verifying every chunk verifies
the pack; the file is stored as ``packs/<id hex>``. Another worker thread writes the
pack back to disk (``fdatasync``) every ``FLUSH_STEP`` bytes while it grows, so the
disk works while the build goes on and the final ``fsync`` has little left to do.

In-place packs (``open_in_place``): an uncompressed tarball is a pack as it is. Its
copy in ``packs/`` is a reflink (``FICLONE``: no byte written) where the filesystem
can, else it is copied with ``copy_file_range`` as the source reads it; the source
reads the COPY, so what is hashed is exactly what the bundle holds, whatever happens
to the original later. A regular member's data is then referenced where it lies
(``put_in_place``): nothing is written. The tarball's reader computes the pack's
chunk digests in the same pass as its source digest (``hashing.BackgroundSha256``).
Pack 0 is always the written pack (it holds at least device 2's superblock); the
in-place packs follow in the order the sources opened them.

Pack compression (``compression="zstd"``, blockmap version 2): once pack 0 is complete,
each of its chunks is rewritten as one zstd frame (kept raw where that is not smaller)
and the chunk digests are taken over these STORED bytes, so a reader rejects a corrupt
frame before decompressing it. Deduplication works on the uncompressed pack as before
(it compares bytes already written). In-place packs are never compressed: they are the
source tarball byte for byte.

A base image (``base``, ``build --base``): its packs are packs ``1..n`` and its content
is known to the deduplication from the start, so content equal to the base's (compared
byte by byte with the base's verified chunks) is mapped where it lies in the base's pack,
not written (``bytes_reused``). In-place packs follow the base's.

btrfs compressed extents (``compression="btrfs-zstd"``, blockmap version 1): pack 0 holds
each file's content as btrfs extents stored the kernel's way (``btrfs/encoded.py``): cut
into 128 KiB pieces, each one zstd frame or raw where that is not smaller, without the
sector padding; the pack is served as stored and the kernel decompresses. The extents
and their sector checksums are recorded in ``encoded`` for the btrfs writer. Content is
deduplicated on its stored bytes (the compressor is deterministic: equal content, equal
frames). In-place blobs stay raw; their sector checksums are taken as they are read.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import queue
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, Protocol, cast

from btrfs_ublk_image import native
from btrfs_ublk_image.btrfs.ondisk import SECTORSIZE
from btrfs_ublk_image.crc import crc32c
from btrfs_ublk_image.errors import ImageError, SourceError
from btrfs_ublk_image.files import FICLONE, UNSUPPORTED
from btrfs_ublk_image.tree import Blob, Content, Sparse

if TYPE_CHECKING:  # blockmap and encoded: compressed packs only (a build's first tar layer
    # is read from start-up on, early.py: what its start imports delays it)
    from btrfs_ublk_image.base import BaseImage
    from btrfs_ublk_image.blockmap import StoredChunk
    from btrfs_ublk_image.btrfs.encoded import EncodedExtents, ZstdExtentEncoder

DEFAULT_CHUNK_SIZE = 1 << 20
COPY_BUFFER = 1 << 20
# zstd's default level: ~3-5x faster to compress than level 9+ for a few % less ratio on
# 1 MiB chunks, and decompression (on ublkd's read path) is equally fast at any level
ZSTD_LEVEL = 3
COMPRESSIONS = ("none", "zstd", "btrfs-zstd")
IN_PLACE_COPY_STEP = 8 << 20  # bytes copied ahead of the reader when reflinks are unavailable
# CRC-32C (~5 GB/s) keeps the GIL: handing it to the worker threads and waiting to get it
# back costs the parsing thread more than the CRC of a MiB (0.2 ms) does
_KEEP_GIL = 0
FLUSH_STEP = 16 << 20  # the pack is written back (fdatasync) each time it grew this much
# the pack file's write buffer. Every write(2) releases the GIL, and the parsing thread then
# waits to get it back from the worker threads (inflate, hashing): unbuffered, one write per
# content piece cost the Debian build ~0.3-0.6 s of waiting for ~0.1 s of copying
PACK_BUFFER = 4 << 20


class Progress(Protocol):
    def add_bytes(self, n: int) -> None: ...


class SparseSource(Protocol):
    """A sparse file read front to back: ``read`` gives its bytes (zeros in holes),
    ``skip_hole`` moves over ``n`` bytes that lie in one hole without making them."""

    def read(self, n: int = -1, /) -> bytes: ...

    def skip_hole(self, n: int) -> None: ...


def sector_runs(data: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Data segments (offset, length; sorted, not overlapping) -> the file ranges that
    must be stored: (start, end) with ``start`` a sector boundary (a file extent starts
    at one) and ``end`` the end of the last data byte in it (the rest of that sector is
    zeros on the device). Segments that share or touch a sector are one range, the zeros
    between them stored."""
    runs: list[list[int]] = []
    for off, num in data:
        start = off - off % SECTORSIZE
        if runs and start <= -(-runs[-1][1] // SECTORSIZE) * SECTORSIZE:
            runs[-1][1] = max(runs[-1][1], off + num)
        else:
            runs.append([start, off + num])
    return [(a, b) for a, b in runs]


class PackInfo(NamedTuple):
    """A finished pack: where it is and what the blockmap must record about it (a
    NamedTuple, as the other records of the modules a build starts with: early.py)."""

    id: bytes  # sha256 over ``chunk_digests``
    size: int  # logical (uncompressed) bytes
    chunk_digests: list[bytes]  # of the stored bytes
    path: str
    stored: list[StoredChunk] | None = None  # compressed pack: each chunk's stored bytes

    @property
    def stored_size(self) -> int:
        """The pack file's size."""
        return self.size if self.stored is None else sum(c.length for c in self.stored)

    @property
    def name(self) -> str:
        return self.id.hex()


class PackWriter:
    """Appends content to one pack file under ``directory`` (one pack per build)."""

    def __init__(
        self,
        directory: str,
        keep_inline: int,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        progress: Progress | None = None,
        compression: str = "none",
        base: BaseImage | None = None,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown pack compression {compression!r}")
        self.compression = compression
        self.directory = directory
        self.keep_inline = keep_inline
        self.chunk_size = chunk_size
        self.progress = progress
        self._path = os.path.join(directory, "pack.tmp")
        nat = native.module()
        # the native pack (native/src/pack.rs): the same appends, dedup index and chunk
        # digests in Rust, shared by the native tar reader and every other source
        self.core: Any = None
        self._interned: dict[Blob, Blob] = {}
        # not with btrfs-zstd (pack 0 holds encoded extents, written by _ExtentSink), nor
        # with a base whose packs the extension cannot read (compressed chunks: compared
        # through BaseImage.read)
        if (
            nat is not None
            and compression != "btrfs-zstd"
            and (base is None or base.native_packs is not None)
        ):
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            # streamed content with O_DIRECT (pack.rs), not where the pack is read back
            # whole right after (zstd rewrites every chunk: from the page cache), nor on a
            # base: most content is the base's, found so only after it streamed into the
            # pack, then compared there and rolled back (through the page cache, it never
            # reaches the disk)
            self.core = nat.Pack(fd, chunk_size, compression == "none" and base is None)
            if base is not None:
                self.core.set_base(base.native_packs)
        # read back only with pread on its fd (hashing, dedup): a BufferedWriter on an O_RDWR
        # fd, as a BufferedRandom would lseek(2) (and release the GIL) after every flush
        if self.core is None:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        else:  # the Python writer's side stays idle (its threads start on first use only)
            fd = os.dup(self.core.fileno())
        self._file = open(fd, "wb", buffering=PACK_BUFFER)  # noqa: SIM115 (finish or abort)
        # chunks go to the hasher (and the file to the kernel) this many at a time
        self._submit_step = max(1, PACK_BUFFER // chunk_size)
        self._size = 0
        # deduplication: size << 32 | crc32c -> the blob (a list only when several distinct
        # contents share the key); a match is confirmed byte by byte, so the content is
        # hashed only once with sha256 (for the chunk digests). One int key and, nearly
        # always, no list: ~120 bytes less per distinct content than a tuple and a list.
        self._by_key: dict[int, Blob | list[Blob]] = {}
        self._hasher = _ChunkHasher(self._file.fileno(), chunk_size)
        self._submitted = 0  # chunks handed to the hasher (all of them final)
        self._flusher = _Flusher(self._file.fileno())
        self._flushed = 0  # pack size at the last flush request
        self._bytes_in = 0  # content bytes offered, before dedup (besides the native pack's)
        self._bytes_deduped = 0
        self.bytes_in_place = 0  # unique content referenced in in-place packs (not written)
        self.bytes_packed = 0  # unique content written to pack 0 (before btrfs-zstd encoding)
        self._in_place: list[InPlacePack] = []
        self.bytes_reused = 0  # content found in the base image's packs (not written)
        self._base = base
        self._n_base = 0 if base is None else len(base.packs)
        if base is not None:
            for blob in base.blobs:
                self._remember(blob.size << 32 | blob.crc32c, blob)
        # btrfs-zstd: every stored blob's extents, and the encoder of pack 0's content
        self.encoded: EncodedExtents | None = None
        self._encoder: ZstdExtentEncoder | None = None
        if compression == "btrfs-zstd":
            from btrfs_ublk_image.btrfs.encoded import EncodedExtents, ZstdExtentEncoder

            self.encoded = EncodedExtents()
            self._encoder = ZstdExtentEncoder()

    @property
    def bytes_in(self) -> int:
        """Content bytes offered, before dedup."""
        return self._bytes_in + (0 if self.core is None else self.core.bytes_in)

    @property
    def bytes_deduped(self) -> int:
        return self._bytes_deduped + (0 if self.core is None else self.core.bytes_deduped)

    def stored_size(self, blob: Blob) -> int:
        """How many pack bytes ``blob`` occupies (its size unless stored as btrfs extents)."""
        if self.encoded is not None:
            n = self.encoded.stored_size(blob.pack, blob.offset)
            if n is not None:
                return n
        return blob.size

    def _comparable(self, old: Blob, pack: int) -> bool:
        """Whether ``old`` may be compared bytewise with new content going to ``pack``:
        with btrfs-zstd, pack 0 holds stored extents and in-place packs raw bytes."""
        return self.encoded is None or (old.pack == 0) == (pack == 0)

    def put_bytes(self, data: bytes) -> bytes | Blob:
        if len(data) <= self.keep_inline:
            self._bytes_in += len(data)
            return data
        return self._append_checked([data], len(data), "inline content")

    def put_stream(self, src: BinaryIO, size: int, where: str) -> bytes | Blob:
        """Read exactly ``size`` bytes from ``src``; ``where`` names the entry in errors."""
        if size <= self.keep_inline:
            data = src.read(size)
            if len(data) != size:
                raise SourceError(f"{where}: truncated: expected {size} bytes, got {len(data)}")
            self._bytes_in += size
            return data
        return self._append_checked(_Reader(src, size, where), size, where)

    def put_sparse(
        self, src: SparseSource, size: int, data: list[tuple[int, int]], where: str
    ) -> Content:
        """A file of ``size`` bytes whose ``data`` segments (offset, length: sorted, not
        overlapping) are all that is not a hole, read front to back from ``src``. Only
        the sector runs holding data are packed (``Sparse``); a small file stays in
        memory whole, and one whose data fills it is a plain ``Blob``."""
        if size <= self.keep_inline:
            return self.put_stream(cast(BinaryIO, src), size, where)
        runs = sector_runs(data)
        if runs == [(0, size)]:
            return self._append_checked(_Reader(cast(BinaryIO, src), size, where), size, where)
        segments: list[tuple[int, Blob]] = []
        pos = 0
        for start, end in runs:
            src.skip_hole(start - pos)
            blob = self._append_checked(
                _Reader(cast(BinaryIO, src), end - start, where), end - start, where
            )
            segments.append((start, blob))
            pos = end
        return Sparse(size, tuple(segments))

    def open_in_place(self, src_path: str) -> InPlacePack:
        """A source file that becomes a pack as it is; read it through the returned object."""
        index = 1 + self._n_base + len(self._in_place)
        pack = InPlacePack(index, src_path, os.path.join(self.directory, f"in-place-{index}.tmp"))
        self._in_place.append(pack)
        if self.core is not None:
            self.core.set_pack_fd(index, pack.fd)
        return pack

    def put_in_place(
        self, pack: InPlacePack, src: BinaryIO, offset: int, size: int, where: str
    ) -> bytes | Blob:
        """Read ``size`` bytes from ``src``: they are pack ``pack``'s bytes at ``offset``.
        Referenced there (or kept inline when small, or an earlier copy): nothing is written."""
        if size <= self.keep_inline:
            return self.put_stream(src, size, where)
        enc = self.encoded
        mark = enc.mark() if enc is not None else (0, 0)
        sink = _ExtentSink(self, None, offset) if enc is not None else None
        crc = self._take(
            _Reader(src, size, where), size, where, sink.write if sink is not None else None
        )
        if sink is not None:
            sink.close()
        key = size << 32 | crc
        for old in self._candidates(key):
            if self._comparable(old, pack.index) and self._same_bytes(
                old.pack, old.offset, pack.index, offset, size
            ):
                if enc is not None:
                    enc.rollback(mark)
                self._count_match(old, size)
                return old
        blob = Blob(crc32c=crc, size=size, pack=pack.index, offset=offset)
        if enc is not None:
            enc.end(pack.index, offset)
        self._remember(key, blob)
        self.bytes_in_place += size
        return blob

    def _take(
        self,
        pieces: Iterable[bytes],
        size: int,
        where: str,
        write: Callable[[bytes], object] | None,
    ) -> int:
        """The CRC-32C of ``pieces``, which must be exactly ``size`` bytes (each also given
        to ``write`` when set); counted as offered content and in the progress."""
        crc = 0
        got = 0
        for piece in pieces:
            crc = crc32c(piece, crc, _KEEP_GIL)
            if write is not None:
                write(piece)
            got += len(piece)
            if self.progress is not None:
                self.progress.add_bytes(len(piece))
        if got != size:
            raise SourceError(f"{where}: truncated: expected {size} bytes, got {got}")
        self._bytes_in += size
        return crc

    def _candidates(self, key: int) -> list[Blob]:
        if self.core is not None:
            crc, size = key & 0xFFFFFFFF, key >> 32
            return [Blob(crc, size, p, o) for p, o in self.core.candidates(key)]
        found = self._by_key.get(key)
        if found is None:
            return []
        return found if isinstance(found, list) else [found]

    def _remember(self, key: int, blob: Blob) -> None:
        if self.core is not None:
            self.core.remember(key, blob.pack, blob.offset)
            return
        found = self._by_key.get(key)
        if found is None:
            self._by_key[key] = blob
        elif isinstance(found, list):
            found.append(blob)
        else:
            self._by_key[key] = [found, blob]

    def put_pack_tail(self, data: bytes) -> Blob:
        """Append bytes that must live in the pack whatever their size (device 2's superblock)."""
        return self._append_checked([data], len(data), "device superblock", dedupe=False)

    def _append_checked(
        self, pieces: list[bytes] | _Reader, size: int, where: str, dedupe: bool = True
    ) -> Blob:
        if self.core is not None:
            counted = pieces if self.progress is None else _Counted(pieces, self.progress)
            try:
                crc, pack, offset = self.core.append(counted, size, dedupe)
            except ValueError as e:
                raise SourceError(f"{where}: truncated: expected {size} bytes, got {e}") from None
            blob = Blob(crc32c=crc, size=size, pack=pack, offset=offset)
            # a duplicate is the first one's object, as in the Python writer (what its
            # index held before: sources that are not native tar readers only)
            return self._interned.setdefault(blob, blob)
        start = self._size
        enc = self.encoded if dedupe else None  # device 2's superblock is not an extent
        if enc is not None and self._encoder is not None:
            mark = enc.mark()
            sink = _ExtentSink(self, self._encoder, start)
            crc = self._take(pieces, size, where, sink.write)
            sink.close()
        else:
            crc = self._take(pieces, size, where, self._write)
        stored = self._size - start
        key = size << 32 | crc
        if dedupe:
            for old in self._candidates(key):
                if (
                    self._comparable(old, 0)
                    and self.stored_size(old) == stored
                    and self._same_bytes(old.pack, old.offset, 0, start, stored)
                ):
                    # identical content already packed: roll the pack back to where it was
                    self._file.truncate(start)
                    self._file.seek(start)
                    self._size = start
                    if enc is not None:
                        enc.rollback(mark)
                    self._count_match(old, size)
                    return old
        blob = Blob(crc32c=crc, size=size, pack=0, offset=start)
        if enc is not None:
            enc.end(0, start)
        if dedupe:
            self._remember(key, blob)
            self.bytes_packed += size
        if self._size >= (self._submitted + self._submit_step) * self.chunk_size:
            self._submit(self._size // self.chunk_size)
        return blob

    def _submit(self, upto: int) -> None:
        """Hand chunks [submitted, upto) to the hasher: every byte of them is final."""
        self._file.flush()
        for index in range(self._submitted, upto):
            self._hasher.submit(index * self.chunk_size)
        self._submitted = upto
        if self._size - self._flushed >= FLUSH_STEP:
            self._flusher.request()
            self._flushed = self._size

    def _count_match(self, old: Blob, size: int) -> None:
        if self._is_base(old.pack):
            self.bytes_reused += size
        else:
            self._bytes_deduped += size

    def _is_base(self, pack: int) -> bool:
        return 1 <= pack <= self._n_base

    def _pread(self, pack: int, n: int, offset: int) -> bytes:
        if pack == 0:
            if self.core is not None:
                return os.pread(int(self.core.fileno()), n, offset)
            self._file.flush()
            return os.pread(self._file.fileno(), n, offset)
        if self._base is not None and self._is_base(pack):
            try:
                return self._base.read(pack, offset, n)
            except ImageError:
                return b""  # a corrupt base chunk: not the same bytes, write them anew
        return os.pread(self._in_place[pack - 1 - self._n_base].fd, n, offset)

    def _same_bytes(self, pack_a: int, a: int, pack_b: int, b: int, size: int) -> bool:
        """Compare two ranges of packs (just written or read: in the page cache; a base
        pack's through its verified chunks)."""
        done = 0
        while done < size:
            n = min(COPY_BUFFER, size - done)
            if self._pread(pack_a, n, a + done) != self._pread(pack_b, n, b + done):
                return False
            done += n
        return True

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._size += len(data)

    def finish(self) -> list[PackInfo]:
        """Close the packs and name them by their ids, in pack-index order. Returns [] when
        nothing was packed."""
        if self.core is not None:
            core = self.core
            self._size = core.size
            self._bytes_in += core.bytes_in
            self._bytes_deduped += core.bytes_deduped
            self.bytes_reused += core.bytes_reused
            self.core = None  # its counters are ours now
            digests = core.finish()
            self._file.close()
        else:
            digests = self._finish_python()
        if self._size == 0 and not self._in_place:
            os.unlink(self._path)
            return []
        if self._size == 0:  # pragma: no cover - write_bundle always packs device 2's superblock
            raise AssertionError("in-place packs need pack 0")
        if self.compression == "zstd":
            infos = [_compress_pack(self._path, self.directory, self._size, self.chunk_size)]
        else:
            infos = [_name_pack(self._path, self.directory, self._size, digests)]
        if self._base is not None:  # left where they are: the bundle links those it uses
            infos.extend(
                PackInfo(p.entry.id, p.entry.size, p.entry.chunk_digests, p.path, p.entry.stored)
                for p in self._base.packs
            )
        for pack in self._in_place:
            infos.append(pack.finish(self.directory))
        return infos

    def _finish_python(self) -> list[bytes]:
        self._submit(-(-self._size // self.chunk_size))  # the last chunk may be short
        digests = self._hasher.finish()
        self._flusher.finish()
        os.fsync(self._file.fileno())
        self._file.close()
        return digests

    def abort(self) -> None:
        if self.core is not None:
            self.core.abort()
            # dropped here, on the thread that made it (the extension's Pack is unsendable:
            # a traceback's cycle collected later on a worker thread could not free it)
            self.core = None
        self._hasher.stop()
        self._flusher.stop()
        if not self._file.closed:
            self._file.close()
        for pack in self._in_place:
            pack.close()


def _name_pack(path: str, directory: str, size: int, digests: list[bytes]) -> PackInfo:
    """Rename a finished pack file to its id (an identical pack already there: the same bytes)."""
    pack_id = hashlib.sha256(b"".join(digests)).digest()
    final = os.path.join(directory, pack_id.hex())
    os.rename(path, final)
    return PackInfo(pack_id, size, digests, final)


def _compress_pack(path: str, directory: str, size: int, chunk_size: int) -> PackInfo:
    """Rewrite the finished pack at ``path`` as one zstd frame per chunk (raw where the frame
    would not be smaller); digests over the stored bytes; name it by its id."""
    import zstandard  # compressed packs only: its 11 MiB library is not loaded otherwise

    from btrfs_ublk_image.blockmap import StoredChunk

    out_path = path + ".zst"
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    digests: list[bytes] = []
    stored: list[StoredChunk] = []
    at = 0
    try:
        with open(path, "rb") as src, open(out_path, "wb") as out:
            for _ in range(0, size, chunk_size):
                data = src.read(chunk_size)
                frame = cctx.compress(data)
                zstd = len(frame) < len(data)
                body = frame if zstd else data
                out.write(body)
                digests.append(hashlib.sha256(body).digest())
                stored.append(StoredChunk(at, len(body), zstd))
                at += len(body)
            out.flush()
            os.fsync(out.fileno())
        os.unlink(path)
    except BaseException:
        if os.path.exists(out_path):
            os.unlink(out_path)
        raise
    info = _name_pack(out_path, directory, size, digests)
    return PackInfo(info.id, size, digests, info.path, stored)


class InPlacePack:
    """A copy of a source file in ``packs/`` that the source reads (``read``): a reflink, or
    ``copy_file_range`` of each piece just before it is read (then a plain copy when even
    that fails, e.g. across filesystems on older kernels)."""

    def __init__(self, index: int, src_path: str, path: str) -> None:
        self.index = index
        self.src_path = src_path
        self.path = path
        self.src_fd = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except BaseException:
            os.close(self.src_fd)
            raise
        self.size: int | None = None  # known once the copy is complete
        self.digests: list[bytes] | None = None
        self.method = "reflink"
        self._copied = 0  # bytes of the source present in the copy
        self._pos = 0  # read position in the copy
        try:
            fcntl.ioctl(self.fd, FICLONE, self.src_fd)
            self.size = self._copied = os.fstat(self.fd).st_size
        except OSError as e:
            if e.errno not in UNSUPPORTED:
                self.close()
                raise
            self.method = "copy_file_range"

    def read(self, n: int = -1, /) -> bytes:
        if n < 0:
            n = 1 << 62
        want = self._pos + n
        while self.size is None and self._copied < want:
            self._copy_more(max(IN_PLACE_COPY_STEP, min(n, 1 << 30)))
        data = os.pread(self.fd, min(n, self._copied - self._pos), self._pos)
        self._pos += len(data)
        return data

    def _copy_more(self, n: int) -> None:
        """Copy up to ``n`` more source bytes into the copy; at the source's end, fix its size."""
        done = 0
        if self.method == "copy_file_range":
            try:
                done = os.copy_file_range(self.src_fd, self.fd, n, self._copied, self._copied)
            except OSError as e:
                if e.errno not in UNSUPPORTED:
                    raise
                self.method = "read/write"
        if self.method == "read/write":
            data = os.pread(self.src_fd, min(n, COPY_BUFFER), self._copied)
            view = memoryview(data)
            while done < len(data):
                done += os.pwrite(self.fd, view[done:], self._copied + done)
        if done == 0:
            self.size = self._copied
        self._copied += done

    def complete(self, digests: list[bytes], nbytes: int) -> None:
        """The source has read the whole copy (``nbytes``) and digested its chunks."""
        if self.size is None or nbytes != self.size or os.fstat(self.fd).st_size != self.size:
            raise SourceError(
                f"{self.src_path}: read {nbytes} bytes, the in-place copy holds"
                f" {os.fstat(self.fd).st_size} (did the file change during the build?)"
            )
        self.digests = digests

    def finish(self, directory: str) -> PackInfo:
        if self.digests is None or self.size is None:
            raise AssertionError(f"{self.src_path}: in-place pack not completed")
        os.fsync(self.fd)
        self.close()
        return _name_pack(self.path, directory, self.size, self.digests)

    def close(self) -> None:
        for fd in (self.src_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.src_fd = self.fd = -1


class _ChunkHasher:
    """sha256 of pack chunks, in order, on a worker thread that reads them back (from the
    page cache) with ``pread``; hashlib and pread release the GIL, so the main thread
    goes on parsing. At most ``depth`` chunks wait."""

    def __init__(self, fd: int, chunk_size: int, depth: int = 32) -> None:
        self.fd = fd
        self.chunk_size = chunk_size
        self.digests: list[bytes] = []
        self._queue: queue.Queue[int | None] = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, offset: int) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pack-sha256", daemon=True)
            self._thread.start()
        self._queue.put(offset)

    def _run(self) -> None:
        while (offset := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain: the error is raised by finish
            try:
                data = os.pread(self.fd, self.chunk_size, offset)
                if not data:
                    raise OSError(f"pack chunk at {offset} is missing")
                self.digests.append(hashlib.sha256(data).digest())
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self._error = e

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def finish(self) -> list[bytes]:
        self.stop()
        if self._error is not None:
            raise self._error
        return self.digests


class _Flusher:
    """Writes the pack back to disk (``fdatasync``) on a worker thread while the build goes
    on, when asked: the disk works beside the CPU, and the final ``fsync`` has little left.
    A failed flush is raised by ``finish`` (the kernel reports a write-back error once per
    open file: the final ``fsync`` would not see it again)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._wanted = threading.Event()
        self._pending = False  # a flush was asked for and has not started
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None

    def request(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pack-flush", daemon=True)
            self._thread.start()
        self._pending = True
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._pending:
                self._pending = False
                try:
                    os.fdatasync(self.fd)
                except OSError as e:
                    self._error = self._error or e
            if self._stopping:
                return

    def stop(self, drop_pending: bool = True) -> None:
        if self._thread is not None:
            if drop_pending:
                self._pending = False
            self._stopping = True
            self._wanted.set()
            self._thread.join()
            self._thread = None

    def finish(self) -> None:
        self.stop(drop_pending=False)  # a flush asked for just before still runs
        if self._error is not None:
            raise self._error


class _Counted:
    """Pieces passed through, each counted in the progress."""

    def __init__(self, pieces: Iterable[bytes], progress: Progress) -> None:
        self.pieces, self.progress = iter(pieces), progress

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> bytes:
        piece = next(self.pieces)
        self.progress.add_bytes(len(piece))
        return piece


class _ExtentSink:
    """Takes a blob's bytes in any pieces and records them as btrfs extents of 128 KiB
    pieces: encoded and appended to pack 0 (``encoder`` set), or only checksummed where
    they already lie (an in-place pack, at ``offset``)."""

    def __init__(self, packs: PackWriter, encoder: ZstdExtentEncoder | None, offset: int) -> None:
        from btrfs_ublk_image.btrfs.encoded import COMPRESSED_EXTENT

        assert packs.encoded is not None
        self.packs, self.encoded, self.encoder = packs, packs.encoded, encoder
        self.extent = COMPRESSED_EXTENT
        self.at = offset  # pack offset of the next stored byte
        self.buf = bytearray()
        self.encoded.begin()

    def write(self, data: bytes) -> None:
        self.buf += data
        extent = self.extent
        if len(self.buf) >= extent:
            view = memoryview(self.buf)
            done = 0
            while len(self.buf) - done >= extent:
                self._piece(bytes(view[done : done + extent]))
                done += extent
            view.release()
            del self.buf[:done]

    def close(self) -> None:
        if self.buf:
            self._piece(bytes(self.buf))
            self.buf.clear()

    def _piece(self, piece: bytes) -> None:
        if self.encoder is None:
            stored, zstd = piece, False
        else:
            stored, zstd = self.encoder.encode(piece)
            self.packs._write(stored)
        self.encoded.add(self.at, stored, len(piece), zstd)
        self.at += len(stored)


class _Reader:
    """Iterates ``size`` bytes of ``src`` in buffer-sized pieces; stops short at EOF."""

    def __init__(self, src: BinaryIO, size: int, where: str) -> None:
        self.src, self.left, self.where = src, size, where

    def __iter__(self) -> _Reader:
        return self

    def __next__(self) -> bytes:
        if self.left <= 0:
            raise StopIteration
        piece = self.src.read(min(COPY_BUFFER, self.left))
        if not piece:
            raise StopIteration
        self.left -= len(piece)
        return piece
