"""sha256 on a second core: hashlib releases the GIL for large updates, so a worker
thread can hash a stream while the main thread parses it."""

from __future__ import annotations

import hashlib
import queue
import threading

_SMALL = 64 * 1024  # below this, hashing inline is cheaper than a hand-off


class BackgroundSha256:
    """``update``/``digest``/``hexdigest`` like hashlib's, computed by a worker thread.

    Updates are applied in order; ``digest`` waits for the queued ones. At most
    ``depth`` buffers wait, so memory stays bounded when the hasher falls behind.
    ``abandon`` (error paths) stops the thread without a digest.

    With ``chunk_size``, the same pass also digests every ``chunk_size`` bytes of the
    stream on their own (``chunk_digests``; the last chunk may be short): the chunk
    digests of a pack that is the hashed file itself (a tarball used in place).
    """

    def __init__(self, depth: int = 8, chunk_size: int | None = None) -> None:
        self._hash = hashlib.sha256()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._done: hashlib._Hash | None = None
        self._chunk_size = chunk_size
        self._chunk = hashlib.sha256()
        self._chunk_fill = 0  # bytes in the current chunk
        self._chunk_digests: list[bytes] = []
        self._inline = False
        self._abandoned = False

    def hash_inline(self) -> None:
        """From now on hash in the caller's thread (the caller is a worker thread itself)."""
        if self._thread is not None:
            raise ValueError("the hashing thread already runs")
        self._inline = True

    def update(self, data: bytes) -> None:
        if self._done is not None:
            raise ValueError("update after digest")
        if self._inline or (len(data) < _SMALL and self._thread is None):
            self._apply(data)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
            self._thread.start()
        self._queue.put(bytes(data))

    def _apply(self, data: bytes) -> None:
        self._hash.update(data)
        size = self._chunk_size
        if size is None:
            return
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            take = min(size - self._chunk_fill, len(view) - pos)
            self._chunk.update(view[pos : pos + take])
            self._chunk_fill += take
            pos += take
            if self._chunk_fill == size:
                self._chunk_digests.append(self._chunk.digest())
                self._chunk = hashlib.sha256()
                self._chunk_fill = 0

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if not self._abandoned:  # else only drained, up to the stop marker
                self._apply(data)

    def abandon(self) -> None:
        """Stop the hashing thread, if any, without a digest (the stream failed): it would
        otherwise wait on its queue until the process exits. No digest after this."""
        self._abandoned = True
        if self._thread is not None and self._done is None:
            self._queue.put(None)
            self._thread.join()
        self._thread = None

    def _finish(self) -> hashlib._Hash:
        if self._abandoned:
            raise ValueError("no digest: the hashing was abandoned")
        if self._done is None:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
            if self._chunk_fill:
                self._chunk_digests.append(self._chunk.digest())
                self._chunk_fill = 0
            self._done = self._hash
        return self._done

    def digest(self) -> bytes:
        return self._finish().digest()

    def hexdigest(self) -> str:
        return self._finish().hexdigest()

    def chunk_digests(self) -> list[bytes]:
        """sha256 of each ``chunk_size`` bytes of what was hashed (needs ``chunk_size``)."""
        if self._chunk_size is None:
            raise ValueError("no chunk_size: chunk digests were not computed")
        self._finish()
        return self._chunk_digests


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class BackgroundFileSha256:
    """``file_sha256`` of ``path`` on a thread of its own (reads and hashlib release the
    GIL), started at once; ``result`` waits for it (and raises its error). A context
    manager: leaving it waits for the thread, so the file may go away after. A thread,
    not ``concurrent.futures``, whose import (with ``logging``) cost every build ~4-5 ms."""

    def __init__(self, path: str, name: str = "file-sha256") -> None:
        self._out: str | BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(path,), name=name, daemon=True)
        self._thread.start()

    def _run(self, path: str) -> None:
        try:
            self._out = file_sha256(path)
        except BaseException as e:  # raised in the caller's thread by result()
            self._out = e

    def result(self) -> str:
        self._thread.join()
        if isinstance(self._out, BaseException):
            raise self._out
        assert self._out is not None
        return self._out

    def __enter__(self) -> BackgroundFileSha256:
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join()
