"""``tree.Entries`` (a directory's entries held by the extension) behaves as the mapping
Python code uses, and ``Names`` as the numbering's name column."""

from __future__ import annotations

import gc
import io
import random
import tarfile
import weakref
from collections.abc import MutableMapping
from pathlib import Path

import pytest
from btrfs_ublk_native import Names, Rows

from btrfs_ublk_image import native
from btrfs_ublk_image.bundle import build_spec
from btrfs_ublk_image.sources.base import LayerContext
from btrfs_ublk_image.spec import load_spec
from btrfs_ublk_image.tree import Entries, FileType, Inode, new_dir


@pytest.mark.unit
def test_entries_is_the_mapping_a_dict_was() -> None:
    rng = random.Random(3)
    e, d = Entries(), dict[bytes, Inode]()
    assert isinstance(e, MutableMapping)
    names = [bytes(rng.choice(b"abcxyz") for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    for i, name in enumerate(names):
        node = Inode(FileType.REG, mode=i & 0o777)
        if i % 3 == 2 and name in d:
            del e[name], d[name]  # removals: the slots are compacted on the way
        else:
            e[name] = d[name] = node
        assert len(e) == len(d)
    assert list(e) == list(d)  # insertion order, a name set again keeps its place
    assert list(e.items()) == list(d.items())
    assert all(e[k] is v for k, v in d.items())
    text: object = "a"
    assert b"nope" not in e and text not in e and e.get(b"nope") is None
    assert e.get(b"nope", 5) == 5
    with pytest.raises(KeyError):
        e[b"nope"]
    with pytest.raises(KeyError):
        del e[b"nope"]
    first = next(iter(d))
    assert e.pop(first) is d.pop(first)
    assert e == d and sorted(e) == sorted(d)
    e.clear()
    assert len(e) == 0 and list(e) == []


@pytest.mark.unit
def test_inode_entries_take_any_mapping() -> None:
    child = Inode(FileType.REG)
    d = Inode(FileType.DIR, entries={b"a": child})
    assert isinstance(d.entries, Entries) and d.entries[b"a"] is child
    d.entries = {b"b": child}
    assert list(d.entries) == [b"b"]
    same = Entries({b"c": child})
    d.entries = same
    assert d.entries is same
    with pytest.raises(TypeError):
        d.entries[b"x"] = 5  # type: ignore[assignment]
    assert isinstance(Inode(FileType.REG).entries, Entries)


class _Xattrs(dict[bytes, bytes]):
    """xattrs that can be referred to weakly."""


@pytest.mark.unit
def test_a_cycle_through_entries_is_collected() -> None:
    a = new_dir()
    a.entries[b"self"] = a  # a hardlinked directory: a cycle
    a.xattrs = held = _Xattrs({b"user.a": b"1"})
    gone = weakref.ref(held)
    del a, held
    gc.collect()
    assert gone() is None


@pytest.mark.unit
def test_names_and_rows_columns() -> None:
    names = Names([b"..", b"a"])
    names.append(b"\xffb")
    assert len(names) == 3 and names[2] == b"\xffb" and names[-1] == b"\xffb"
    assert list(names) == [b"..", b"a", b"\xffb"]
    for outside in (3, -4):
        with pytest.raises(IndexError, match="name row out of range"):
            names[outside]
    root, other = new_dir(), new_dir()
    rows = Rows([root, other])
    assert len(rows) == 2 and rows[-1] is other and rows[0] is root and rows[-2] is root
    for outside in (2, -3):
        with pytest.raises(IndexError, match="inode row out of range"):
            rows[outside]


@pytest.mark.unit
def test_members_placed_natively_are_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An archive the native read hands back after placing members (no end-of-archive
    marker): its undo log holds one ``Names`` per run of members in one directory, and the
    undo leaves none of them in the tree."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for d in ("d", "e"):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            t.addfile(info)
            for i in range(3000):
                t.addfile(tarfile.TarInfo(f"{d}/f{i}"), io.BytesIO(b""))
    data = buf.getvalue()[: -2 * 512].rstrip(b"\0")
    (tmp_path / "l.tar").write_bytes(data + b"\0" * (-len(data) % 512))
    spec = tmp_path / "spec.yaml"
    spec.write_text("version: 1\nname: t\nlayers:\n  - tar: {path: l.tar}\n")
    undone: list[tuple[list[str], list[bytes]]] = []
    undo = LayerContext.undo

    def watched(ctx: LayerContext) -> None:
        kinds = [type(c[1]).__name__ for c in ctx._changes or [] if len(c) == 2]
        undo(ctx)
        undone.append((kinds, list(ctx.tree.root.entries)))

    monkeypatch.setattr(LayerContext, "undo", watched)
    del native.fallbacks[:]
    build_spec(load_spec(spec), spec, str(tmp_path / "out"), None)
    assert native.fallbacks and undone == [(["Names"] * 4, [])]
