"""A static HTTP server that waits before every response: a latency source for tests and
benchmarks of remote bundles (issue 21).

    python tests/slowhttp.py ROOT PORT DELAY_MS [LOG]

Serves the files under ROOT on 127.0.0.1:PORT (GET and HEAD, single byte ranges: what
ublkd asks for), each request answered DELAY_MS after it arrived, every request on its
own thread, so N requests in flight wait DELAY_MS together, not N times. LOG (optional)
gets one line per request: method, path, status, body bytes, range.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


def make_handler(root: Path, delay: float, log: Path | None) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()
    # one open log; bodies by sendfile: the server's own CPU per request stays small (it
    # adds to every request's latency, and under TCG it is what 16 parallel readers wait
    # for once the delay itself overlaps)
    log_file = open(log, "a", buffering=1) if log is not None else None  # noqa: SIM115

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def _record(self, status: int, sent: int) -> None:
            if log_file is not None:
                line = f"{self.command}\t{self.path}\t{status}\t{sent}\t{self.headers.get('Range', '-')}\n"
                with lock:
                    log_file.write(line)

        def _serve(self, body: bool) -> None:
            time.sleep(delay)
            path = (root / self.path.split("?", 1)[0].lstrip("/")).resolve()
            if not path.is_relative_to(root) or not path.is_file():
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                self._record(404, 0)
                return
            size = path.stat().st_size
            start, end, status = 0, size, 200
            if (m := _RANGE.match(self.headers.get("Range", ""))) is not None:
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
                if start >= size or start >= end:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    self._record(416, 0)
                    return
                status = 206
            self.send_response(status)
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.end_headers()
            sent = 0
            if body:
                self.wfile.flush()
                with open(path, "rb") as f:
                    while sent < end - start:
                        n = os.sendfile(self.connection.fileno(), f.fileno(), start + sent,
                                        end - start - sent)  # fmt: skip
                        if n <= 0:
                            break
                        sent += n
            self._record(status, sent)

        def do_GET(self) -> None:  # noqa: N802
            self._serve(True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(False)

    return Handler


def main() -> None:
    root, port, delay_ms = Path(sys.argv[1]).resolve(), int(sys.argv[2]), float(sys.argv[3])
    log = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    # the default listen backlog (5) drops the SYNs of a burst of new connections, which
    # the client then retries a second later
    ThreadingHTTPServer.request_queue_size = 256
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(root, delay_ms / 1000, log))
    server.daemon_threads = True
    os.write(1, b"ready\n")
    server.serve_forever()


if __name__ == "__main__":
    main()
