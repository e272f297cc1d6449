"""The bundle's files and its manifest (docs/bundle-format.md): the names, the format
versions, the manifest's canonical encoding and the image id (the sha256 of those bytes).

Everything that reads or writes a bundle starts here; the build itself is bundle.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from btrfs_ublk_image import patch
from btrfs_ublk_image.errors import ImageError

FORMAT = "btrfs-ublk-image.bundle"
FORMAT_VERSION = 1
# a bundle built with a base: version 1 plus `patches` (meta.img and blockmap as patches
# against the lineage's first meta.img and blockmap, patch.py); all others stay version 1
FORMAT_VERSION_PATCHES = 2
# what a build with a base writes: version 2 with meta.img's patch made between block
# forms (patch.py); version 2 stays readable
FORMAT_VERSION_BLOCK_FORM = patch.FORMAT_VERSION_BLOCK_FORM
MANIFEST = "manifest.json"
META_IMG = "meta.img"
BLOCKMAP = "blockmap"
PACKS = "packs"


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, sort_keys=True, indent=2) + "\n").encode()


def image_id(manifest_bytes: bytes) -> str:
    return "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()


def read_bundle_file(path: str) -> bytes:
    """A whole (small) bundle file; a clear error naming it when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ImageError(f"{path}: cannot read: {e.strerror}") from None


def read_manifest(bundle: str) -> tuple[dict[str, Any], str]:
    """The manifest of ``bundle`` and its image id."""
    path = os.path.join(bundle, MANIFEST)
    return parse_manifest(read_bundle_file(path), path)


def parse_manifest(data: bytes, path: str) -> tuple[dict[str, Any], str]:
    """The manifest in ``data`` (the bytes of ``path``) and its image id."""
    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise ImageError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ImageError(f"{path}: not a btrfs-ublk-image bundle manifest")
    if manifest.get("format_version") not in (
        FORMAT_VERSION,
        FORMAT_VERSION_PATCHES,
        FORMAT_VERSION_BLOCK_FORM,
    ):
        raise ImageError(f"{path}: unsupported format_version {manifest.get('format_version')}")
    patch.entries(manifest, path)  # their shape: readers may rely on it
    return manifest, image_id(data)
