"""Push a bundle (and prefetch traces) to an OCI distribution registry.

The bundle becomes one OCI artifact (format: docs/remote.md, "OCI artifact"): an image
manifest whose config blob is manifest.json (so the config digest IS the image id) and
whose layers are meta.img, the blockmap and every pack, each blob addressed by the
sha256 of the file. A trace is a second artifact whose `subject` is the bundle manifest,
listed in the OCI 1.1 referrers tag schema fallback (tag `sha256-<hex>`), since
docker-registry 2.8 has no referrers API.

meta.img travels as one zstd frame (mediaType ``...meta.v1+zstd``): it is most of the bytes
a container start moves (8 MiB -> 1.5 MB for Debian). It is compressed in the same pass that
checks it against manifest.json, into a temporary file that is then uploaded, so what is
compressed is exactly what was verified; manifest.json (the image id) still names the
uncompressed file.

The bundle is verified completely before the first request, so a corrupt bundle uploads
nothing; the registry checks every blob's digest again when the upload completes. Blobs
the registry already has (HEAD) are not uploaded again. The registry client itself
(references, auth, requests) is registry.py, shared with pulls.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any

from btrfs_ublk_image import blockmap as bmap
from btrfs_ublk_image import patch
from btrfs_ublk_image import trace as trace_format
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.hashing import BackgroundSha256, file_sha256
from btrfs_ublk_image.manifest import (
    BLOCKMAP,
    MANIFEST,
    META_IMG,
    PACKS,
    parse_manifest,
    read_bundle_file,
)
from btrfs_ublk_image.ocispec import MT_OCI_CONFIG, host_platform_name
from btrfs_ublk_image.ocispec import MT_OCI_INDEX as MT_OCI_INDEX
from btrfs_ublk_image.ocispec import MT_OCI_MANIFEST as MT_OCI_MANIFEST
from btrfs_ublk_image.progress import Progress, human_bytes

# the registry client lives in registry.py (shared with pulls); these names stay importable
from btrfs_ublk_image.registry import AUTH_ENV as AUTH_ENV
from btrfs_ublk_image.registry import Blob as Blob
from btrfs_ublk_image.registry import Reference as Reference
from btrfs_ublk_image.registry import Registry as Registry
from btrfs_ublk_image.registry import bytes_blob as bytes_blob
from btrfs_ublk_image.registry import is_loopback as is_loopback
from btrfs_ublk_image.registry import parse_auth as parse_auth
from btrfs_ublk_image.registry import parse_reference as parse_reference
from btrfs_ublk_image.trace import Trace

MT_OCI_EMPTY = "application/vnd.oci.empty.v1+json"
ARTIFACT_BUNDLE = "application/vnd.btrfs-ublk-image.bundle.v1"
ARTIFACT_TRACE = "application/vnd.btrfs-ublk-image.trace.v1"
MT_CONFIG = "application/vnd.btrfs-ublk-image.manifest.v1+json"
MT_META = "application/vnd.btrfs-ublk-image.meta.v1"
MT_META_ZSTD = MT_META + "+zstd"  # what push uploads; ublkd reads both
# meta.img's zstd level: fixed (same bundle, same blob, same manifest digest). zstd -3 takes
# Debian's 8 MiB meta.img to 1.5 MB; decompression is equally fast at any level
META_ZSTD_LEVEL = 3
_META_BLOCK = 1 << 20  # meta.img is read and compressed this much at a time
MT_BLOCKMAP = "application/vnd.btrfs-ublk-image.blockmap.v1"
# meta.img or blockmap as a zstd patch against the layer titled base/<name> (patch.py)
MT_PATCH = "application/vnd.btrfs-ublk-image.patch.v1"
MT_PACK = "application/vnd.btrfs-ublk-image.pack.v1"
MT_TRACE = "application/vnd.btrfs-ublk-image.trace.v1+json"
ANNOTATION_IMAGE_ID = "dev.btrfs-ublk-image.image-id"
EMPTY_CONFIG = b"{}"  # the OCI 1.1 empty descriptor's blob, for the trace artifact


# --- the bundle, verified -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VerifiedBundle:
    path: str
    image_id: str
    config: Blob  # manifest.json
    layers: list[Blob]  # meta.img, blockmap, packs in manifest order


def _checked_file(bundle: str, rel: str, entry: Any, media_type: str) -> Blob:
    """A bundle file (meta.img, blockmap, a patch or a patch base), checked against its
    manifest entry (`files`, `patches`)."""
    path = os.path.join(bundle, rel)
    if not isinstance(entry, dict) or "sha256" not in entry or "size" not in entry:
        raise ImageError(f"{os.path.join(bundle, MANIFEST)}: no files entry for {rel}")
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ImageError(f"{path}: cannot read: {e.strerror}") from None
    if size != entry["size"]:
        raise ImageError(f"{path}: {size} bytes, the manifest says {entry['size']}")
    digest = file_sha256(path)
    if digest != entry["sha256"]:
        raise ImageError(f"{path}: sha256 {digest} differs from the manifest's {entry['sha256']}")
    return Blob(path, None, media_type, digest, size, rel)


def _compressed_meta(bundle: str, rel: str, entry: Any, workdir: str) -> Blob:
    """meta.img (or the patch base's, ``rel``) checked against the manifest's `files` entry and, in the same pass (so what
    is compressed is what was checked), streamed into ``workdir`` as one zstd frame: fixed
    level, content size in the frame header, no checksum, no dictionary, one thread, so the
    same bytes give the same blob."""
    import zstandard

    path = os.path.join(bundle, rel)
    if not isinstance(entry, dict) or "sha256" not in entry or "size" not in entry:
        raise ImageError(f"{os.path.join(bundle, MANIFEST)}: no files entry for {rel}")
    out_path = os.path.join(workdir, rel.replace("/", "-") + ".zst")
    cctx = zstandard.ZstdCompressor(
        level=META_ZSTD_LEVEL, write_content_size=True, write_checksum=False, threads=0
    )
    raw, blob = hashlib.sha256(), hashlib.sha256()
    raw_size = blob_size = 0
    try:
        with open(path, "rb") as src, open(out_path, "wb") as out:
            size = os.fstat(src.fileno()).st_size
            if size != entry["size"]:
                raise ImageError(f"{path}: {size} bytes, the manifest says {entry['size']}")
            zobj = cctx.compressobj(size=size)  # the size goes into the frame header
            try:
                while True:
                    data = src.read(_META_BLOCK)
                    raw.update(data)
                    raw_size += len(data)
                    frame = zobj.compress(data) if data else zobj.flush()
                    blob.update(frame)
                    blob_size += len(frame)
                    out.write(frame)
                    if not data:
                        break
            except zstandard.ZstdError as e:  # more or fewer bytes than the pledged size
                raise ImageError(f"{path}: changed while being read ({e})") from None
    except OSError as e:
        raise ImageError(f"{path}: cannot read: {e.strerror}") from None
    digest = "sha256:" + raw.hexdigest()
    if raw_size != entry["size"]:
        raise ImageError(f"{path}: changed while being read")
    if digest != entry["sha256"]:
        raise ImageError(f"{path}: sha256 {digest} differs from the manifest's {entry['sha256']}")
    return Blob(out_path, None, MT_META_ZSTD, "sha256:" + blob.hexdigest(), blob_size, rel)


def _checked_pack(
    bundle: str,
    rel: str,
    pack: dict[str, Any],
    entry: bmap.PackEntry,
    chunk_size: int,
    progress: Progress,
) -> Blob:
    """A pack, its chunk digests checked against the blockmap and its id against the
    manifest; returns its blob (digest = sha256 of the whole file), hashed in the same pass."""
    path = os.path.join(bundle, rel)
    if pack.get("id") != "sha256:" + entry.id.hex():
        raise ImageError(f"{path}: the manifest's pack id differs from the blockmap's")
    whole = BackgroundSha256()
    chunks: list[bytes] = []
    size = 0
    try:
        with open(path, "rb") as f:
            # chunk by chunk as stored (compressed packs: one zstd frame each), in order
            for i in range(len(entry.chunk_digests)):
                data = f.read(entry.stored_chunk(i, chunk_size).length)
                whole.update(data)
                chunks.append(hashlib.sha256(data).digest())
                size += len(data)
                progress.add_bytes(len(data))
            while data := f.read(chunk_size):  # bytes past the last chunk: a wrong size
                whole.update(data)
                size += len(data)
    except OSError as e:
        raise ImageError(f"{path}: cannot read: {e.strerror}") from None
    if size != pack.get("size") or size != entry.stored_size:
        raise ImageError(f"{path}: {size} bytes, the manifest says {pack.get('size')}")
    for i, (got, want) in enumerate(zip(chunks, entry.chunk_digests, strict=True)):
        if got != want:
            raise ImageError(
                f"{path}: chunk {i} (stored bytes {entry.stored_chunk(i, chunk_size).offset}..)"
                " does not match its digest in the blockmap (corrupt pack)"
            )
    if hashlib.sha256(b"".join(chunks)).digest() != entry.id:
        raise ImageError(f"{path}: pack id does not match its chunk digests")
    progress.add_file()
    return Blob(path, None, MT_PACK, "sha256:" + whole.hexdigest(), size, rel)


def verify_bundle(
    bundle: str, progress: Progress | None = None, workdir: str | None = None
) -> VerifiedBundle:
    """Every file of ``bundle`` checked against manifest.json (and the packs' chunks against
    the blockmap), so what is pushed is exactly the image its id names. With ``workdir``,
    meta.img's layer is its zstd frame, written there while meta.img is checked (what push
    uploads); without, meta.img itself (uncompressed, as pushes before zstd had it)."""
    bundle = os.path.abspath(bundle)
    progress = progress or Progress("verifying", force=False)
    manifest_path = os.path.join(bundle, MANIFEST)
    data = read_bundle_file(manifest_path)
    manifest, image_id = parse_manifest(data, manifest_path)
    files = manifest.get("files") or {}
    if workdir is None:
        meta = _checked_file(bundle, META_IMG, files.get(META_IMG), MT_META)
    else:
        meta = _compressed_meta(bundle, META_IMG, files.get(META_IMG), workdir)
    bm_blob = _checked_file(bundle, BLOCKMAP, files.get(BLOCKMAP), MT_BLOCKMAP)
    assert bm_blob.path is not None
    bm = bmap.decode(read_bundle_file(bm_blob.path), bm_blob.path)
    if file_sha256(bm_blob.path) != bm_blob.digest:  # changed between the two reads
        raise ImageError(f"{bm_blob.path}: changed while being read")
    packs = manifest.get("packs")
    if not isinstance(packs, list) or len(packs) != len(bm.packs):
        raise ImageError(f"{manifest_path}: its packs do not match the blockmap's")
    patches = patch.entries(manifest, manifest_path)
    layers = (
        _patch_layers(bundle, manifest, patches, files, workdir) if patches else [meta, bm_blob]
    )
    for pack, entry in zip(packs, bm.packs, strict=True):
        rel = pack.get("path") if isinstance(pack, dict) else None
        if not isinstance(rel, str) or not re.fullmatch(PACKS + r"/[0-9a-f]{64}", rel):
            raise ImageError(f"{manifest_path}: pack path {rel!r} is not packs/<hex>")
        layers.append(_checked_pack(bundle, rel, pack, entry, bm.chunk_size, progress))
    config = bytes_blob(data, MT_CONFIG)
    assert config.digest == image_id
    return VerifiedBundle(bundle, image_id, config, layers)


def _patch_layers(
    bundle: str,
    manifest: dict[str, Any],
    patches: dict[str, Any],
    files: dict[str, Any],
    workdir: str | None,
) -> list[Blob]:
    """A bundle with patches (format_version 2, 3) travels as its patch base and its patches,
    not as its meta.img and blockmap: the patch base is the lineage's first meta.img and
    blockmap, whose blobs (meta.img as the same zstd frame) the registry holds from that
    version's push, so a later version uploads only its patches. Each is checked against
    the manifest, and each patch applied to its base must give the file `files` names."""
    base_meta = patch.base_path(META_IMG)
    if workdir is None:
        base_blob = _checked_file(bundle, base_meta, patches[META_IMG]["base"], MT_META)
    else:
        base_blob = _compressed_meta(bundle, base_meta, patches[META_IMG]["base"], workdir)
    bases = {
        META_IMG: base_blob,
        BLOCKMAP: _checked_file(
            bundle, patch.base_path(BLOCKMAP), patches[BLOCKMAP]["base"], MT_BLOCKMAP
        ),
    }
    out = []
    for name in (META_IMG, BLOCKMAP):
        rel = patch.patch_path(name)
        blob = _checked_file(bundle, rel, patches[name], MT_PATCH)
        base = read_bundle_file(os.path.join(bundle, patch.base_path(name)))
        data = patch.apply(
            base,
            read_bundle_file(os.path.join(bundle, rel)),
            files[name]["size"],
            rel,
            patch.in_block_form(manifest, name),
        )
        if "sha256:" + hashlib.sha256(data).hexdigest() != files[name]["sha256"]:
            raise ImageError(
                f"{os.path.join(bundle, rel)}: patches its base to other bytes than {name}"
            )
        out.append(blob)
    return [bases[META_IMG], bases[BLOCKMAP], *out]


def bundle_manifest(b: VerifiedBundle) -> bytes:
    """The OCI image manifest of a bundle (deterministic: same bundle, same digest)."""
    m = {
        "schemaVersion": 2,
        "mediaType": MT_OCI_MANIFEST,
        "artifactType": ARTIFACT_BUNDLE,
        "config": b.config.descriptor(),
        "layers": [layer.descriptor() for layer in b.layers],
        "annotations": {ANNOTATION_IMAGE_ID: b.image_id},
    }
    return _encode(m)


def _encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# --- traces -------------------------------------------------------------------------------
def read_trace(path: str) -> tuple[bytes, Trace]:
    """A trace file's bytes (uploaded as they are) and its parsed, checked form."""
    data = read_bundle_file(path)
    return data, trace_format.decode(data, path)


def check_trace_for(path: str, trace: Trace, image_id: str) -> None:
    if trace.image_id != image_id:
        raise ImageError(
            f"{path}: trace was made for image {trace.image_id}, not {image_id}"
            " (a trace applies only to the image it was made for)"
        )


def trace_manifest(trace: Blob, empty: Blob, subject: dict[str, Any], image_id: str) -> bytes:
    m = {
        "schemaVersion": 2,
        "mediaType": MT_OCI_MANIFEST,
        "artifactType": ARTIFACT_TRACE,
        "config": empty.descriptor() | {"data": base64.b64encode(EMPTY_CONFIG).decode()},
        "layers": [trace.descriptor()],
        "subject": subject,
        "annotations": {ANNOTATION_IMAGE_ID: image_id},
    }
    return _encode(m)


def referrers_tag(digest: str) -> str:
    """The OCI 1.1 referrers tag schema: sha256:<hex> -> sha256-<hex>."""
    return digest.replace(":", "-", 1)


# --- the commands -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Pushed:
    manifest_digest: str
    image_id: str
    uploaded: list[Blob]
    skipped: list[Blob]
    trace_digest: str | None = None


def push_bundle(
    bundle: str,
    reference: str,
    *,
    plain_http: bool = False,
    credentials: tuple[str, str] | None = None,
    trace: str | None = None,
    progress: Progress | None = None,
) -> Pushed:
    """Verify ``bundle``, upload its blobs and tag its manifest as ``reference``; attach
    ``trace`` (or the bundle's prefetch.trace) as a referrer."""
    ref = parse_reference(reference)
    progress = progress or Progress("verifying", force=False)
    with tempfile.TemporaryDirectory(prefix="bui-push-") as workdir:  # meta.img.zst
        return _push_verified(bundle, ref, workdir, plain_http, credentials, trace, progress)


def _push_verified(
    bundle: str,
    ref: Reference,
    workdir: str,
    plain_http: bool,
    credentials: tuple[str, str] | None,
    trace: str | None,
    progress: Progress,
) -> Pushed:
    progress.phase("verifying")
    b = verify_bundle(bundle, progress, workdir)
    if trace is None and os.path.exists(os.path.join(b.path, trace_format.FILE_NAME)):
        trace = os.path.join(b.path, trace_format.FILE_NAME)
    trace_data = None
    if trace is not None:
        trace_data, parsed = read_trace(trace)
        check_trace_for(trace, parsed, b.image_id)
    manifest = bundle_manifest(b)
    reg = Registry(ref, plain_http=plain_http, credentials=credentials, progress=progress)
    try:
        progress.files = progress.bytes = 0
        progress.phase(f"pushing to {ref}")
        for blob in [b.config, *b.layers]:
            reg.put_blob(blob)
        digest = reg.put_manifest(ref.tag, manifest, MT_OCI_MANIFEST)
        subject = {"mediaType": MT_OCI_MANIFEST, "digest": digest, "size": len(manifest)}
        trace_digest = None
        if trace_data is not None:
            trace_digest = _attach_trace(reg, trace_data, subject, b.image_id)
    finally:
        reg.close()
    return Pushed(digest, b.image_id, reg.uploaded, reg.skipped, trace_digest)


@dataclass(frozen=True, slots=True)
class PushedImage:
    """`push --image`: the runnable image at the tag, the bundle artifact beside it."""

    image_digest: str  # the runnable image manifest, tagged TAG
    bundle: Pushed  # the bundle artifact, tagged TAG-bundle


def push_image(
    bundle: str,
    reference: str,
    *,
    plain_http: bool = False,
    credentials: tuple[str, str] | None = None,
    trace: str | None = None,
    progress: Progress | None = None,
) -> PushedImage:
    """Push ``bundle`` as its artifact (tag ``TAG-bundle``) and a runnable image that
    names it (tag ``TAG``) for containerd's snapshotter (runnable.py, docs/containerd.md)."""
    from btrfs_ublk_image import runnable

    ref = parse_reference(reference)
    bundle_ref = Reference(ref.registry, ref.repo, runnable.bundle_tag(ref.tag))
    pushed = push_bundle(
        bundle,
        str(bundle_ref),
        plain_http=plain_http,
        credentials=credentials,
        trace=trace,
        progress=progress,
    )
    manifest, _ = parse_manifest(read_bundle_file(os.path.join(bundle, MANIFEST)), bundle)
    layer_gz, diff_id = runnable.placeholder_layer(pushed.image_id)
    config = bytes_blob(
        runnable.image_config(
            manifest.get("image_config"), pushed.image_id, diff_id, host_platform_name()
        ),
        MT_OCI_CONFIG,
    )
    layer = bytes_blob(layer_gz, runnable.MT_LAYER_GZIP)
    location = f"oci://{ref.registry}/{ref.repo}@{pushed.manifest_digest}"
    image = _encode(
        {
            "schemaVersion": 2,
            "mediaType": MT_OCI_MANIFEST,
            "config": config.descriptor(),
            "layers": [
                layer.descriptor()
                | {
                    "annotations": runnable.layer_annotations(
                        pushed.image_id, pushed.manifest_digest, location
                    )
                }
            ],
            "annotations": {
                ANNOTATION_IMAGE_ID: pushed.image_id,
                runnable.ANNOTATION_BUNDLE: pushed.manifest_digest,
            },
        }
    )
    reg = Registry(ref, plain_http=plain_http, credentials=credentials, progress=progress)
    try:
        reg.put_blob(config)
        reg.put_blob(layer)
        digest = reg.put_manifest(ref.tag, image, MT_OCI_MANIFEST)
    finally:
        reg.close()
    return PushedImage(digest, pushed)


def push_trace(
    trace: str,
    reference: str,
    *,
    plain_http: bool = False,
    credentials: tuple[str, str] | None = None,
) -> tuple[str, str, str]:
    """Attach ``trace`` to the bundle pushed as ``reference``: -> (trace manifest digest,
    bundle manifest digest, image id)."""
    ref = parse_reference(reference)
    data, parsed = read_trace(trace)
    reg = Registry(ref, plain_http=plain_http, credentials=credentials)
    try:
        raw = reg.get_manifest(ref.tag, MT_OCI_MANIFEST)
        if raw is None:
            raise ImageError(f"{ref}: no such manifest in the registry (push the bundle first)")
        try:
            m = json.loads(raw)
            image_id = m["config"]["digest"]
            artifact = m.get("artifactType")
        except (ValueError, KeyError, TypeError):
            raise ImageError(f"{ref}: not an OCI image manifest") from None
        if artifact != ARTIFACT_BUNDLE:
            raise ImageError(
                f"{ref}: artifactType {artifact!r}, not a pushed bundle ({ARTIFACT_BUNDLE})"
            )
        check_trace_for(trace, parsed, image_id)
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        subject = {"mediaType": MT_OCI_MANIFEST, "digest": digest, "size": len(raw)}
        return _attach_trace(reg, data, subject, image_id), digest, image_id
    finally:
        reg.close()


def _attach_trace(reg: Registry, data: bytes, subject: dict[str, Any], image_id: str) -> str:
    """Upload the trace artifact and list it in the subject's referrers index (tag
    sha256-<hex>), keeping every other referrer there."""
    trace = bytes_blob(data, MT_TRACE, trace_format.FILE_NAME)
    empty = bytes_blob(EMPTY_CONFIG, MT_OCI_EMPTY)
    reg.put_blob(empty)
    reg.put_blob(trace)
    manifest = trace_manifest(trace, empty, subject, image_id)
    digest = reg.put_manifest(digest_ref(manifest), manifest, MT_OCI_MANIFEST)
    tag = referrers_tag(subject["digest"])
    old = reg.get_manifest(tag, MT_OCI_INDEX)
    referrers: list[dict[str, Any]] = []
    if old is not None:
        try:
            index = json.loads(old)
            referrers = list(index["manifests"])
        except (ValueError, KeyError, TypeError):
            raise ImageError(
                f"{reg.where}:{tag}: not an image index (referrers tag schema)"
            ) from None
    entry = {
        "mediaType": MT_OCI_MANIFEST,
        "digest": digest,
        "size": len(manifest),
        "artifactType": ARTIFACT_TRACE,
        "annotations": {ANNOTATION_IMAGE_ID: image_id},
    }
    # the newest trace goes last (ublkd uses the last one); other referrers stay as they are
    referrers = [r for r in referrers if not (isinstance(r, dict) and r.get("digest") == digest)]
    referrers.append(entry)
    index_bytes = _encode({"schemaVersion": 2, "mediaType": MT_OCI_INDEX, "manifests": referrers})
    reg.put_manifest(tag, index_bytes, MT_OCI_INDEX)
    return digest


def digest_ref(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def summary(p: Pushed) -> str:
    up = sum(b.size for b in p.uploaded)
    return f"{len(p.uploaded)} blobs uploaded ({human_bytes(up)}), {len(p.skipped)} already there"
