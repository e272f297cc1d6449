"""`btrfs-ublk-image push` / `push-trace` against Debian's docker-registry on loopback.

Oracles: skopeo (inspect --raw, copy to an OCI layout, whose blobs must be byte-identical
to the bundle's files), the registry's access log (what was uploaded, and that a corrupt
bundle made no request at all), htpasswd (Basic auth) and a token service written here
whose JWTs openssl signs (Bearer auth: the registry checks the signature).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard
from servers import Registry, TokenService, docker_registry, htpasswd_auth

from btrfs_ublk_image import trace as trace_format
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.manifest import BLOCKMAP, MANIFEST, META_IMG, read_manifest
from btrfs_ublk_image.push import (
    ARTIFACT_BUNDLE,
    ARTIFACT_TRACE,
    MT_META_ZSTD,
    MT_OCI_INDEX,
    MT_OCI_MANIFEST,
    referrers_tag,
)

pytestmark = pytest.mark.unit

CHUNK = 1 << 20


def build_bundle(tmp: Path, name: str = "app", seed: int = 1) -> Path:
    """A bundle from a directory of random files; its pack spans several 1 MiB chunks."""
    rnd = random.Random(seed)
    src = tmp / f"src-{name}"
    (src / "data").mkdir(parents=True)
    (src / "data" / "big.bin").write_bytes(rnd.randbytes(3 * CHUNK + 4321))
    (src / "data" / "small.bin").write_bytes(rnd.randbytes(70_000))
    (src / "etc").mkdir()
    (src / "etc" / "hostname").write_text(f"{name}-{seed}\n")
    spec = tmp / f"{name}.yaml"
    spec.write_text(
        f"version: 1\nname: {name}\nsource_date_epoch: 1700000000\n"
        f"layers:\n  - dir: {{path: {src}, dest: /}}\n"
    )
    bundle = tmp / f"{name}.bundle"
    assert cli(["build", str(spec), "-o", str(bundle)]) == 0
    return bundle


def push(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it (stdout, stderr, exit status), in this process (a child
    costs seconds of imports here); `env` replaces BUI_REGISTRY_AUTH for the call."""
    out, err = io.StringIO(), io.StringIO()
    saved = os.environ.pop("BUI_REGISTRY_AUTH", None)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli([str(x) for x in args])
    finally:
        os.environ.pop("BUI_REGISTRY_AUTH", None)
        if saved is not None:
            os.environ["BUI_REGISTRY_AUTH"] = saved
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


def ok(r: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert r.returncode == 0, f"exit {r.returncode}:\n{r.stdout}{r.stderr}"
    return r


def skopeo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["skopeo", *args], capture_output=True, text=True, timeout=120)


def raw_manifest(ref: str) -> dict[str, Any]:
    r = skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{ref}")
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def sha256_file(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def blob_uploads(reg: Registry) -> list[str]:
    """Paths of completed blob uploads (the PUT that ends each upload session)."""
    return [r.path for r in reg.requests() if r.method == "PUT" and "/blobs/uploads/" in r.path]


def write_trace(path: Path, image_id: str, chunks: list[list[int]]) -> Path:
    refs = tuple((c[0], c[1]) for c in chunks)
    trace_format.write(str(path), trace_format.Trace(image_id, CHUNK, "record", refs))
    return path


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with docker_registry(tmp_path / "registry") as reg:
        yield reg


# --- the artifact ---------------------------------------------------------------------------
def test_push_then_skopeo_reads_the_artifact(tmp_path: Path, registry: Registry) -> None:
    bundle = build_bundle(tmp_path)
    manifest, image_id = read_manifest(str(bundle))
    ref = f"{registry.address}/images/app:v1"
    r = ok(push("push", bundle, ref))
    m = raw_manifest(ref)
    digest = (
        "sha256:"
        + hashlib.sha256(
            skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{ref}").stdout.encode()
        ).hexdigest()
    )
    assert f"manifest {digest}" in r.stdout and f"image id: {image_id}" in r.stdout

    assert m["mediaType"] == MT_OCI_MANIFEST and m["artifactType"] == ARTIFACT_BUNDLE
    assert m["config"]["digest"] == image_id == sha256_file(bundle / MANIFEST)
    assert m["annotations"]["dev.btrfs-ublk-image.image-id"] == image_id
    titles = [d["annotations"]["org.opencontainers.image.title"] for d in m["layers"]]
    assert titles == [META_IMG, BLOCKMAP, *(p["path"] for p in manifest["packs"])]
    assert [d["mediaType"].rsplit(".", 2)[-2] for d in m["layers"]] == [
        "meta",
        "blockmap",
        *["pack"] * len(manifest["packs"]),
    ]

    assert m["layers"][0]["mediaType"] == MT_META_ZSTD

    # an independent client copies every blob out; each must be the bundle's file, byte for
    # byte, except meta.img: one zstd frame that decompresses to it
    layout = tmp_path / "layout"
    c = skopeo("copy", "--src-tls-verify=false", f"docker://{ref}", f"oci:{layout}:v1")
    assert c.returncode == 0, c.stderr
    index = json.loads((layout / "index.json").read_text())
    copied_digest = index["manifests"][0]["digest"]
    assert copied_digest == digest
    copied = json.loads((layout / "blobs" / "sha256" / digest.split(":")[1]).read_bytes())
    assert copied == m
    for d in [m["config"], *m["layers"]]:
        blob = layout / "blobs" / "sha256" / d["digest"].split(":")[1]
        title = d.get("annotations", {}).get("org.opencontainers.image.title", MANIFEST)
        assert sha256_file(blob) == d["digest"] and blob.stat().st_size == d["size"]
        if title != META_IMG:
            assert blob.read_bytes() == (bundle / title).read_bytes(), title
            continue
        meta = (bundle / META_IMG).read_bytes()
        frame = blob.read_bytes()
        params = zstandard.get_frame_parameters(frame)
        assert params.content_size == len(meta) == manifest["files"][META_IMG]["size"]
        assert params.dict_id == 0 and not params.has_checksum
        assert zstandard.ZstdDecompressor().decompress(frame) == meta
        # the image id still names the uncompressed file
        assert sha256_file(bundle / META_IMG) == manifest["files"][META_IMG]["sha256"]
        assert len(frame) < len(meta) // 2, (len(frame), len(meta))


def test_push_again_uploads_nothing_and_a_new_tag_shares_blobs(
    tmp_path: Path, registry: Registry
) -> None:
    bundle = build_bundle(tmp_path)
    ref = f"{registry.address}/images/app:v1"
    first = ok(push("push", bundle, ref))
    uploads = blob_uploads(registry)
    manifest, _ = read_manifest(str(bundle))
    assert len(uploads) == 3 + len(manifest["packs"])  # config, meta.img, blockmap, packs
    assert len(set(uploads)) == len(uploads)

    again = ok(push("push", bundle, ref))
    other_tag = ok(push("push", bundle, f"{registry.address}/images/app:v2"))
    assert blob_uploads(registry) == uploads, "a blob the registry had was uploaded again"
    assert "0 blobs uploaded" in again.stderr and "0 blobs uploaded" in other_tag.stderr
    # same bundle, same manifest: the digest is deterministic (meta.img is compressed again
    # by each push: the same zstd frame)
    assert first.stdout.splitlines()[0].split()[-1] == again.stdout.splitlines()[0].split()[-1]
    assert raw_manifest(f"{registry.address}/images/app:v2") == raw_manifest(ref)
    # and so is a push to an empty registry: every blob uploaded again, the same manifest
    with docker_registry(tmp_path / "registry2") as other:
        fresh = ok(push("push", bundle, f"{other.address}/images/app:v1"))
        assert len(blob_uploads(other)) == len(uploads)
    assert fresh.stdout.splitlines()[0].split()[-1] == first.stdout.splitlines()[0].split()[-1]


@pytest.mark.parametrize("damage", ["pack chunk", "meta.img", "blockmap", "missing pack"])
def test_corrupt_bundle_is_refused_before_any_request(
    tmp_path: Path, registry: Registry, damage: str
) -> None:
    bundle = build_bundle(tmp_path)
    manifest, _ = read_manifest(str(bundle))
    pack = bundle / manifest["packs"][0]["path"]
    if damage == "pack chunk":
        with open(pack, "r+b") as f:  # one byte in the third chunk
            f.seek(2 * CHUNK + 5)
            b = f.read(1)
            f.seek(2 * CHUNK + 5)
            f.write(bytes([b[0] ^ 0xFF]))
        expect = "chunk 2"
    elif damage == "meta.img":
        with open(bundle / META_IMG, "r+b") as f:
            f.seek(70_000)
            f.write(b"\x01")
        expect = "differs from the manifest"
    elif damage == "blockmap":
        (bundle / BLOCKMAP).write_bytes((bundle / BLOCKMAP).read_bytes()[:-10])
        expect = "the manifest says"
    else:
        pack.unlink()
        expect = "cannot read"
    r = push("push", bundle, f"{registry.address}/images/app:v1")
    assert r.returncode == 1
    assert "error:" in r.stderr and expect in r.stderr, r.stderr
    assert registry.requests() == [], "a corrupt bundle must not reach the registry"


def test_bad_references_and_unreachable_registry(tmp_path: Path) -> None:
    bundle = build_bundle(tmp_path)
    for ref, expect in [
        ("no-slash", "not REGISTRY/REPO"),
        ("127.0.0.1:1/Upper/Case:v1", "not a valid repository name"),
        ("127.0.0.1:1/a@sha256:00", "push needs a tag"),
    ]:
        r = push("push", bundle, ref)
        assert r.returncode == 1 and expect in r.stderr, r.stderr
    r = push("push", bundle, "127.0.0.1:1/images/app:v1")
    assert r.returncode == 1
    assert "127.0.0.1:1/images/app" in r.stderr and "refused" in r.stderr.lower(), r.stderr


# --- auth -----------------------------------------------------------------------------------
def test_basic_auth_htpasswd(tmp_path: Path) -> None:
    bundle = build_bundle(tmp_path)
    auth = htpasswd_auth(tmp_path, "pusher", "s3cret")
    with docker_registry(tmp_path / "registry", auth=auth) as reg:
        ref = f"{reg.address}/images/app:v1"
        anonymous = push("push", bundle, ref)
        assert anonymous.returncode == 1
        assert f"{reg.address}/images/app" in anonymous.stderr and "HTTP 401" in anonymous.stderr
        assert "needs credentials" in anonymous.stderr, anonymous.stderr

        wrong = push("push", bundle, ref, "--auth", "pusher:nope")
        assert wrong.returncode == 1 and "credentials refused" in wrong.stderr, wrong.stderr

        ok(push("push", bundle, ref, "--auth", "pusher:s3cret"))
        again = ok(push("push", bundle, ref, env={"BUI_REGISTRY_AUTH": "pusher:s3cret"}))
        assert "0 blobs uploaded" in again.stderr
        listed = skopeo(
            "inspect", "--raw", "--tls-verify=false", "--creds", "pusher:s3cret", f"docker://{ref}"
        )
        assert json.loads(listed.stdout)["artifactType"] == ARTIFACT_BUNDLE


def test_bearer_token_auth(tmp_path: Path) -> None:
    bundle = build_bundle(tmp_path)
    tokens = TokenService(tmp_path, "pusher", "s3cret")
    auth = (
        f"{{token: {{realm: '{tokens.realm}', service: bui-registry, issuer: bui-test-issuer,"
        f" rootcertbundle: {tokens.cert}}}}}"
    )
    with tokens.running(), docker_registry(tmp_path / "registry", auth=auth) as reg:
        ref = f"{reg.address}/images/app:v1"
        anonymous = push("push", bundle, ref)
        assert anonymous.returncode == 1
        assert f"token from {tokens.realm}: HTTP 401" in anonymous.stderr, anonymous.stderr
        assert f"{reg.address}/images/app" in anonymous.stderr

        r = ok(push("push", bundle, ref, "--auth", "pusher:s3cret"))
        assert "repository:images/app:pull,push" in tokens.scopes[-1]
        _, image_id = read_manifest(str(bundle))
        assert f"image id: {image_id}" in r.stdout
        # the registry accepted our token for every upload: the manifest is there
        assert any(x.method == "PUT" and x.status == 201 for x in reg.requests())
        trace = write_trace(tmp_path / "t.trace", image_id, [[0, 1]])
        ok(push("push-trace", trace, ref, "--auth", "pusher:s3cret"))


# --- traces ---------------------------------------------------------------------------------
def test_push_trace_as_referrer_keeps_other_referrers(tmp_path: Path, registry: Registry) -> None:
    bundle = build_bundle(tmp_path)
    _, image_id = read_manifest(str(bundle))
    ref = f"{registry.address}/images/app:v1"
    out = ok(push("push", bundle, ref)).stdout
    bundle_digest = out.splitlines()[0].split()[-1]
    tag_ref = f"{registry.address}/images/app:{referrers_tag(bundle_digest)}"

    # someone else's referrer (a signature, say) already listed under the referrers tag
    foreign = _push_foreign_referrer(registry, bundle_digest)

    trace1 = write_trace(tmp_path / "one.trace", image_id, [[0, 2], [0, 0]])
    r1 = ok(push("push-trace", trace1, ref))
    assert f"attached to manifest {bundle_digest}" in r1.stdout
    trace2 = write_trace(tmp_path / "two.trace", image_id, [[0, 3]])
    r2 = ok(push("push-trace", trace2, ref))
    d1, d2 = (r.stdout.split()[2] for r in (r1, r2))

    index = raw_manifest(tag_ref)
    assert index["mediaType"] == MT_OCI_INDEX
    assert [e["digest"] for e in index["manifests"]] == [foreign, d1, d2]
    assert [e["artifactType"] for e in index["manifests"]] == [
        "application/example.signature",
        ARTIFACT_TRACE,
        ARTIFACT_TRACE,
    ]
    # each trace artifact: subject = the bundle manifest, one layer = the trace file's bytes
    for digest, path in ((d1, trace1), (d2, trace2)):
        tm = raw_manifest(f"{registry.address}/images/app@{digest}")
        assert tm["artifactType"] == ARTIFACT_TRACE
        assert tm["subject"]["digest"] == bundle_digest
        assert [layer["digest"] for layer in tm["layers"]] == [sha256_file(path)]
    # the bundle (and so its image id) is untouched
    assert raw_manifest(ref)["config"]["digest"] == image_id

    # pushing trace1 again moves it last, without duplicating it
    ok(push("push-trace", trace1, ref))
    assert [e["digest"] for e in raw_manifest(tag_ref)["manifests"]] == [foreign, d2, d1]


def _push_foreign_referrer(registry: Registry, subject: str) -> str:
    """Another tool's referrer of `subject` and the referrers index listing it (as a tool
    following the OCI 1.1 tag schema writes them) -> its manifest digest."""
    from btrfs_ublk_image.push import Reference, bytes_blob
    from btrfs_ublk_image.push import Registry as Client

    client = Client(Reference(registry.address, "images/app", "x"))
    try:
        layer = bytes_blob(b"signature\n", "application/example.signature.v1")
        empty = bytes_blob(b"{}", "application/vnd.oci.empty.v1+json")
        for blob in (layer, empty):
            client.put_blob(blob)
        raw = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": MT_OCI_MANIFEST,
                "artifactType": "application/example.signature",
                "config": empty.descriptor(),
                "layers": [layer.descriptor()],
                "subject": {"mediaType": MT_OCI_MANIFEST, "digest": subject, "size": 1},
            }
        ).encode()
        digest = client.put_manifest(
            "sha256:" + hashlib.sha256(raw).hexdigest(), raw, MT_OCI_MANIFEST
        )
        index = {
            "schemaVersion": 2,
            "mediaType": MT_OCI_INDEX,
            "manifests": [
                {
                    "mediaType": MT_OCI_MANIFEST,
                    "digest": digest,
                    "size": len(raw),
                    "artifactType": "application/example.signature",
                }
            ],
        }
        client.put_manifest(referrers_tag(subject), json.dumps(index).encode(), MT_OCI_INDEX)
    finally:
        client.close()
    return digest


def test_trace_for_another_image_is_refused(tmp_path: Path, registry: Registry) -> None:
    bundle = build_bundle(tmp_path)
    other = build_bundle(tmp_path, "other", seed=2)
    _, image_id = read_manifest(str(bundle))
    _, other_id = read_manifest(str(other))
    ref = f"{registry.address}/images/app:v1"
    ok(push("push", bundle, ref))
    before = len(registry.requests())

    wrong = write_trace(tmp_path / "wrong.trace", other_id, [[0, 0]])
    r = push("push-trace", wrong, ref)
    assert r.returncode == 1 and other_id in r.stderr and image_id in r.stderr, r.stderr
    assert not any(x.method in ("PUT", "POST") for x in registry.requests()[before:])

    # push --trace checks before uploading anything, as does a prefetch.trace in the bundle
    r = push("push", other, f"{registry.address}/images/other:v1", "--trace", wrong.parent / "x")
    assert r.returncode == 1 and "cannot read" in r.stderr
    write_trace(bundle / trace_format.FILE_NAME, other_id, [[0, 0]])
    r = push("push", bundle, f"{registry.address}/images/app:v2")
    assert r.returncode == 1 and other_id in r.stderr, r.stderr
    assert not any(x.method in ("PUT", "POST") for x in registry.requests()[before:])

    bad = tmp_path / "bad.trace"
    bad.write_text('{"format": "something else"}')
    r = push("push-trace", bad, ref)
    assert r.returncode == 1 and "not a trace" in r.stderr


def test_push_with_trace_beside_the_bundle(tmp_path: Path, registry: Registry) -> None:
    bundle = build_bundle(tmp_path)
    _, image_id = read_manifest(str(bundle))
    write_trace(bundle / trace_format.FILE_NAME, image_id, [[0, 1], [0, 0]])
    ref = f"{registry.address}/images/app:v1"
    r = ok(push("push", bundle, ref))
    bundle_digest = r.stdout.splitlines()[0].split()[-1]
    trace_digest = next(
        line.split()[-1] for line in r.stdout.splitlines() if line.startswith("trace:")
    )
    index = raw_manifest(f"{registry.address}/images/app:{referrers_tag(bundle_digest)}")
    assert [e["digest"] for e in index["manifests"]] == [trace_digest]
    # the trace is not part of the image: same image id as without it
    assert raw_manifest(ref)["config"]["digest"] == image_id


# --- transport ------------------------------------------------------------------------------
def test_references_and_the_scheme_they_get() -> None:
    from btrfs_ublk_image.errors import ImageError
    from btrfs_ublk_image.push import Registry as Client
    from btrfs_ublk_image.push import parse_reference

    for text, registry, repo, tag in [
        ("reg.example/a/b:v1", "reg.example", "a/b", "v1"),
        ("oci://reg.example:5000/app", "reg.example:5000", "app", "latest"),
        ("[::1]:5000/app:x", "[::1]:5000", "app", "x"),
    ]:
        ref = parse_reference(text)
        assert (ref.registry, ref.repo, ref.tag) == (registry, repo, tag)
    scheme = {
        text: Client(parse_reference(text)).scheme
        for text in ("reg.example/a", "10.0.0.1:5000/a", "127.0.0.2:5000/a", "localhost/a")
    }
    assert scheme == {
        "reg.example/a": "https",
        "10.0.0.1:5000/a": "https",
        "127.0.0.2:5000/a": "http",
        "localhost/a": "http",
    }
    assert Client(parse_reference("[::1]:5000/a")).scheme == "http"
    assert Client(parse_reference("reg.example/a"), plain_http=True).scheme == "http"
    for bad in ("reg.example/a:b:c", "reg.example/a:-x", "reg.example/"):
        with pytest.raises(ImageError, match="reg.example"):
            parse_reference(bad)


def _host_address() -> str | None:
    """A non-loopback IPv4 address of this host (HTTPS is the default off loopback)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        addr = line.split()[3].split("/")[0]
        if not addr.startswith("127."):
            return addr
    return None


def test_https_by_default_off_loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = _host_address()
    if host is None:
        pytest.skip("no non-loopback IPv4 address on this host")
    bundle = build_bundle(tmp_path)
    cert, key = tmp_path / "registry.pem", tmp_path / "registry.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
        + ["-subj", "/CN=bui-registry", "-addext", f"subjectAltName=IP:{host}"]
        + ["-keyout", str(key), "-out", str(cert)],
        capture_output=True,
        check=True,
    )
    with docker_registry(tmp_path / "registry", host=host, tls=(cert, key)) as reg:
        ref = f"{reg.address}/images/app:v1"
        untrusted = push("push", bundle, ref)  # the system CA store does not know our cert
        assert untrusted.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
        assert reg.address in untrusted.stderr
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        plain = push("push", bundle, ref, "--plain-http")
        assert plain.returncode == 1 and "HTTP 400" in plain.stderr, plain.stderr
        r = ok(push("push", bundle, ref))
        _, image_id = read_manifest(str(bundle))
        assert f"image id: {image_id}" in r.stdout
        # skopeo, verifying TLS against the same SSL_CERT_FILE, reads what we pushed
        listed = skopeo("inspect", "--raw", f"docker://{ref}")
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout)["config"]["digest"] == image_id
