"""Read a spec's local inputs into the page cache while the interpreter starts.

``build`` calls ``start`` first thing: it reads the spec's YAML on its own (no
validation: pydantic is not imported yet) and names the tarballs and OCI archives its
layers read and the layer blobs of OCI layout directories (those of the image ``ref``
names, else all in ``index.json``), in layer order; a daemon thread then reads them
into the page cache with ``sendfile`` to ``/dev/null`` (no copy; the thread holds no GIL
while it waits for the disk). So the disk reads the inputs while Python imports and
validates the spec instead of after it. ``posix_fadvise(WILLNEED)`` would not do: Linux
reads only the first readahead window (``force_page_cache_ra`` caps it at the
device's readahead size).

Advisory only: anything it cannot read or parse is skipped silently (the build itself
reports it, with its usual errors); at most ``LIMIT`` bytes are read, so a huge input is
not pushed through the page cache ahead of its reading (the kernel's own readahead
takes over behind it).
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Iterator
from typing import Any

# bytes asked for per build: what the disk here reads (about 500 MB/s cold) in the time
# the interpreter takes to start and validate the spec (0.3-0.9 s cold)
LIMIT = 256 << 20
STEP = 8 << 20  # bytes per sendfile call
_JSON_MAX = 4 << 20  # an index or manifest larger than this is skipped
_NESTING = 4  # index -> index -> manifest at most this deep


def start(spec_path: str) -> threading.Thread | None:
    """Start reading ``spec_path``'s inputs into the page cache on a daemon thread (never
    joined: it ends with the inputs, or with the process); None when there is nothing."""
    try:
        files = list(_inputs(spec_path))
    except Exception:  # noqa: BLE001 - advisory: the build reports the spec's problems
        return None
    if not files:
        return None
    t = threading.Thread(target=_read, args=(files,), name="readahead", daemon=True)
    t.start()
    return t


def _read(files: list[str]) -> None:
    left = LIMIT
    try:
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for path in files:
            if left <= 0:
                return
            left -= _read_file(path, null, left)
    finally:
        os.close(null)


def _read_file(path: str, null: int, limit: int) -> int:
    """The first ``limit`` bytes of ``path`` into the page cache; -> the bytes read.
    Regular files only, never opened otherwise: reading a FIFO would take the bytes from
    the build, and even opening one lets its writer start before the build reads."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return 0
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return 0
    done = 0
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return 0
        while done < limit:
            n = os.sendfile(null, fd, done, min(STEP, limit - done))
            if n <= 0:
                break
            done += n
    except OSError:
        pass
    finally:
        os.close(fd)
    return done


def _inputs(spec_path: str) -> Iterator[str]:
    """The files the spec's tar and oci layers will read, in layer order."""
    import yaml  # the spec module imports it too

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(spec_path, "rb") as f:
        spec = yaml.load(f.read(_JSON_MAX), Loader=loader)  # noqa: S506 - a safe loader
    here = os.path.dirname(os.path.abspath(spec_path))
    for layer in spec.get("layers") or []:
        if not isinstance(layer, dict):
            continue
        src = layer.get("tar") or layer.get("oci")
        if not isinstance(src, dict) or not isinstance(src.get("path"), str):
            continue
        path = os.path.join(here, src["path"])
        if "oci" in layer and os.path.isdir(path):
            ref = src.get("ref")
            try:  # what a broken layout still names
                yield from _layout_blobs(path, ref if isinstance(ref, str) else None)
            except (OSError, ValueError):
                continue
        else:
            yield path


def _layout_blobs(layout: str, ref: str | None) -> Iterator[str]:
    """An OCI layout's layer blobs: of the manifests ``ref`` names (all without one)."""
    index = _read_json(os.path.join(layout, "index.json"))
    descs = [
        d
        for d in _manifests(index)
        if ref is None
        or (d.get("annotations") or {}).get("org.opencontainers.image.ref.name") == ref
    ]
    for _ in range(_NESTING):
        nested: list[dict[str, Any]] = []
        for desc in descs:
            doc = _read_json(_blob(layout, desc.get("digest")))
            nested.extend(_manifests(doc))
            for layer in doc.get("layers") or []:
                if isinstance(layer, dict):
                    yield _blob(layout, layer.get("digest"))
        descs = nested


def _manifests(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in doc.get("manifests") or [] if isinstance(d, dict)]


def _blob(layout: str, digest: object) -> str:
    if not isinstance(digest, str) or ":" not in digest or "/" in digest:
        raise ValueError(f"not a digest: {digest!r}")
    alg, hexd = digest.split(":", 1)
    return os.path.join(layout, "blobs", alg, hexd)


def _read_json(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        doc = json.loads(f.read(_JSON_MAX))
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    return doc
