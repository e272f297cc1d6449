"""The files source: inline regular files, directories and symlinks; build_tree's records."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.sources import SourceRecord, build_tree
from btrfs_ublk_image.sources.files import canonical_sha256
from btrfs_ublk_image.spec import FilesLayer, parse_spec
from btrfs_ublk_image.tree import Blob, FileType, Tree

Build = Callable[[str], tuple[Tree, list[SourceRecord]]]

pytestmark = pytest.mark.unit

SPEC = """\
version: 1
name: t
layers:
  - files:
      - {path: /etc/motd, content: "hello\\n", mode: "0600", uid: 1, gid: 2, mtime: 1000}
      - {path: /usr/bin/vi, symlink: /usr/bin/vim.tiny}
      - {path: /srv/data, directory: true, mode: "2775", uid: 33}
      - {path: /usr/bin/su, content: "", mode: "4755"}
      - {path: etc/relative/../file, content: "r"}
      - {path: /, directory: true, mode: "0711", mtime: 7}
"""


def test_files_layer(build: Build) -> None:
    tree, records = build(SPEC)
    f = dict(tree.walk())
    motd = f[b"/etc/motd"]
    assert (motd.type, motd.content, motd.mode) == (FileType.REG, b"hello\n", 0o600)
    assert (motd.uid, motd.gid, motd.mtime_ns) == (1, 2, 1000 * 10**9)
    vi = f[b"/usr/bin/vi"]
    assert (vi.type, vi.target, vi.mode, vi.mtime_ns) == (
        FileType.SYMLINK,
        b"/usr/bin/vim.tiny",
        0o777,
        0,
    )
    data = f[b"/srv/data"]
    assert (data.type, data.mode, data.uid) == (FileType.DIR, 0o2775, 33)
    assert f[b"/usr/bin/su"].st_mode == 0o104755
    assert f[b"/etc/file"].content == b"r"
    assert f[b"/etc"].mode == 0o755  # created parent
    assert (tree.root.mode, tree.root.mtime_ns) == (0o711, 7 * 10**9)
    assert len(records) == 1
    assert records[0].kind == "files" and records[0].path == ""
    assert records[0].sha256.startswith("sha256:")


def test_defaults_follow_source_date_epoch(build: Build) -> None:
    tree, _ = build(
        "version: 1\nname: t\nsource_date_epoch: 99\nlayers:\n"
        "  - files:\n      - {path: /a/b/c, content: x}\n      - {path: /d, directory: true}\n"
    )
    f = dict(tree.walk())
    for p in (b"/", b"/a", b"/a/b", b"/a/b/c", b"/d"):
        assert f[p].mtime_ns == 99 * 10**9, p
    assert f[b"/a/b/c"].mode == 0o644 and f[b"/d"].mode == 0o755


def test_big_content_is_packed_and_deduplicated(build: Build, packs: PackWriter) -> None:
    body = "z" * 5000
    tree, _ = build(
        "version: 1\nname: t\nlayers:\n  - files:\n"
        f"      - {{path: /a, content: {body}}}\n      - {{path: /b, content: {body}}}\n"
    )
    a, b = tree.lookup("/a"), tree.lookup("/b")
    assert a is not None and b is not None
    assert isinstance(a.content, Blob) and a.content == b.content
    assert packs.bytes_deduped == 5000


def test_later_layers_win_over_tar(tmp_path: Path, build: Build) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in (("etc/motd", b"from tar"), ("etc/keep", b"keep")):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        ti = tarfile.TarInfo("usr/bin/vi")
        ti.type, ti.linkname = tarfile.SYMTYPE, "vim.basic"
        tf.addfile(ti)
    (tmp_path / "base.tar").write_bytes(buf.getvalue())
    tree, records = build(
        "version: 1\nname: t\nlayers:\n  - tar: {path: base.tar}\n  - files:\n"
        "      - {path: /etc/motd, content: new}\n"
        "      - {path: /usr/bin/vi, content: script}\n"
        "      - {path: /etc, directory: true, mode: '0700'}\n"
    )
    f = dict(tree.walk())
    assert f[b"/etc/motd"].content == b"new"
    assert f[b"/etc/keep"].content == b"keep"  # the directory kept its children
    assert f[b"/etc"].mode == 0o700
    assert f[b"/usr/bin/vi"].type == FileType.REG
    assert [r.kind for r in records] == ["tar", "files"]


def test_canonical_sha256_is_stable_and_content_sensitive() -> None:
    def layer(text: str) -> FilesLayer:
        spec = parse_spec("version: 1\nname: t\nlayers:\n  - files:\n" + text)
        files = spec.layers[0]
        assert isinstance(files, FilesLayer)
        return files

    a = layer("    - {path: /a, content: x, mode: '0644'}\n")
    same = layer("    - path: /a\n      mode: 420\n      content: x\n")
    other = layer("    - {path: /a, content: y}\n")
    assert canonical_sha256(a) == canonical_sha256(same)
    assert canonical_sha256(a) != canonical_sha256(other)


def test_path_through_a_file_replaces_it(build: Build) -> None:
    tree, _ = build(
        "version: 1\nname: t\nlayers:\n  - files:\n"
        "      - {path: /a, content: x}\n      - {path: /a/b, content: y}\n"
    )
    a = tree.lookup("/a")
    assert a is not None and a.type == FileType.DIR
    b = tree.lookup("/a/b")
    assert b is not None and b.content == b"y"


def test_long_component_is_a_spec_error(tmp_path: Path) -> None:
    from btrfs_ublk_image.errors import SpecError
    from btrfs_ublk_image.spec import load_spec

    p = tmp_path / "s.yaml"
    p.write_text(
        f"version: 1\nname: t\nlayers:\n  - files:\n    - {{path: /{'n' * 256}, content: x}}\n"
    )
    with pytest.raises(SpecError, match=r"s.yaml:5: layers\[0\].files\[0\].path: path component"):
        load_spec(p)


def test_build_tree_with_a_constructed_spec(tmp_path: Path, packs: PackWriter) -> None:
    spec = parse_spec("version: 1\nname: t\nlayers:\n  - files: [{path: /x, content: x}]\n")
    tree, records = build_tree(spec, tmp_path / "spec.yaml", packs, None)
    assert tree.lookup("/x") is not None and len(records) == 1


def test_tar_path_is_relative_to_the_spec(tmp_path: Path, packs: PackWriter) -> None:
    sub = tmp_path / "sub"
    sub.mkdir()
    spec = parse_spec("version: 1\nname: t\nlayers:\n  - tar: {path: here.tar}\n")
    with pytest.raises(SourceError, match=r"sub/here.tar: cannot open tarball"):
        build_tree(spec, sub / "spec.yaml", packs, None)
