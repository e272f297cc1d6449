"""The dir source, `remove:` globs, source_date_epoch clamping, tar include/exclude/owner."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.errors import SourceError, SpecError
from btrfs_ublk_image.packs import PackWriter
from btrfs_ublk_image.sources import SourceRecord
from btrfs_ublk_image.sources.globs import compile_glob
from btrfs_ublk_image.spec import load_spec
from btrfs_ublk_image.tree import Blob, FileType, Tree

from bundletools import list_dir, list_tree, mounted_bundle, run

Build = Callable[[str], tuple[Tree, list[SourceRecord]]]
unit = pytest.mark.unit
NS = 1_000_000_000


def spec_dir(path: str, extra: str = "", opts: str = "") -> str:
    return f"version: 1\nname: t\n{extra}layers:\n  - dir: {{path: {path}{opts}}}\n"


def make_tree(root: Path) -> None:
    """Regular files (empty, small, big), dirs, a symlink, hard links, a fifo, xattrs, ns mtimes."""
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_bytes(b"image\n")
    (root / "etc" / "empty").write_bytes(b"")
    (root / "big").write_bytes(os.urandom(300_000))
    os.link(root / "big", root / "etc" / "big-link")
    (root / "bin").mkdir()
    (root / "bin" / "sh").write_bytes(b"#!shell")
    os.chmod(root / "bin" / "sh", 0o4755)
    os.symlink("../etc/hostname", root / "bin" / "link")
    os.mkfifo(root / "fifo", 0o600)
    os.setxattr(root / "etc" / "hostname", "user.comment", b"hi\0there")
    os.chmod(root / "etc", 0o750)
    for p in (root / "etc" / "hostname", root / "big", root / "etc"):
        os.utime(p, ns=(1_600_000_000_123_456_789, 1_700_000_000_987_654_321))
    os.utime(root / "bin" / "link", ns=(5 * NS, 6 * NS), follow_symlinks=False)


@unit
def test_dir_source_keeps_everything(tmp_path: Path, build: Build, packs: PackWriter) -> None:
    src = tmp_path / "src"
    make_tree(src)
    tree, records = build(spec_dir("src"))
    packs._file.flush()
    got = list_tree(tree, tmp_path / "packs")
    # the pack is still "pack.tmp": list_tree reads the only file in the directory
    want = list_dir(src)
    for e in want.values():
        if e["type"] == "dir":
            e.pop("mtime_ns", None)
    for e in got.values():
        if e["type"] == "dir":
            e.pop("mtime_ns", None)
    assert got == want
    big = tree.lookup("/big")
    assert big is not None and isinstance(big.content, Blob)
    assert big is tree.lookup("/etc/big-link")  # one inode
    etc = tree.lookup("/etc")
    assert etc is not None and etc.mtime_ns == 1_700_000_000_987_654_321 and etc.mode == 0o750
    assert records[0].kind == "dir" and records[0].path == "src"
    # the digest is of the tree, not of where it lives
    os.rename(src, tmp_path / "moved")
    packs2 = PackWriter(str(tmp_path / "packs"), keep_inline=64)
    try:
        from btrfs_ublk_image.sources import build_tree

        (tmp_path / "s2.yaml").write_text(spec_dir("moved"))
        _, again = build_tree(load_spec(tmp_path / "s2.yaml"), tmp_path / "s2.yaml", packs2)
    finally:
        packs2.abort()
    assert again[0].sha256 == records[0].sha256


@unit
def test_dir_source_dest_owner_and_filters(tmp_path: Path, build: Build) -> None:
    src = tmp_path / "src"
    make_tree(src)
    tree, _ = build(
        spec_dir(
            "src",
            opts=", dest: /srv/www, uid: 33, gid: 34, exclude: ['/srv/www/etc/big-*', '**/fifo']",
        )
    )
    paths = sorted(p for p, _ in tree.walk())
    assert b"/srv/www/etc/hostname" in paths
    assert b"/srv/www/etc/big-link" not in paths and b"/srv/www/fifo" not in paths
    for p, node in tree.walk():
        if p.startswith(b"/srv/www/"):
            assert (node.uid, node.gid) == (33, 34), p
    tree, _ = build(spec_dir("src", opts=", include: [/etc]"))
    assert sorted(p for p, _ in tree.walk()) == [
        b"/",
        b"/etc",
        b"/etc/big-link",
        b"/etc/empty",
        b"/etc/hostname",
    ]


@unit
def test_dir_source_root_metadata_is_not_copied(tmp_path: Path, build: Build) -> None:
    src = tmp_path / "src"
    src.mkdir(mode=0o700)
    (src / "f").write_text("x")
    tree, _ = build(spec_dir("src", extra="source_date_epoch: 7\n", opts=", dest: /opt/x"))
    assert tree.root.mode == 0o755 and tree.root.mtime_ns == 7 * NS
    x = tree.lookup("/opt/x")
    assert x is not None and x.mode == 0o755 and x.uid == 0
    # an empty directory still makes dest
    (tmp_path / "empty").mkdir()
    tree, _ = build(spec_dir("empty", opts=", dest: /srv"))
    assert tree.lookup("/srv") is not None


@unit
def test_dir_source_streams_without_reading_whole_files(
    tmp_path: Path, build: Build, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(5 << 20))
    sizes: list[int] = []
    real_fdopen = os.fdopen

    class Spy(io.RawIOBase):
        def __init__(self, f: io.FileIO) -> None:
            self.f = f

        def read(self, n: int = -1) -> bytes | None:
            sizes.append(n)
            return self.f.read(n)

        def fileno(self) -> int:
            return self.f.fileno()

        def close(self) -> None:
            self.f.close()

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: Spy(real_fdopen(*a, **k)))
    tree, _ = build(spec_dir("src"))
    assert sizes and max(sizes) <= 1 << 20 and -1 not in sizes


@unit
@pytest.mark.parametrize(
    "what, match",
    [
        ("missing", "cannot read directory: No such file or directory"),
        ("file", "not a directory"),
    ],
)
def test_dir_source_errors(tmp_path: Path, build: Build, what: str, match: str) -> None:
    if what == "file":
        (tmp_path / "file").write_text("x")
    with pytest.raises(SourceError, match=match) as info:
        build(spec_dir(what))
    assert str(info.value).startswith(str(tmp_path / what))


@unit
def test_dir_source_unreadable_file(tmp_path: Path, build: Build) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "secret").write_text("x")
    os.chmod(src / "secret", 0)
    if os.geteuid() != 0:
        with pytest.raises(SourceError, match="secret: cannot open: Permission denied"):
            build(spec_dir("src"))
        return
    # root reads everything: build in a child without the capabilities that bypass modes
    (tmp_path / "spec.yaml").write_text(spec_dir("src"))
    r = subprocess.run(
        ["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable]
        + [
            "-m",
            "btrfs_ublk_image",
            "build",
            str(tmp_path / "spec.yaml"),
            "-o",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "secret: cannot open: Permission denied" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.root
def test_dir_source_devices_xattrs_mount_identical(tmp_path: Path) -> None:
    """Root: devices, trusted/security xattrs, odd owners; the mounted bundle equals the tree."""
    src = tmp_path / "src"
    make_tree(src)
    os.mknod(src / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(src / "sda", 0o660 | stat.S_IFBLK, os.makedev(8, 0))
    os.chown(src / "etc" / "hostname", 1000, 2000)
    os.setxattr(src / "bin" / "sh", "security.capability", bytes.fromhex("01000002" + "00" * 16))
    os.setxattr(src / "bin", "trusted.x", b"\xff\x00")
    os.setxattr(src / "bin" / "link", "trusted.sym", b"s", follow_symlinks=False)
    (tmp_path / "spec.yaml").write_text(spec_dir("src"))
    assert cli(["build", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "bundle")]) == 0
    with mounted_bundle(tmp_path / "bundle", tmp_path) as m:
        got = list_dir(m.mountpoint)
        dir_mtimes = {
            p: os.lstat(str(m.mountpoint) + p).st_mtime_ns
            for p, e in got.items()
            if e["type"] == "dir"
        }
    assert got == list_dir(src)
    assert dir_mtimes == {
        p: os.lstat(str(src) + p).st_mtime_ns for p, e in got.items() if e["type"] == "dir"
    }
    assert run("btrfs", "check", "--readonly", tmp_path / "bundle" / "meta.img").returncode == 0


# ---- remove: ---------------------------------------------------------------------------


@unit
def test_remove_globs(tmp_path: Path, build: Build) -> None:
    src = tmp_path / "src"
    for p in ["usr/share/doc/a/copyright", "usr/share/doc/b", "usr/lib/x.pyc", "usr/lib/p/y.pyc",
              "usr/lib/p/y.py", "var/cache/apt/pkgcache.bin", "var/cache/apt/keep", ".hidden"]:  # fmt: skip
        (src / p).parent.mkdir(parents=True, exist_ok=True)
        (src / p).write_text(p)
    tree, _ = build(
        spec_dir(
            "src",
            extra="remove: ['/usr/share/doc/**', '**/*.pyc', 'var/cache/apt/*.bin', '/.h*']\n",
        )
    )
    paths = sorted(p.decode() for p, _ in tree.walk())
    assert paths == [
        "/",
        "/usr",
        "/usr/lib",
        "/usr/lib/p",
        "/usr/lib/p/y.py",
        "/usr/share",
        "/usr/share/doc",
        "/var",
        "/var/cache",
        "/var/cache/apt",
        "/var/cache/apt/keep",
    ]


@unit
@pytest.mark.parametrize(
    "pattern, yes, no",
    [
        ("/a/*", ["/a/b", "/a/.b"], ["/a", "/a/b/c"]),
        ("/a/**", ["/a/b", "/a/b/c"], ["/a", "/ab"]),
        ("/a/**/c", ["/a/c", "/a/b/c", "/a/b/b/c"], ["/a/b/d"]),
        ("**/c?", ["/c1", "/x/y/cd"], ["/c", "/x/cde"]),
        ("/[ab]x/[!0-9]", ["/ax/y", "/bx/z"], ["/cx/y", "/ax/1"]),
        ("a/b/", ["/a/b"], ["/a/b/c"]),
    ],
)
def test_glob_syntax(pattern: str, yes: list[str], no: list[str]) -> None:
    r = compile_glob(pattern)
    for p in yes:
        assert r.fullmatch(p.encode()), (pattern, p)
    for p in no:
        assert not r.fullmatch(p.encode()), (pattern, p)


@unit
@pytest.mark.parametrize(
    "pattern, error",
    [("/", "names no path"), ("/a/[b", "unterminated character class"), ("/../x", "'..'")],
)
def test_bad_globs_are_spec_errors(tmp_path: Path, pattern: str, error: str) -> None:
    p = tmp_path / "spec.yaml"
    p.write_text(f"version: 1\nname: t\nremove: ['{pattern}']\nlayers: []\n")
    with pytest.raises(
        SpecError, match=r"spec.yaml:3: remove\[0\]: .*" + error.replace("[", r"\[")
    ):
        load_spec(p)


# ---- source_date_epoch clamping -------------------------------------------------------


@unit
def test_source_date_epoch_clamps_every_time(tmp_path: Path, build: Build) -> None:
    src = tmp_path / "src"
    make_tree(src)
    os.utime(src / "bin" / "sh", ns=(3 * NS, 4 * NS))  # older: kept
    tree, _ = build(spec_dir("src", extra="source_date_epoch: 1650000000\n"))
    for path, node in tree.walk():
        assert node.mtime_ns <= 1_650_000_000 * NS, path
        assert node.atime_ns is None or node.atime_ns <= 1_650_000_000 * NS
    sh = tree.lookup("/bin/sh")
    host = tree.lookup("/etc/hostname")
    assert sh is not None and sh.mtime_ns == 4 * NS
    assert host is not None and host.mtime_ns == 1_650_000_000 * NS  # was 1_700_000_000.98..


@unit
def test_source_date_epoch_from_environment(tmp_path: Path) -> None:
    p = tmp_path / "spec.yaml"
    p.write_text("version: 1\nname: t\nlayers: []\n")
    assert load_spec(p, {"SOURCE_DATE_EPOCH": "1234"}).source_date_epoch == 1234
    assert load_spec(p, {}).source_date_epoch is None
    assert load_spec(p, {"SOURCE_DATE_EPOCH": ""}).source_date_epoch is None
    with pytest.raises(SpecError, match="SOURCE_DATE_EPOCH='soon': not a non-negative integer"):
        load_spec(p, {"SOURCE_DATE_EPOCH": "soon"})
    p.write_text("version: 1\nname: t\nsource_date_epoch: 5\nlayers: []\n")
    assert load_spec(p, {"SOURCE_DATE_EPOCH": "1234"}).source_date_epoch == 5  # the spec wins


@unit
def test_source_date_epoch_clamps_files_and_tar(tmp_path: Path, build: Build) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("new")
        ti.mtime = 2_000_000_000
        tf.addfile(ti)
    (tmp_path / "a.tar").write_bytes(buf.getvalue())
    tree, _ = build(
        "version: 1\nname: t\nsource_date_epoch: 100\nlayers:\n  - tar: {path: a.tar}\n"
        "  - files:\n      - {path: /f, content: x, mtime: 999}\n"
    )
    for path in ("/new", "/f", "/"):
        node = tree.lookup(path)
        assert node is not None and node.mtime_ns == 100 * NS, path


# ---- tar options: include / exclude / owner ---------------------------------------------


def _tar(tmp_path: Path, names: list[str]) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for n in names:
            ti = tarfile.TarInfo(n.rstrip("/"))
            ti.uid, ti.gid = 1000, 1000
            if n.endswith("/"):
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            elif "->" in n:
                name, target = n.split("->")
                ti.name, ti.type, ti.linkname = name, tarfile.LNKTYPE, target
                tf.addfile(ti)
            else:
                ti.size = len(n)
                tf.addfile(ti, io.BytesIO(n.encode()))
    (tmp_path / "a.tar").write_bytes(buf.getvalue())


@unit
def test_tar_include_exclude_owner(tmp_path: Path, build: Build) -> None:
    _tar(tmp_path, ["etc/", "etc/a", "etc/ssh/", "etc/ssh/key", "usr/", "usr/bin/x", "root/x"])
    tree, _ = build(
        "version: 1\nname: t\nlayers:\n"
        "  - tar: {path: a.tar, include: [/etc, /usr/**], exclude: ['/etc/ssh'], uid: 0, gid: 7}\n"
    )
    assert sorted(p.decode() for p, _ in tree.walk()) == [
        "/",
        "/etc",
        "/etc/a",
        "/usr",
        "/usr/bin",
        "/usr/bin/x",
    ]
    for p, node in tree.walk():
        if p != b"/" and p != b"/usr" and p != b"/usr/bin":
            assert (node.uid, node.gid) == (0, 7), p
    # patterns see the image path: after strip_components and dest
    tree, _ = build(
        "version: 1\nname: t\nlayers:\n"
        "  - tar: {path: a.tar, strip_components: 1, dest: /opt, include: ['/opt/ssh']}\n"
    )
    assert sorted(p.decode() for p, _ in tree.walk()) == ["/", "/opt", "/opt/ssh", "/opt/ssh/key"]


@unit
def test_tar_hardlink_to_excluded_file(tmp_path: Path, build: Build) -> None:
    _tar(tmp_path, ["a", "b->a"])
    with pytest.raises(
        SourceError, match="member 'b': hard link to 'a', which include/exclude leave out"
    ):
        build("version: 1\nname: t\nlayers:\n  - tar: {path: a.tar, exclude: [/a]}\n")


@unit
def test_dir_then_files_later_wins(tmp_path: Path, build: Build) -> None:
    src = tmp_path / "src"
    make_tree(src)
    tree, _ = build(
        "version: 1\nname: t\nlayers:\n  - dir: {path: src}\n"
        "  - files:\n      - {path: /etc/hostname, content: other}\n"
    )
    node = tree.lookup("/etc/hostname")
    assert node is not None and node.content == b"other" and node.xattrs == {}
    etc = tree.lookup("/etc")
    assert etc is not None and etc.type == FileType.DIR and etc.mode == 0o750
