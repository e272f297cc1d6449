"""Registry images as sources: a digest-checked local cache and the spec's lock file.

The cache is a content-addressed OCI image layout (``oci-layout``, an empty
``index.json``, ``blobs/sha256/<hex>``) in ``$BUI_CACHE_DIR``, else
``/var/cache/btrfs-ublk-image/oci``. A blob enters it only through a temporary file
in its directory that is renamed to ``blobs/sha256/<hex>`` once its sha256 matched
(registry.Registry.get_blob; manifests the same way), so a name in the cache always
holds the bytes of its digest, and a wrong blob leaves nothing behind. The source then
reads the image from the cache exactly as from a local layout (sources/oci.py), which
checks every blob again while it streams.

A pull by digest whose blobs are all cached makes no request at all: a locked build
works offline.

The lock file (``<spec>.lock``, beside the spec) pins each registry ref of the spec to
the manifest (or index) digest it resolved to::

    {
      "lock_version": 1,
      "refs": {
        "registry.example/library/debian:12": "sha256:..."
      }
    }

``build`` resolves refs missing from it and writes it (sorted, after a successful
build); refs it has are pulled by their digest, so a tag that moved does not change the
image. ``build --update-lock`` resolves every ref again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from btrfs_ublk_image import patch
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.files import write_atomic
from btrfs_ublk_image.hashing import file_sha256
from btrfs_ublk_image.manifest import (
    BLOCKMAP,
    MANIFEST,
    META_IMG,
    PACKS,
    parse_manifest,
    read_bundle_file,
)
from btrfs_ublk_image.ocispec import (
    ANNOTATION_TITLE,
    MT_DOCKER_LIST,
    MT_OCI_INDEX,
    host_platform_name,
    platform_name,
    select_platform,
)
from btrfs_ublk_image.progress import Progress
from btrfs_ublk_image.push import ARTIFACT_BUNDLE, MT_META_ZSTD
from btrfs_ublk_image.registry import (
    Reference,
    Registry,
    credentials_for,
    parse_pull_reference,
)
from btrfs_ublk_image.spec import OciLayer, Spec

CACHE_ENV = "BUI_CACHE_DIR"
DEFAULT_CACHE = "/var/cache/btrfs-ublk-image/oci"
LOCK_SUFFIX = ".lock"
LOCK_VERSION = 1
_INDEX_TYPES = (MT_OCI_INDEX, MT_DOCKER_LIST)
_MAX_NESTING = 8


def cache_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get(CACHE_ENV) or DEFAULT_CACHE)


class BlobCache:
    """The content-addressed blob store (an OCI layout) registry images are pulled into."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs" / "sha256"
        try:
            self.blobs.mkdir(parents=True, exist_ok=True)
            if not (root / "oci-layout").exists():
                write_atomic(root / "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
            if not (root / "index.json").exists():
                write_atomic(root / "index.json", b'{"schemaVersion":2,"manifests":[]}')
        except OSError as e:
            raise ImageError(f"{root}: cannot create the image cache: {e.strerror or e}") from None

    def path(self, digest: str) -> Path:
        return self.blobs / digest.removeprefix("sha256:")

    def has(self, digest: str, size: int | None = None) -> bool:
        """The blob is cached (it was checked when it came in), of ``size`` if given."""
        try:
            got = self.path(digest).stat().st_size
        except OSError:
            return False
        return size is None or got == size

    def read(self, digest: str) -> bytes:
        return self.path(digest).read_bytes()

    def put(self, digest: str, data: bytes) -> None:
        got = "sha256:" + hashlib.sha256(data).hexdigest()
        if got != digest:
            raise ImageError(f"{self.root}: refusing to cache {digest}: its bytes are {got}")
        write_atomic(self.path(digest), data)


@dataclass(frozen=True, slots=True)
class Pulled:
    """A registry image in the cache."""

    ref: Reference  # as asked, with the digest it resolved to
    digest: str  # of the manifest or index the ref names
    media_type: str
    size: int
    platforms: list[str]  # of an index: the platforms pulled; [] for a single manifest


def _json(data: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ImageError(f"{where}: not JSON") from None
    if not isinstance(doc, dict):
        raise ImageError(f"{where}: not a JSON object")
    return doc


def pull(
    ref: Reference,
    cache: BlobCache,
    *,
    platform: str | None,
    plain_http: bool = False,
    credentials: tuple[str, str] | None = None,
    progress: Progress | None = None,
) -> Pulled:
    """Pull ``ref`` (by its digest if it has one, else its tag) into ``cache``: the manifest,
    or the index and the manifest of ``platform`` in it (``None``: of every platform), and
    their configs and layers. Blobs already cached are not fetched again."""
    reg = Registry(
        ref, plain_http=plain_http, credentials=credentials, progress=progress, actions="pull"
    )
    try:
        if ref.digest is not None and cache.has(ref.digest):
            digest, data = ref.digest, cache.read(ref.digest)
            media_type = str(_json(data, f"{ref}").get("mediaType") or "")
        else:
            data, media_type = reg.pull_manifest(ref.reference)
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            cache.put(digest, data)
        name = ref.with_digest(digest)
        doc = _json(data, str(name))
        platforms = _pull_tree(reg, cache, name, doc, media_type, platform, 0)
    finally:
        reg.close()
    return Pulled(name, digest, media_type, len(data), platforms)


def _pull_tree(
    reg: Registry,
    cache: BlobCache,
    name: Reference,
    doc: dict[str, Any],
    media_type: str,
    platform: str | None,
    depth: int,
) -> list[str]:
    """The blobs below one manifest or index document (already cached)."""
    if depth > _MAX_NESTING:
        raise ImageError(f"{name}: image indexes nested too deep")
    if media_type in _INDEX_TYPES or (not media_type and "manifests" in doc):
        descs = doc.get("manifests")
        if not isinstance(descs, list) or not all(isinstance(d, dict) for d in descs):
            raise ImageError(f"{name}: an image index without a manifests list")
        if platform is not None:
            chosen = [select_platform(descs, platform, "image index", str(name))]
        else:  # every platform (attestations and the like name os 'unknown')
            chosen = [d for d in descs if _runnable_platform(platform_name(d.get("platform")))]
            if not chosen:
                raise ImageError(f"{name}: the image index names no platform")
        out = []
        for d in chosen:
            child = _pull_manifest_blob(reg, cache, name, d)
            cdoc = _json(cache.read(child), f"{name}: manifest {child}")
            ctype = str(d.get("mediaType") or cdoc.get("mediaType") or "")
            _pull_tree(reg, cache, name, cdoc, ctype, platform, depth + 1)
            out.append(platform_name(d.get("platform")) or "")
        return out
    config = doc.get("config")
    layers = doc.get("layers")
    if not isinstance(config, dict) or not isinstance(layers, list):
        raise ImageError(f"{name}: not an image manifest (no config or layers)")
    for i, d in enumerate([config, *layers]):
        if not isinstance(d, dict):
            raise ImageError(f"{name}: descriptor {i} is not an object")
        _pull_blob(reg, cache, name, d)
    return []


def _runnable_platform(name: str | None) -> bool:
    return name is not None and not name.startswith("unknown/")


def _pull_manifest_blob(
    reg: Registry, cache: BlobCache, name: Reference, desc: dict[str, Any]
) -> str:
    digest = desc.get("digest")
    if not isinstance(digest, str):
        raise ImageError(f"{name}: an index entry without a digest")
    if not cache.has(digest):
        data, _ = reg.pull_manifest(digest)  # checked against the digest
        size = desc.get("size")
        if isinstance(size, int) and size != len(data):
            raise ImageError(f"{name}: manifest {digest}: {len(data)} bytes, the index says {size}")
        cache.put(digest, data)
    return digest


def _pull_blob(reg: Registry, cache: BlobCache, name: Reference, desc: dict[str, Any]) -> None:
    digest = desc.get("digest")
    size = desc.get("size")
    if not isinstance(digest, str):
        raise ImageError(f"{name}: a descriptor without a digest")
    size = size if isinstance(size, int) else None
    if cache.has(digest, size):
        return
    try:
        reg.get_blob(digest, str(cache.path(digest)), size)
    except ImageError as e:
        raise ImageError(f"{name}: {e}") from None
    if reg.progress is not None:
        reg.progress.add_file()


# --- the lock file --------------------------------------------------------------------------
def lock_path(spec_path: Path) -> Path:
    return spec_path.with_name(spec_path.name + LOCK_SUFFIX)


def read_lock(path: Path) -> dict[str, str]:
    """ref -> digest; {} when there is no lock file."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ImageError(f"{path}: cannot read the lock file: {e}") from None
    refs = doc.get("refs") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("lock_version") != LOCK_VERSION
        or not isinstance(refs, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in refs.items())
    ):
        raise ImageError(
            f"{path}: not a lock file of version {LOCK_VERSION} ({{lock_version, refs: {{REF:"
            " DIGEST}}}}); remove it or build with --update-lock"
        )
    return dict(refs)


def encode_lock(refs: dict[str, str]) -> bytes:
    doc = {"lock_version": LOCK_VERSION, "refs": refs}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def write_lock(path: Path, refs: dict[str, str]) -> bool:
    """Write the lock unless it already says exactly this; True if it was written."""
    data = encode_lock(refs)
    try:
        if path.read_bytes() == data:
            return False
    except OSError:
        pass
    try:
        write_atomic(path, data)
    except OSError as e:
        raise ImageError(f"{path}: cannot write the lock file: {e.strerror or e}") from None
    return True


def pin_spec(
    spec: Spec,
    spec_path: Path,
    *,
    update_lock: bool = False,
    locked: dict[str, str] | None = None,
    plain_http: bool = False,
    auth: str | None = None,
    progress: Progress | None = None,
) -> tuple[Spec, dict[str, str]]:
    """Pull every registry image of ``spec`` into the cache, each by its digest in the
    lock file (or the spec), else by its tag; -> the spec with each such source pinned to
    its digest, and the lock's new content (ref -> digest). ``update_lock``: the lock file
    is not read; ``locked``: these pins instead of the lock file's."""
    if locked is None:
        locked = {} if update_lock else read_lock(lock_path(spec_path))
    cache: BlobCache | None = None
    pins: dict[str, str] = {}
    layers = []
    for layer in spec.layers:
        if isinstance(layer, OciLayer) and layer.oci.path is None and layer.oci.ref is not None:
            src = layer.oci
            assert src.ref is not None
            ref = parse_pull_reference(src.ref)
            digest = src.digest or ref.digest or pins.get(src.ref) or locked.get(src.ref)
            cache = cache or BlobCache(cache_dir())
            if progress is not None:
                progress.phase(f"pulling {src.ref}")
            pulled = pull(
                ref.with_digest(digest) if digest else ref,
                cache,
                platform=src.platform or host_platform_name(),
                plain_http=plain_http,
                credentials=credentials_for(ref.registry, auth),
                progress=progress,
            )
            pins[src.ref] = pulled.digest
            layer = OciLayer(oci=src.model_copy(update={"digest": pulled.digest}))
        layers.append(layer)
    # model_copy keeps spec_sha256: the spec file's, as loaded
    return spec.model_copy(update={"layers": layers}), pins


def pull_bundle(
    text: str,
    dest: str,
    *,
    plain_http: bool = False,
    auth: str | None = None,
    progress: Progress | None = None,
) -> str:
    """The bundle artifact ``text`` (``oci://REGISTRY/REPO:TAG`` or ``@sha256:...``, as
    `push` makes it, docs/remote.md) downloaded into the new directory ``dest``: manifest.json
    (the config blob), meta.img (inflated from its zstd frame), the blockmap and the packs,
    each blob checked against its digest and meta.img and the blockmap against manifest.json
    (a pack's chunks are checked whenever they are read). Returns the image id."""
    ref = parse_pull_reference(text)
    reg = Registry(
        ref,
        plain_http=plain_http,
        credentials=credentials_for(ref.registry, auth),
        progress=progress,
        actions="pull",
    )
    with _pulling_into(dest, reg):
        data, _ = reg.pull_manifest(ref.reference)
        doc = _json(data, text)
        if doc.get("artifactType") != ARTIFACT_BUNDLE:
            raise ImageError(f"{text}: not a btrfs-ublk-image bundle (artifactType)")
        config, layers = doc.get("config"), doc.get("layers")
        if not isinstance(config, dict) or not isinstance(layers, list):
            raise ImageError(f"{text}: manifest without config or layers")
        mpath = os.path.join(dest, MANIFEST)
        reg.get_blob(str(config.get("digest")), mpath, config.get("size"))
        manifest, image_id = parse_manifest(read_bundle_file(mpath), f"{text}: {MANIFEST}")
        files: dict[str, Any] = manifest.get("files") or {}
        patches = patch.entries(manifest, f"{text}: {MANIFEST}")
        # a bundle with patches travels as its patch base and its patches (docs/remote.md)
        sizes = {patch.base_path(n): p["base"]["size"] for n, p in patches.items()}
        sizes[META_IMG] = files.get(META_IMG, {}).get("size", 0)
        os.mkdir(os.path.join(dest, "packs"))
        if patches:
            os.mkdir(os.path.join(dest, patch.BASE_DIR))
        for layer in layers:
            title = (layer.get("annotations") or {}).get(ANNOTATION_TITLE)
            if not isinstance(title, str) or not re.fullmatch(
                r"(base/)?(meta\.img|blockmap)|(meta\.img|blockmap)\.patch|packs/[0-9a-f]{64}",
                title,
            ):
                raise ImageError(f"{text}: layer {layer.get('digest')}: unexpected title {title!r}")
            if title.startswith(patch.BASE_DIR + "/") and not patches:
                raise ImageError(f"{text}: layer {title!r} but {MANIFEST} has no patches")
            path = os.path.join(dest, title)
            if os.path.exists(path):
                continue  # the same pack listed twice
            if layer.get("mediaType") == MT_META_ZSTD:
                reg.get_blob(str(layer.get("digest")), path + ".zst", layer.get("size"))
                _inflate(path + ".zst", path, int(sizes.get(title, 0)))
            else:
                reg.get_blob(str(layer.get("digest")), path, layer.get("size"))
        for name, p in patches.items():
            _unpatch(dest, manifest, name, p, files.get(name, {}), text)
        _check_files(dest, files, text)
    return image_id


def pull_http_bundle(url: str, dest: str, *, progress: Progress | None = None) -> str:
    """The bundle whose manifest.json is at ``url`` (``http(s)://HOST/PATH/manifest.json``, a
    bundle directory on a web server, as ``ublkd mount`` takes it, docs/remote.md)
    downloaded into the new directory ``dest``, its files found relative to the manifest's
    URL: manifest.json, meta.img and the blockmap (a bundle with patches: their patch base
    and patches, meta.img and the blockmap made from them), each checked against
    manifest.json, and the packs, whose chunks are checked whenever they are read. The
    client is the registry's (registry.Registry, its requests and checked downloads).
    Returns the image id."""
    parts = urllib.parse.urlsplit(url)
    if (
        parts.scheme not in ("http", "https")
        or not parts.path.endswith("/" + MANIFEST)
        or parts.query
        or parts.fragment
    ):
        raise ImageError(f"{url}: expected the URL of a bundle's {MANIFEST} (http or https)")
    directory = parts.path.rsplit("/", 1)[0]
    at = f"{parts.scheme}://{parts.netloc}{directory}/"
    ref = Reference(parts.netloc, directory.strip("/"), "")
    reg = Registry(ref, plain_http=parts.scheme == "http", progress=progress, actions="pull")
    with _pulling_into(dest, reg):
        mpath = os.path.join(dest, MANIFEST)
        reg.get_file(url, mpath, None, None)
        manifest, image_id = parse_manifest(read_bundle_file(mpath), url)
        files: dict[str, Any] = manifest.get("files") or {}
        patches = patch.entries(manifest, url)
        wanted = {patch.base_path(n): p["base"] for n, p in patches.items()}
        wanted |= {patch.patch_path(n): p for n, p in patches.items()}
        if patches:
            os.mkdir(os.path.join(dest, patch.BASE_DIR))
        else:
            wanted = {n: files.get(n, {}) for n in files}
        for rel, e in wanted.items():
            reg.get_file(at + rel, os.path.join(dest, rel), e.get("sha256"), e.get("size"))
        for name, p in patches.items():
            _unpatch(dest, manifest, name, p, files.get(name, {}), url)
        _check_files(dest, files, url)
        os.mkdir(os.path.join(dest, PACKS))
        for i, pack in enumerate(manifest.get("packs") or []):
            ppath = pack.get("path") if isinstance(pack, dict) else None
            if not isinstance(ppath, str) or not re.fullmatch(PACKS + r"/[0-9a-f]{64}", ppath):
                raise ImageError(f"{url}: pack {i}: path {ppath!r} is not packs/<hex>")
            if not os.path.exists(os.path.join(dest, ppath)):  # the same pack listed twice
                reg.get_file(at + ppath, os.path.join(dest, ppath), None, pack.get("size"))
    return image_id


@contextlib.contextmanager
def _pulling_into(dest: str, reg: Registry) -> Iterator[None]:
    """A pull into the new directory ``dest``: removed if the pull fails; ``reg`` closed."""
    os.mkdir(dest)
    try:
        yield
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    finally:
        reg.close()


def _check_files(dest: str, files: dict[str, Any], text: str) -> None:
    """meta.img and the blockmap in ``dest`` are the files manifest.json names."""
    for name in (META_IMG, BLOCKMAP):
        want = files.get(name, {}).get("sha256")
        path = os.path.join(dest, name)
        if not os.path.exists(path) or file_sha256(path) != want:
            raise ImageError(f"{text}: {name} is missing or differs from {MANIFEST}")


def _unpatch(
    dest: str,
    manifest: dict[str, Any],
    name: str,
    entry: dict[str, Any],
    want: dict[str, Any],
    text: str,
) -> None:
    """``name`` made from its patch base and patch in ``dest``, each checked against the
    manifest first (the result is checked by the caller)."""
    for rel, e in ((patch.base_path(name), entry["base"]), (patch.patch_path(name), entry)):
        path = os.path.join(dest, rel)
        if not os.path.exists(path) or file_sha256(path) != e["sha256"]:
            raise ImageError(f"{text}: {rel} is missing or differs from manifest.json")
    data = patch.apply(
        read_bundle_file(os.path.join(dest, patch.base_path(name))),
        read_bundle_file(os.path.join(dest, patch.patch_path(name))),
        int(want.get("size", 0)),
        f"{text}: {patch.patch_path(name)}",
        patch.in_block_form(manifest, name),
    )
    write_atomic(Path(dest) / name, data)


def _inflate(src: str, dest: str, limit: int) -> None:
    """The zstd frame ``src`` inflated into ``dest`` (at most ``limit`` bytes); ``src`` removed."""
    import zstandard

    written = 0
    try:
        with (
            open(src, "rb") as f,
            open(dest, "wb") as out,
            zstandard.ZstdDecompressor().stream_reader(f) as r,
        ):
            while block := r.read(1 << 20):
                written += len(block)
                if written > limit:
                    raise ImageError(f"{src}: inflates past {limit} bytes (manifest.json)")
                out.write(block)
    except zstandard.ZstdError as e:
        raise ImageError(f"{src}: bad zstd frame: {e}") from None
    finally:
        os.unlink(src)
