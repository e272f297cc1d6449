"""Read what a build will read into the page cache while the interpreter starts.

``build`` calls ``start`` first thing, with two lists for one daemon thread:

* the files of the Python modules the last build loaded after this point (pydantic,
  pydantic-core's library, the stdlib modules they pull in, the btrfs writer...), as
  ``remember_modules`` wrote them to ``CACHE_FILE`` after that build: the imports then
  find them in the page cache. On a cold page cache the build's imports took 0.68 s
  instead of 0.36 s warm (9 runs each), most of it waiting for these ~250 small files;
* the spec's inputs: it reads the spec's YAML on its own (no validation: pydantic is
  not imported yet) for the tarballs and OCI archives its layers name and the layer
  blobs of OCI layout directories (those of the image ``ref`` names, else all in
  ``index.json``), in layer order. So the disk reads the inputs while Python imports
  and validates the spec instead of after it.

The thread reads with ``sendfile`` to ``/dev/null`` (no copy; it holds no GIL while it
waits for the disk). ``posix_fadvise(WILLNEED)`` would not do: Linux reads only the
first readahead window of it (``force_page_cache_ra`` caps it at the device's
readahead size).

Advisory only: anything it cannot read or parse is skipped silently (the build itself
reports it, with its usual errors); regular files only; at most ``LIMIT`` bytes of
inputs are read, so a huge input is not pushed through the page cache ahead of its
reading (the kernel's own readahead takes over behind it).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
import zlib
from collections.abc import Iterator
from typing import Any

# bytes asked for per build: what the disk here reads (about 500 MB/s cold) in the time
# the interpreter takes to start and validate the spec (0.3-0.9 s cold)
LIMIT = 256 << 20
STEP = 8 << 20  # bytes per sendfile call
_JSON_MAX = 4 << 20  # an index or manifest larger than this is skipped
_NESTING = 4  # index -> index -> manifest at most this deep


# the module files of the last build, one "NAME PATH" line each, in import order; one
# list per interpreter and checkout (several installs of one user share the cache)
# (crc32: hashlib would load OpenSSL's library before the module thread starts)
_KEY = zlib.crc32(f"{sys.executable}\0{__file__}".encode("utf-8", "surrogateescape"))
CACHE_FILE = f"btrfs-ublk-image/build-modules-{_KEY:08x}"
MODULES_LIMIT = 64 << 20  # bytes of module files read at most
# the module list as ``start`` read it: ``remember_modules`` writes only a changed one
_remembered: list[str] | None = None
_started = False  # ``start`` ran: this process is a build


def start(spec_path: str) -> list[threading.Thread]:
    """Start reading the last build's module files, then ``spec_path``'s inputs, into the
    page cache, each list on a daemon thread of its own (never joined: each ends with its
    files, or with the process). The module thread starts before the spec's YAML is
    parsed (the YAML library itself is on its list)."""
    global _started
    _started = True
    threads = []
    modules = _module_files()
    if modules:
        threads.append(_thread(modules, MODULES_LIMIT))
    inputs = _inputs_or_none(spec_path)
    if inputs:
        threads.append(_thread(inputs, LIMIT))
    return threads


def _inputs_or_none(spec_path: str) -> list[str] | None:
    try:
        return list(_inputs(spec_path)) or None
    except Exception:  # noqa: BLE001 - advisory: the build reports the spec's problems
        return None


def _thread(files: list[str], limit: int) -> threading.Thread:
    t = threading.Thread(target=_read, args=(files, limit), name="readahead", daemon=True)
    t.start()
    return t


def _read(files: list[str], limit: int) -> None:
    try:
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    left = limit
    try:
        for path in files:
            if left <= 0:
                break
            left -= _read_file(path, null, left)
    finally:
        os.close(null)


def _cache_path() -> str | None:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, CACHE_FILE) if os.path.isabs(base) else None


def _module_files() -> list[str]:
    """The files of the modules the last build loaded that this process has not."""
    global _remembered
    path = _cache_path()
    try:
        if path is None:
            return []
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return []
    _remembered = lines
    loaded = sys.modules
    return [p for n, _, p in (line.partition(" ") for line in lines) if p and n not in loaded]


def remember_modules() -> None:
    """After a build (``start`` ran in this process): write the files of the modules
    it loaded (compiled ``.pyc`` where there is one, else the source or the extension
    library) for the next build's ``start``; only when they changed. Errors are ignored
    (a cache). ``cli.run`` calls it: a build run in-process (tests) leaves it alone."""
    path = _cache_path()
    if path is None or not _started:
        return
    lines = []
    for name, mod in list(sys.modules.items()):
        spec = getattr(mod, "__spec__", None)
        for f in (getattr(spec, "cached", None), getattr(spec, "origin", None)):
            if isinstance(f, str) and os.path.isabs(f) and " " not in name and os.path.isfile(f):
                lines.append(f"{name} {f}")
                break
    if lines == _remembered:
        return
    from btrfs_ublk_image.files import write_atomic  # after the build: not on the early path

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(
            path, "".join(line + "\n" for line in lines).encode("utf-8", "surrogateescape")
        )
    except OSError:
        pass


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
