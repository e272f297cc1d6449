"""The oci source on images written here: layer order, whiteouts, selection, verification."""

from __future__ import annotations

import gzip
import json
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from ocitools import Layout, archive, docker_archive, entry, sha, tar_bytes

from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.ocispec import host_platform_name
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.sources import SourceRecord, build_sources
from btrfs_ublk_image.spec import load_spec
from btrfs_ublk_image.tree import FileType, Tree

pytestmark = pytest.mark.unit
Build = Callable[[str], tuple[Tree, list[SourceRecord]]]
DIR, REG, SYM, LNK = tarfile.DIRTYPE, tarfile.REGTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE


def spec(path: str = "img", extra: str = "") -> str:
    return f"version: 1\nname: t\nlayers:\n  - oci: {{path: {path}{extra}}}\n"


def paths(tree: Tree) -> list[str]:
    return sorted(p.decode() for p, _ in tree.walk())


BASE = [
    entry("etc", DIR),
    entry("etc/passwd", data=b"root:x:0:0\n"),
    entry("etc/hosts", data=b"127.0.0.1\n"),
    entry("usr", DIR),
    entry("usr/lib", DIR),
    entry("usr/lib/a", data=b"a"),
    entry("usr/lib/sub", DIR),
    entry("usr/lib/sub/b", data=b"b"),
    entry("opt", DIR),
    entry("opt/x", data=b"x"),
    entry("opt/keep", DIR),
    entry("opt/keep/y", data=b"y"),
    entry("var", DIR),
    entry("var/d", DIR),
    entry("var/d/z", data=b"z"),
    entry("lib", SYM, linkname="usr/lib"),
]


def image(tmp_path: Path, *layers: list[tuple[tarfile.TarInfo, bytes]], **kw: object) -> Layout:
    lay = Layout(tmp_path / "img")
    lay.tag(lay.image(list(layers), **kw), "v1")  # type: ignore[arg-type]
    return lay


def test_whiteouts_opaque_dirs_and_replacements(tmp_path: Path, build: Build) -> None:
    top = [
        entry("etc/.wh.hosts"),  # delete a file
        entry("var/d", REG, b"now a file"),  # a directory replaced by a file
        entry("opt", DIR, mode=0o700),
        entry("opt/.wh..wh..opq"),  # opaque: lower children gone
        entry("opt/new", data=b"n"),
        entry("usr/lib/.wh.sub"),  # delete a directory
        entry("lib/.wh.a"),  # a whiteout through a symlinked parent (lib -> usr/lib)
        entry("etc/passwd-link", LNK, linkname="etc/passwd"),  # hard link to a lower file
        entry(".wh.nothing-here"),  # whiteout of a missing path: no-op
    ]
    image(tmp_path, BASE, top)
    tree, records = build(spec())
    assert paths(tree) == [
        "/",
        "/etc",
        "/etc/passwd",
        "/etc/passwd-link",
        "/lib",
        "/opt",
        "/opt/new",
        "/usr",
        "/usr/lib",
        "/var",
        "/var/d",
    ]
    assert tree.lookup("/etc/passwd") is tree.lookup("/etc/passwd-link")
    d = tree.lookup("/var/d")
    assert d is not None and d.type == FileType.REG and d.content == b"now a file"
    opt = tree.lookup("/opt")
    assert opt is not None and opt.mode == 0o700
    assert records[0].kind == "oci" and records[0].sha256.startswith("sha256:")


def test_whiteout_order_within_a_layer(tmp_path: Path, build: Build) -> None:
    """A whiteout hides only lower layers: entries of its own layer stay, before or after it."""
    top = [
        entry("opt/new", data=b"n"),  # this layer, before the opaque marker
        entry("opt/.wh..wh..opq"),
        entry("opt/keep", DIR),  # this layer re-creates keep: lower keep/y still hidden
        entry("etc/hosts", data=b"new hosts"),  # written, then whited out: stays
        entry("etc/.wh.hosts"),
        entry("usr/lib/sub/c", data=b"c"),  # new child of a dir whited out below
        entry("usr/lib/.wh.sub"),
    ]
    image(tmp_path, BASE, top)
    tree, _ = build(spec())
    got = paths(tree)
    assert "/opt/new" in got and "/opt/keep" in got
    assert "/opt/x" not in got and "/opt/keep/y" not in got
    hosts = tree.lookup("/etc/hosts")
    assert hosts is not None and hosts.content == b"new hosts"
    assert "/usr/lib/sub/c" in got and "/usr/lib/sub/b" not in got


def test_three_layers_in_order(tmp_path: Path, build: Build) -> None:
    image(
        tmp_path,
        BASE,
        [entry("etc/.wh.passwd")],
        [entry("etc/passwd", data=b"back"), entry("opt/.wh.keep"), entry("opt/keep", REG, b"f")],
    )
    tree, _ = build(spec())
    pw = tree.lookup("/etc/passwd")
    keep = tree.lookup("/opt/keep")
    assert pw is not None and pw.content == b"back"
    assert keep is not None and keep.type == FileType.REG


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
def test_layer_compressions_and_config(tmp_path: Path, compression: str) -> None:
    cfg = {"Env": ["A=1"], "Entrypoint": ["/bin/x"], "User": "1000:1000", "WorkingDir": "/w",
           "Labels": {"k": "v"}, "Cmd": None}  # fmt: skip
    image(tmp_path, BASE, compression=compression, config=cfg)
    (tmp_path / "spec.yaml").write_text(spec())
    packs = PackWriter(str(tmp_path), keep_inline=64)
    try:
        built = build_sources(load_spec(tmp_path / "spec.yaml"), tmp_path / "spec.yaml", packs)
    finally:
        packs.abort()
    assert built.image_config is not None
    assert built.image_config["config"] == {k: v for k, v in cfg.items() if v is not None}
    assert built.image_config["os"] == "linux" and built.image_config["architecture"] == "amd64"
    assert built.image_config["digest"] == built.records[0].sha256


def test_select_by_ref_digest_and_platform(tmp_path: Path, build: Build) -> None:
    lay = Layout(tmp_path / "img")
    amd = lay.image([[entry("arch", data=b"amd64")]], arch="amd64")
    arm = lay.image([[entry("arch", data=b"arm64")]], arch="arm64")
    other = lay.image([[entry("other", data=b"o")]])
    lay.tag(lay.multi([arm, amd]), "multi")
    lay.tag(other, "other")

    def arch(extra: str) -> bytes:
        tree, _ = build(spec(extra=extra))
        node = tree.lookup("/arch")
        assert node is not None and isinstance(node.content, bytes)
        return node.content

    assert host_platform_name() == "linux/amd64"  # this machine
    assert arch(", ref: multi") == b"amd64"
    assert arch(", ref: multi, platform: linux/arm64") == b"arm64"
    assert arch(f", digest: '{arm['digest']}'") == b"arm64"  # a manifest inside the index
    assert arch(f", ref: multi, digest: '{amd['digest']}'") == b"amd64"  # ref + pin
    tree, _ = build(spec(extra=", ref: other"))
    assert paths(tree) == ["/", "/other"]
    errors = {
        ", ref: nope": "no image tagged 'nope' (tags: multi, other)",
        "": "the image holds 2 images: choose one with ref (tags: multi, other) or digest",
        ", ref: multi, platform: linux/s390x": "no manifest for platform linux/s390x"
        " (available: linux/amd64, linux/arm64)",
        f", ref: other, digest: '{amd['digest']}'": f"is {other['digest']}, the spec pins",
        ", digest: 'sha256:" + "0" * 64 + "'": "is missing",
    }
    for extra, msg in errors.items():
        with pytest.raises(SourceError) as info:
            build(spec(extra=extra))
        assert str(info.value).startswith(str(tmp_path / "img") + ": "), info.value
        assert msg in str(info.value), (extra, str(info.value))


def test_archives_give_the_same_image(tmp_path: Path) -> None:
    """A layout dir, its oci-archive and a docker-archive: same tree, same record, same id."""
    cfg = {"Env": ["A=1"], "Cmd": ["/bin/sh"]}
    layers = [BASE, [entry("etc/.wh.hosts"), entry("new", data=b"n")]]
    ids = []
    for kind in ("dir", "oci-archive", "docker-archive"):
        work = tmp_path / kind
        work.mkdir()
        if kind == "docker-archive":
            docker_archive(work / "image", layers, "example/img:v1",
                           {"architecture": "amd64", "os": "linux", "config": cfg})  # fmt: skip
        else:
            lay = Layout(tmp_path / "layout")
            lay.tag(lay.image(layers, compression="none", config=cfg), "v1")
            if kind == "dir":
                shutil.copytree(lay.root, work / "image")
            else:
                archive(lay.root, work / "image")
        (work / "spec.yaml").write_text(spec("image", ", ref: v1"))
        assert cli(["build", str(work / "spec.yaml"), "-o", str(work / "out")]) == 0
        manifest = json.loads((work / "out" / "manifest.json").read_text())
        assert manifest["image_config"]["config"] == cfg
        ids.append(sha((work / "out" / "manifest.json").read_bytes()))
    assert ids[0] == ids[1] == ids[2]


def test_docker_archive_selection(tmp_path: Path, build: Build) -> None:
    cfg = {"architecture": "amd64", "os": "linux", "config": {}}
    cdig = docker_archive(tmp_path / "img", [BASE], "example/img:v1", cfg)
    for extra in ("", ", ref: v1", ", ref: 'example/img:v1'", f", digest: '{cdig}'"):
        tree, records = build(spec(extra=extra))
        assert "/etc/passwd" in paths(tree) and records[0].sha256 == cdig
    with pytest.raises(SourceError, match=r"no image tagged 'v2' \(tags: example/img:v1\)"):
        build(spec(extra=", ref: v2"))


# ---- verification and malformed images ------------------------------------------------


def corrupt_blob(lay: Layout, digest: str, data: bytes) -> None:
    (lay.root / "blobs" / "sha256" / digest[7:]).write_bytes(data)


def layer_digest(lay: Layout, i: int = 0) -> str:
    (desc,) = lay.index
    m = json.loads((lay.root / "blobs" / "sha256" / desc["digest"][7:]).read_bytes())
    return str(m["layers"][i]["digest"])


def expect(build: Build, tmp_path: Path, *needles: str, path: str = "img") -> str:
    with pytest.raises(SourceError) as info:
        build(spec(path))
    msg = str(info.value)
    assert msg.startswith(str(tmp_path / path) + ": "), msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_corrupt_compressed_layer(tmp_path: Path, build: Build) -> None:
    lay = image(tmp_path, BASE)
    p = lay.root / "blobs" / "sha256" / layer_digest(lay)[7:]
    raw = bytearray(p.read_bytes())
    raw[-8:-4] = b"\0\0\0\0"  # the gzip CRC: same size, other bytes
    p.write_bytes(bytes(raw))
    expect(build, tmp_path, "layer 1/1", "corrupt or truncated archive (gzip)")


def test_diff_id_mismatch(tmp_path: Path, build: Build) -> None:
    image(tmp_path, BASE, diff_ids=["sha256:" + "1" * 64])
    expect(build, tmp_path, "layer 1/1", "diff_id mismatch: the config says sha256:111")


def test_blob_replaced_with_same_size_other_content(tmp_path: Path, build: Build) -> None:
    lay = image(tmp_path, BASE, compression="none")
    d = layer_digest(lay)
    p = lay.root / "blobs" / "sha256" / d[7:]
    raw = bytearray(p.read_bytes())
    i = raw.index(b"root:x")
    raw[i] = ord("R")
    p.write_bytes(bytes(raw))
    expect(build, tmp_path, "layer 1/1", f"({d})", "digest mismatch")


@pytest.mark.parametrize(
    "damage, needles",
    [
        ("missing-layer", ["layer 1/1", "blob is missing"]),
        ("missing-config", ["config: blob sha256:", "is missing"]),
        ("bad-index", ["index.json: invalid JSON"]),
        ("bad-layout", ["unsupported oci-layout version '2.0.0'"]),
        ("manifest-edit", ["digest mismatch: blob sha256:"]),
        ("media-type", ["unsupported media type 'application/x-foo'"]),
        ("truncated-layer", ["layer 1/1", "size mismatch"]),
        ("wrong-compression", ["promises gzip, the blob is none"]),
    ],
)
def test_malformed_layouts(tmp_path: Path, build: Build, damage: str, needles: list[str]) -> None:
    lay = image(tmp_path, BASE)
    (desc,) = lay.index
    mpath = lay.root / "blobs" / "sha256" / desc["digest"][7:]
    manifest = json.loads(mpath.read_bytes())
    layer = lay.root / "blobs" / "sha256" / manifest["layers"][0]["digest"][7:]
    if damage == "missing-layer":
        layer.unlink()
    elif damage == "missing-config":
        (lay.root / "blobs" / "sha256" / manifest["config"]["digest"][7:]).unlink()
    elif damage == "bad-index":
        (lay.root / "index.json").write_text("{")
    elif damage == "bad-layout":
        (lay.root / "oci-layout").write_text('{"imageLayoutVersion": "2.0.0"}')
    elif damage == "manifest-edit":
        mpath.write_bytes(mpath.read_bytes().replace(b'"schemaVersion": 2', b'"schemaVersion":2'))
    elif damage in ("media-type", "wrong-compression"):
        if damage == "media-type":
            manifest["layers"][0]["mediaType"] = "application/x-foo"
        else:
            plain = gzip.decompress(layer.read_bytes())
            manifest["layers"][0].update(digest=lay.blob(plain), size=len(plain))
        data = json.dumps(manifest).encode()
        lay.index = [{**desc, "digest": lay.blob(data), "size": len(data)}]
        lay.write_index()
    elif damage == "truncated-layer":
        layer.write_bytes(layer.read_bytes()[:-100])
    expect(build, tmp_path, *needles)


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"", "empty file"),
        (gzip.compress(b"x" * 1000), "gzip compressed; decompress an archive first"),
        (b"PK\x03\x04" + b"\0" * 600, "unknown format"),
    ],
)
def test_not_an_image(tmp_path: Path, build: Build, content: bytes, needle: str) -> None:
    (tmp_path / "img").write_bytes(content)
    expect(build, tmp_path, "not an OCI image layout directory", needle)


def test_tar_without_index_or_manifest(tmp_path: Path, build: Build) -> None:
    (tmp_path / "img").write_bytes(tar_bytes([entry("hello", data=b"x")]))
    expect(build, tmp_path, "not an OCI image layout (no index.json) nor a docker-archive")
    (tmp_path / "img").unlink()
    expect(build, tmp_path, "cannot open image: No such file or directory")


def test_truncated_archive(tmp_path: Path, build: Build) -> None:
    lay = image(tmp_path / "src", BASE)
    archive(lay.root, tmp_path / "img")
    with tarfile.open(tmp_path / "img") as tf:
        cut = tf.getmember("blobs/sha256/" + layer_digest(lay)[7:]).offset_data + 10
    data = (tmp_path / "img").read_bytes()
    (tmp_path / "img").write_bytes(data[:cut])
    expect(build, tmp_path, "corrupt or truncated image archive: unexpected end of data")


def test_docker_archive_config_digest_mismatch(tmp_path: Path, build: Build) -> None:
    cfg = {"architecture": "amd64", "os": "linux", "config": {}}
    cdig = docker_archive(tmp_path / "src.tar", [BASE], "x:y", cfg)
    with tarfile.open(tmp_path / "src.tar") as src, tarfile.open(tmp_path / "img", "w") as dst:
        for m in src.getmembers():
            f = src.extractfile(m)
            assert f is not None
            data = f.read()
            if m.name == cdig[7:] + ".json":
                data = data.replace(b'"linux"', b'"LINUX"')
            dst.addfile(m, __import__("io").BytesIO(data))
    expect(build, tmp_path, f"{cdig[7:]}.json: digest mismatch: named {cdig}")


def test_failed_oci_build_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image(tmp_path, BASE, diff_ids=["sha256:" + "2" * 64])
    (tmp_path / "spec.yaml").write_text(spec())
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli(["build", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("btrfs-ublk-image: error: ") and "diff_id mismatch" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_layer_without_end_of_archive_blocks(tmp_path: Path, build: Build) -> None:
    """umoci 0.4 `insert` writes layers that stop right after the last member's data."""
    raw = tar_bytes([entry("etc", DIR), entry("etc/f", data=b"abc")])
    cut = raw[: raw.index(b"abc") + 3]  # no padding, no zero blocks
    lay = Layout(tmp_path / "img")
    lay.tag(lay.image([BASE]), "v1")
    (desc,) = lay.index
    mpath = lay.root / "blobs" / "sha256" / desc["digest"][7:]
    manifest = json.loads(mpath.read_bytes())
    cpath = lay.root / "blobs" / "sha256" / manifest["config"]["digest"][7:]
    config = json.loads(cpath.read_bytes())
    manifest["layers"].append(
        {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": lay.blob(cut),
         "size": len(cut)}
    )  # fmt: skip
    config["rootfs"]["diff_ids"].append(sha(cut))
    cdata = json.dumps(config).encode()
    manifest["config"].update(digest=lay.blob(cdata), size=len(cdata))
    mdata = json.dumps(manifest).encode()
    lay.index = [{**desc, "digest": lay.blob(mdata), "size": len(mdata)}]
    lay.write_index()
    tree, _ = build(spec())
    f = tree.lookup("/etc/f")
    assert f is not None and f.content == b"abc"
    # the same bytes as a plain tar source stay an error, and a short last member too
    (tmp_path / "cut.tar").write_bytes(cut)
    with pytest.raises(SourceError, match="truncated archive"):
        build("version: 1\nname: t\nlayers:\n  - tar: {path: cut.tar}\n")


def test_intended_differences_from_umoci(tmp_path: Path, build: Build) -> None:
    """docs/sources.md, intended differences 3-6 (1 and 2: test_oci_umoci.py and above)."""
    xattr = entry("x", data=b"x")
    xattr[0].pax_headers = {
        "SCHILY.xattr.security.selinux": "system_u:object_r:etc_t:s0",
        "SCHILY.xattr.trusted.overlay.opaque": "y",
    }
    odd = entry("odd", data=b"")
    odd[0].type = b"Z"  # an unknown entry type
    image(
        tmp_path,
        BASE + [xattr, odd, entry("afile", data=b"f"), entry("dirlink", SYM, linkname="usr")],
        [entry("afile/child", data=b"c"), entry("dirlink", DIR)],
    )
    tree, _ = build(spec())
    x = tree.lookup("/x")
    assert x is not None and set(x.xattrs) == {b"security.selinux", b"trusted.overlay.opaque"}
    o = tree.lookup("/odd")
    assert o is not None and o.type == FileType.REG  # 4: a regular file (umoci fails)
    a = tree.lookup("/afile")
    assert a is not None and a.type == FileType.DIR and "/afile/child" in paths(tree)  # 5
    d = tree.lookup("/dirlink")
    assert d is not None and d.type == FileType.DIR  # 6: the directory replaces the symlink
