"""A client of OCI distribution registries (the v2 HTTP API), shared by push and pull.

References: ``REGISTRY[:PORT]/REPO[:TAG]`` and ``REGISTRY[:PORT]/REPO[:TAG]@sha256:HEX``
(``parse_reference`` for pushes, which need a tag; ``parse_pull_reference`` for pulls).
HTTPS, except plain HTTP for loopback registries or when asked.

Auth: anonymous first; a 401's ``WWW-Authenticate`` challenge is answered once (Basic with
the credentials, Bearer with a token from the realm). Credentials (``credentials_for``):
``--auth USER:PASS``, else ``$BUI_REGISTRY_AUTH``, else docker's ``config.json``
(``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``, ``auths[REGISTRY].auth``).

Reading: ``get_manifest`` (by tag or digest; a digest is checked against the bytes) and
``get_blob`` (streamed to a file: hashed while it arrives, renamed into place only when
its sha256 and size match). Redirects of GETs are followed; ``Authorization`` goes only to
the registry itself.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import ipaddress
import json
import os
import re
import ssl
import tempfile
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from btrfs_ublk_image import __version__
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.ocispec import (
    ANNOTATION_TITLE,
    MT_DOCKER_LIST,
    MT_DOCKER_MANIFEST,
    MT_OCI_INDEX,
    MT_OCI_MANIFEST,
)
from btrfs_ublk_image.progress import Progress

# what a pull accepts for a manifest, by tag or digest
ACCEPT_MANIFESTS = ", ".join((MT_OCI_INDEX, MT_OCI_MANIFEST, MT_DOCKER_LIST, MT_DOCKER_MANIFEST))
AUTH_ENV = "BUI_REGISTRY_AUTH"
MAX_MANIFEST = 4 << 20  # manifests are read whole: bounded

_REPO_RE = re.compile(
    r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*)*"
)
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_IO_BLOCK = 1 << 20
_TIMEOUT = 300.0  # seconds without progress on one connection before we give up
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_REDIRECTS = 5
_REDIRECT_STATUS = (301, 302, 303, 307, 308)


# --- blobs --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Blob:
    """One file of the bundle as an OCI blob."""

    path: str | None  # file to stream from, or None: ``data`` holds the bytes
    data: bytes | None
    media_type: str
    digest: str  # "sha256:<hex>" of the bytes
    size: int
    title: str | None = None  # bundle-relative path (layer annotation)

    def descriptor(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.title is not None:
            d["annotations"] = {ANNOTATION_TITLE: self.title}
        return d


def bytes_blob(data: bytes, media_type: str, title: str | None = None) -> Blob:
    return Blob(
        None, data, media_type, "sha256:" + hashlib.sha256(data).hexdigest(), len(data), title
    )


# --- references and the registry ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Reference:
    registry: str  # host[:port]
    repo: str
    tag: str  # "" when only a digest was given
    digest: str | None = None  # sha256:<hex>: the manifest (or index) by digest

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repo}"
        if self.tag:
            out += f":{self.tag}"
        return out + (f"@{self.digest}" if self.digest else "")

    @property
    def reference(self) -> str:
        """What /v2/<repo>/manifests/<reference> takes: the digest if any, else the tag."""
        return self.digest or self.tag

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repo, self.tag, digest)


def parse_reference(text: str) -> Reference:
    """REGISTRY[:PORT]/REPO[:TAG] (tag default `latest`; an `oci://` prefix is accepted)."""
    if "@" in text.partition("/")[2]:
        raise ImageError(f"{text}: push needs a tag, not a digest")
    return parse_pull_reference(text)


def parse_pull_reference(text: str) -> Reference:
    """REGISTRY[:PORT]/REPO[:TAG][@sha256:HEX] (no tag and no digest: tag `latest`)."""
    ref = text.removeprefix("oci://")
    registry, slash, rest = ref.partition("/")
    if not slash or not registry or not rest:
        raise ImageError(f"{text}: not REGISTRY/REPO[:TAG] or REGISTRY/REPO@sha256:HEX")
    rest, at, digest = rest.partition("@")
    if at and not _DIGEST_RE.fullmatch(digest):
        raise ImageError(f"{text}: {digest!r} is not a sha256 digest (sha256:<64 hex digits>)")
    repo, _, tag = rest.rpartition(":") if ":" in rest else (rest, "", "" if at else "latest")
    if not _REPO_RE.fullmatch(repo):
        raise ImageError(f"{text}: {repo!r} is not a valid repository name (lowercase a-z0-9._-/)")
    if (tag or not at) and not _TAG_RE.fullmatch(tag):
        raise ImageError(f"{text}: {tag!r} is not a valid tag")
    return Reference(registry, repo, tag, digest or None)


def is_loopback(registry: str) -> bool:
    """127.0.0.0/8, [::1] or localhost, with or without a port."""
    if registry.startswith("["):
        name = registry[1 : registry.find("]")]
    else:
        name = registry.rsplit(":", 1)[0]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def parse_auth(text: str | None, where: str) -> tuple[str, str] | None:
    if not text:
        return None
    user, colon, password = text.partition(":")
    if not colon or not user:
        raise ImageError(f"{where}: credentials must be USER:PASS")
    return user, password


def docker_config_path(environ: dict[str, str] | None = None) -> Path:
    """``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``."""
    env = os.environ if environ is None else environ
    if env.get("DOCKER_CONFIG"):
        return Path(env["DOCKER_CONFIG"]) / "config.json"
    return Path(env.get("HOME") or os.path.expanduser("~")) / ".docker" / "config.json"


def docker_config_auth(registry: str, path: Path) -> tuple[str, str] | None:
    """``auths[REGISTRY].auth`` (base64 USER:PASS) of a docker config.json; None if the file
    or the entry is absent. Keys may carry a scheme and a path (``https://REGISTRY/v1/``)."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ImageError(f"{path}: cannot read docker config: {e}") from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        return None
    for key, entry in sorted(auths.items()):
        host = urllib.parse.urlsplit(key).netloc if "://" in key else key.split("/", 1)[0]
        if host != registry or not isinstance(entry, dict) or not entry.get("auth"):
            continue
        try:
            text = base64.b64decode(str(entry["auth"]), validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            raise ImageError(f"{path}: auths[{key!r}].auth is not base64 of USER:PASS") from None
        return parse_auth(text, f"{path}: auths[{key!r}].auth")
    return None


def credentials_for(
    registry: str, explicit: str | None = None, environ: dict[str, str] | None = None
) -> tuple[str, str] | None:
    """Credentials for ``registry``: ``explicit`` (--auth), else $BUI_REGISTRY_AUTH, else the
    docker config.json entry of that registry, else None (anonymous)."""
    env = os.environ if environ is None else environ
    if explicit is not None:
        return parse_auth(explicit, "--auth")
    if env.get(AUTH_ENV):
        return parse_auth(env[AUTH_ENV], AUTH_ENV)
    return docker_config_auth(registry, docker_config_path(dict(env)))


@dataclass
class Response:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


def _error_text(body: bytes) -> str:
    """The registry's `errors` body as one line, else the start of the body."""
    try:
        errs = json.loads(body).get("errors")
        return "; ".join(
            f"{e.get('code', '?')}: {e.get('message', '')}"
            + (f" ({json.dumps(e['detail'])})" if e.get("detail") else "")
            for e in errs
        )
    except (ValueError, AttributeError, TypeError):
        return body[:300].decode(errors="replace").strip()


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """`Bearer realm="..",service="..",scope=".."` -> ("bearer", {..})."""
    scheme, _, rest = header.strip().partition(" ")
    params = {
        m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
        for m in re.finditer(r'([A-Za-z]+)=(?:"([^"]*)"|([^,\s]*))', rest)
    }
    return scheme.lower(), params


Body = bytes | Blob | None
Sink = Callable[[bytes], None]  # takes a 200 response's body, block by block


@dataclass
class Registry:
    """A client of one repository of an OCI distribution registry (the v2 HTTP API)."""

    ref: Reference
    plain_http: bool = False
    credentials: tuple[str, str] | None = None
    progress: Progress | None = None
    actions: str = "pull,push"  # the scope asked of a Bearer token service
    _conn: http.client.HTTPConnection | None = None
    _authorization: str | None = None
    uploaded: list[Blob] = field(default_factory=list)
    skipped: list[Blob] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.ref.registry}/{self.ref.repo}"

    @property
    def scheme(self) -> str:
        return "http" if self.plain_http or is_loopback(self.ref.registry) else "https"

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self, netloc: str, scheme: str) -> http.client.HTTPConnection:
        """The kept-alive connection to the registry, or a new one for another host (a
        token realm), closed by the caller."""
        if netloc != self.ref.registry or scheme != self.scheme:
            return _new_connection(netloc, scheme)
        if self._conn is None:
            self._conn = _new_connection(netloc, scheme)
        return self._conn

    def _send(
        self, method: str, url: str, headers: dict[str, str], body: Body, sink: Sink | None = None
    ) -> Response:
        parts = urllib.parse.urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        shared = parts.netloc == self.ref.registry and parts.scheme == self.scheme
        conn = self._connection(parts.netloc, parts.scheme)
        try:
            conn.putrequest(method, target, skip_accept_encoding=True)
            conn.putheader("User-Agent", f"btrfs-ublk-image/{__version__}")
            if body is None:
                size = 0
            elif isinstance(body, bytes):
                size = len(body)
            else:
                size = body.size
            if body is not None or method in ("PUT", "POST", "PATCH"):
                conn.putheader("Content-Length", str(size))
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders()
            if isinstance(body, bytes):
                conn.send(body)
            elif isinstance(body, Blob):
                for block in _blob_blocks(body):
                    conn.send(block)
                    if self.progress is not None:
                        self.progress.add_bytes(len(block))
            resp = conn.getresponse()
            if sink is not None and resp.status == 200:
                while block := resp.read(_IO_BLOCK):
                    sink(block)
                return Response(resp.status, resp.headers, b"")
            return Response(resp.status, resp.headers, resp.read())
        except (OSError, http.client.HTTPException) as e:
            self.close()
            reason = (
                e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
            )
            raise ImageError(
                f"{self.where}: {method} {parts.scheme}://{parts.netloc}{parts.path}: {reason}"
            ) from None
        except BaseException:  # e.g. a pack unreadable mid-upload: the request is half sent
            self.close()
            raise
        finally:
            if not shared:
                conn.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        body: Body = None,
        ok: tuple[int, ...] = (200,),
        sink: Sink | None = None,
    ) -> Response:
        """One API request (`path` under /v2/<repo>/ or an absolute upload URL), with the
        registry's auth challenge answered once and redirects of GET and HEAD followed; an
        unexpected status is an ImageError. ``sink`` takes the body of a 200 as it arrives."""
        url = path if "://" in path else f"{self.scheme}://{self.ref.registry}{path}"
        for _ in range(_REDIRECTS + 1):
            resp = self._authorized(method, url, headers or {}, body, sink)
            location = resp.headers.get("Location")
            if method not in ("GET", "HEAD") or resp.status not in _REDIRECT_STATUS or not location:
                break
            url = urllib.parse.urljoin(url, location)
        else:
            raise ImageError(f"{self.where}: {method} {path}: more than {_REDIRECTS} redirects")
        if resp.status not in ok:
            detail = _error_text(resp.body)
            hint = ""
            if resp.status == 401:
                hint = (
                    " (credentials refused)"
                    if self.credentials
                    else " (the registry needs credentials: --auth USER:PASS,"
                    f" {AUTH_ENV} or docker's config.json)"
                )
            raise ImageError(
                f"{self.where}: {method} {urllib.parse.urlsplit(url).path}: HTTP {resp.status}"
                f"{hint}" + (f": {detail}" if detail else "")
            )
        return resp

    def _authorized(
        self, method: str, url: str, headers: dict[str, str], body: Body, sink: Sink | None
    ) -> Response:
        """One request, sent again once with the answer to a 401's challenge."""
        hdrs = dict(headers)
        # credentials go to the registry only, never to another host a URL names
        ours = urllib.parse.urlsplit(url).netloc == self.ref.registry
        for attempt in range(2):
            if self._authorization is not None and ours:
                hdrs["Authorization"] = self._authorization
            resp = self._send(method, url, hdrs, body, sink)
            if not (resp.status == 401 and attempt == 0 and ours and self._authenticate(resp)):
                break
        return resp

    def _authenticate(self, resp: Response) -> bool:
        """Answer a 401's challenge; False when there is nothing new to try (no challenge,
        Basic without credentials or with the ones just refused)."""
        header = resp.headers.get("WWW-Authenticate")
        if not header:
            return False
        scheme, params = _parse_challenge(header)
        if scheme == "basic":
            if self.credentials is None:
                return False  # the 401 becomes the error, with the hint
            token = base64.b64encode(":".join(self.credentials).encode()).decode()
            if self._authorization == f"Basic {token}":
                return False
            self._authorization = f"Basic {token}"
        elif scheme == "bearer":
            self._authorization = f"Bearer {self._bearer_token(params)}"
        else:
            raise ImageError(f"{self.where}: unsupported auth scheme in WWW-Authenticate: {header}")
        return True

    def _bearer_token(self, params: dict[str, str]) -> str:
        realm = params.get("realm")
        if not realm or urllib.parse.urlsplit(realm).scheme not in ("http", "https"):
            raise ImageError(f"{self.where}: Bearer challenge without a usable realm: {params}")
        query = [("service", params["service"])] if "service" in params else []
        scopes = {params["scope"]} if "scope" in params else set()
        scopes.add(f"repository:{self.ref.repo}:{self.actions}")
        query += [("scope", s) for s in sorted(scopes)]
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        headers = {}
        if self.credentials is not None:
            basic = base64.b64encode(":".join(self.credentials).encode()).decode()
            headers["Authorization"] = f"Basic {basic}"
        resp = self._send("GET", url, headers, None)
        if resp.status != 200:
            hint = (
                ""
                if self.credentials
                else f" (no credentials given: --auth USER:PASS, {AUTH_ENV} or docker's config.json)"
            )
            raise ImageError(
                f"{self.where}: token from {realm}: HTTP {resp.status}{hint}: {_error_text(resp.body)}"
            )
        try:
            answer = json.loads(resp.body)
            token = answer.get("token") or answer.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise ImageError(f"{self.where}: token from {realm}: no token in the answer")
        return token

    # --- the distribution API ---------------------------------------------------------
    def has_blob(self, digest: str) -> bool:
        resp = self.request("HEAD", f"/v2/{self.ref.repo}/blobs/{digest}", ok=(200, 404))
        return resp.status == 200

    def put_blob(self, blob: Blob) -> None:
        """Upload unless the registry has it: POST a session, then one monolithic PUT."""
        if self.has_blob(blob.digest):
            self.skipped.append(blob)
            return
        start = self.request("POST", f"/v2/{self.ref.repo}/blobs/uploads/", ok=(202,))
        location = start.headers.get("Location")
        if not location:
            raise ImageError(f"{self.where}: upload started without a Location header")
        location = urllib.parse.urljoin(f"{self.scheme}://{self.ref.registry}/", location)
        sep = "&" if urllib.parse.urlsplit(location).query else "?"
        url = f"{location}{sep}digest={urllib.parse.quote(blob.digest)}"
        body: Body = blob.data if blob.data is not None else blob
        self.request(
            "PUT", url, headers={"Content-Type": "application/octet-stream"}, body=body, ok=(201,)
        )
        self.uploaded.append(blob)
        if self.progress is not None:
            self.progress.add_file()

    def put_manifest(self, reference: str, data: bytes, media_type: str) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        resp = self.request(
            "PUT",
            f"/v2/{self.ref.repo}/manifests/{reference}",
            headers={"Content-Type": media_type},
            body=data,
            ok=(201,),
        )
        echoed = resp.headers.get("Docker-Content-Digest")
        if echoed and echoed != digest:
            raise ImageError(f"{self.where}: registry stored manifest {echoed}, we sent {digest}")
        return digest

    def get_manifest(self, reference: str, accept: str) -> bytes | None:
        """The manifest bytes, None if the registry has no such manifest."""
        resp = self.request(
            "GET",
            f"/v2/{self.ref.repo}/manifests/{reference}",
            headers={"Accept": accept},
            ok=(200, 404),
        )
        return resp.body if resp.status == 200 else None

    def pull_manifest(self, reference: str) -> tuple[bytes, str]:
        """A manifest or an index by tag or digest: (bytes, media type). Fetched by digest,
        its bytes must have that sha256. A missing one is an ImageError naming it."""
        name = f"{self.where}@{reference}" if ":" in reference else f"{self.where}:{reference}"
        resp = self.request(
            "GET",
            f"/v2/{self.ref.repo}/manifests/{reference}",
            headers={"Accept": ACCEPT_MANIFESTS},
            ok=(200, 404),
        )
        if resp.status == 404:
            raise ImageError(f"{name}: no such manifest in the registry")
        if len(resp.body) > MAX_MANIFEST:
            raise ImageError(f"{name}: manifest of {len(resp.body)} bytes, more than allowed")
        got = "sha256:" + hashlib.sha256(resp.body).hexdigest()
        if _DIGEST_RE.fullmatch(reference) and got != reference:
            raise ImageError(f"{name}: the registry sent a manifest whose sha256 is {got}")
        media_type = (resp.headers.get("Content-Type") or "").split(";")[0].strip()
        try:
            doc = json.loads(resp.body)
        except (ValueError, UnicodeDecodeError):
            raise ImageError(f"{name}: the manifest is not JSON") from None
        if isinstance(doc, dict) and isinstance(doc.get("mediaType"), str):
            media_type = doc["mediaType"]  # the document's own word wins over the header
        return resp.body, media_type

    def get_blob(self, digest: str, dest: str, size: int | None = None) -> int:
        """Blob ``digest`` streamed into the file ``dest``: written to a temporary file in
        its directory, hashed on the way and renamed to ``dest`` only when its sha256 (and
        ``size``, when given) match; otherwise nothing is left. Returns its size."""
        if not _DIGEST_RE.fullmatch(digest):
            raise ImageError(f"{self.where}: unsupported or invalid blob digest {digest!r}")
        return self.get_file(f"/v2/{self.ref.repo}/blobs/{digest}", dest, digest, size)

    def get_file(self, path: str, dest: str, digest: str | None, size: int | None) -> int:
        """The body of GET ``path`` (under the registry, or an absolute URL) streamed into
        ``dest`` as ``get_blob`` does, checked against ``digest`` and ``size`` where given.
        Returns its size."""
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(dest) or ".")
        blob = path.endswith(f"/blobs/{digest}")
        h = hashlib.sha256()
        got_size = 0
        try:
            with os.fdopen(fd, "wb") as f:

                def sink(block: bytes) -> None:
                    nonlocal got_size
                    h.update(block)
                    f.write(block)
                    got_size += len(block)
                    if self.progress is not None:
                        self.progress.add_bytes(len(block))

                self.request("GET", path, sink=sink)
                got = "sha256:" + h.hexdigest()
                where = f"{self.where}: " + (
                    f"blob {digest}" if blob else urllib.parse.urlsplit(path).path
                )
                if digest is not None and got != digest:
                    raise ImageError(
                        f"{where}: the registry sent {got_size} bytes whose sha256 is {got}"
                        " (refused, not cached)"
                        if blob
                        else f"{where}: {got_size} bytes whose sha256 is {got}, expected"
                        f" {digest} (refused, not kept)"
                    )
                if size is not None and got_size != size:
                    what = "its descriptor says" if blob else "expected"
                    raise ImageError(f"{where}: {got_size} bytes, {what} {size}")
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, dest)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return got_size


def _new_connection(netloc: str, scheme: str) -> http.client.HTTPConnection:
    if scheme == "https":
        ctx = ssl.create_default_context()
        return http.client.HTTPSConnection(netloc, timeout=_TIMEOUT, context=ctx)
    return http.client.HTTPConnection(netloc, timeout=_TIMEOUT)


def _blob_blocks(blob: Blob) -> Iterator[bytes]:
    assert blob.path is not None
    try:
        with open(blob.path, "rb") as f:
            while block := f.read(_IO_BLOCK):
                yield block
    except OSError as e:
        raise ImageError(f"{blob.path}: cannot read: {e.strerror}") from None
