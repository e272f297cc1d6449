"""The ``oci`` layer: an OCI image (layout directory, ``oci-archive`` or ``docker-archive``).

Containers
  * an OCI image layout directory (``oci-layout``, ``index.json``, ``blobs/sha256/..``);
  * an ``oci-archive``: the same layout in an uncompressed tarball (skopeo, buildah);
  * a ``docker-archive``: ``docker save`` output (``manifest.json`` + config + layer tars).
  A tarball is never unpacked: one pass over its headers finds each member's offset,
  then every blob is read in place, once. A directory holding ``manifest.json`` (an
  unpacked docker-archive) works too. A tarball with both (docker 25+) is read as OCI.
  * an image in a registry (no ``path``, ``ref: REGISTRY/REPO:TAG`` or ``@sha256:``):
    pulled into the digest-checked cache (pull.py), then read from it as a layout.

Selection: ``ref`` matches the ``org.opencontainers.image.ref.name`` annotation of a
descriptor in ``index.json`` (docker-archive: a ``RepoTags`` entry, whole or its tag);
``digest`` selects an index or manifest by digest (docker-archive: the config digest);
with neither, the image must hold exactly one image. An image index (nested ones too)
is resolved to the manifest of ``platform`` (default: the host's, ``linux/amd64`` on
x86_64).

Verification: every JSON blob and every layer blob is hashed while read and must
match its descriptor (digest and size); each layer's uncompressed tar stream is hashed
while it is parsed and must match the config's ``rootfs.diff_ids``. A mismatch fails
the build (nothing is written: the bundle writer discards its temporary directory).

Layers apply in order with the OCI whiteout rules (``LayerContext.whiteout``). The
image config's runtime part (env, entrypoint, cmd, user, working dir, labels, ...)
goes to the bundle manifest's ``image_config``; the source record's digest is the
config digest (the image id), so the same image gives the same record whatever
container it came in.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from btrfs_ublk_image.errors import SourceError
from btrfs_ublk_image.ocispec import (
    MT_DOCKER_LIST,
    MT_DOCKER_MANIFEST,
    MT_OCI_INDEX,
    MT_OCI_MANIFEST,
    host_platform_name,
    platform_name,
    select_platform,
)
from btrfs_ublk_image.sources.base import LayerContext, SourceRecord
from btrfs_ublk_image.sources.tar import TarOptions, detect_compression, read_tar
from btrfs_ublk_image.spec import OciLayer

MAX_JSON = 16 << 20  # index, manifest and config blobs are read whole: bounded
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")

_INDEX_TYPES = (MT_OCI_INDEX, MT_DOCKER_LIST)
_MANIFEST_TYPES = (MT_OCI_MANIFEST, MT_DOCKER_MANIFEST)
# layer media type -> the compression it promises (None: any, detected from the bytes)
_LAYER_TYPES: dict[str, str | None] = {
    "application/vnd.oci.image.layer.v1.tar": "none",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "none",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": None,  # docker: often plain tar
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": None,
}
REF_NAME = "org.opencontainers.image.ref.name"
CONTAINERD_NAME = "io.containerd.image.name"
# the runtime part of an image config kept in the bundle manifest
CONFIG_KEYS = (
    "User",
    "ExposedPorts",
    "Env",
    "Entrypoint",
    "Cmd",
    "Volumes",
    "WorkingDir",
    "Labels",
    "StopSignal",
)

# ---- containers -------------------------------------------------------------------------


class _Range:
    """A read-only window ``[offset, offset + size)`` of an open file."""

    def __init__(self, f: BinaryIO, offset: int, size: int) -> None:
        self.f, self.pos, self.left = f, offset, size

    def read(self, n: int = -1) -> bytes:
        if n < 0 or n > self.left:
            n = self.left
        if n == 0:
            return b""
        self.f.seek(self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        self.left -= len(data)
        return data


class _Store:
    """Files of an image container by relative path: a directory or an uncompressed tarball."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.members: dict[str, tuple[int, int]] | None = None  # archive: name -> (offset, size)
        self.file: BinaryIO | None = None
        if path.is_dir():
            return
        try:
            self.file = open(path, "rb")  # noqa: SIM115 - closed by close()
        except OSError as e:
            raise SourceError(f"{path}: cannot open image: {e.strerror or e}") from None
        head = self.file.read(512)
        kind = detect_compression(head)
        if kind is None or kind != "none" or not head:
            self.close()
            what = "empty file" if not head else f"{kind} compressed" if kind else "unknown format"
            raise SourceError(
                f"{path}: not an OCI image layout directory nor an uncompressed oci-archive or"
                f" docker-archive tarball ({what}; decompress an archive first)"
            )
        self.file.seek(0)
        self.members = self._index(self.file)

    def _index(self, f: BinaryIO) -> dict[str, tuple[int, int]]:
        import tarfile  # archives only: a layout directory's build does not load it

        members: dict[str, tuple[int, int]] = {}
        links: dict[str, str] = {}
        try:
            with tarfile.open(
                fileobj=f, mode="r:", encoding="utf-8", errors="surrogateescape"
            ) as tf:
                for m in tf:
                    name = _norm(m.name)
                    if m.isreg():
                        members[name] = (m.offset_data, m.size)
                    elif m.issym():
                        links[name] = _norm(os.path.join(os.path.dirname(name), m.linkname))
                    elif m.islnk():
                        links[name] = _norm(m.linkname)
                    vars(tf)["members"].clear()  # only the index is kept
        except (tarfile.TarError, EOFError) as e:
            raise SourceError(f"{self.path}: corrupt or truncated image archive: {e}") from None
        end = f.seek(0, os.SEEK_END)
        for name, (off, size) in members.items():
            if off + size > end:
                raise SourceError(f"{self.path}: truncated archive: member {name!r} is cut short")
        for name, target in links.items():
            for _ in range(16):
                if target in members or target not in links:
                    break
                target = links[target]
            if target in members:
                members.setdefault(name, members[target])
        return members

    def exists(self, rel: str) -> bool:
        if self.members is not None:
            return _norm(rel) in self.members
        return (self.path / rel).is_file()

    def open(self, rel: str) -> tuple[Any, int]:
        """(reader, size) of file ``rel``; SourceError if missing."""
        if self.members is not None:
            entry = self.members.get(_norm(rel))
            if entry is None:
                raise SourceError(f"{self.path}: {rel} is missing from the archive")
            assert self.file is not None
            return _Range(self.file, entry[0], entry[1]), entry[1]
        p = self.path / rel
        try:
            f = open(p, "rb")  # noqa: SIM115 - the caller closes it
            st = os.fstat(f.fileno())
        except OSError as e:
            raise SourceError(f"{self.path}: cannot read {rel}: {e.strerror or e}") from None
        if not stat.S_ISREG(st.st_mode):
            f.close()
            raise SourceError(f"{self.path}: {rel} is not a regular file")
        return f, st.st_size

    def read(self, rel: str, limit: int = MAX_JSON) -> bytes:
        reader, size = self.open(rel)
        try:
            if size > limit:
                raise SourceError(f"{self.path}: {rel} is {size} bytes, more than {limit} allowed")
            data: bytes = reader.read(size)
        finally:
            if hasattr(reader, "close"):
                reader.close()
        if len(data) != size:
            raise SourceError(f"{self.path}: {rel}: truncated")
        return data

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _norm(name: str) -> str:
    return os.path.normpath("/" + name).lstrip("/")


def _blob_path(digest: Any, where: str) -> str:
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        alg = digest.split(":", 1)[0] if isinstance(digest, str) else digest
        raise SourceError(f"{where}: unsupported or invalid digest {alg!r} (sha256 only)")
    return "blobs/sha256/" + digest[7:]


def _json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise SourceError(f"{where}: invalid JSON: {e}") from None


# ---- OCI layout -----------------------------------------------------------------------


class _Image:
    """What a source resolves to: the config and the layers to apply."""

    def __init__(
        self,
        config: dict[str, Any],
        config_digest: str,
        layers: list[tuple[str, str | None, int | None, str | None]],
    ) -> None:
        self.config = config
        self.config_digest = config_digest
        # (path in the store, expected blob digest or None, size or None, media type or None)
        self.layers = layers


class _Oci:
    def __init__(self, store: _Store, label: str) -> None:
        self.store = store
        self.label = label

    def blob(self, desc: Any, what: str) -> bytes:
        """A small JSON blob by descriptor, verified."""
        if not isinstance(desc, dict):
            raise SourceError(f"{self.label}: {what}: invalid descriptor")
        digest = desc.get("digest")
        rel = _blob_path(digest, f"{self.label}: {what}")
        if not self.store.exists(rel):
            raise SourceError(f"{self.label}: {what}: blob {digest} is missing")
        data = self.store.read(rel)
        got = "sha256:" + hashlib.sha256(data).hexdigest()
        if got != digest:
            raise SourceError(
                f"{self.label}: {what}: digest mismatch: blob {digest} has digest {got}"
            )
        size = desc.get("size")
        if size is not None and size != len(data):
            raise SourceError(
                f"{self.label}: {what}: size mismatch: descriptor says {size}, blob is {len(data)}"
            )
        return data

    def select(self, ref: str | None, digest: str | None, plat: str) -> _Image:
        desc = self.top(ref, digest)
        pinned = digest is None or desc.get("digest") == digest
        return self.resolve(
            desc, digest if not pinned else None, plat, f"image {ref or desc.get('digest')}"
        )

    def platforms(self, ref: str | None) -> list[str]:
        """The platforms of the image ``ref`` selects when it is an index, else []."""
        desc = self.top(ref, None)
        what = f"image {ref or desc.get('digest')}"
        doc = _json(self.blob(desc, what), f"{self.label}: {what}")
        if not isinstance(doc, dict) or not isinstance(doc.get("manifests"), list):
            return []
        names = [platform_name(d.get("platform")) for d in _descriptors(doc, what)]
        return [n for n in names if n is not None and not n.startswith("unknown/")]

    def top(self, ref: str | None, digest: str | None) -> dict[str, Any]:
        """The descriptor of index.json that ``ref`` (a tag) or ``digest`` selects."""
        if self.store.exists("oci-layout"):
            layout = _json(self.store.read("oci-layout"), f"{self.label}: oci-layout")
            version = layout.get("imageLayoutVersion") if isinstance(layout, dict) else None
            if not isinstance(version, str) or not version.startswith("1."):
                raise SourceError(
                    f"{self.label}: unsupported oci-layout version {version!r} (1.x expected)"
                )
        index = _json(self.store.read("index.json"), f"{self.label}: index.json")
        top = _descriptors(index, f"{self.label}: index.json")
        if ref is not None:
            chosen = [d for d in top if ref in _names(d)]
            if not chosen:
                raise SourceError(f"{self.label}: no image tagged {ref!r} (tags: {_tag_list(top)})")
            desc = chosen[0]  # with digest too: the pin may name a manifest inside it
        elif digest is not None:
            desc = self._find(top, digest) or {"digest": digest}
        else:
            if len(top) != 1:
                raise SourceError(
                    f"{self.label}: the image holds {len(top)} images: choose one with ref"
                    f" (tags: {_tag_list(top)}) or digest"
                )
            desc = top[0]
        return desc

    def resolve(self, desc: dict[str, Any], digest: str | None, plat: str, what: str) -> _Image:
        """The image ``desc`` names: an index (nested ones too) resolved to ``plat``'s
        manifest. ``digest``: a pin that ``desc`` or one of the indexes' entries must have."""
        pinned = digest is None
        for _ in range(8):  # nested indexes
            data = self.blob(desc, what)
            doc = _json(data, f"{self.label}: {what}")
            if not isinstance(doc, dict):
                raise SourceError(f"{self.label}: {what}: not a JSON object")
            mt = desc.get("mediaType") or doc.get("mediaType")
            if mt in _INDEX_TYPES or (mt is None and "manifests" in doc):
                desc = select_platform(
                    _descriptors(doc, f"{self.label}: {what}"), plat, what, self.label
                )
                pinned = pinned or desc.get("digest") == digest
                what = f"{what} ({plat})"
                continue
            if mt not in _MANIFEST_TYPES and not (mt is None and "layers" in doc):
                raise SourceError(f"{self.label}: {what}: unsupported media type {mt!r}")
            if not pinned:
                raise SourceError(
                    f"{self.label}: {what} is {desc.get('digest')}, the spec pins {digest}"
                )
            return self._manifest(doc, what)
        raise SourceError(f"{self.label}: {what}: image indexes nested too deep")

    def _find(self, descs: list[dict[str, Any]], digest: str) -> dict[str, Any] | None:
        for d in descs:
            if d.get("digest") == digest:
                return d
        return None

    def _manifest(self, doc: dict[str, Any], what: str) -> _Image:
        cdesc = doc.get("config")
        cdata = self.blob(cdesc, f"{what}: config")
        config = _json(cdata, f"{self.label}: {what}: config")
        layers = doc.get("layers")
        if not isinstance(layers, list):
            raise SourceError(f"{self.label}: {what}: the manifest has no layers list")
        out: list[tuple[str, str | None, int | None, str | None]] = []
        for i, ld in enumerate(layers):
            if not isinstance(ld, dict):
                raise SourceError(f"{self.label}: {what}: layer {i + 1}: invalid descriptor")
            mt = ld.get("mediaType")
            if mt not in _LAYER_TYPES:
                raise SourceError(
                    f"{self.label}: {what}: layer {i + 1}: unsupported media type {mt!r}"
                )
            digest = ld.get("digest")
            rel = _blob_path(digest, f"{self.label}: {what}: layer {i + 1}")
            size = ld.get("size")
            out.append((rel, digest, size if isinstance(size, int) else None, mt))
        assert isinstance(cdesc, dict)  # self.blob checked it
        return _Image(config, str(cdesc["digest"]), out)


def _descriptors(doc: Any, where: str) -> list[dict[str, Any]]:
    descs = doc.get("manifests") if isinstance(doc, dict) else None
    if not isinstance(descs, list) or not all(isinstance(d, dict) for d in descs):
        raise SourceError(f"{where}: not an image index (no manifests list)")
    return descs


def _names(desc: dict[str, Any]) -> set[str]:
    ann = desc.get("annotations")
    if not isinstance(ann, dict):
        return set()
    names = set()
    for key in (REF_NAME, CONTAINERD_NAME):
        v = ann.get(key)
        if isinstance(v, str):
            names.add(v)
    return names


def _tag_list(descs: list[dict[str, Any]]) -> str:
    tags = sorted({n for d in descs for n in _names(d)})
    return ", ".join(tags) or "none"


# ---- docker-archive ---------------------------------------------------------------------


def _docker(store: _Store, label: str, ref: str | None, digest: str | None) -> _Image:
    doc = _json(store.read("manifest.json"), f"{label}: manifest.json")
    if not isinstance(doc, list) or not all(isinstance(e, dict) for e in doc):
        raise SourceError(f"{label}: manifest.json: not a docker-archive manifest (a list)")

    def config_digest(e: dict[str, Any]) -> str | None:
        name = e.get("Config")
        if not isinstance(name, str):
            return None
        hexpart = os.path.basename(name).removesuffix(".json")
        return "sha256:" + hexpart if re.fullmatch(r"[0-9a-f]{64}", hexpart) else None

    def tags(e: dict[str, Any]) -> list[str]:
        t = e.get("RepoTags")
        return [x for x in t if isinstance(x, str)] if isinstance(t, list) else []

    cands = doc
    if ref is not None:
        cands = [e for e in cands if any(ref in (t, t.rsplit(":", 1)[-1]) for t in tags(e))]
        if not cands:
            avail = ", ".join(sorted({t for e in doc for t in tags(e)})) or "none"
            raise SourceError(f"{label}: no image tagged {ref!r} (tags: {avail})")
    if digest is not None:
        cands = [e for e in cands if config_digest(e) == digest]
        if not cands:
            raise SourceError(f"{label}: no image with config digest {digest}")
    if len(cands) != 1:
        avail = ", ".join(sorted({t for e in doc for t in tags(e)})) or "none"
        raise SourceError(
            f"{label}: the archive holds {len(cands)} images: choose one with ref (tags:"
            f" {avail}) or digest"
        )
    entry = cands[0]
    cname = entry.get("Config")
    if not isinstance(cname, str):
        raise SourceError(f"{label}: manifest.json: no Config")
    cdata = store.read(cname)
    cdig = "sha256:" + hashlib.sha256(cdata).hexdigest()
    named = config_digest(entry)
    if named is not None and named != cdig:
        raise SourceError(f"{label}: {cname}: digest mismatch: named {named}, content is {cdig}")
    config = _json(cdata, f"{label}: {cname}")
    layers = entry.get("Layers")
    if not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
        raise SourceError(f"{label}: manifest.json: no Layers list")
    return _Image(config, cdig, [(x, None, None, None) for x in layers])


# ---- applying -----------------------------------------------------------------------


def image_config(config: dict[str, Any], digest: str) -> dict[str, Any]:
    """The part of an image config the bundle manifest keeps."""
    runtime = config.get("config")
    runtime = runtime if isinstance(runtime, dict) else {}
    out: dict[str, Any] = {"digest": digest}
    for key in ("architecture", "os", "variant"):
        if isinstance(config.get(key), str) and config[key]:
            out[key] = config[key]
    out["config"] = {k: runtime[k] for k in CONFIG_KEYS if runtime.get(k) not in (None, "", [], {})}
    return out


def apply(layer: OciLayer, ctx: LayerContext) -> SourceRecord:
    src = layer.oci
    if src.path is None:
        return _apply_registry(layer, ctx)
    path = ctx.resolve(src.path)
    label = str(path)
    plat = src.platform or host_platform_name()
    store = _Store(path)
    try:
        if store.exists("index.json"):
            image = _Oci(store, label).select(src.ref, src.digest, plat)
        elif store.exists("manifest.json"):
            image = _docker(store, label, src.ref, src.digest)
        elif path.exists():
            raise SourceError(
                f"{label}: not an OCI image layout (no index.json) nor a docker-archive"
                " (no manifest.json)"
            )
        else:
            raise SourceError(f"{label}: cannot open image: No such file or directory")
        config = _apply_image(store, image, ctx, label)
    finally:
        store.close()
    return SourceRecord(
        kind="oci",
        path=src.path,
        sha256=image.config_digest,
        image_config=image_config(config, image.config_digest),
    )


def local_platforms(path: Path, ref: str | None) -> list[str]:
    """The platforms of a local image (layout or archive) that is an index; [] otherwise
    (one manifest, or a docker-archive)."""
    store = _Store(path)
    try:
        if not store.exists("index.json"):
            return []
        return _Oci(store, str(path)).platforms(ref)
    finally:
        store.close()


def _apply_registry(layer: OciLayer, ctx: LayerContext) -> SourceRecord:
    """A registry image: pulled into the local cache (nothing fetched when the pinned
    digest's blobs are there already), then applied from it as from a layout."""
    from btrfs_ublk_image import pull
    from btrfs_ublk_image.registry import credentials_for, parse_pull_reference

    src = layer.oci
    assert src.ref is not None  # the spec checked it
    ref = parse_pull_reference(src.ref)
    if src.digest is not None:
        ref = ref.with_digest(src.digest)
    plat = src.platform or host_platform_name()
    cache = pull.BlobCache(pull.cache_dir())
    pulled = pull.pull(ref, cache, platform=plat, credentials=credentials_for(ref.registry))
    label = src.ref
    store = _Store(cache.root)
    try:
        desc = {"digest": pulled.digest, "size": pulled.size}
        image = _Oci(store, label).resolve(desc, None, plat, f"image {pulled.digest}")
        config = _apply_image(store, image, ctx, label)
    finally:
        store.close()
    return SourceRecord(
        kind="oci",
        path="",
        sha256=image.config_digest,
        image_config=image_config(config, image.config_digest),
        ref=src.ref,
        digest=pulled.digest,
    )


def _apply_image(store: _Store, image: _Image, ctx: LayerContext, label: str) -> dict[str, Any]:
    """Check the image config against the layers and apply them in order; -> the config."""
    try:
        config = image.config
        if not isinstance(config, dict):
            raise SourceError(f"{label}: image config: not a JSON object")
        rootfs = config.get("rootfs")
        diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        if not isinstance(rootfs, dict) or rootfs.get("type") != "layers":
            raise SourceError(f"{label}: image config: unsupported rootfs (type 'layers' expected)")
        if not isinstance(diff_ids, list) or len(diff_ids) != len(image.layers):
            n = len(diff_ids) if isinstance(diff_ids, list) else 0
            raise SourceError(
                f"{label}: image config lists {n} diff_ids for {len(image.layers)} layers"
            )
        for i, (rel, digest, size, mt) in enumerate(image.layers):
            _apply_layer(
                store, ctx, label, i, len(image.layers), rel, digest, size, mt, diff_ids[i]
            )
    finally:
        ctx.upper = None
    return config


def _apply_layer(
    store: _Store,
    ctx: LayerContext,
    label: str,
    i: int,
    n: int,
    rel: str,
    digest: str | None,
    size: int | None,
    media_type: str | None,
    diff_id: Any,
) -> None:
    name = digest or rel
    where = f"{label}: layer {i + 1}/{n} ({name})"
    if not store.exists(rel):
        raise SourceError(f"{where}: blob is missing")
    reader, actual = store.open(rel)
    try:
        if size is not None and size != actual:
            raise SourceError(f"{where}: size mismatch: the manifest says {size}, blob is {actual}")
        ctx.upper = set()
        got = read_tar(
            reader, where, ctx, TarOptions(whiteouts=True, diff_id=True, lenient_end=True)
        )
    finally:
        close: Callable[[], None] | None = getattr(reader, "close", None)
        if close is not None:
            close()
    if digest is not None and got.raw != digest:
        raise SourceError(f"{where}: digest mismatch: the blob's sha256 is {got.raw}")
    want = _LAYER_TYPES.get(media_type or "")
    if want is not None and got.compression != want:
        raise SourceError(
            f"{where}: media type {media_type} promises {want}, the blob is {got.compression}"
        )
    if got.uncompressed != diff_id:
        raise SourceError(
            f"{where}: diff_id mismatch: the config says {diff_id}, the uncompressed layer is"
            f" {got.uncompressed}"
        )
