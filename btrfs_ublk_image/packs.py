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
rollback can touch it).

A pack's id is sha256 over its chunk digests, so verifying every chunk verifies
the pack; the file is stored as ``packs/<id hex>``.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from dataclasses import dataclass
from typing import BinaryIO, Protocol

import crc32c

from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.tree import Blob, Content

DEFAULT_CHUNK_SIZE = 1 << 20
COPY_BUFFER = 1 << 20


class Progress(Protocol):
    def add_bytes(self, n: int) -> None: ...


@dataclass(frozen=True, slots=True)
class PackInfo:
    """A finished pack: where it is and what the blockmap must record about it."""

    id: bytes  # sha256 over ``chunk_digests``
    size: int
    chunk_digests: list[bytes]
    path: str

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
    ) -> None:
        self.directory = directory
        self.keep_inline = keep_inline
        self.chunk_size = chunk_size
        self.progress = progress
        self._path = os.path.join(directory, "pack.tmp")
        self._file = open(self._path, "w+b")  # noqa: SIM115 (closed by finish or abort)
        self._size = 0
        # deduplication: (crc32c, size) -> blobs; a match is confirmed byte by byte, so the
        # content is hashed only once with sha256 (for the chunk digests)
        self._by_key: dict[tuple[int, int], list[Blob]] = {}
        self._hasher = _ChunkHasher(self._file.fileno(), chunk_size)
        self._submitted = 0  # chunks handed to the hasher (all of them final)
        self.bytes_in = 0  # content bytes offered, before dedup
        self.bytes_deduped = 0

    def put_bytes(self, data: bytes) -> Content:
        if len(data) <= self.keep_inline:
            self.bytes_in += len(data)
            return data
        return self._append_checked([data], len(data), "inline content")

    def put_stream(self, src: BinaryIO, size: int, where: str) -> Content:
        """Read exactly ``size`` bytes from ``src``; ``where`` names the entry in errors."""
        if size <= self.keep_inline:
            data = src.read(size)
            if len(data) != size:
                raise SourceError(f"{where}: truncated: expected {size} bytes, got {len(data)}")
            self.bytes_in += size
            return data
        return self._append_checked(_Reader(src, size, where), size, where)

    def put_pack_tail(self, data: bytes) -> Blob:
        """Append bytes that must live in the pack whatever their size (device 2's superblock)."""
        blob = self._append_checked([data], len(data), "device superblock", dedupe=False)
        assert isinstance(blob, Blob)
        return blob

    def _append_checked(
        self, pieces: list[bytes] | _Reader, size: int, where: str, dedupe: bool = True
    ) -> Content:
        start = self._size
        crc = 0
        written = 0
        for piece in pieces:
            crc = crc32c.crc32c(piece, crc)
            self._write(piece)
            written += len(piece)
            if self.progress is not None:
                self.progress.add_bytes(len(piece))
        if written != size:
            raise SourceError(f"{where}: truncated: expected {size} bytes, got {written}")
        self.bytes_in += size
        key = (crc, size)
        if dedupe:
            for old in self._by_key.get(key, ()):
                if self._same_bytes(old.offset, start, size):
                    # identical content already packed: roll the pack back to where it was
                    self._file.truncate(start)
                    self._file.seek(start)
                    self._size = start
                    self.bytes_deduped += size
                    return old
        blob = Blob(crc32c=crc, size=size, pack=0, offset=start)
        if dedupe:
            self._by_key.setdefault(key, []).append(blob)
        if self._size >= (self._submitted + 1) * self.chunk_size:
            self._submit(self._size // self.chunk_size)
        return blob

    def _submit(self, upto: int) -> None:
        """Hand chunks [submitted, upto) to the hasher: every byte of them is final."""
        self._file.flush()
        for index in range(self._submitted, upto):
            self._hasher.submit(index * self.chunk_size)
        self._submitted = upto

    def _same_bytes(self, a: int, b: int, size: int) -> bool:
        """Compare two ranges of the pack (just written: in the page cache)."""
        self._file.flush()
        fd = self._file.fileno()
        done = 0
        while done < size:
            n = min(COPY_BUFFER, size - done)
            if os.pread(fd, n, a + done) != os.pread(fd, n, b + done):
                return False
            done += n
        return True

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._size += len(data)

    def finish(self) -> list[PackInfo]:
        """Close the pack and name it by its id. Returns [] when nothing was packed."""
        self._submit(-(-self._size // self.chunk_size))  # the last chunk may be short
        digests = self._hasher.finish()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._size == 0:
            os.unlink(self._path)
            return []
        pack_id = hashlib.sha256(b"".join(digests)).digest()
        final = os.path.join(self.directory, pack_id.hex())
        os.rename(self._path, final)
        return [PackInfo(pack_id, self._size, digests, final)]

    def abort(self) -> None:
        self._hasher.stop()
        if not self._file.closed:
            self._file.close()


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
