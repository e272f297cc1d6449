"""Prefetch traces (docs/trace-format.md): which pack chunks to fetch first, in order.

A trace is a small JSON file of its own beside a bundle (``prefetch.trace``), NOT listed
in manifest.json: adding or replacing it never changes the image id. It names the image
id it was made for; ublkd refuses a trace made for another image. ``build`` writes one
from the spec's ``prefetch:`` globs (source ``build``); ``ublkd record`` writes one from
the chunks a running server was asked for (source ``record``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.files import write_atomic
from btrfs_ublk_image.tree import Blob, FileType, Sparse, Tree

FORMAT = "btrfs-ublk-image.trace"
FORMAT_VERSION = 1
FILE_NAME = "prefetch.trace"
SOURCES = ("build", "record")

Source = Literal["build", "record"]
ChunkRef = tuple[int, int]  # (pack index, chunk index within the pack)


@dataclass(frozen=True, slots=True)
class Trace:
    image_id: str
    chunk_size: int
    source: Source
    chunks: tuple[ChunkRef, ...]  # fetch order, each chunk at most once


def encode(trace: Trace) -> bytes:
    """Keys sorted, compact, trailing newline: the same trace gives the same bytes (ublkd
    writes exactly these bytes too)."""
    obj = {
        "chunk_size": trace.chunk_size,
        "chunks": [list(c) for c in trace.chunks],
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "image_id": trace.image_id,
        "source": trace.source,
    }
    return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode()


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def decode(data: bytes, where: str) -> Trace:
    """Parse and check a trace's structure; errors name ``where`` and the problem."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ImageError(f"{where}: not a trace: invalid JSON: {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ImageError(f"{where}: not a trace (format is not {FORMAT!r})")
    obj = cast(dict[str, Any], obj)
    if obj.get("format_version") != FORMAT_VERSION:
        raise ImageError(
            f"{where}: trace format_version {obj.get('format_version')!r} is not supported"
            f" (this reads {FORMAT_VERSION})"
        )
    extra = sorted(
        set(obj) - {"format", "format_version", "image_id", "chunk_size", "source", "chunks"}
    )
    if extra:
        raise ImageError(f"{where}: unknown trace keys: {', '.join(extra)}")
    image_id = obj.get("image_id")
    if (
        not isinstance(image_id, str)
        or not image_id.startswith("sha256:")
        or len(image_id) != 71
        or any(c not in "0123456789abcdef" for c in image_id[7:])
    ):
        raise ImageError(f"{where}: image_id {image_id!r} is not sha256:<64 lowercase hex>")
    chunk_size = obj.get("chunk_size")
    if (
        not isinstance(chunk_size, int)
        or isinstance(chunk_size, bool)
        or chunk_size < 4096
        or chunk_size & (chunk_size - 1)
    ):
        raise ImageError(f"{where}: chunk_size {chunk_size!r} is not a power of two >= 4096")
    source = obj.get("source")
    if source not in SOURCES:
        raise ImageError(f"{where}: source {source!r} is not one of {', '.join(SOURCES)}")
    raw = obj.get("chunks")
    if not isinstance(raw, list):
        raise ImageError(f"{where}: chunks is not a list")
    chunks: list[ChunkRef] = []
    seen: set[ChunkRef] = set()
    for i, c in enumerate(raw):
        if not (isinstance(c, list) and len(c) == 2 and all(_int(x) and x >= 0 for x in c)):
            raise ImageError(f"{where}: chunks[{i}] = {c!r} is not [pack_index, chunk_index]")
        ref = (c[0], c[1])
        if ref in seen:
            raise ImageError(f"{where}: chunks[{i}] = {c!r} is listed twice")
        seen.add(ref)
        chunks.append(ref)
    return Trace(image_id, chunk_size, cast(Source, source), tuple(chunks))


def read(path: str) -> Trace:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ImageError(f"{path}: cannot read trace: {e.strerror}") from None
    return decode(data, path)


def write(path: str, trace: Trace) -> None:
    """Write atomically (temp file in the same directory, renamed)."""
    write_atomic(path, encode(trace), prefix=".trace.")


def check_for_bundle(trace: Trace, manifest: dict[str, Any], image_id: str, where: str) -> None:
    """The trace belongs to this bundle: same image id, chunk size, chunks that exist."""
    if trace.image_id != image_id:
        raise ImageError(
            f"{where}: trace was made for image {trace.image_id}, this bundle is image {image_id}"
        )
    if trace.chunk_size != manifest["chunk_size"]:
        raise ImageError(
            f"{where}: chunk_size {trace.chunk_size}, the bundle's is {manifest['chunk_size']}"
        )
    counts = [-(-int(p["size"]) // trace.chunk_size) for p in manifest["packs"]]
    for i, (pack, chunk) in enumerate(trace.chunks):
        if pack >= len(counts) or chunk >= counts[pack]:
            raise ImageError(
                f"{where}: chunks[{i}] = [{pack}, {chunk}] is not a chunk of this bundle's packs"
            )


def chunks_of_files(
    tree: Tree,
    patterns: Sequence[str],
    chunk_size: int,
    stored_size: Callable[[Blob], int] | None = None,
) -> list[ChunkRef]:
    """The pack chunks holding the content of the files ``patterns`` select (globs, as in
    ``remove:``; a pattern naming a directory selects everything under it), in pattern
    order, each pattern's files in listing (sorted path) order, each chunk once. Symlinks
    are not followed; inline files and empty files need no chunk. A pattern that selects
    nothing is an error (a typo would otherwise go unnoticed). ``stored_size``: the pack
    bytes a blob occupies when that is not its size (btrfs-zstd extents)."""
    from btrfs_ublk_image.sources.globs import PathSet

    entries = [(p, n) for p, n in tree.walk() if p != b"/"]
    out: list[ChunkRef] = []
    seen: set[ChunkRef] = set()
    for pattern in patterns:
        sel = PathSet([pattern])
        if not any(sel.match_or_parent(p) for p, _ in entries):
            raise ImageError(f"prefetch: pattern {pattern!r} matches nothing in the image")
        for path, node in entries:
            if node.type != FileType.REG or not sel.match_or_parent(path):
                continue
            content = node.content
            if isinstance(content, Blob):
                blobs: tuple[Blob, ...] = (content,)
            elif isinstance(content, Sparse):  # its data segments (holes need no chunk)
                blobs = tuple(blob for _, blob in content.segments)
            else:
                continue
            for blob in blobs:
                stored = blob.size if stored_size is None else stored_size(blob)
                if stored == 0:
                    continue
                first = blob.offset // chunk_size
                last = (blob.offset + stored - 1) // chunk_size
                for c in range(first, last + 1):
                    ref = (blob.pack, c)
                    if ref not in seen:
                        seen.add(ref)
                        out.append(ref)
    return out
