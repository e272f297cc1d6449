"""An HTTP proxy that injects faults between ublkd and a web server (issue 22's soak).

    python tests/faultproxy.py UPSTREAM PORT COUNTS [--drop P] [--stall P] [--stall-ms MS]
                               [--corrupt P] [--seed N]

Listens on 127.0.0.1:PORT and forwards GET/HEAD to UPSTREAM (http://HOST:PORT), headers
as sent (Range included). Requests with a Range header (ublkd's chunk fetches; whole-file
downloads such as `meta.img` pass untouched) meet, each with its probability:
  * drop: the status line and headers, half the body, then the connection is closed
    (a short body, as from a server or link that dies mid-response);
  * stall: the answer waits STALL_MS first;
  * corrupt: one byte of the body, at a random place, is flipped.
COUNTS is rewritten (atomically) after every request: {"requests", "ranges", "drop",
"stall", "corrupt"}.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit


def make_handler(
    upstream: str, counts_path: Path, args: argparse.Namespace
) -> type[BaseHTTPRequestHandler]:
    up = urlsplit(upstream)
    host, port = up.hostname or "127.0.0.1", up.port or 80
    lock = threading.Lock()
    rnd = random.Random(args.seed)
    counts = {"requests": 0, "ranges": 0, "drop": 0, "stall": 0, "corrupt": 0}

    def count(*kinds: str) -> None:
        with lock:
            for k in kinds:
                counts[k] += 1
            tmp = counts_path.with_suffix(f".tmp{threading.get_ident()}")
            tmp.write_text(json.dumps(counts))
            os.replace(tmp, counts_path)

    def draw() -> str | None:
        with lock:
            x = rnd.random()
        for kind, p in (("drop", args.drop), ("stall", args.stall), ("corrupt", args.corrupt)):
            if x < p:
                return kind
            x -= p
        return None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *a: object) -> None:  # noqa: A002
            pass

        def _forward(self, body: bool) -> None:
            conn = http.client.HTTPConnection(host, port, timeout=60)
            headers = {
                k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
            }
            conn.request(self.command, self.path, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            fault = draw() if "Range" in self.headers and resp.status == 206 and body else None
            count(
                "requests",
                *(["ranges"] if "Range" in self.headers else []),
                *([fault] if fault else []),
            )
            if fault == "stall":
                time.sleep(args.stall_ms / 1000)
            if fault == "corrupt" and data:
                at = rnd.randrange(len(data))
                data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not body:
                return
            if fault == "drop":
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._forward(True)

        def do_HEAD(self) -> None:
            self._forward(False)

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("upstream")
    ap.add_argument("port", type=int)
    ap.add_argument("counts", type=Path)
    ap.add_argument("--drop", type=float, default=0.0)
    ap.add_argument("--stall", type=float, default=0.0)
    ap.add_argument("--stall-ms", type=float, default=1000.0)
    ap.add_argument("--corrupt", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    server = ThreadingHTTPServer(
        ("127.0.0.1", args.port), make_handler(args.upstream, args.counts, args)
    )
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
