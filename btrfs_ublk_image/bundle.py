"""The bundle: manifest.json, meta.img, blockmap, packs/ (format: docs/bundle-format.md).

A bundle appears atomically and durably: everything is written into a hidden sibling
directory; every file's fsync is started as soon as it is complete (``files.Syncer``:
the packs' own writers fsync them), and once all of them and the directories' fsyncs
have returned, the sibling is renamed onto the destination and the parent directory
fsynced. Any error removes the sibling, so nothing is left at the destination.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from btrfs_ublk_image import __version__, patch
from btrfs_ublk_image.blockmap import VERSION, VERSION_COMPRESSED, BlockMap, PackEntry, Range
from btrfs_ublk_image.btrfs import ondisk
from btrfs_ublk_image.errors import ImageError
from btrfs_ublk_image.files import Syncer, link_or_copy, sync_dir
from btrfs_ublk_image.hashing import BackgroundFileSha256, file_sha256
from btrfs_ublk_image.manifest import (
    BLOCKMAP,
    FORMAT,
    FORMAT_VERSION,
    FORMAT_VERSION_BLOCK_FORM,
    MANIFEST,
    META_IMG,
    PACKS,
    encode_manifest,
    image_id,
    read_bundle_file,
    read_manifest,
)
from btrfs_ublk_image.packs import DEFAULT_CHUNK_SIZE, PackInfo, PackWriter
from btrfs_ublk_image.progress import Progress
from btrfs_ublk_image.staging import (
    BUILDING,
    new_pack_writer,
    new_temporary_dir,
    start_bundle,
    unused_output,
)
from btrfs_ublk_image.tree import Tree

if TYPE_CHECKING:
    from btrfs_ublk_image.base import BaseImage
    from btrfs_ublk_image.btrfs.writer import ImageLayout, WriterOptions
    from btrfs_ublk_image.early import EarlyRead
    from btrfs_ublk_image.spec import Spec

# bases that build pulls into a temporary directory first (the rest are bundle directories)
REMOTE_BASES = ("oci://", "http://", "https://")

# Fills a tree from the sources, streaming file content into the pack writer; returns the
# tree, the source records for the manifest and the image config (OCI) or None.
TreeFiller = Callable[[PackWriter], tuple[Tree, list[dict[str, Any]], dict[str, Any] | None]]


@dataclass(frozen=True, slots=True)
class BuildResult:
    path: str
    image_id: str
    manifest: dict[str, Any]
    layout: ImageLayout


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """The cyclic garbage collector off while a build runs, back on after it (if it was).

    A build keeps every entry's objects (the tree, the writer's rows) until its end, so each
    full collection walks all of them again for nothing, more of them the more entries, and
    holds the GIL meanwhile (the records' placement, and the parser behind it, wait). A build
    makes no per-entry reference cycles; reference counting frees everything else as it goes.
    Measured: bench/results/issue23-log.md, "1,000,000 entries"."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def write_bundle(
    out_dir: str,
    *,
    name: str,
    opts: WriterOptions,
    fill: TreeFiller,
    spec_sha256: str,
    progress: Progress | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    prefetch: Sequence[str] = (),
    pack_compression: str = "none",
    base: str | None = None,
    early: EarlyRead | None = None,
) -> BuildResult:
    """``early``: the bundle begun by ``early.EarlyRead`` (its temporary directory and
    pack, the first layer being read into them), which this build takes over."""
    if early is None:
        out_dir, tmp = start_bundle(out_dir)
    else:
        out_dir, tmp = early.claim()
    parent = os.path.dirname(out_dir)
    base_image = None
    syncer = Syncer()
    try:
        base_image = _open_base(base, chunk_size, progress)
        with _no_cyclic_gc():
            result = _write_into(
                tmp,
                name,
                opts,
                fill,
                spec_sha256,
                progress,
                chunk_size,
                prefetch,
                pack_compression,
                base_image,
                syncer,
                early,
            )
        os.unlink(os.path.join(tmp, BUILDING))
        os.chmod(tmp, 0o755)
        syncer.start(tmp)  # its entries
        syncer.wait()  # every file and directory on disk: only then the rename
        os.rename(tmp, out_dir)
    except BaseException as e:
        if early is not None:
            early.stop()  # its thread writes into tmp
        syncer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            # the output's filesystem is full (a pack or meta.img write, or their fsync)
            raise ImageError(f"{out_dir}: writing the bundle: {os.strerror(e.errno)}") from None
        raise
    finally:
        if base_image is not None:
            base_image.close()
    try:
        sync_dir(parent)  # the rename
    except OSError as e:
        raise ImageError(
            f"{parent}: fsync after renaming {out_dir} into it: {e.strerror}"
        ) from None
    return BuildResult(out_dir, result[0], result[1], result[2])


def build_spec(
    spec: Spec,
    spec_path: Path,
    out: str,
    progress: Progress | None,
    base: str | None = None,
    plain_http: bool = False,
    auth: str | None = None,
    early: EarlyRead | None = None,
) -> BuildResult:
    """Build ``spec`` (its paths relative to ``spec_path``'s directory) into the bundle
    directory ``out``: every layer's sources, then the writer (``write_bundle``). ``base``
    (else the spec's ``base``, relative to its directory): a bundle whose packs to reuse,
    an ``oci://`` reference to one or the http(s) URL of its manifest.json (pulled into a
    temporary directory beside ``out``,
    removed after the build: the new bundle holds the base packs it uses). ``early``: the
    first layer's read begun before ``spec`` was validated (``early.EarlyRead``), taken
    over when it read it as ``spec`` says, else discarded."""
    from btrfs_ublk_image.btrfs.writer import WriterOptions, inline_max
    from btrfs_ublk_image.sources import build_sources

    opts = WriterOptions(
        inline_limit=spec.btrfs.inline_limit,
        label=spec.btrfs.label,
        fsid=spec.btrfs.fsid,
        time_ns=(spec.source_date_epoch or 0) * 1_000_000_000,
    )
    base = base if base is not None else spec_base(spec, spec_path)
    if early is not None and not early.matches(spec, out, inline_max(opts), base):
        early.discard()
        early = None

    def fill(packs: PackWriter) -> tuple[Tree, list[dict[str, Any]], dict[str, Any] | None]:
        started = None if early is None else early.result()
        built = build_sources(spec, spec_path, packs, progress, started=started)
        return built.tree, [r.to_json() for r in built.records], built.image_config

    pulled = None
    if base is not None and base.startswith(REMOTE_BASES):
        base_ref = base
        from btrfs_ublk_image.pull import pull_bundle, pull_http_bundle

        # an existing output fails before the pull; a killed build's pulled base goes like
        # its temporary bundle (the same marker)
        out = unused_output(out)
        pulled = new_temporary_dir(os.path.dirname(out), ".base-")
        try:
            if progress is not None:
                progress.phase("pulling the base image")
            base = os.path.join(pulled, "bundle")
            if base_ref.startswith("oci://"):
                pull_bundle(base_ref, base, plain_http=plain_http, auth=auth, progress=progress)
            else:
                pull_http_bundle(base_ref, base, progress=progress)
        except BaseException:
            shutil.rmtree(pulled, ignore_errors=True)
            raise
    try:
        return write_bundle(
            out,
            name=spec.name,
            opts=opts,
            fill=fill,
            spec_sha256=spec.spec_sha256,
            progress=progress,
            chunk_size=spec.pack_chunk_size,
            prefetch=spec.prefetch,
            pack_compression=spec.pack_compression,
            base=base,
            early=early,
        )
    finally:
        if pulled is not None:
            shutil.rmtree(pulled, ignore_errors=True)


def spec_base(spec: Spec, spec_path: Path) -> str | None:
    """The spec's ``base`` bundle, relative to the spec's directory."""
    if spec.base is None or spec.base.startswith(REMOTE_BASES):
        return spec.base
    return os.path.join(os.path.dirname(os.path.abspath(spec_path)), spec.base)


def _open_base(path: str | None, chunk_size: int, progress: Progress | None) -> BaseImage | None:
    if path is None:
        return None
    from btrfs_ublk_image.base import BaseImage

    if progress is not None:
        progress.phase("indexing the base image")
    return BaseImage(path, chunk_size=chunk_size)


def _write_into(
    tmp: str,
    name: str,
    opts: WriterOptions,
    fill: TreeFiller,
    spec_sha256: str,
    progress: Progress | None,
    chunk_size: int,
    prefetch: Sequence[str],
    pack_compression: str,
    base: BaseImage | None,
    syncer: Syncer,
    early: EarlyRead | None,
) -> tuple[str, dict[str, Any], ImageLayout]:
    from btrfs_ublk_image.btrfs.writer import inline_max, write_image

    packs_dir = os.path.join(tmp, PACKS)
    meta_path = os.path.join(tmp, META_IMG)
    if early is None:
        packer = new_pack_writer(
            tmp, inline_max(opts), chunk_size, progress, pack_compression, base
        )
    else:
        packer = early.packs
    try:
        if progress is not None and base is not None:
            progress.phase("reading sources")
        tree, sources, image_config = fill(packer)
        if progress is not None:
            progress.phase("writing metadata")
        layout = write_image(
            tree,
            meta_path,
            opts,
            packer.encoded,
            None if base is None else base.layout(),
        )
        syncer.start(meta_path)
        # device 2's own superblock is pack content like any other, mapped at 64 KiB
        sb = packer.put_pack_tail(layout.data_super)
    except BaseException:
        if early is not None:
            early.stop()  # its thread writes into the pack
        packer.abort()
        raise
    # meta.img is complete: its sha256 is taken on a second core (reads and hashlib release
    # the GIL) while the packs finish and the blockmap is made; an error waits for it
    with BackgroundFileSha256(meta_path, "meta-sha256") as meta_sha256:
        pack_infos = packer.finish()  # each pack fsynced, renamed to its id
        ranges = layout.data_ranges.with_first(
            Range(ondisk.SUPER_INFO_OFFSET, len(layout.data_super), sb.pack, sb.offset)
        )
        n_base = 0 if base is None else len(base.packs)
        # the base's packs this image maps a byte of are kept (hard links of the base's files),
        # the others dropped; the written and in-place packs are all kept
        used = set(ranges.pack)
        keep = [i for i in range(len(pack_infos)) if not 1 <= i <= n_base or i in used]
        renumber = {old: new for new, old in enumerate(keep)}
        pack_infos = [pack_infos[i] for i in keep]
        if any(old != new for old, new in renumber.items()):
            ranges = ranges.renumbered(renumber)
        for old in keep:
            if 1 <= old <= n_base:
                _link_base_pack(pack_infos[renumber[old]], packs_dir)
        syncer.start(packs_dir)  # the packs' names
        compressed = pack_compression == "zstd" or any(
            p.stored is not None and any(c.zstd for c in p.stored) for p in pack_infos
        )
        bm = BlockMap(
            chunk_shift=chunk_size.bit_length() - 1,
            device_size=layout.data_size,
            # a base's uncompressed pack from a version 2 blockmap: its raw chunks need no table
            packs=[
                PackEntry(p.id, p.size, p.chunk_digests, p.stored if compressed else None)
                for p in pack_infos
            ],
            ranges=ranges,
            # version 1 unless pack chunks are compressed: uncompressed bundles keep their ids
            # (btrfs-zstd packs hold device 2's bytes as stored: version 1 too)
            version=VERSION_COMPRESSED if compressed else VERSION,
        )
        bm.check()
        with open(os.path.join(tmp, BLOCKMAP), "wb") as f:
            f.write(bm.encode())
        syncer.start(os.path.join(tmp, BLOCKMAP))
        files = {
            fname: {
                "sha256": meta_sha256.result() if fname == META_IMG else file_sha256(path),
                "size": os.path.getsize(path),
            }
            for fname, path in ((META_IMG, meta_path), (BLOCKMAP, os.path.join(tmp, BLOCKMAP)))
        }
    stats = dict(layout.stats)
    # pack 0 holds only unique content (and the superblock); in-place packs hold whole
    # tarballs, of which only the referenced unique member data counts (btrfs-zstd: pack 0
    # holds encoded extents, so the packer counts the content it wrote)
    packed = (
        packer.bytes_packed
        if packer.encoded is not None
        else pack_infos[0].size - len(layout.data_super)
    )
    stats["unique_bytes"] = packed + packer.bytes_in_place
    stats["content_bytes_in"] = packer.bytes_in
    stats["deduplicated_bytes"] = packer.bytes_deduped
    if base is not None:
        stats["base_reused_bytes"] = packer.bytes_reused
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": name,
        "builder": f"btrfs-ublk-image {__version__}",
        "fsid": str(layout.fsid),
        "devices": [
            {"devid": 1, "uuid": str(layout.dev_uuids[0]), "size": layout.meta_size},
            {"devid": 2, "uuid": str(layout.dev_uuids[1]), "size": layout.data_size},
        ],
        "generation": layout.generation,
        "files": files,
        "packs": [
            {"id": "sha256:" + p.id.hex(), "size": p.stored_size, "path": f"{PACKS}/{p.name}"}
            for p in pack_infos
        ],
        "chunk_size": chunk_size,
        "spec_sha256": spec_sha256,
        "sources": sources,
        "stats": stats,
        "image_config": image_config,
    }
    if base is not None:  # only then: the manifests (ids) of other builds are unchanged
        manifest["base"] = base.image_id
        manifest["format_version"] = FORMAT_VERSION_BLOCK_FORM
        manifest["patches"] = _write_patches(tmp, base.bundle, manifest, syncer)
    data = encode_manifest(manifest)
    with open(os.path.join(tmp, MANIFEST), "wb") as f:
        f.write(data)
    syncer.start(os.path.join(tmp, MANIFEST))
    iid = image_id(data)
    if prefetch:
        from btrfs_ublk_image import trace  # only with prefetch globs

        # beside the manifest, not listed in it: the image id does not depend on it
        chunks = [
            (renumber[pack], c)
            for pack, c in trace.chunks_of_files(tree, prefetch, chunk_size, packer.stored_size)
        ]
        trace.write(
            os.path.join(tmp, trace.FILE_NAME),
            trace.Trace(iid, chunk_size, "build", tuple(chunks)),
        )
    return iid, manifest, layout


def _link_base_pack(info: PackInfo, packs_dir: str) -> None:
    """Put a base pack the image uses into its ``packs/``: a hard link of the base's file
    (else a reflink, else a copy), so the bundle stays whole when the base is removed."""
    dst = os.path.join(packs_dir, info.name)
    if os.path.lexists(dst):  # the same id: the same bytes (e.g. the same in-place tarball)
        return
    try:
        link_or_copy(info.path, dst)
    except OSError as e:
        raise ImageError(f"{info.path}: cannot link or copy into {packs_dir}: {e}") from None


def _write_patches(
    tmp: str, base_bundle: str, manifest: dict[str, Any], syncer: Syncer
) -> dict[str, dict[str, Any]]:
    """meta.img and blockmap as patches against the lineage's patch base: the base's own
    patch base when it has one (so every version patches against the files that the
    registry and hosts already hold), else the base's files. The patch base goes into
    ``base/`` (a hard link, else a reflink, else a copy), checked against the base's
    manifest; each in the form ``manifest`` (its format version) names; -> its ``patches``."""
    base_manifest, _ = read_manifest(base_bundle)
    base_where = os.path.join(base_bundle, MANIFEST)
    base_patches = patch.entries(base_manifest, base_where)
    os.mkdir(os.path.join(tmp, patch.BASE_DIR))
    out: dict[str, dict[str, Any]] = {}
    for name in (META_IMG, BLOCKMAP):
        if base_patches:
            src, want = patch.base_path(name), base_patches[name]["base"]
        else:
            src, want = name, (base_manifest.get("files") or {}).get(name)
        src_path = os.path.join(base_bundle, src)
        dst = os.path.join(tmp, patch.base_path(name))
        try:
            link_or_copy(src_path, dst)
        except OSError as e:
            raise ImageError(f"{src_path}: cannot link or copy into {tmp}: {e}") from None
        ref = read_bundle_file(dst)
        got = {"sha256": "sha256:" + hashlib.sha256(ref).hexdigest(), "size": len(ref)}
        if not isinstance(want, dict) or got != {k: want.get(k) for k in got}:
            raise ImageError(f"{src_path}: differs from {base_where} (a corrupt base)")
        new = read_bundle_file(os.path.join(tmp, name))
        if patch.in_block_form(manifest, name):
            # the files' own bytes (2 x 64 MiB for the synthetic set) freed before zstd's
            # tables are made
            ref, new = patch.block_form(ref), patch.block_form(new)
        data = patch.make(ref, new)
        del ref, new
        with open(os.path.join(tmp, patch.patch_path(name)), "wb") as f:
            f.write(data)
        syncer.start(os.path.join(tmp, patch.patch_path(name)))
        out[name] = {
            "sha256": "sha256:" + hashlib.sha256(data).hexdigest(),
            "size": len(data),
            "base": got,
        }
    syncer.start(os.path.join(tmp, patch.BASE_DIR))  # its entries (the links)
    return out
