"""Hostile and malformed input: it stays inside the image, or fails clearly leaving nothing."""

from __future__ import annotations

import gzip
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from ocitools import entry, tar_bytes

from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.sources import SourceRecord
from btrfs_ublk_image.tree import FileType, Tree

pytestmark = pytest.mark.unit
Build = Callable[[str], tuple[Tree, list[SourceRecord]]]
DIR, REG, SYM, LNK = tarfile.DIRTYPE, tarfile.REGTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE


def tar_spec(extra_layers: str = "") -> str:
    return f"version: 1\nname: t\nlayers:\n  - tar: {{path: a.tar}}\n{extra_layers}"


def paths(tree: Tree) -> list[str]:
    return sorted(p.decode() for p, _ in tree.walk())


def test_paths_through_symlinks_stay_in_the_image(tmp_path: Path, build: Build) -> None:
    (tmp_path / "a.tar").write_bytes(
        tar_bytes(
            [
                entry("etc", DIR),
                entry("etc/passwd", data=b"image"),
                entry("abs", SYM, linkname="/etc"),
                entry("abs/shadow", data=b"through an absolute symlink"),
                entry("rel", SYM, linkname="../../../../x/y"),
                entry("rel/z", data=b"through a relative symlink climbing out"),
                entry("chain", SYM, linkname="abs/../rel"),
                entry("chain/w", data=b"through a chain"),
                entry("hl", LNK, linkname="abs/passwd"),  # a hard link through a symlink
                entry("dangling", SYM, linkname="/nowhere/deep"),
                entry("dangling/f", data=b"creates the target inside the image"),
            ]
        )
    )
    tree, _ = build(tar_spec())
    assert paths(tree) == [
        "/",
        "/abs",
        "/chain",
        "/dangling",
        "/etc",
        "/etc/passwd",
        "/etc/shadow",
        "/hl",
        "/nowhere",
        "/nowhere/deep",
        "/nowhere/deep/f",
        "/rel",
        "/x",
        "/x/y",
        "/x/y/w",
        "/x/y/z",
    ]
    assert tree.lookup("/hl") is tree.lookup("/etc/passwd")
    for link in ("/abs", "/rel", "/chain", "/dangling"):
        node = tree.lookup(link)
        assert node is not None and node.type == FileType.SYMLINK  # never replaced
    assert not Path("/x/y/z").exists() and b"through" not in Path("/etc/shadow").read_bytes()


def test_later_layers_follow_symlinks_too(tmp_path: Path, build: Build) -> None:
    (tmp_path / "a.tar").write_bytes(tar_bytes([entry("srv", SYM, linkname="/data")]))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "index.html").write_text("hi")
    tree, _ = build(
        tar_spec(
            "  - dir: {path: src, dest: /srv/www}\n"
            "  - files:\n      - {path: /srv/motd, content: m}\n"
        )
    )
    assert paths(tree) == ["/", "/data", "/data/motd", "/data/www", "/data/www/index.html", "/srv"]


def expect(tmp_path: Path, build: Build, members: list[tuple[tarfile.TarInfo, bytes]]) -> str:
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    with pytest.raises(SourceError) as info:
        build(tar_spec())
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / 'a.tar'}: member "), msg
    return msg


def test_symlink_loop(tmp_path: Path, build: Build) -> None:
    msg = expect(
        tmp_path,
        build,
        [entry("l1", SYM, linkname="l2"), entry("l2", SYM, linkname="/l1"), entry("l1/f")],
    )
    assert msg.endswith("member 'l1/f': too many levels of symbolic links (more than 40)")


def test_name_too_long(tmp_path: Path, build: Build) -> None:
    msg = expect(tmp_path, build, [entry("d/" + "n" * 256, data=b"x")])
    assert "file name longer than 255 bytes: b'nnnn" in msg and "member 'd/nnn" in msg
    msg = expect(tmp_path, build, [entry("p" * 256 + "/f", data=b"x")])
    assert "file name longer than 255 bytes" in msg


@pytest.mark.parametrize("target", ["", "t" * 4096])
def test_bad_symlink_targets(tmp_path: Path, build: Build, target: str) -> None:
    msg = expect(tmp_path, build, [entry("s", SYM, linkname=target)])
    assert "member 's': invalid symlink target" in msg


def test_whiteout_names_in_a_plain_tar_are_files(tmp_path: Path, build: Build) -> None:
    (tmp_path / "a.tar").write_bytes(
        tar_bytes([entry("f", data=b"1"), entry(".wh.f", data=b"2"), entry("d/.wh..wh..opq")])
    )
    tree, _ = build(tar_spec())
    assert paths(tree) == ["/", "/.wh.f", "/d", "/d/.wh..wh..opq", "/f"]


# ---- every malformed class through the CLI: a clear one-line error, nothing left ---------


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    return tar_bytes(members)


GOOD = _tar([entry("etc", DIR), entry("etc/f", data=b"x" * 5000)])


def _bad_gzip() -> bytes:
    raw = bytearray(gzip.compress(GOOD, mtime=0))
    raw[-8:-4] = b"\xde\xad\xbe\xef"
    return bytes(raw)


CASES: dict[str, tuple[bytes, str, str]] = {
    # name: (tarball bytes, extra tar options, expected message part)
    "truncated": (GOOD[:1000], "", "truncated"),
    "corrupt-gzip": (_bad_gzip(), "", "corrupt or truncated archive (gzip)"),
    "unknown-compression": (b"\x04\x22\x4d\x18" + bytes(600), "", "unsupported compression: lz4"),
    "not-a-tar": (b"hello world" * 100, "", "unknown compression or not a tar archive"),
    "digest-mismatch": (GOOD, ", sha256: '" + "0" * 64 + "'", "sha256 mismatch"),
    "long-name": (_tar([entry("x" * 300, data=b"")]), "", "file name longer than 255 bytes"),
    "symlink-loop": (
        _tar([entry("a", SYM, linkname="a"), entry("a/b")]),
        "",
        "too many levels of symbolic links",
    ),
    "hardlink-missing": (_tar([entry("h", LNK, linkname="nope")]), "", "not in the image"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_input_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    data, opts, needle = CASES[case]
    (tmp_path / "a.tar").write_bytes(data)
    (tmp_path / "spec.yaml").write_text(
        f"version: 1\nname: t\nlayers:\n  - files: [{{path: /big, content: '{'y' * 9000}'}}]\n"
        f"  - tar: {{path: a.tar{opts}}}\n"
    )
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli(["build", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"btrfs-ublk-image: error: {tmp_path / 'a.tar'}: "), err
    assert needle in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no bundle, no temp dir


def test_failed_build_never_touches_an_existing_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.tar").write_bytes(GOOD)
    (tmp_path / "spec.yaml").write_text(tar_spec())
    assert cli(["build", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "out")]) == 0
    manifest = (tmp_path / "out" / "manifest.json").read_bytes()
    (tmp_path / "a.tar").write_bytes(GOOD[:700])
    assert cli(["build", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "out")]) == 1
    assert (tmp_path / "out" / "manifest.json").read_bytes() == manifest
    assert "already exists" in capsys.readouterr().err
