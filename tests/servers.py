"""Real servers on loopback for the remote-pack tests and benchmarks: nginx and docker-registry.

Each runs as our own child process on a free 127.0.0.1 port, with its config, logs
and state in a directory of the caller's; `stop()` signals that process by its pid
(never by name) and `start()` brings it back on the same port, so tests can take a
server away mid-read and return it.

    with nginx_serving(bundle_parent, tmp_path / "nginx") as web:
        url = f"{web.url}/bundle/manifest.json"
        ...
        web.requests()   # parsed access log: one AccessRecord per request

    with docker_registry(tmp_path / "registry") as reg:
        reg.address      # "127.0.0.1:PORT" (plain HTTP)
        reg.requests()   # parsed access log (method, path, status)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NGINX = "/usr/sbin/nginx"
DOCKER_REGISTRY = "/usr/bin/docker-registry"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class AccessRecord:
    """One line of nginx's access log (format `bui` below)."""

    method: str
    path: str
    status: int
    bytes_sent: int  # body bytes
    range: str  # the request's Range header, "-" if none


class ServerProcess:
    """A server child process on a fixed loopback port; stop/start keep the port."""

    def __init__(
        self, argv: list[str], port: int, workdir: Path, name: str, host: str = "127.0.0.1"
    ) -> None:
        self.argv = argv
        self.host = host
        self.port = port
        self.workdir = workdir
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self, timeout: float = 20.0) -> None:
        assert self.proc is None, f"{self.name} already running"
        log = open(self.workdir / f"{self.name}.out", "ab")  # noqa: SIM115 (owned by the child)
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = (self.workdir / f"{self.name}.out").read_text(errors="replace")
                self.proc = None
                raise RuntimeError(f"{self.name} exited at start:\n{out[-2000:]}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.host, self.port), 0.2),
            ):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not listen on {self.address} within {timeout} s")

    def stop(self) -> None:
        """SIGTERM our child (SIGKILL after 10 s) and wait for it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


class Nginx(ServerProcess):
    """nginx serving `root` read-only (static files, byte ranges) on loopback."""

    def requests(self) -> list[AccessRecord]:
        """Every request logged so far (nginx writes the line when the response ends)."""
        path = self.workdir / "access.log"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            method, req_path, status, sent, rng = line.split("\t")
            out.append(AccessRecord(method, req_path, int(status), int(sent), rng))
        return out

    def clear_log(self) -> None:
        """Start a new access log (nginx reopens it on SIGUSR1)."""
        (self.workdir / "access.log").unlink(missing_ok=True)
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(0.2)


def _nginx_conf(root: Path, workdir: Path, port: int) -> str:
    temps = "\n".join(
        f"  {k}_temp_path {workdir}/tmp-{k};"
        for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""daemon off;
master_process off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 256; }}
http {{
  log_format bui "$request_method\\t$uri\\t$status\\t$body_bytes_sent\\t$http_range";
  access_log {workdir}/access.log bui;
{temps}
  types {{ application/json json; }}
  default_type application/octet-stream;
  sendfile on;
  server {{
    listen 127.0.0.1:{port};
    root {root};
    location / {{ }}
  }}
}}
"""


@contextlib.contextmanager
def nginx_serving(root: Path, workdir: Path) -> Iterator[Nginx]:
    """nginx (Debian's nginx-light) serving the directory `root`; config and logs in `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(_nginx_conf(root.resolve(), workdir.resolve(), port))
    server = Nginx(
        [NGINX, "-c", str(conf), "-e", str(workdir / "error.log")], port, workdir, "nginx"
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Registry(ServerProcess):
    """docker-registry; its access log (combined format) goes to its stdout, registry.out."""

    _LINE = re.compile(r'"(\S+) (\S+) HTTP/[0-9.]+" (\d+) (\d+|-)')

    def requests(self) -> list[AccessRecord]:
        """Every request logged so far (the line is written when the response ends)."""
        path = self.workdir / "registry.out"
        out = []
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if (m := self._LINE.search(line)) is not None and not line.startswith("time="):
                sent = 0 if m.group(4) == "-" else int(m.group(4))
                out.append(AccessRecord(m.group(1), m.group(2), int(m.group(3)), sent, "-"))
        return out


@contextlib.contextmanager
def docker_registry(
    workdir: Path, auth: str = "", host: str = "127.0.0.1", tls: tuple[Path, Path] | None = None
) -> Iterator[Registry]:
    """Debian's docker-registry (the reference OCI distribution registry), plain HTTP.

    `auth`: the config's `auth:` section as YAML flow text, e.g.
    `{htpasswd: {realm: test, path: /x/htpasswd}}`; default none (anonymous push).
    `tls`: (certificate, key) PEM files: HTTPS only. `host`: the address to listen on.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port(host)
    conf = workdir / "config.yml"
    conf.write_text(
        f"""version: 0.1
log: {{level: warn}}
storage:
  filesystem: {{rootdirectory: {workdir.resolve() / "storage"}}}
  delete: {{enabled: true}}
http:
  addr: {host}:{port}
"""
        + (f"  tls: {{certificate: {tls[0]}, key: {tls[1]}}}\n" if tls else "")
        + (f"auth: {auth}\n" if auth else "")
    )
    server = Registry([DOCKER_REGISTRY, "serve", str(conf)], port, workdir, "registry", host)
    server.start()
    try:
        yield server
    finally:
        server.stop()
