"""gzip streams inflated on a worker thread, the compressed blob hashed there too.

The tar reader parses on the main thread; this thread reads the compressed file,
hashes it (the blob digest) and inflates it; the result (an OCI layer's diff_id) is
hashed on a third thread (``BackgroundSha256``: the Debian OCI build 1.77 -> 1.68 s
wall median, the inflating thread was the one the parser waited for). ISA-L's
inflate (``isal``, about twice zlib's speed) and hashlib release the GIL while they
work, and every call handles up to a MiB, so the threads run on separate cores with
few hand-offs (Python's ``gzip.GzipFile`` inflates in 8 KiB steps and checks the CRC
itself: thousands of GIL round trips, all on the parsing thread).

Semantics follow ``gzip.GzipFile``: members one after another, zero padding
between or after them ignored, anything else after a member an error. The inflater
checks each member's header, CRC-32 and length (``wbits=31``: the gzip wrapper).
Output per inflate call is capped, so a gzip bomb costs time, not memory; at most
``depth`` pieces wait.
"""

from __future__ import annotations

import queue
import threading
from typing import Protocol, cast

from isal.igzip_lib import DECOMP_GZIP, IgzipDecompressor, IsalError

from btrfs_ublk_image.hashing import BackgroundSha256

IN_SIZE = 1 << 20  # compressed bytes per read
OUT_SIZE = 1 << 20  # inflated bytes per piece at most
GZIP_MAGIC = b"\x1f\x8b"


class _Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


InflateError = cast(type[Exception], IsalError)  # corrupt deflate data, a CRC-32 or length mismatch


class GzipError(OSError):
    """Not gzip where a member should start (``gzip.BadGzipFile``'s message)."""


class ThreadedGunzip:
    """A readable of the inflated stream of ``raw`` (gzip members), inflated on a worker
    thread; with ``digest``, ``hexdigest()`` gives the sha256 of the inflated stream.

    ``raw`` is read only by the worker (start to end, so it may hash what it reads),
    from the first ``read``; errors (``InflateError``, ``EOFError`` for a truncated
    stream, ``GzipError``, and whatever ``raw`` raises) come out of ``read``. The end
    (``b""``) comes only after ``raw`` is read to its end and every member checked.
    ``close`` stops the worker early (on the caller's errors). The digest is complete
    when the end is read; an error or an early ``close`` stops the hashing thread too.
    """

    def __init__(self, raw: _Readable, digest: bool = False, depth: int = 4) -> None:
        self._raw = raw
        self._hash = BackgroundSha256(depth=8) if digest else None
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=depth)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._piece = b""
        self._off = 0
        self._ended = False
        self._complete = False  # the end was read: the stream is whole, its digest final

    # ---- consumer (the parsing thread) ----

    def read(self, n: int = -1, /) -> bytes:
        """Up to ``n`` bytes (all remaining when negative); fewer, but some, before the end."""
        if self._off >= len(self._piece):
            if self._ended:
                return b""
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gunzip", daemon=True)
                self._thread.start()
            item = self._queue.get()
            if item is None:
                self._ended = self._complete = True
                self._thread.join()
                if self._hash is not None:
                    self._hash.digest()  # waits for the hashing thread, which then ends
                return b""
            if isinstance(item, BaseException):
                self._ended = True
                self._thread.join()
                if self._hash is not None:
                    self._hash.abandon()
                raise item
            self._piece, self._off = item, 0
        if n < 0:
            pieces = [self.read(OUT_SIZE)]
            while pieces[-1]:
                pieces.append(self.read(OUT_SIZE))
            return b"".join(pieces)
        off = self._off
        if off == 0 and n >= len(self._piece):
            self._off = len(self._piece)
            return self._piece
        self._off = off + n
        return self._piece[off : off + n]

    def readable(self) -> bool:
        return True

    def hexdigest(self) -> str:
        """sha256 of the whole inflated stream (after the end was read)."""
        if self._hash is None or not self._complete:
            raise ValueError("no digest: not asked for, or the stream was not read to its end")
        return self._hash.hexdigest()

    def close(self) -> None:
        """Stop the worker (if running) and wait for it; reads give nothing more."""
        self._ended = True
        self._piece, self._off = b"", 0
        thread = self._thread
        if thread is not None:
            self._stop = True  # a worker waiting to hand over a piece gives up within 50 ms
            thread.join()
            self._thread = None
        if self._hash is not None and not self._complete:
            self._hash.abandon()

    # ---- worker ----

    def _run(self) -> None:
        try:
            self._inflate()
            self._put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the reading thread
            self._put(e)

    def _put(self, item: bytes | BaseException | None) -> None:
        while not self._stop:
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                pass

    def _emit(self, data: bytes) -> None:
        if self._hash is not None:
            self._hash.update(data)
        self._put(data)

    def _inflate(self) -> None:
        raw = self._raw
        # the gzip wrapper: header, CRC-32 and length checked. Unlike a zlib decompressobj,
        # it keeps input it has not used (no ``unconsumed_tail`` copied back and forth when
        # the output cap is reached: 5-10% of the inflating thread's time)
        d = IgzipDecompressor(DECOMP_GZIP)
        pending = b""  # compressed input not yet given to d
        in_member = True  # the caller saw the magic of the first member
        while not self._stop:
            if not in_member:
                # between members: zero padding, then another member or the end
                pending = pending.lstrip(b"\0")
                while len(pending) < len(GZIP_MAGIC):
                    more = raw.read(IN_SIZE)
                    if not more:
                        break
                    pending = (pending + more).lstrip(b"\0")
                if not pending:
                    return
                if not pending.startswith(GZIP_MAGIC):
                    raise GzipError(f"Not a gzipped file ({pending[:2]!r})")
                d = IgzipDecompressor(DECOMP_GZIP)
                in_member = True
            if d.needs_input:
                if not pending:
                    pending = raw.read(IN_SIZE)
                    if not pending:
                        raise EOFError(
                            "Compressed file ended before the end-of-stream marker was reached"
                        )
                out = d.decompress(pending, OUT_SIZE)
                pending = b""
            else:  # output the cap held back
                out = d.decompress(b"", OUT_SIZE)
            if out:
                self._emit(out)
            if d.eof:
                pending = d.unused_data
                in_member = False
