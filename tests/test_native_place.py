"""The native reader's members placed by the extension (``btrfs_ublk_native.Placer``)
against ``_place_member`` (the reference, ``tar.NATIVE_PLACE = False``) and the Python
reader (``BUI_NATIVE=0``): the same tree, entry by entry (names, types, modes, owners,
times, xattrs, content and where it is kept, hardlink identity), the
same image id, or the same error."""

from __future__ import annotations

import gc
import io
import itertools
import tarfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tartools import END, pax, rec, regular

from btrfs_ublk_image import native, sources
from btrfs_ublk_image.bundle import build_spec
from btrfs_ublk_image.errors import ImageError, SourceError
from btrfs_ublk_image.sources import tar as tar_source
from btrfs_ublk_image.spec import load_spec
from btrfs_ublk_image.tree import Blob, FileType, Inode, Tree

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        native.module() is None or not hasattr(native.module(), "Placer"),
        reason="native extension (with Placer) not built",
    ),
]

_serial = itertools.count()
Snapshot = list[tuple[Any, ...]]


def snapshot(tree: Tree) -> Snapshot:
    """Every entry of ``tree`` as comparable values, in walk order."""
    first: dict[int, bytes] = {}
    out: Snapshot = []
    for path, node in tree.walk():
        t, mode, uid, gid, xattrs = node.meta()
        aside = node.aside_at()
        payload: Any
        if aside is not None:
            payload = ("aside", *aside, node.content)
        elif t is FileType.DIR:
            payload = "dir"
        elif t is FileType.REG and isinstance(node.content, Blob):
            b = node.content
            payload = ("blob", b.crc32c, b.size, b.pack, b.offset)
        else:
            p = node.content if t is FileType.REG else node.target
            payload = (type(p).__name__, p)
        out.append(
            (
                path,
                type(t).__name__,
                int(t),
                mode,
                uid,
                gid,
                node.times(),
                dict(xattrs or {}),
                payload,
                first.setdefault(id(node), path),  # hardlinks: the first name of the inode
                node.ino,
            )
        )
    return out


def _build(tmp: Path, spec_text: str, how: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """(image id, tree snapshot, _place_member calls) of the spec built ``how`` ("python":
    the Python reader; "reference": the native reader, every member by _place_member;
    "native": the native reader and Placer), or 'error: MESSAGE'."""
    tag = f"{how}{next(_serial)}"
    spec_path = tmp / f"spec-{tag}.yaml"
    spec_path.write_text(spec_text)
    out = tmp / f"out-{tag}"
    trees: list[Snapshot] = []
    calls = [0]
    real_sources, real_place = sources.build_sources, tar_source._place_member

    def build_sources(*args: Any, **kw: Any) -> Any:
        built = real_sources(*args, **kw)
        trees.append(snapshot(built.tree))
        return built

    def place_member(*args: Any, **kw: Any) -> None:
        calls[0] += 1
        real_place(*args, **kw)

    with monkeypatch.context() as m:
        m.setenv(native.ENV, "0" if how == "python" else "1")
        m.setattr(tar_source, "NATIVE_PLACE", how == "native")
        m.setattr(sources, "build_sources", build_sources)
        m.setattr(tar_source, "_place_member", place_member)
        try:
            result = build_spec(load_spec(spec_path), spec_path, str(out), None)
        except (SourceError, ImageError) as e:
            assert not out.exists(), "a failed build left its output behind"
            return f"error: {e}", None, calls[0]
    assert len(trees) == 1
    return result.image_id, trees[0], calls[0]


def _all_ways(tmp: Path, spec_text: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """The three builds' results, checked equal; returns the native one's."""
    py = _build(tmp, spec_text, "python", monkeypatch)
    del native.fallbacks[:]
    ref = _build(tmp, spec_text, "reference", monkeypatch)
    got = _build(tmp, spec_text, "native", monkeypatch)
    assert got[0] == ref[0] == py[0]
    assert got[1] == ref[1]
    if py[1] is not None and not native.fallbacks:
        assert got[1] == py[1]
    return got + (ref[2], list(native.fallbacks))


def _tar(entries: list[tuple[tarfile.TarInfo, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding="utf-8") as tf:
        for t, data in entries:
            tf.addfile(t, io.BytesIO(data) if data else None)
    return buf.getvalue()


def _e(
    name: str,
    kind: bytes = tarfile.REGTYPE,
    data: bytes = b"",
    link: str = "",
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    mtime: float = 1_700_000_000,
    pax_headers: dict[str, str] | None = None,
) -> tuple[tarfile.TarInfo, bytes]:
    t = tarfile.TarInfo(name)
    t.type, t.linkname, t.mode, t.uid, t.gid, t.mtime = kind, link, mode, uid, gid, mtime
    t.size = len(data) if kind == tarfile.REGTYPE else 0
    if kind == tarfile.CHRTYPE:
        t.devmajor, t.devminor = 1, 3
    if pax_headers:
        t.pax_headers = pax_headers
    return t, data


D, S, H = tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE


def _files(prefix: str, n: int) -> Iterator[tuple[tarfile.TarInfo, bytes]]:
    sizes = [0, 1, 95, 96, 97, 98, 300, 4095, 4096, 9000, 70_000]
    for i in range(n):
        size = sizes[i % len(sizes)]
        yield _e(f"{prefix}/f{i}", data=bytes([i % 251]) * size, mode=0o600 + i % 3, uid=i % 4)


def _cases() -> dict[str, bytes]:
    long_dir = "d" * 200
    return {
        "plain": _tar(
            [_e("a", D, mode=0o755), *_files("a", 40), _e("a/s", S, link="f1"), _e("a/b", D)]
            + [*_files("a/b", 20), _e("a/b/sym", S, link="../f2"), _e("c", D), *_files("c", 5)]
            + [*_files("a", 3)]  # back to a directory placed before: replaced entries
        ),
        "no-directories-listed": _tar([*_files("x/y/z", 30), *_files("x", 5), *_files("w", 3)]),
        "hardlinks": _tar(
            [*_files("h", 12), _e("h/l1", H, link="h/f3"), _e("h/l2", H, link="h/f10")]
            + [_e("h/s", S, link="f1"), _e("h/ls", H, link="h/s"), _e("h/after", data=b"q" * 200)]
        ),
        "replaced": _tar(
            [*_files("r", 6), _e("r/f1", data=b"new" * 50), _e("r/f2", D), _e("r/f2/in", data=b"i")]
            + [_e("r/d", D), _e("r/d/x", data=b"x" * 99), _e("r/d", data=b"now a file" * 20)]
            + [_e("r/g", data=b"g" * 100), _e("r/g", S, link="f1"), _e("r/tail", data=b"t" * 97)]
        ),
        "dir-metadata-updates": _tar(
            [_e("m", D, mode=0o700, mtime=5), *_files("m", 5), _e("m", D, mode=0o751, uid=7)]
            + [_e("m/n", D), _e("m/n", D, mode=0o711, mtime=9.5), *_files("m/n", 4)]
            + [_e("./", D, mode=0o750, mtime=3), _e("m/tail", data=b"z" * 500)]
        ),
        "symlinked-dirs": _tar(
            [_e("real", D), *_files("real", 4), _e("link", S, link="real"), *_files("link", 4)]
            + [_e("abs", S, link="/real"), *_files("abs/deeper", 3), _e("loop", S, link="loop")]
            + [*_files("real", 2)]
        ),
        "dotdot-paths": _tar(
            [*_files("p", 3), _e("p/../q", data=b"q" * 150), _e("../../top", data=b"t" * 98)]
            + [_e("p/./x/../y", data=b"y" * 97), _e("./p/z", data=b"z"), _e("p//w", data=b"w" * 96)]
        ),
        "times-owners-modes": _tar(
            [_e("t", D)]
            + [_e(f"t/m{i}", data=b"m" * 120, mode=m, mtime=1.5 * i) for i, m in
               enumerate([0o4755, 0o2755, 0o1777, 0o7777, 0o000])]
            + [_e("t/neg", data=b"n", mtime=-5), _e("t/big-owner", data=b"o" * 100, uid=1 << 30,
                                                      gid=(1 << 32) - 2)]
            + [_e("t/pax-times", data=b"p" * 100, pax_headers={"atime": "12.5", "ctime": "-1.25"})]
            + [_e("t/atime-only", data=b"a", pax_headers={"atime": "7"})]
        ),  # fmt: skip
        "xattrs-and-specials": _tar(
            [_e("x", D), *_files("x", 3)]
            + [_e("x/xa", data=b"x" * 200, pax_headers={"SCHILY.xattr.user.k": "v"})]
            + [_e("x/fifo", tarfile.FIFOTYPE), _e("x/chr", tarfile.CHRTYPE), *_files("x", 2)]
            + [_e("x/dx", D, pax_headers={"SCHILY.xattr.user.d": "w"}), *_files("x/dx", 2)]
        ),
        "long-names": _tar(
            [_e(long_dir, D), _e(f"{long_dir}/{'n' * 255}", data=b"n" * 97)]
            + [_e(f"{long_dir}/{'s' * 255}", S, link="t" * 4095), *_files(long_dir, 3)]
        ),
        # more set-aside content in one segment than Placer hands the side file at once
        "many-set-aside": _tar([_e(f"s/f{i}", data=bytes([i % 251]) * 2000 + b"%d" % i)
                                for i in range(300)]),
        "raw-owner-minus-one": regular(b"o", b"y" * 300, uid=0xFFFFFFFF, gid=0xFFFFFFFF)
        + regular(b"o2", b"z" * 30, uid=0xFFFFFFFF)
        + END,
        "raw-pax-path": pax(rec(b"path", b"pp/named-by-pax")) + regular(b"ignored", b"x" * 100)
        + regular(b"pp/plain", b"y" * 100)
        + END,
    }  # fmt: skip


def _bad_cases() -> dict[str, bytes]:
    return {
        "name-too-long": _tar([*_files("a", 3), _e(f"a/{'n' * 256}", data=b"x")]),
        "symlink-target-too-long": _tar([*_files("a", 3), _e("a/s", S, link="t" * 4096)]),
        "empty-symlink-target": _tar([*_files("a", 3), _e("a/s", S, link="")]),
        "hard-link-to-nothing": _tar([*_files("a", 3), _e("a/l", H, link="a/none")]),
        "symlink-loop": _tar([_e("a", S, link="b"), _e("b", S, link="a"), *_files("a", 2)]),
        "dir-name-too-long": _tar([*_files("a", 3), _e(f"a/{'d' * 256}/x", data=b"x")]),
    }


def _spec(*layers: str, epoch: bool = True) -> str:
    head = "version: 1\nname: t\n" + ("source_date_epoch: 1\n" if epoch else "")
    return head + "layers:\n" + "".join(f"  - {layer}\n" for layer in layers)


@pytest.mark.parametrize("case", sorted(_cases()))
def test_placed_natively_same_tree(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "in.tar"
    path.write_bytes(_cases()[case])
    image_id, tree, calls, ref_calls, fellback = _all_ways(
        tmp_path, _spec(f"tar: {{path: {path}}}"), monkeypatch
    )
    assert not image_id.startswith("error"), image_id
    assert fellback == [], fellback
    assert tree is not None and len(tree) >= 3
    # some members went through Placer, not _place_member
    assert calls < ref_calls, (calls, ref_calls)


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_placed_natively_same_error(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "in.tar"
    path.write_bytes(_bad_cases()[case])
    image_id, *_ = _all_ways(tmp_path, _spec(f"tar: {{path: {path}}}"), monkeypatch)
    assert image_id.startswith("error: ") and str(path) in image_id, image_id


def test_layers_owner_overrides_and_no_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Later layers replacing and adding entries; uid/gid overrides; created directories'
    times without source_date_epoch."""
    cases = _cases()
    layers = []
    for i, case in enumerate(["plain", "replaced", "no-directories-listed", "hardlinks"]):
        path = tmp_path / f"in{i}.tar"
        path.write_bytes(cases[case])
        owner = ", uid: 42, gid: 4242" if i % 2 else ""
        layers.append(f"tar: {{path: {path}{owner}}}")
    for epoch in (True, False):
        image_id, tree, calls, ref_calls, _ = _all_ways(
            tmp_path, _spec(*layers, epoch=epoch), monkeypatch
        )
        assert not image_id.startswith("error"), image_id
        assert calls < ref_calls, (calls, ref_calls)


def test_oci_layers_with_whiteouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OCI layers (whiteouts, opaque directories, the layer's own entries kept: the upper
    set, which Placer adds to as _mark_upper does)."""
    from ocitools import Layout, entry

    layout = Layout(tmp_path / "oci")
    lower = [entry("a/x", data=b"x" * 5000), entry("a/y", data=b"y" * 97)]
    lower += [entry("o/in", data=b"i" * 120), entry("k", data=b"k" * 3000)]
    upper = [entry("a/.wh.x"), entry("b", data=b"b" * 4000), entry("o/.wh..wh..opq")]
    upper += [entry("o/new", data=b"n" * 96), entry("a/z", data=b"z" * 100)]
    # whiteouts after this layer's own entries: they stay (they are in its upper set)
    upper += [entry("a/w", data=b"w" * 300), entry("a/.wh.w"), entry("o/n2", data=b"2")]
    upper += [entry("o/.wh..wh..opq"), entry("a/.wh.y")]
    layout.tag(layout.image([lower, upper], compression="gzip"), "latest")
    image_id, tree, calls, ref_calls, _ = _all_ways(
        tmp_path, _spec(f"oci: {{path: {tmp_path / 'oci'}, ref: latest}}"), monkeypatch
    )
    assert not image_id.startswith("error"), image_id
    assert calls < ref_calls, (calls, ref_calls)  # the upper set tracked by Placer too
    names = [entry[0] for entry in tree]
    assert b"/a/x" not in names and b"/a/y" not in names and b"/o/in" not in names
    assert {b"/o/new", b"/o/n2", b"/a/w", b"/a/z"} <= set(names)


def _placed_tree(
    tmp: Path, spec_text: str, monkeypatch: pytest.MonkeyPatch, touch: bool = False
) -> tuple[str, Tree]:
    """(image id, tree) of the spec built natively; the tree as the writer read it (its
    files held inline in their directories' entries), or, with ``touch``, after Python
    code read every other directory's children (promoted: a tree mixing both kinds)."""
    tag = f"placed{next(_serial)}"
    spec_path = tmp / f"spec-{tag}.yaml"
    spec_path.write_text(spec_text)
    trees: list[Tree] = []
    real_sources = sources.build_sources

    def build_sources(*args: Any, **kw: Any) -> Any:
        built = real_sources(*args, **kw)
        trees.append(built.tree)
        if touch:
            for n, (_, node) in enumerate(list(built.tree.walk())):
                if node.type is FileType.DIR and n % 2:
                    list(node.entries.values())
        return built

    with monkeypatch.context() as m:
        m.setenv(native.ENV, "1")
        m.setattr(sources, "build_sources", build_sources)
        result = build_spec(load_spec(spec_path), spec_path, str(tmp / f"out-{tag}"), None)
    return result.image_id, trees[0]


def _python_id(tmp: Path, spec_text: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The image id of the spec built by the Python reader and writer (BUI_NATIVE=0)."""
    image_id, _, _ = _build(tmp, spec_text, "python", monkeypatch)
    assert isinstance(image_id, str) and image_id.startswith("sha256:"), image_id
    return image_id


def _inode_objects() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is Inode)


def test_inline_children_promoted_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files placed natively are no objects until Python code reads them; then each is one
    object, the same on every access and under every name of a hardlink."""
    members = [_e("d", kind=tarfile.DIRTYPE)]
    members += [_e(f"d/f{i}", data=bytes([65 + i % 26]) * (i * 7)) for i in range(60)]
    members += [
        _e("d/l", kind=tarfile.SYMTYPE, link="f1"),
        _e("d/h", kind=tarfile.LNKTYPE, link="d/f3"),
    ]
    (tmp_path / "l.tar").write_bytes(_tar(members))
    spec = _spec("tar: {path: l.tar}")
    image_id, tree = _placed_tree(tmp_path, spec, monkeypatch)
    assert image_id == _python_id(tmp_path, spec, monkeypatch)
    entries = tree.root.entries[b"d"].entries
    before = _inode_objects()
    f5 = entries[b"f5"]
    assert _inode_objects() == before + 1
    assert entries[b"f5"] is f5 and entries.get(b"f5") is f5 and dict(entries.items())[b"f5"] is f5
    assert f5.content == b"F" * 35 and entries[b"f59"].content == b"H" * 413  # set aside
    assert entries[b"l"].target == b"f1"
    assert entries[b"h"] is entries[b"f3"]  # the hardlink's target was promoted to link it
    children = list(entries.values())
    assert list(entries.values()) == children and len({id(c) for c in children}) == 61
    assert _inode_objects() <= before + 60  # one object per inode held inline, made once
    assert [n for n, _ in entries.items()] == list(entries)
    assert entries.pop(b"f7") is not None and b"f7" not in entries


def test_inline_children_in_a_mixed_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree whose directories hold some children inline and some as objects writes the
    same image as the Python path's."""
    members = []
    for d in range(6):
        members.append(_e(f"d{d}", kind=tarfile.DIRTYPE))
        members += [_e(f"d{d}/f{i}", data=b"%d" % (d * i) * 30) for i in range(40)]
        if d:
            members.append(_e(f"d{d}/h", kind=tarfile.LNKTYPE, link=f"d{d - 1}/f1"))
    (tmp_path / "l.tar").write_bytes(_tar(members))
    spec = _spec("tar: {path: l.tar}")
    mixed, _ = _placed_tree(tmp_path, spec, monkeypatch, touch=True)
    inline, _ = _placed_tree(tmp_path, spec, monkeypatch)
    assert mixed == inline == _python_id(tmp_path, spec, monkeypatch)


def test_inline_children_survive_undo_and_whiteouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer placed natively then undone (its archive handed back to the Python reader)
    leaves the earlier layer's inline children as they were; OCI whiteouts remove inline
    children. Both written as the Python path writes them."""
    from ocitools import Layout, entry

    (tmp_path / "a.tar").write_bytes(
        _tar([_e("d", kind=tarfile.DIRTYPE)] + [_e(f"d/a{i}", data=b"a" * i) for i in range(200)])
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for i in range(3000):
            info = tarfile.TarInfo(f"d/b{i}")
            info.size = i % 150
            t.addfile(info, io.BytesIO(b"b" * info.size))
    data = buf.getvalue()[: -2 * 512].rstrip(b"\0")  # no end-of-archive marker
    (tmp_path / "b.tar").write_bytes(data + b"\0" * (-len(data) % 512))
    spec = _spec("tar: {path: a.tar}", "tar: {path: b.tar}")
    del native.fallbacks[:]
    image_id, tree = _placed_tree(tmp_path, spec, monkeypatch)
    assert native.fallbacks
    assert image_id == _python_id(tmp_path, spec, monkeypatch)
    assert tree.root.entries[b"d"].entries[b"a150"].content == b"a" * 150

    layout = Layout(tmp_path / "oci")
    lower = [entry(f"a/x{i}", data=b"x" * i) for i in range(120)] + [entry("o/in", data=b"i" * 9)]
    upper = [entry("a/.wh.x3"), entry("a/.wh.x100"), entry("o/.wh..wh..opq")]
    upper += [entry("o/new", data=b"n" * 96), entry("a/x5", data=b"5")]
    layout.tag(layout.image([lower, upper], compression="gzip"), "latest")
    spec = _spec(f"oci: {{path: {tmp_path / 'oci'}, ref: latest}}")
    image_id, tree = _placed_tree(tmp_path, spec, monkeypatch)
    assert image_id == _python_id(tmp_path, spec, monkeypatch)
    a = tree.root.entries[b"a"].entries
    assert b"x3" not in a and b"x100" not in a and a[b"x5"].content == b"5"
    assert list(tree.root.entries[b"o"].entries) == [b"new"]


def test_inline_children_cycles_are_collected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects held by inline children (here the numbering's marks, made to refer back to
    the tree) are visited by their entries' GC traversal: the cycle is collected."""
    from btrfs_ublk_image.btrfs import numbering

    (tmp_path / "l.tar").write_bytes(
        _tar([_e("d", kind=tarfile.DIRTYPE)] + [_e(f"d/f{i}", data=b"f") for i in range(10)])
    )
    _, tree = _placed_tree(tmp_path, _spec("tar: {path: l.tar}"), monkeypatch)

    class Mark:
        tree: object

    once, more = Mark(), Mark()
    once.tree = tree  # tree -> entries -> an inline child's ino -> once -> tree
    num = numbering.Numbering(tree.root, once)
    native.module().number_inodes(tree.root, num, more)
    assert len(num.inodes) == 12
    gone = weakref.ref(once)
    del once, more, num, tree
    gc.collect()
    assert gone() is None


def test_numbering_on_a_base_keeps_children_inline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree placed natively, numbered on a base by the extension (numbering.rs,
    ``number_on_base``): no ``Inode`` object made for its files, the columns of the Python
    numbering; and a build on that base makes the Python path's image."""
    from types import SimpleNamespace

    from btrfs_ublk_image.base import BaseImage
    from btrfs_ublk_image.btrfs import numbering

    def layer(version: int) -> list[tuple[tarfile.TarInfo, bytes]]:
        members = []
        for d in range(4):
            members.append(_e(f"d{d}", kind=tarfile.DIRTYPE))
            for i in range(50):
                if (i + d + version) % 9:  # some names gone, some back, some new
                    members.append(_e(f"d{d}/f{i}-{(i * version) % 3}", data=b"%d" % i * 40))
        for d in range(4):
            target = f"d{(d + version) % 4}/f1-{version % 3}"
            members.append(_e(f"d{d}/h", kind=tarfile.LNKTYPE, link=target))
        return members

    (tmp_path / "v1.tar").write_bytes(_tar(layer(0)))
    (tmp_path / "v2.tar").write_bytes(_tar(layer(1)))
    v1 = _spec(f"tar: {{path: {tmp_path / 'v1.tar'}}}")
    _placed_tree(tmp_path, v1, monkeypatch)
    (base_dir,) = tmp_path.glob("out-placed*")
    v2 = _spec(f"tar: {{path: {tmp_path / 'v2.tar'}}}")
    _, tree = _placed_tree(tmp_path, v2, monkeypatch)
    with BaseImage(str(base_dir)) as base:
        layout = base.layout()

    def columns(num: Any) -> tuple[Any, ...]:
        return (
            bytes(num.inos), bytes(num.parent), bytes(num.index), list(num.name),
            num.more_refs, num.dir_indexes, [id(node) for node in num.inodes],
        )  # fmt: skip

    before = _inode_objects()
    ours = numbering.number(tree, layout)
    assert _inode_objects() == before  # its 4 directories and hardlinked files: objects already
    ours_columns = columns(ours)  # read from Python: promoted
    with monkeypatch.context() as m:
        m.setattr(numbering, "native", SimpleNamespace(module=lambda: None))
        assert columns(numbering.number(tree, layout)) == ours_columns
    assert len(ours_columns[3]) > 150 and ours_columns[4]  # rows, hardlinks

    on_base = v2.replace("layers:", f"base: {base_dir}\nlayers:")
    image_id, _ = _placed_tree(tmp_path, on_base, monkeypatch)
    assert image_id == _python_id(tmp_path, on_base, monkeypatch)


@pytest.mark.parametrize("base_kind", ["raw", "corrupt", "zstd"])
def test_a_build_on_a_base_reads_natively(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base_kind: str
) -> None:
    """A base whose packs are stored raw is read by the extension (basepacks.rs: each chunk
    checked against its digest before a compare reads it), so a build on it runs the
    native tar reader and placer (no ``_place_member`` call); a chunk that fails its digest
    is not reused; a compressed base keeps the Python reader. Every way gives the Python
    path's image and the same counts of reused and deduplicated bytes."""
    import json
    import random

    rnd = random.Random(11)
    contents = [rnd.randbytes(rnd.randint(2_000, 200_000)) for _ in range(40)]

    def layer(version: int) -> list[tuple[tarfile.TarInfo, bytes]]:
        members = [_e(f"d{d}", kind=tarfile.DIRTYPE) for d in range(4)]
        for i, data in enumerate(contents):
            if version and i % 13 == 5:
                data = data[:-1] + b"!"  # changed
            members.append(_e(f"d{i % 4}/f{i}", data=data))
        if version:  # base content under new names, twice
            members += [_e(f"d0/copy{n}", data=contents[i]) for n, i in enumerate((3, 3, 17))]
        return members

    (tmp_path / "v1.tar").write_bytes(_tar(layer(0)))
    (tmp_path / "v2.tar").write_bytes(_tar(layer(1)))
    v1 = _spec(f"tar: {{path: {tmp_path / 'v1.tar'}}}")
    if base_kind == "zstd":
        v1 = v1.replace("layers:", "pack_compression: zstd\nlayers:")
    base_dir = tmp_path / "base"
    spec_path = tmp_path / "v1.yaml"
    spec_path.write_text(v1)
    build_spec(load_spec(spec_path), spec_path, str(base_dir), None)
    if base_kind == "corrupt":
        (pack,) = (base_dir / "packs").iterdir()
        data = bytearray(pack.read_bytes())
        data[len(data) // 2] ^= 0xFF
        pack.write_bytes(bytes(data))
    on_base = _spec(f"tar: {{path: {tmp_path / 'v2.tar'}}}").replace(
        "layers:", f"base: {base_dir}\nlayers:"
    )
    image_id, tree, calls, _ref_calls, _fellback = _all_ways(tmp_path, on_base, monkeypatch)
    assert isinstance(image_id, str) and image_id.startswith("sha256:"), image_id
    assert (calls == 0) == (base_kind != "zstd"), calls
    stats = []
    for out in sorted(tmp_path.glob("out-*")):
        manifest = json.loads((out / "manifest.json").read_text())
        stats.append(
            (manifest["stats"]["base_reused_bytes"], manifest["stats"]["deduplicated_bytes"])
        )
    assert len(stats) == 3 and len(set(stats)) == 1, stats
    reused, deduped = stats[0]
    unchanged = sum(len(c) for i, c in enumerate(contents) if i % 13 != 5)
    if base_kind == "corrupt":
        assert 0 < reused < unchanged
    else:
        assert reused == unchanged + 2 * len(contents[3]) + len(contents[17])
        assert deduped == 0
