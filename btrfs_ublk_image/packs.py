"""Pack files: the image's file content, deduplicated, in fixed-size verified chunks.

Sources stream each regular file into a ``PackWriter`` exactly once. Content at
most ``keep_inline`` bytes long stays in memory (the btrfs writer may make it an
inline extent); anything larger is appended to the open pack while two hashes
run over it: the content's CRC-32C (deduplication: a copy whose CRC and size
match earlier content is compared byte by byte, then rolled back and the first
``Blob`` returned) and the pack's chunk digests (sha256 of every ``chunk_size``
bytes of the pack, which ublkd checks before serving a byte). So the content
is hashed with sha256 once.

A pack's id is sha256 over its chunk digests, so verifying every chunk verifies
the pack; the file is stored as ``packs/<id hex>``.
"""

from __future__ import annotations

import hashlib
import os
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
        self._chunk_digests: list[bytes] = []
        self._chunk = hashlib.sha256()  # digest of the chunk being filled
        self._chunk_fill = 0
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
        saved = (self._chunk.copy(), self._chunk_fill, len(self._chunk_digests))
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
                    self._chunk, self._chunk_fill = saved[0], saved[1]
                    del self._chunk_digests[saved[2] :]
                    self.bytes_deduped += size
                    return old
        blob = Blob(crc32c=crc, size=size, pack=0, offset=start)
        if dedupe:
            self._by_key.setdefault(key, []).append(blob)
        return blob

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
        if self._chunk_fill + len(data) < self.chunk_size:  # the common case: inside one chunk
            self._chunk.update(data)
            self._chunk_fill += len(data)
            return
        view = memoryview(data)
        while view:
            take = min(len(view), self.chunk_size - self._chunk_fill)
            self._chunk.update(view[:take])
            self._chunk_fill += take
            view = view[take:]
            if self._chunk_fill == self.chunk_size:
                self._chunk_digests.append(self._chunk.digest())
                self._chunk = hashlib.sha256()
                self._chunk_fill = 0

    def finish(self) -> list[PackInfo]:
        """Close the pack and name it by its id. Returns [] when nothing was packed."""
        if self._chunk_fill:
            self._chunk_digests.append(self._chunk.digest())
            self._chunk_fill = 0
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._size == 0:
            os.unlink(self._path)
            return []
        pack_id = hashlib.sha256(b"".join(self._chunk_digests)).digest()
        final = os.path.join(self.directory, pack_id.hex())
        os.rename(self._path, final)
        return [PackInfo(pack_id, self._size, list(self._chunk_digests), final)]

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()


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
