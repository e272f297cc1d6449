"""`btrfs-ublk-image convert SRC DST` against docker-registry on loopback.

Oracles: `umoci raw unpack` of the source image (the tree, compared as listings with the
bundle read by our own reader), `skopeo inspect` of what was pushed (the runnable image's
config, the index), and the registry's access log (nothing pushed after a failure).
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ocitools import Layout, archive, docker_archive, entry
from servers import Registry, docker_registry
from test_push import ok, push, raw_manifest
from test_registry_source import registry_blob, skopeo_copy

from btrfs_ublk_image import pull
from btrfs_ublk_image.listing import diff, load

DIR = tarfile.DIRTYPE
CONFIG = {
    "Entrypoint": ["/bin/sh", "-c"],
    "Env": ["PATH=/usr/bin:/bin", "GREETING=hello"],
    "WorkingDir": "/srv",
    "User": "1000:1000",
}


def sh(*cmd: str | Path) -> str:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cmd}: {r.stderr}"
    return r.stdout


def inspect_config(ref: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(
        sh("skopeo", "inspect", "--config", "--tls-verify=false", f"docker://{ref}")
    )
    return out


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    monkeypatch.setenv(pull.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # convert's work dirs
    (tmp_path / "tmp").mkdir()
    with docker_registry(tmp_path / "registry") as reg:
        yield reg


def umoci_image(work: Path) -> Path:
    """An OCI layout (tag 't') made by umoci: three layers, the later ones with whiteouts
    (a deleted file, a deleted directory) and an opaque directory, and a runtime config."""
    layout, bundle = work / "layout", work / "unpacked"
    sh("umoci", "init", "--layout", layout)
    sh("umoci", "new", "--image", f"{layout}:t")
    sh("umoci", "config", "--image", f"{layout}:t", "--config.entrypoint", "/bin/sh",
       "--config.entrypoint", "-c", "--config.env", "PATH=/usr/bin:/bin", "--config.env",
       "GREETING=hello", "--config.workingdir", "/srv", "--config.user", "1000:1000")  # fmt: skip
    sh("umoci", "unpack", "--image", f"{layout}:t", bundle)
    root = bundle / "rootfs"
    for d in ("etc", "usr/share/doc/pkg", "srv", "var/lib"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/motd").write_text("hello\n")
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (root / "usr/share/doc/pkg/README").write_text("doc\n")
    (root / "srv/big").write_bytes(bytes(range(256)) * 12_000)  # a few MiB chunks
    (root / "srv/motd-link").symlink_to("../etc/motd")
    (root / "etc/passwd-hl").hardlink_to(root / "etc/passwd")
    sh("umoci", "repack", "--image", f"{layout}:t", bundle)
    (root / "etc/motd").unlink()  # whiteout of a file
    for p in sorted((root / "usr/share/doc/pkg").iterdir()):
        p.unlink()
    (root / "usr/share/doc/pkg").rmdir()  # whiteout of a directory
    (root / "var/lib/state").write_text("new\n")
    (root / "etc/passwd").chmod(0o600)
    sh("umoci", "repack", "--image", f"{layout}:t", bundle)
    (work / "insert").mkdir()
    (work / "insert/only").write_text("only file left in /usr/share\n")
    sh("umoci", "insert", "--opaque", "--image", f"{layout}:t", work / "insert", "/usr/share")
    return layout


@pytest.mark.root
def test_convert_equals_umoci_unpack_and_is_reproducible(
    tmp_path: Path, registry: Registry
) -> None:
    layout = umoci_image(tmp_path)
    src = f"{registry.address}/library/app:v1"
    dst = f"{registry.address}/converted/app:v1"
    skopeo_copy(f"oci:{layout}:t", f"docker://{src}")
    r = ok(push("convert", src, dst, "-o", tmp_path / "app.bundle"))
    assert f"pulling {src}" in r.stderr and "pushing sha256:" in r.stderr

    # the tree is umoci's, entry by entry (names, types, modes, owners, mtimes, content,
    # symlinks, hard links), and the whiteouts and the opaque directory took effect
    sh("umoci", "raw", "unpack", "--image", f"{layout}:t", tmp_path / "ref")
    ours = load(str(tmp_path / "app.bundle"))
    assert diff(ours, load(str(tmp_path / "ref"))) == []
    paths = {e.path.decode() for e in ours}
    assert "/etc/motd" not in paths and "/usr/share/doc" not in paths
    assert {"/usr/share/only", "/var/lib/state", "/etc/passwd-hl", "/srv/big"} <= paths

    # the runnable image keeps the source's config
    want = inspect_config(src)["config"]
    got = inspect_config(dst)
    assert {k: got["config"].get(k) for k in CONFIG} == CONFIG == {k: want[k] for k in CONFIG}
    assert (got["os"], got["architecture"]) == ("linux", "amd64")
    image_id = r.stdout.split("image id: ")[1].split()[0]
    assert raw_manifest(f"{dst}-bundle")["config"]["digest"] == image_id
    digest = r.stdout.split(f"{dst}: image ")[1].split()[0]

    # converting again (to a temporary bundle): the same image and the same manifests
    again = ok(push("convert", src, dst))
    assert f"image id: {image_id}" in again.stdout and f"{dst}: image {digest}" in again.stdout
    assert "kept:" not in again.stdout and not list((tmp_path / "tmp").iterdir())


@pytest.mark.unit
def test_all_platforms_index_of_runnable_images(tmp_path: Path, registry: Registry) -> None:
    lay = Layout(tmp_path / "multi")
    descs = [
        lay.image([[entry("etc", DIR), entry("etc/arch", data=f"{a}\n".encode())]], arch=a)
        for a in ("amd64", "arm64")
    ]
    lay.tag(lay.multi(descs), "m")
    src = f"{registry.address}/library/multi:v1"
    dst = f"{registry.address}/converted/multi:v1"
    skopeo_copy(f"oci:{tmp_path / 'multi'}:m", f"docker://{src}", "--all")
    r = ok(push("convert", src, dst, "--all-platforms", "-o", tmp_path / "out"))
    index = raw_manifest(dst)
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    plats = [(m["platform"]["os"], m["platform"]["architecture"]) for m in index["manifests"]]
    assert plats == [("linux", "amd64"), ("linux", "arm64")]
    for arch, m in zip(("amd64", "arm64"), index["manifests"], strict=True):
        tagged = f"{dst}-linux-{arch}"
        assert f"{tagged}: image {m['digest']} (linux/{arch})" in r.stdout
        assert inspect_config(tagged)["architecture"] == arch
        bundle = tmp_path / "out" / f"linux-{arch}.bundle"
        assert ok(push("manifest", bundle)).stdout.count("/etc/arch type=file") == 1
        (line,) = [x for x in ok(push("manifest", bundle)).stdout.splitlines() if "/etc/arch" in x]
        assert f"size={len(arch) + 1} " in line
    index_digest = r.stdout.split(f"{dst}: index ")[1].split()[0]
    again = ok(push("convert", src, dst, "--all-platforms"))
    assert f"{dst}: index {index_digest}" in again.stdout

    # a local oci-archive of the same index: its platforms are found there
    archive(tmp_path / "multi", tmp_path / "multi.tar")
    local = ok(
        push(
            "convert", f"oci-archive:{tmp_path / 'multi.tar'}:m", f"{dst}-local", "--all-platforms"
        )
    )
    assert f"{dst}-local-linux-arm64: image" in local.stdout
    assert [m["platform"]["architecture"] for m in raw_manifest(f"{dst}-local")["manifests"]] == [
        "amd64",
        "arm64",
    ]


@pytest.mark.unit
def test_local_archives_and_clear_errors(tmp_path: Path, registry: Registry) -> None:
    dst = f"{registry.address}/converted/local:v1"
    archive = tmp_path / "saved.tar"
    docker_archive(
        archive,
        [[entry("etc", DIR), entry("etc/hostname", data=b"saved\n")]],
        "example/saved:1",
        {"architecture": "amd64", "os": "linux", "config": {"Cmd": ["/bin/true"]}},
    )
    r = ok(push("convert", f"docker-archive:{archive}:1", dst))
    assert inspect_config(dst)["config"]["Cmd"] == ["/bin/true"]
    assert "image id: sha256:" in r.stdout

    lay = Layout(tmp_path / "one")
    lay.tag(lay.image([[entry("etc", DIR)]]), "v")
    src = f"{registry.address}/library/one:v1"
    skopeo_copy(f"oci:{tmp_path / 'one'}:v", f"docker://{src}")
    layer = lay_layer_digest(tmp_path / "one", lay)
    pushes_before = len([x for x in registry.requests() if x.method == "PUT"])
    for args, message in [
        (("oci-layout:",), "no path after oci-layout:"),
        (("oci-layout:" + str(tmp_path / "nope"),), "cannot open image: No such file"),
        ((f"{src}", "--platform", "linux"), "not os/arch"),
        ((f"{registry.address}/library/none:v1",), "none:v1: no such manifest in the registry"),
        (("127.0.0.1:1/library/one:v1",), "127.0.0.1:1/library/one: GET http://127.0.0.1:1/"),
        ((f"{src}", "--all-platforms", "--platform", "linux/amd64"), "exclude each other"),
    ]:
        bad = push("convert", *args[:1], dst, *args[1:])
        assert bad.returncode == 1 and message in bad.stderr, bad.stderr
    # a registry serving a wrong layer blob: refused, nothing cached, nothing pushed
    blob = registry_blob(registry, layer)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    bad = push("convert", src, f"{registry.address}/converted/bad:v1")
    assert bad.returncode == 1 and f"blob {layer}" in bad.stderr and "refused" in bad.stderr
    assert not pull.BlobCache(tmp_path / "cache").has(layer)
    assert len([x for x in registry.requests() if x.method == "PUT"]) == pushes_before
    assert not list((tmp_path / "tmp").iterdir())


def lay_layer_digest(root: Path, lay: Layout) -> str:
    manifest = json.loads((root / "blobs/sha256" / lay.index[0]["digest"][7:]).read_bytes())
    digest: str = manifest["layers"][0]["digest"]
    return digest
