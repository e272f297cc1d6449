"""`oci: {ref: REGISTRY/REPO:TAG}` sources: pulled from docker-registry on loopback through the
digest-checked cache, pinned by the spec's lock file; the registry client's reading side.

Oracles: the same image as a local OCI layout (written by tests/ocitools.py, copied into the
registry by skopeo, which keeps its digests), the registry's access log, and the registry's
own storage directory (a blob corrupted there is what a broken or hostile registry serves).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ocitools import Layout, entry
from servers import Registry, TokenService, docker_registry, htpasswd_auth
from test_push import ok, push

from btrfs_ublk_image import pull
from btrfs_ublk_image.errors import ImageError, SpecError
from btrfs_ublk_image.registry import AUTH_ENV, credentials_for, parse_pull_reference
from btrfs_ublk_image.spec import parse_spec

pytestmark = pytest.mark.unit
DIR = tarfile.DIRTYPE

BASE = [
    entry("etc", DIR),
    entry("etc/passwd", data=b"root:x:0:0\n"),
    entry("etc/motd", data=b"welcome\n"),
    entry("usr", DIR),
    entry("usr/share", DIR),
    entry("usr/share/doc", DIR),
    entry("usr/share/doc/a", data=b"a" * 5000),
    entry("usr/share/doc/b", data=b"b" * 3000),
]
TOP = [
    entry("etc/.wh.motd"),  # whiteout of a lower file
    entry("usr/share/doc/.wh..wh..opq"),  # opaque: a and b go
    entry("usr/share/doc/c", data=b"c" * 7000),
    entry("srv", DIR),
    entry("srv/data", data=os.urandom(3 << 20)),
]
CONFIG = {"Env": ["PATH=/usr/bin", "A=1"], "Entrypoint": ["/bin/sh", "-c"], "WorkingDir": "/srv"}


def skopeo_copy(src: str, dest: str, *extra: str) -> None:
    r = subprocess.run(
        ["skopeo", "copy", "-q", "--dest-tls-verify=false", *extra, src, dest],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr


def make_layout(root: Path, tag: str, extra: bytes = b"") -> Layout:
    """Two layers (the second with whiteouts and an opaque dir), amd64 and arm64 in an index."""
    lay = Layout(root)
    top = [*TOP, entry("etc/extra", data=extra)] if extra else TOP
    amd = lay.image([BASE, top], config=CONFIG)
    arm = lay.image([BASE], arch="arm64", config=CONFIG)
    lay.tag(lay.multi([amd, arm]), tag)
    return lay


def spec_text(source: str, name: str = "t") -> str:
    return f"version: 1\nname: {name}\nsource_date_epoch: 1700000000\nlayers:\n  - oci: {source}\n"


def build(spec: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return push("build", spec, "-o", out, *args)


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    monkeypatch.setenv(pull.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))  # not the host's
    with docker_registry(tmp_path / "registry") as reg:
        yield reg


def manifest(bundle: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((bundle / "manifest.json").read_bytes())
    return out


def same_image_files(a: Path, b: Path) -> None:
    """meta.img, blockmap and every pack byte-identical."""
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in names:
        if rel.name != "manifest.json":
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def registry_blob(reg: Registry, digest: str) -> Path:
    hexd = digest.removeprefix("sha256:")
    return reg.workdir / "storage/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


# --- references, credentials, the spec ------------------------------------------------------
def test_pull_references() -> None:
    d = "sha256:" + "ab" * 32
    for text, want in [
        ("reg.example/a/b:v1", ("reg.example", "a/b", "v1", None)),
        ("reg.example:5000/app", ("reg.example:5000", "app", "latest", None)),
        (f"127.0.0.1:5000/app@{d}", ("127.0.0.1:5000", "app", "", d)),
        (f"reg.example/app:v2@{d}", ("reg.example", "app", "v2", d)),
    ]:
        ref = parse_pull_reference(text)
        assert (ref.registry, ref.repo, ref.tag, ref.digest) == want
        assert str(ref) == (text if ref.tag != "latest" else text + ":latest")
    assert str(parse_pull_reference(f"r.example/app@{d}")) == f"r.example/app@{d}"
    assert parse_pull_reference(f"r.example/app@{d}").reference == d
    for bad, why in [
        ("r.example/app@sha256:00", "not a sha256 digest"),
        ("r.example/app@md5:" + "0" * 32, "not a sha256 digest"),
        ("r.example/App:v1", "not a valid repository name"),
        ("noslash", "not REGISTRY/REPO"),
    ]:
        with pytest.raises(ImageError, match=why):
            parse_pull_reference(bad)


def test_credentials_from_flag_env_and_docker_config(tmp_path: Path) -> None:
    conf = tmp_path / "docker" / "config.json"
    conf.parent.mkdir()
    conf.write_text(
        json.dumps(
            {
                "auths": {
                    "reg.example:5000": {"auth": base64.b64encode(b"alice:pw1").decode()},
                    "https://other.example/v1/": {"auth": base64.b64encode(b"bob:pw2").decode()},
                    "broken.example": {"auth": "%%%"},
                }
            }
        )
    )
    env = {"DOCKER_CONFIG": str(conf.parent)}
    assert credentials_for("reg.example:5000", None, env) == ("alice", "pw1")
    assert credentials_for("other.example", None, env) == ("bob", "pw2")
    assert credentials_for("reg.example", None, env) is None  # another port, another registry
    assert credentials_for("reg.example:5000", "carol:x", env) == ("carol", "x")
    assert credentials_for("reg.example:5000", None, env | {"BUI_REGISTRY_AUTH": "d:y"}) == (
        "d",
        "y",
    )
    with pytest.raises(ImageError, match="not base64"):
        credentials_for("broken.example", None, env)
    (tmp_path / ".docker").mkdir()
    (tmp_path / ".docker/config.json").write_bytes(conf.read_bytes())
    home = {"HOME": str(tmp_path)}  # ~/.docker/config.json without DOCKER_CONFIG
    assert credentials_for("reg.example:5000", None, home) == ("alice", "pw1")
    assert credentials_for("reg.example:5000", None, {"HOME": str(tmp_path / "none")}) is None


def test_spec_registry_source_errors_name_file_line_field() -> None:
    ok_spec = parse_spec(spec_text("{ref: reg.example/app:v1}"))
    assert ok_spec.layers[0].oci.path is None  # type: ignore[union-attr]
    for source, message in [
        ("{platform: linux/amd64}", "needs path (a local image) or ref"),
        ("{ref: reg.example/App}", "ref without path names a registry image"),
        ("{ref: just-a-tag}", "not REGISTRY/REPO"),
        (
            "{ref: 'r.example/a@sha256:" + "1" * 64 + "', digest: 'sha256:" + "2" * 64 + "'}",
            "name different images",
        ),
    ]:
        with pytest.raises(SpecError) as e:
            parse_spec(spec_text(source), "s.yaml")
        assert str(e.value).startswith("s.yaml:5: layers[0].oci: "), str(e.value)
        assert message in str(e.value)
    parse_spec(spec_text("{path: img, ref: just-a-tag}"))  # a local layout's tag: unchanged


def test_lock_file_round_trip_and_bad_lock(tmp_path: Path) -> None:
    lock = pull.lock_path(tmp_path / "spec.yaml")
    assert lock.name == "spec.yaml.lock" and pull.read_lock(lock) == {}
    refs = {"r.example/b:1": "sha256:" + "2" * 64, "r.example/a:1": "sha256:" + "1" * 64}
    assert pull.write_lock(lock, refs) and not pull.write_lock(lock, refs)
    text = lock.read_text()
    assert text.index("r.example/a:1") < text.index("r.example/b:1")  # sorted
    assert pull.read_lock(lock) == refs
    lock.write_text('{"refs": []}')
    with pytest.raises(ImageError, match="spec.yaml.lock: not a lock file"):
        pull.read_lock(lock)


# --- builds from the registry ---------------------------------------------------------------
def test_registry_source_builds_the_layout_image(tmp_path: Path, registry: Registry) -> None:
    make_layout(tmp_path / "oci", "v1")
    ref = f"{registry.address}/images/app:v1"
    skopeo_copy(f"oci:{tmp_path / 'oci'}:v1", f"docker://{ref}", "--all")
    local_spec, reg_spec = tmp_path / "local.yaml", tmp_path / "reg.yaml"
    local_spec.write_text(spec_text(f"{{path: {tmp_path / 'oci'}, ref: v1}}"))
    reg_spec.write_text(spec_text(f"{{ref: {ref}}}"))
    ok(build(local_spec, tmp_path / "local.bundle"))
    r = ok(build(reg_spec, tmp_path / "reg.bundle"))
    assert "reg.yaml.lock: 1 registry image(s) pinned" in r.stderr

    # the same image: meta.img, blockmap and packs identical, the manifests differ only in
    # the spec digest and the source record, which names the ref and its digest
    same_image_files(tmp_path / "local.bundle", tmp_path / "reg.bundle")
    a, b = manifest(tmp_path / "local.bundle"), manifest(tmp_path / "reg.bundle")
    index_digest = json.loads((tmp_path / "oci" / "index.json").read_text())["manifests"][0][
        "digest"
    ]
    assert b["sources"] == [
        {"kind": "oci", "path": "", "sha256": a["sources"][0]["sha256"], "ref": ref}
        | {"digest": index_digest}
    ]
    for m in (a, b):
        del m["sources"], m["spec_sha256"]
    assert a == b
    assert b["image_config"]["config"]["Entrypoint"] == ["/bin/sh", "-c"]
    lock = json.loads((tmp_path / "reg.yaml.lock").read_text())
    assert lock == {"lock_version": 1, "refs": {ref: index_digest}}

    # only the amd64 image was pulled: the arm64 manifest and its config are not cached
    cache = pull.BlobCache(tmp_path / "cache")
    arm = json.loads((tmp_path / "oci" / "blobs/sha256" / index_digest[7:]).read_bytes())[
        "manifests"
    ][1]["digest"]
    assert cache.has(index_digest) and not cache.has(arm)
    assert not list(cache.blobs.glob(".tmp-*"))

    # a rebuild with the lock and a full cache makes no request at all
    before = len(registry.requests())
    ok(build(reg_spec, tmp_path / "again.bundle"))
    assert len(registry.requests()) == before
    assert (tmp_path / "again.bundle/manifest.json").read_bytes() == (
        tmp_path / "reg.bundle/manifest.json"
    ).read_bytes()


def test_lock_pins_the_digest_when_the_tag_moves(tmp_path: Path, registry: Registry) -> None:
    ref = f"{registry.address}/images/app:stable"
    make_layout(tmp_path / "one", "v")
    make_layout(tmp_path / "two", "v", extra=b"second release\n")
    skopeo_copy(f"oci:{tmp_path / 'one'}:v", f"docker://{ref}", "--all")
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text(f"{{ref: {ref}}}"))
    ok(build(spec, tmp_path / "b1"))
    lock1 = (tmp_path / "spec.yaml.lock").read_bytes()

    skopeo_copy(f"oci:{tmp_path / 'two'}:v", f"docker://{ref}", "--all")  # the tag moves
    ok(build(spec, tmp_path / "b2"))  # locked: byte-identical
    for f in ("manifest.json", "meta.img", "blockmap"):
        assert (tmp_path / "b1" / f).read_bytes() == (tmp_path / "b2" / f).read_bytes()
    assert (tmp_path / "spec.yaml.lock").read_bytes() == lock1

    r = ok(build(spec, tmp_path / "b3", "--update-lock"))  # re-resolved: the new image
    assert "pinned" in r.stderr
    assert (tmp_path / "spec.yaml.lock").read_bytes() != lock1
    assert b"/etc/extra" not in ok(push("ls", tmp_path / "b1", "/etc")).stdout.encode()
    assert "extra" in ok(push("ls", tmp_path / "b3", "/etc")).stdout
    m1, m3 = manifest(tmp_path / "b1"), manifest(tmp_path / "b3")
    assert m1["sources"][0]["digest"] != m3["sources"][0]["digest"]
    assert m1["sources"][0]["ref"] == m3["sources"][0]["ref"] == ref

    # the lock is used even when the tag now names the other image: b4 is b1 again
    (tmp_path / "spec.yaml.lock").write_bytes(lock1)
    ok(build(spec, tmp_path / "b4"))
    assert (tmp_path / "b4/manifest.json").read_bytes() == (
        tmp_path / "b1/manifest.json"
    ).read_bytes()


def test_wrong_blob_is_refused_and_not_cached(tmp_path: Path, registry: Registry) -> None:
    lay = Layout(tmp_path / "oci")
    lay.tag(lay.image([BASE, TOP], config=CONFIG), "v1")
    ref = f"{registry.address}/images/bad:v1"
    skopeo_copy(f"oci:{tmp_path / 'oci'}:v1", f"docker://{ref}")
    manifest_doc = json.loads(
        (tmp_path / "oci/blobs/sha256" / lay.index[0]["digest"][7:]).read_bytes()
    )
    layer = manifest_doc["layers"][1]["digest"]
    blob = registry_blob(registry, layer)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the registry now serves bytes that are not that digest
    blob.write_bytes(bytes(data))
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text(f"{{ref: {ref}}}"))
    r = build(spec, tmp_path / "bad.bundle")
    assert r.returncode == 1
    assert f"{ref}@sha256:" in r.stderr and f"blob {layer}" in r.stderr, r.stderr
    assert "refused, not cached" in r.stderr
    cache = pull.BlobCache(tmp_path / "cache")
    assert not cache.has(layer) and not list(cache.blobs.glob(".tmp-*"))
    assert cache.has(manifest_doc["layers"][0]["digest"])  # the good blob before it stays
    assert not (tmp_path / "bad.bundle").exists() and not (tmp_path / "spec.yaml.lock").exists()
    assert not list(tmp_path.glob(".bad.bundle.*"))


def test_missing_tag_platform_and_unreachable_registry(tmp_path: Path, registry: Registry) -> None:
    make_layout(tmp_path / "oci", "v1")
    ref = f"{registry.address}/images/app"
    skopeo_copy(f"oci:{tmp_path / 'oci'}:v1", f"docker://{ref}:v1", "--all")
    spec = tmp_path / "spec.yaml"
    cases = [
        (f"{{ref: {ref}:nope}}", f"{ref}:nope: no such manifest in the registry"),
        (
            f"{{ref: {ref}:v1, platform: linux/s390x}}",
            "no manifest for platform linux/s390x (available: linux/amd64, linux/arm64)",
        ),
        ("{ref: 127.0.0.1:1/images/app:v1}", "127.0.0.1:1/images/app: GET http://127.0.0.1:1/v2/"),
    ]
    for source, message in cases:
        spec.write_text(spec_text(source))
        r = build(spec, tmp_path / "x.bundle")
        assert r.returncode == 1 and message in r.stderr, r.stderr
        assert not (tmp_path / "x.bundle").exists()


def test_pull_with_basic_auth_from_docker_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(pull.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    lay = Layout(tmp_path / "oci")
    lay.tag(lay.image([BASE], config=CONFIG), "v1")
    auth = htpasswd_auth(tmp_path, "puller", "s3cret")
    with docker_registry(tmp_path / "registry", auth=auth) as reg:
        ref = f"{reg.address}/images/app:v1"
        skopeo_copy(f"oci:{tmp_path / 'oci'}:v1", f"docker://{ref}", "--dest-creds=puller:s3cret")
        spec = tmp_path / "spec.yaml"
        spec.write_text(spec_text(f"{{ref: {ref}}}"))
        r = build(spec, tmp_path / "anon.bundle")
        assert r.returncode == 1 and "needs credentials" in r.stderr, r.stderr
        (tmp_path / "docker").mkdir()
        (tmp_path / "docker/config.json").write_text(
            json.dumps(
                {"auths": {reg.address: {"auth": base64.b64encode(b"puller:s3cret").decode()}}}
            )
        )
        ok(build(spec, tmp_path / "ok.bundle"))
        # push reads the same file
        ok(push("push", tmp_path / "ok.bundle", f"{reg.address}/images/bundle:v1"))


class _Front:
    """A registry front on two loopback ports: A answers /v2/ with Basic auth (user:pw) and
    forwards manifests to the registry, but redirects blob GETs (307) to B, another host as
    far as a client can tell, which serves them from the registry: a registry whose blobs
    live in a separate store. B records the Authorization header of each request."""

    def __init__(self, upstream: str) -> None:
        import threading
        import urllib.error
        import urllib.request
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        front = self
        self.blob_auth: list[str | None] = []

        def relay(handler: BaseHTTPRequestHandler) -> None:
            req = urllib.request.Request(f"http://{upstream}{handler.path}")
            if handler.headers.get("Accept"):
                req.add_header("Accept", handler.headers["Accept"])
            try:
                with urllib.request.urlopen(req) as resp:
                    status, headers, body = resp.status, resp.headers, resp.read()
            except urllib.error.HTTPError as e:
                status, headers, body = e.code, e.headers, e.read()
            handler.send_response(status)
            for k in ("Content-Type", "Docker-Content-Digest"):
                if headers.get(k):
                    handler.send_header(k, headers[k])
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)

        class A(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if (
                    self.headers.get("Authorization")
                    != "Basic " + base64.b64encode(b"user:pw").decode()
                ):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="front"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif "/blobs/" in self.path:
                    self.send_response(307)
                    self.send_header("Location", f"http://{front.b_address}{self.path}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    relay(self)

            def log_message(self, *args: object) -> None:
                pass

        class B(A):
            def do_GET(self) -> None:
                front.blob_auth.append(self.headers.get("Authorization"))
                relay(self)

        self.a = ThreadingHTTPServer(("127.0.0.1", 0), A)
        self.b = ThreadingHTTPServer(("localhost", 0), B)
        self.address = f"127.0.0.1:{self.a.server_address[1]}"
        self.b_address = f"localhost:{self.b.server_address[1]}"
        for server in (self.a, self.b):
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def close(self) -> None:
        for server in (self.a, self.b):
            server.shutdown()
            server.server_close()


def test_blobs_behind_a_redirect_get_no_credentials(tmp_path: Path, registry: Registry) -> None:
    lay = Layout(tmp_path / "oci")
    lay.tag(lay.image([BASE, TOP], config=CONFIG), "v1")
    skopeo_copy(f"oci:{tmp_path / 'oci'}:v1", f"docker://{registry.address}/images/app:v1")
    front = _Front(registry.address)
    try:
        spec = tmp_path / "spec.yaml"
        spec.write_text(spec_text(f"{{ref: {front.address}/images/app:v1}}"))
        r = build(spec, tmp_path / "anon.bundle")
        assert r.returncode == 1 and "HTTP 401 (the registry needs credentials" in r.stderr
        ok(build(spec, tmp_path / "app.bundle", "--auth", "user:pw"))
        # config + 2 layers came from the blob store, which never saw the credentials
        assert front.blob_auth == [None, None, None]
    finally:
        front.close()
    (tmp_path / "local.yaml").write_text(spec_text(f"{{path: {tmp_path / 'oci'}, ref: v1}}"))
    ok(build(tmp_path / "local.yaml", tmp_path / "local.bundle"))
    same_image_files(tmp_path / "local.bundle", tmp_path / "app.bundle")


def test_pull_with_a_bearer_token_asks_only_for_pull(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(pull.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    lay = Layout(tmp_path / "oci")
    lay.tag(lay.image([BASE, TOP], config=CONFIG), "v1")
    tokens = TokenService(tmp_path, "puller", "s3cret")
    auth = (
        f"{{token: {{realm: '{tokens.realm}', service: bui-registry, issuer: bui-test-issuer,"
        f" rootcertbundle: {tokens.cert}}}}}"
    )
    with tokens.running(), docker_registry(tmp_path / "registry", auth=auth) as reg:
        ref = f"{reg.address}/images/app:v1"
        skopeo_copy(f"oci:{tmp_path / 'oci'}:v1", f"docker://{ref}", "--dest-creds=puller:s3cret")
        spec = tmp_path / "spec.yaml"
        spec.write_text(spec_text(f"{{ref: {ref}}}"))
        r = build(spec, tmp_path / "anon.bundle")
        assert r.returncode == 1 and f"token from {tokens.realm}: HTTP 401" in r.stderr
        tokens.scopes.clear()
        ok(push("build", spec, "-o", tmp_path / "app.bundle", env={AUTH_ENV: "puller:s3cret"}))
        assert tokens.scopes and all(s == ["repository:images/app:pull"] for s in tokens.scopes)


def test_docker_schema2_manifest_builds_the_same_tree(tmp_path: Path, registry: Registry) -> None:
    lay = Layout(tmp_path / "oci")
    lay.tag(lay.image([BASE, TOP], config=CONFIG), "v1")
    ref = f"{registry.address}/images/docker:v1"
    skopeo_copy(f"oci:{tmp_path / 'oci'}:v1", f"docker://{ref}", "--format", "v2s2")
    r = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert (
        json.loads(r.stdout)["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    )
    (tmp_path / "reg.yaml").write_text(spec_text(f"{{ref: {ref}}}"))
    (tmp_path / "local.yaml").write_text(spec_text(f"{{path: {tmp_path / 'oci'}, ref: v1}}"))
    ok(build(tmp_path / "reg.yaml", tmp_path / "reg.bundle"))
    ok(build(tmp_path / "local.yaml", tmp_path / "local.bundle"))
    same_image_files(tmp_path / "local.bundle", tmp_path / "reg.bundle")
    assert manifest(tmp_path / "reg.bundle")["image_config"]["config"] == CONFIG
