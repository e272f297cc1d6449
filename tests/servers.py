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

import base64
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


def stop_child(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM our child ``proc`` by its pid, SIGKILL after ``grace`` seconds, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


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
        if self.proc is not None:
            stop_child(self.proc, 10)
        self.proc = None


class Nginx(ServerProcess):
    """nginx serving `root` read-only (static files, byte ranges) on loopback; with TLS,
    `ca` is the certificate that signed its certificate (for 127.0.0.1)."""

    ca: Path | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.ca else 'http'}://{self.address}"

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


def make_tls_certs(workdir: Path) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate for 127.0.0.1 it signed -> (ca, cert, key)."""
    ca, ca_key = workdir / "ca.crt", workdir / "ca.key"
    cert, key, csr = workdir / "server.crt", workdir / "server.key", workdir / "server.csr"
    ext = workdir / "server.ext"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
    )
    for argv in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test CA"]
        + ["-keyout", str(ca_key), "-out", str(ca)],
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1"]
        + ["-keyout", str(key), "-out", str(csr)],
        ["x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key)]
        + ["-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert)],
    ):
        subprocess.run(["openssl", *argv], check=True, capture_output=True)
    return ca, cert, key


def _nginx_conf(root: Path, workdir: Path, port: int, redirects: dict[str, str], tls: bool) -> str:
    listen = (
        f"{port} ssl;\n    ssl_certificate {workdir}/server.crt;\n"
        f"    ssl_certificate_key {workdir}/server.key"
        if tls
        else str(port)
    )
    moves = "\n".join(
        f"    location {src} {{ rewrite ^{src}(.*)$ {dst}$1 redirect; }}"
        for src, dst in redirects.items()
    )
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
    listen 127.0.0.1:{listen};
    root {root};
    location / {{ }}
{moves}
  }}
}}
"""


@contextlib.contextmanager
def nginx_serving(
    root: Path, workdir: Path, redirects: dict[str, str] | None = None, tls: bool = False
) -> Iterator[Nginx]:
    """nginx (Debian's nginx-light) serving the directory `root`; config and logs in `workdir`.
    `redirects`: URL prefix -> prefix it answers with a 302 to (e.g. "/moved/": "/b/").
    `tls`: HTTPS with a certificate of a test CA (`server.ca`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ca = make_tls_certs(workdir)[0] if tls else None
    conf = workdir / "nginx.conf"
    conf.write_text(_nginx_conf(root.resolve(), workdir.resolve(), port, redirects or {}, tls))
    server = Nginx(
        [NGINX, "-c", str(conf), "-e", str(workdir / "error.log")], port, workdir, "nginx"
    )
    server.ca = ca
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


def htpasswd_auth(workdir: Path, user: str, password: str) -> str:
    """docker_registry's `auth` for htpasswd (Basic) auth with one user (bcrypt file in workdir)."""
    htpasswd = workdir / "htpasswd"
    r = subprocess.run(
        ["htpasswd", "-Bbn", user, password], capture_output=True, text=True, check=True
    )
    htpasswd.write_text(r.stdout)
    return f"{{htpasswd: {{realm: bui-test, path: {htpasswd}}}}}"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenService:
    """A Docker token service (the registry's `auth: token`): checks Basic credentials and
    issues an RS256 JWT signed by openssl with a self-signed key the registry trusts."""

    def __init__(self, workdir: Path, user: str, password: str) -> None:
        self.key = workdir / "token.key"
        self.cert = workdir / "token.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
            + ["-subj", "/CN=bui-token", "-keyout", self.key, "-out", self.cert],
            capture_output=True,
            check=True,
        )
        der = subprocess.run(
            ["openssl", "x509", "-in", self.cert, "-outform", "DER"],
            capture_output=True,
            check=True,
        ).stdout
        self.x5c = base64.b64encode(der).decode()
        self.basic = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.scopes: list[list[str]] = []  # the scopes each token request asked for
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                from urllib.parse import parse_qs, urlsplit

                query = parse_qs(urlsplit(self.path).query)
                service.scopes.append(query.get("scope", []))
                if self.headers.get("Authorization") != service.basic:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps({"token": service.token(query)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.realm = f"http://127.0.0.1:{self.server.server_address[1]}/token"

    def token(self, query: dict[str, list[str]]) -> str:
        access: list[dict[str, object]] = []
        for scope in query.get("scope", []):
            kind, name, actions = scope.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {
            "iss": "bui-test-issuer",
            "sub": "pusher",
            "aud": query["service"][0],
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": os.urandom(8).hex(),
            "access": access,
        }
        signing_input = (
            f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        )
        signature = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)],
            input=signing_input.encode(),
            capture_output=True,
            check=True,
        ).stdout
        return f"{signing_input}.{_b64url(signature)}"

    @contextlib.contextmanager
    def running(self) -> Iterator[TokenService]:
        thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()
            thread.join()


class SlowHttp(ServerProcess):
    """tests/slowhttp.py: static files with a fixed delay before every response."""

    def requests(self) -> list[AccessRecord]:
        path = self.workdir / "access.log"
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            method, req_path, status, sent, rng = line.split("\t")
            out.append(AccessRecord(method, req_path, int(status), int(sent), rng))
        return out


@contextlib.contextmanager
def slow_http(root: Path, workdir: Path, delay_ms: float) -> Iterator[SlowHttp]:
    """Serve `root` on loopback, every response `delay_ms` late (a latency source)."""
    import sys

    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    script = Path(__file__).resolve().parent / "slowhttp.py"
    argv = [sys.executable, str(script), str(root), str(port), str(delay_ms)]
    server = SlowHttp(argv + [str(workdir / "access.log")], port, workdir, "slowhttp")
    server.start()
    try:
        yield server
    finally:
        server.stop()


class FaultProxy(ServerProcess):
    """tests/faultproxy.py: a proxy in front of `upstream` that drops connections
    mid-body, stalls, and flips bytes in range responses; `counts()` says how often."""

    def counts(self) -> dict[str, int]:
        path = self.workdir / "faults.json"
        out: dict[str, int] = json.loads(path.read_text()) if path.exists() else {}
        return out


@contextlib.contextmanager
def fault_proxy(
    upstream: str,
    workdir: Path,
    *,
    drop: float = 0.0,
    stall: float = 0.0,
    stall_ms: float = 1000.0,
    corrupt: float = 0.0,
    seed: int | None = None,
) -> Iterator[FaultProxy]:
    """Proxy `upstream` (http://HOST:PORT) on loopback, injecting faults into the
    responses to range requests with the given probabilities (see tests/faultproxy.py)."""
    import sys

    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    script = Path(__file__).resolve().parent / "faultproxy.py"
    argv = [sys.executable, str(script), upstream, str(port), str(workdir / "faults.json"),
            "--drop", str(drop), "--stall", str(stall), "--stall-ms", str(stall_ms),
            "--corrupt", str(corrupt)]  # fmt: skip
    if seed is not None:
        argv += ["--seed", str(seed)]
    proxy = FaultProxy(argv, port, workdir, "faultproxy")
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
