"""Prefetch traces (docs/trace-format.md): the format, and build's `prefetch:` list.

The oracle for "exactly the chunks of those files" is our bundle reader: it reads each
selected file through meta.img's extents, the chunk tree and the blockmap, and we note
which pack chunks it loads. That path shares nothing with how build derives the trace
(from the in-memory tree's pack offsets).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from btrfs_ublk_image import trace
from btrfs_ublk_image.cli import main as cli
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.manifest import read_manifest
from btrfs_ublk_image.reader import BundleReader, DataDevice

pytestmark = pytest.mark.unit

CHUNK = 1 << 20
ID = "sha256:" + "ab" * 32


def sample(chunks: tuple[tuple[int, int], ...] = ((0, 3), (0, 0), (0, 7))) -> trace.Trace:
    return trace.Trace(ID, CHUNK, "record", chunks)


def test_round_trip_and_canonical_bytes(tmp_path: Path) -> None:
    t = sample()
    data = trace.encode(t)
    assert data == (
        b'{"chunk_size":1048576,"chunks":[[0,3],[0,0],[0,7]],"format":"btrfs-ublk-image.trace",'
        b'"format_version":1,"image_id":"' + ID.encode() + b'","source":"record"}\n'
    )
    assert trace.decode(data, "t") == t
    path = tmp_path / "x.trace"
    trace.write(str(path), t)
    assert trace.read(str(path)) == t
    assert [p.name for p in tmp_path.iterdir()] == ["x.trace"]  # no temp file left


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "other"}, "not a trace"),
        ({"format_version": 2}, "format_version 2 is not supported"),
        ({"image_id": "sha256:xyz"}, "is not sha256:<64 lowercase hex>"),
        ({"chunk_size": 1000}, "not a power of two"),
        ({"source": "guess"}, "source 'guess' is not one of build, record"),
        ({"chunks": [[0, 1], [0, 1]]}, "chunks[1] = [0, 1] is listed twice"),
        ({"chunks": [[0, -1]]}, "is not [pack_index, chunk_index]"),
        ({"chunks": [[0]]}, "is not [pack_index, chunk_index]"),
        ({"chunks": {"a": 1}}, "chunks is not a list"),
        ({"extra": 1}, "unknown trace keys: extra"),
    ],
)
def test_invalid_traces_are_refused_by_name(change: dict[str, object], message: str) -> None:
    obj = json.loads(trace.encode(sample()))
    obj.update(change)
    with pytest.raises(ImageError, match=r"^t\.trace: .*") as e:
        trace.decode(json.dumps(obj).encode(), "t.trace")
    assert message in str(e.value)


def test_not_json_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "bad.trace"
    p.write_bytes(b"\xff{")
    with pytest.raises(ImageError, match="bad.trace: not a trace: invalid JSON"):
        trace.read(str(p))
    with pytest.raises(ImageError, match="missing.trace: cannot read trace"):
        trace.read(str(tmp_path / "missing.trace"))


# --- build-time prefetch ----------------------------------------------------------------
def make_tree(root: Path) -> dict[str, bytes]:
    rnd = random.Random(11)
    files = {
        "usr/bin/big": rnd.randbytes(3 * CHUNK + 5),
        "usr/bin/small": rnd.randbytes(9000),
        "usr/bin/tiny": b"#!/bin/sh\n",  # inline: no pack chunk
        "usr/lib/libx.so": rnd.randbytes(2 * CHUNK),
        "etc/conf.d/a": rnd.randbytes(70_000),
        "etc/conf.d/b": rnd.randbytes(CHUNK + 1),
        "etc/motd": b"hi\n",
        "var/data": rnd.randbytes(4 * CHUNK),
    }
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


def build(tmp_path: Path, prefetch: list[str] | None, rc: int = 0) -> Path:
    src = tmp_path / "src"
    if not src.exists():
        src.mkdir()
        make_tree(src)
    spec = tmp_path / "spec.yaml"
    text = "version: 1\nname: pf\nsource_date_epoch: 0\nlayers:\n  - dir: {path: src}\n"
    if prefetch is not None:
        text += f"prefetch: {json.dumps(prefetch)}\n"
    spec.write_text(text)
    out = tmp_path / f"b{len(list(tmp_path.glob('b*')))}.bundle"
    assert cli(["build", str(spec), "-o", str(out)]) == rc
    return out


def chunks_read(bundle: Path, paths: list[str]) -> list[tuple[int, int]]:
    """Pack chunks the bundle reader loads to read ``paths`` in order (first-use order)."""
    seen: list[tuple[int, int]] = []
    orig = DataDevice._chunk

    def spy(self: DataDevice, pack: int, index: int) -> bytes:
        if (pack, index) not in seen:
            seen.append((pack, index))
        return orig(self, pack, index)

    with BundleReader(str(bundle)) as r:
        r.fs.dev2._chunk = spy.__get__(r.fs.dev2)  # type: ignore[method-assign]
        for p in paths:
            r.read(r.lookup(p))
    return seen


def test_build_writes_trace_of_exactly_those_files(tmp_path: Path) -> None:
    bundle = build(tmp_path, ["/usr/bin/*", "/etc/conf.d"])
    manifest, image_id = read_manifest(str(bundle))
    t = trace.read(str(bundle / trace.FILE_NAME))
    assert t.image_id == image_id
    assert t.source == "build" and t.chunk_size == manifest["chunk_size"]
    trace.check_for_bundle(t, manifest, image_id, "t")
    # pattern order, each pattern's files in sorted order
    want = chunks_read(
        bundle,
        ["/usr/bin/big", "/usr/bin/small", "/usr/bin/tiny", "/etc/conf.d/a", "/etc/conf.d/b"],
    )
    assert list(t.chunks) == want
    assert len(want) >= 4  # big alone spans 4 chunks
    others = chunks_read(bundle, ["/usr/lib/libx.so", "/var/data"])
    assert set(others) - set(want), "unselected files hold chunks of their own"
    # the trace is not part of the bundle's manifest (so not of its image id)
    assert trace.FILE_NAME not in json.dumps(manifest)
    assert sorted(os.listdir(bundle)) == [
        "blockmap",
        "manifest.json",
        "meta.img",
        "packs",
        "prefetch.trace",
    ]


def test_no_prefetch_no_trace_and_same_tree(tmp_path: Path) -> None:
    bundle = build(tmp_path, None)
    assert not (bundle / trace.FILE_NAME).exists()


def test_pattern_matching_nothing_fails_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build(tmp_path, ["/usr/bin/big", "/usr/sbin/*"], rc=1)
    assert "prefetch: pattern '/usr/sbin/*' matches nothing in the image" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml", "src"]


def test_trace_for_another_bundle_is_refused(tmp_path: Path) -> None:
    bundle = build(tmp_path, ["/var/data"])
    manifest, image_id = read_manifest(str(bundle))
    t = trace.read(str(bundle / trace.FILE_NAME))
    other = trace.Trace(ID, t.chunk_size, t.source, t.chunks)
    with pytest.raises(ImageError, match=f"made for image {ID}, this bundle is image {image_id}"):
        trace.check_for_bundle(other, manifest, image_id, "x")
    beyond = trace.Trace(image_id, t.chunk_size, t.source, ((0, 10_000),))
    with pytest.raises(ImageError, match=r"chunks\[0\] = \[0, 10000\] is not a chunk"):
        trace.check_for_bundle(beyond, manifest, image_id, "x")
