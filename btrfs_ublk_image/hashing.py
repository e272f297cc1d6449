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
    """

    def __init__(self, depth: int = 8) -> None:
        self._hash = hashlib.sha256()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._done: hashlib._Hash | None = None

    def update(self, data: bytes) -> None:
        if self._done is not None:
            raise ValueError("update after digest")
        if len(data) < _SMALL and self._thread is None:
            self._hash.update(data)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
            self._thread.start()
        self._queue.put(bytes(data))

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            self._hash.update(data)

    def _finish(self) -> hashlib._Hash:
        if self._done is None:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
            self._done = self._hash
        return self._done

    def digest(self) -> bytes:
        return self._finish().digest()

    def hexdigest(self) -> str:
        return self._finish().hexdigest()
