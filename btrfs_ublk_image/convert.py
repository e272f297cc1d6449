"""``btrfs-ublk-image convert SRC DST``: an OCI image to bundles and runnable images (docs/convert.md).

SRC is one of
  * ``REGISTRY[:PORT]/REPO[:TAG]`` or ``REGISTRY[:PORT]/REPO[:TAG]@sha256:HEX`` (``docker://``
    in front is accepted, as skopeo writes it): pulled through the digest-checked cache;
  * ``oci-layout:PATH[:REF]``: an OCI image layout directory, REF its tag (ref.name);
  * ``oci-archive:PATH[:REF]``: the same in an uncompressed tarball;
  * ``docker-archive:PATH[:REF]``: ``docker save`` output, REF a RepoTags entry or its tag.
  PATH ends at its first ``:``.

For each platform, a spec is made in memory with one ``oci`` layer (the image, that
platform) and built by the normal build path (``bundle.build_spec``) into a temporary
directory (or ``-o DIR``); then ``push.push_image`` pushes the bundle artifact and the
runnable image that names it. One platform (``--platform``, default the host's): the
runnable image is tagged DST's tag. ``--all-platforms`` on an index: each platform's
runnable image is tagged ``TAG-OS-ARCH[-VARIANT]`` (its bundle that plus ``-bundle``) and
DST's tag gets an OCI image index of them, each descriptor with its platform.

Same SRC, same DST: same bundles (image ids), same runnable manifests, same index.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from btrfs_ublk_image.bundle import build_spec
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.ocispec import (
    MT_OCI_INDEX,
    MT_OCI_MANIFEST,
    host_platform_name,
    platform_name,
)
from btrfs_ublk_image.progress import Progress
from btrfs_ublk_image.push import PushedImage, push_image
from btrfs_ublk_image.registry import (
    Reference,
    Registry,
    credentials_for,
    parse_pull_reference,
    parse_reference,
)
from btrfs_ublk_image.spec import OciLayer, OciSource, Spec, check_chunk_size

LOCAL_KINDS = ("oci-layout", "oci-archive", "docker-archive")
# a container's start reads small pieces of many files: 256 KiB chunks fetch about half
# the pack bytes 1 MiB chunks do for the Debian image (docs/containerd.md)
CONTAINER_CHUNK_SIZE = 256 << 10
_PLATFORM_RE = re.compile(r"[a-z0-9]+/[a-z0-9_]+(/[a-z0-9]+)?")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,254}")  # the spec's name rule


@dataclass(frozen=True, slots=True)
class Source:
    kind: str  # "registry" or one of LOCAL_KINDS
    location: str  # the registry reference, or the local path
    ref: str | None = None  # local images: the tag inside them
    digest: str | None = None  # registry images: the digest the location was pinned to

    def __str__(self) -> str:
        if self.kind == "registry":
            return self.location
        return f"{self.kind}:{self.location}" + (f":{self.ref}" if self.ref else "")


def parse_source(text: str) -> Source:
    kind, colon, rest = text.partition(":")
    if colon and kind in LOCAL_KINDS:
        path, _, ref = rest.partition(":")
        if not path:
            raise ImageError(f"{text}: no path after {kind}: ({kind}:PATH[:REF])")
        return Source(kind, path, ref or None)
    location = text.removeprefix("docker://")
    parse_pull_reference(location)  # checked now: an error names the text
    return Source("registry", location)


@dataclass(frozen=True, slots=True)
class Converted:
    platform: str  # os/arch[/variant]; "" when the source is one manifest and none was asked
    reference: str  # where its runnable image was pushed (REG/REPO:TAG)
    image_id: str
    pushed: PushedImage
    bundle: str | None  # the bundle directory kept with -o, else None


@dataclass(frozen=True, slots=True)
class Conversion:
    images: list[Converted]
    index_digest: str | None  # --all-platforms on an index: the index tagged DST


def _stderr(line: str) -> None:
    print(f"convert: {line}", file=sys.stderr, flush=True)


def spec_name(src: Source) -> str:
    """The bundle's name: the repository's last component, or the file's name."""
    if src.kind == "registry":
        base = parse_pull_reference(src.location).repo.rsplit("/", 1)[-1]
    else:
        base = Path(src.location).name.split(".")[0]
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", base).lstrip("._+-")
    return name[:255] or "image"


def make_spec(
    src: Source, platform: str | None, name: str, chunk_size: int = CONTAINER_CHUNK_SIZE
) -> Spec:
    """The one-layer spec of ``src`` (paths relative to the working directory)."""
    if src.kind == "registry":
        oci = OciSource(ref=src.location, platform=platform)
    else:
        oci = OciSource(path=src.location, ref=src.ref, platform=platform)
    return Spec(version=1, name=name, layers=[OciLayer(oci=oci)], pack_chunk_size=chunk_size)


def convert(
    source: str,
    destination: str,
    *,
    output: str | None = None,
    platform: str | None = None,
    all_platforms: bool = False,
    name: str | None = None,
    chunk_size: int = CONTAINER_CHUNK_SIZE,
    plain_http: bool = False,
    auth: str | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] = _stderr,
) -> Conversion:
    """Convert ``source`` and push it to ``destination`` (see the module's docstring)."""
    src = parse_source(source)
    dst = parse_reference(destination)
    if platform is not None and not _PLATFORM_RE.fullmatch(platform):
        raise ImageError(f"--platform {platform!r}: not os/arch[/variant] (e.g. linux/amd64)")
    if platform is not None and all_platforms:
        raise ImageError("--platform and --all-platforms exclude each other")
    try:
        check_chunk_size(chunk_size)
    except ValueError as e:
        raise ImageError(f"--pack-chunk-size: {e}") from None
    if output is not None and Path(output).exists():
        raise ImageError(f"{output}: already exists (a bundle is never overwritten)")
    name = name or spec_name(src)
    if not _NAME_RE.fullmatch(name):
        raise ImageError(f"--name {name!r}: letters, digits, '.', '_', '+', '-' (255 at most)")
    if src.kind == "registry" and all_platforms:
        src = _pin_registry_index(src, plain_http, auth, progress, log)
    platforms = _platforms(src) if all_platforms else []
    multi = len(platforms) > 0
    work = None if output is not None else tempfile.mkdtemp(prefix="btrfs-ublk-image-convert.")
    try:
        if multi and output is not None:
            Path(output).mkdir(parents=True)
        images = []
        for plat in platforms or [platform or host_platform_name()]:
            tag = f"{dst.tag}-{plat.replace('/', '-')}" if multi else dst.tag
            bundle = _bundle_path(output, work, plat, multi)
            image = _convert_one(
                src, plat, name, chunk_size, bundle, dst, tag, plain_http, auth, progress, log
            )
            images.append(image if output is not None else _forget_bundle(image))
        index_digest = None
        if multi:
            index_digest = _push_index(dst, images, plain_http, auth)
            log(f"{dst}: index {index_digest} of {len(images)} platforms")
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return Conversion(images, index_digest)


def _forget_bundle(image: Converted) -> Converted:
    return Converted(image.platform, image.reference, image.image_id, image.pushed, None)


def _bundle_path(output: str | None, work: str | None, plat: str, multi: bool) -> str:
    if output is None:
        assert work is not None
        return str(Path(work) / f"{plat.replace('/', '-')}.bundle")
    return str(Path(output) / f"{plat.replace('/', '-')}.bundle") if multi else output


def _pin_registry_index(
    src: Source,
    plain_http: bool,
    auth: str | None,
    progress: Progress | None,
    log: Callable[[str], None],
) -> Source:
    """Pull the whole image (every platform) once; -> the source pinned to its digest, so
    every platform comes from the same index even if the tag moves meanwhile."""
    from btrfs_ublk_image import pull

    ref = parse_pull_reference(src.location)
    log(f"pulling {src} (every platform)")
    pulled = pull.pull(
        ref,
        pull.BlobCache(pull.cache_dir()),
        platform=None,
        plain_http=plain_http,
        credentials=credentials_for(ref.registry, auth),
        progress=progress,
    )
    return Source("registry", src.location, digest=pulled.digest)


def _platforms(src: Source) -> list[str]:
    """The platforms of an index, sorted ([] for a single manifest)."""
    if src.kind == "registry":
        from btrfs_ublk_image import pull

        cache = pull.BlobCache(pull.cache_dir())
        assert src.digest is not None  # _pin_registry_index pulled it
        doc = json.loads(cache.read(src.digest))
        names = [platform_name(d.get("platform")) for d in doc.get("manifests") or []]
        return sorted({n for n in names if n is not None and not n.startswith("unknown/")})
    from btrfs_ublk_image.sources.oci import local_platforms

    return sorted(set(local_platforms(Path(src.location), src.ref)))


def _convert_one(
    src: Source,
    plat: str,
    name: str,
    chunk_size: int,
    bundle: str,
    dst: Reference,
    tag: str,
    plain_http: bool,
    auth: str | None,
    progress: Progress | None,
    log: Callable[[str], None],
) -> Converted:
    from btrfs_ublk_image import pull

    spec = make_spec(src, plat, name, chunk_size)
    spec_path = Path.cwd() / "convert"  # local paths are relative to the working directory
    if src.kind == "registry":
        log(f"pulling {src} ({plat})")
        spec, _ = pull.pin_spec(
            spec,
            spec_path,
            # no lock file: the ref is resolved now, or was for every platform at once
            locked={src.location: src.digest} if src.digest else {},
            plain_http=plain_http,
            auth=auth,
            progress=progress,
        )
    log(f"building {src} ({plat}) -> {bundle}")
    built = build_spec(spec, spec_path, bundle, progress)
    reference = f"{dst.registry}/{dst.repo}:{tag}"
    log(f"pushing {built.image_id} -> {reference} (bundle: {reference}-bundle)")
    pushed = push_image(
        bundle,
        reference,
        plain_http=plain_http,
        credentials=credentials_for(dst.registry, auth),
        progress=progress,
    )
    return Converted(plat, reference, built.image_id, pushed, bundle)


def _push_index(dst: Reference, images: list[Converted], plain_http: bool, auth: str | None) -> str:
    """An OCI image index of the runnable images, one descriptor per platform, tagged DST."""
    reg = Registry(dst, plain_http=plain_http, credentials=credentials_for(dst.registry, auth))
    try:
        manifests = []
        for image in images:
            data, _ = reg.pull_manifest(image.pushed.image_digest)  # its size, digest-checked
            os_name, arch, *variant = image.platform.split("/")
            plat = {"architecture": arch, "os": os_name} | (
                {"variant": variant[0]} if variant else {}
            )
            manifests.append(
                {
                    "mediaType": MT_OCI_MANIFEST,
                    "digest": image.pushed.image_digest,
                    "size": len(data),
                    "platform": plat,
                }
            )
        doc = {"schemaVersion": 2, "mediaType": MT_OCI_INDEX, "manifests": manifests}
        data = json.dumps(doc, separators=(",", ":")).encode()
        return reg.put_manifest(dst.tag, data, MT_OCI_INDEX)
    finally:
        reg.close()
